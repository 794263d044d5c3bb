"""Observability: stats() under torch.cuda.memory_stats() names, reset_peak_stats(),
summary() in the layout of torch.cuda.memory_summary(), snapshot() in the format of
torch.cuda.memory._snapshot() (rendered by PyTorch's own torch.cuda._memory_viz), and
trace recording with record_history().

PyTorch's CPU build cannot take a CUDA snapshot or summary itself, but its formatting and
viewer code is plain Python: the tests feed it the pool's output.
"""
import base64
import io
import json
import pickle
import re
import subprocess
import sys
from contextlib import redirect_stdout

import pytest

import mempool
from mempool.tools import report
from _support import BASE, MiB

S1, S2 = 7, 9

FAMILIES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
            "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
POOLS = ("all", "large_pool", "small_pool")
METRICS = ("current", "peak", "allocated", "freed")

# Every key of torch.cuda.memory_stats() (torch 2.13) that describes a single pool.
PYTORCH_KEYS = (
    {f"{f}.{p}.{m}" for f in FAMILIES for p in POOLS for m in METRICS}
    | {f"{f}.{m}" for f in ("oversize_allocations", "oversize_segments") for m in METRICS}
    | {"num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
       "num_device_free", "max_split_size"}
)


def family(stats, name):
    """{pool: (current, peak, allocated, freed)} of one key family."""
    return {p: tuple(stats[f"{name}.{p}.{m}"] for m in METRICS) for p in POOLS}


def scripted(pool):
    """A small, a split large and a whole large allocation; the split one freed while S2
    still uses it (pending), the small one freed. Returns the pointers."""
    a = pool.alloc(3000)                     # a 2 MiB small segment at BASE
    b = pool.alloc(5 * MiB, S1)              # a 20 MiB segment at BASE + 2 MiB, 15 MiB left
    c = pool.alloc(30 * MiB)                 # a 30 MiB segment at BASE + 22 MiB
    pool.record_stream(b, S2)
    pool.device.launch(S2)
    pool.free(b)                             # pending on S2
    pool.free(a)
    return a, b, c


# --------------------------------------------------------------------------- stats


def test_stats_has_every_pytorch_key_as_an_int(sim):
    stats = sim().stats()
    assert PYTORCH_KEYS <= set(stats)
    assert all(type(stats[k]) is int for k in PYTORCH_KEYS)
    assert stats["max_split_size"] == -1     # unlimited, as PyTorch reports it


def test_stats_count_blocks_segments_and_bytes_per_pool(sim):
    pool = sim()
    scripted(pool)
    st = pool.stats()
    K = 3072                                 # 3000 bytes rounded to 512 B
    assert family(st, "allocation") == {
        "all": (1, 3, 3, 2), "large_pool": (1, 2, 2, 1), "small_pool": (0, 1, 1, 1)}
    assert family(st, "allocated_bytes") == {
        "all": (30 * MiB, 35 * MiB + K, 35 * MiB + K, 5 * MiB + K),
        "large_pool": (30 * MiB, 35 * MiB, 35 * MiB, 5 * MiB),
        "small_pool": (0, K, K, K)}
    # The pending block is still active, and (as in PyTorch) its requested bytes count
    # until the free completes.
    assert family(st, "active") == {
        "all": (2, 3, 3, 1), "large_pool": (2, 2, 2, 0), "small_pool": (0, 1, 1, 1)}
    assert family(st, "active_bytes") == {
        "all": (35 * MiB, 35 * MiB + K, 35 * MiB + K, K),
        "large_pool": (35 * MiB, 35 * MiB, 35 * MiB, 0),
        "small_pool": (0, K, K, K)}
    assert family(st, "requested_bytes") == {
        "all": (35 * MiB, 35 * MiB + 3000, 35 * MiB + 3000, 3000),
        "large_pool": (35 * MiB, 35 * MiB, 35 * MiB, 0),
        "small_pool": (0, 3000, 3000, 3000)}
    assert family(st, "segment") == {
        "all": (3, 3, 3, 0), "large_pool": (2, 2, 2, 0), "small_pool": (1, 1, 1, 0)}
    assert family(st, "reserved_bytes") == {
        "all": (52 * MiB,) * 3 + (0,), "large_pool": (50 * MiB,) * 3 + (0,),
        "small_pool": (2 * MiB,) * 3 + (0,)}
    # Free blocks of split segments: b's 15 MiB remainder; a's remainder until a's free
    # merged the small segment whole again.
    assert family(st, "inactive_split") == {
        "all": (1, 2, 2, 1), "large_pool": (1, 1, 1, 0), "small_pool": (0, 1, 1, 1)}
    assert family(st, "inactive_split_bytes") == {
        "all": (15 * MiB, 17 * MiB - K, 17 * MiB - K, 2 * MiB - K),
        "large_pool": (15 * MiB, 15 * MiB, 15 * MiB, 0),
        "small_pool": (0, 2 * MiB - K, 2 * MiB - K, 2 * MiB - K)}
    assert {k: st[k] for k in ("num_alloc_retries", "num_ooms", "num_sync_all_streams",
                               "num_device_alloc", "num_device_free")} == {
        "num_alloc_retries": 0, "num_ooms": 0, "num_sync_all_streams": 0,
        "num_device_alloc": 3, "num_device_free": 0}
    # The byte accessors are the same counters.
    assert pool.used_bytes() == st["allocated_bytes.all.current"]
    assert pool.reserved_bytes() == st["reserved_bytes.all.current"]
    assert pool.cached_bytes() == st["reserved_bytes.all.current"] - st["active_bytes.all.current"]

    pool.device.complete(S2)
    pool.empty_cache()                       # b completes, then the idle segments go
    st = pool.stats()
    assert family(st, "active")["large_pool"] == (1, 2, 2, 1)
    assert family(st, "requested_bytes")["large_pool"] == (30 * MiB, 35 * MiB, 35 * MiB, 5 * MiB)
    assert family(st, "segment")["all"] == (1, 3, 3, 2)
    assert family(st, "reserved_bytes")["all"] == (30 * MiB, 52 * MiB, 52 * MiB, 22 * MiB)
    assert family(st, "inactive_split")["all"] == (0, 2, 2, 2)
    assert st["num_device_free"] == 2


def test_oversize_counters_and_max_split_size(sim):
    pool = sim(max_split_size="32MiB")
    a = pool.alloc(40 * MiB)                 # >= max_split_size: oversize
    b = pool.alloc(12 * MiB)
    st = pool.stats()
    assert st["max_split_size"] == 32 * MiB
    assert tuple(st[f"oversize_allocations.{m}"] for m in METRICS) == (1, 1, 1, 0)
    assert tuple(st[f"oversize_segments.{m}"] for m in METRICS) == (1, 1, 1, 0)
    pool.free(a)
    pool.empty_cache()
    st = pool.stats()
    assert tuple(st[f"oversize_allocations.{m}"] for m in METRICS) == (0, 1, 1, 1)
    assert tuple(st[f"oversize_segments.{m}"] for m in METRICS) == (0, 1, 1, 1)
    pool.free(b)


def test_reset_peak_stats_sets_every_peak_to_current_and_keeps_the_totals(sim):
    pool = sim()
    a, b, c = scripted(pool)
    before = pool.stats()
    pool.reset_peak_stats()
    after = pool.stats()
    for key, value in after.items():
        if key.endswith(".peak"):
            assert value == after[key[:-len("peak")] + "current"], key
        else:
            assert value == before[key], key
    assert after["allocated_bytes.all.peak"] == 30 * MiB < before["allocated_bytes.all.peak"]
    d = pool.alloc(10 * MiB)                 # peaks follow again from here
    assert pool.stats()["allocated_bytes.all.peak"] == 40 * MiB
    pool.free(c)
    pool.free(d)
    pool.device.complete(S2)


# --------------------------------------------------------------------------- summary


def torch_summary(stats, device, abbreviated):
    """torch.cuda.memory_summary() itself, reading the given stats."""
    tm = pytest.importorskip("torch.cuda.memory")
    saved = tm.memory_stats, tm._get_device_index
    tm.memory_stats = lambda device=None: stats
    tm._get_device_index = lambda d, optional=False: d
    try:
        return tm.memory_summary(device, abbreviated=abbreviated)
    finally:
        tm.memory_stats, tm._get_device_index = saved


@pytest.mark.parametrize("abbreviated", [False, True])
def test_summary_is_pytorchs_layout(sim, abbreviated):
    pool = sim(max_split_size="32MiB")
    a, b, c = scripted(pool)
    big = [pool.alloc(900 * MiB) for _ in range(2)]       # units up to GiB
    # The table of a cuda pool is PyTorch's; a sim pool's renames the "GPU reserved" rows.
    ours = report.summary(pool.stats(), 0, abbreviated).splitlines()
    theirs = torch_summary(pool.stats(), 0, abbreviated).splitlines()
    on_sim = pool.summary(abbreviated=abbreviated).splitlines()
    assert [x for x in on_sim if "GPU" in x] == []
    assert sum(x.startswith("| Reserved memory ") for x in on_sim) == 1
    assert len(ours) == len(theirs) == (29 if abbreviated else 47)
    # Only the title and the OOM line name the allocator; every other line is PyTorch's.
    assert [i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y] == [1, 3]
    assert ours[1] == "|                       mempool memory summary, device ID 0" \
                      "                 |"
    assert all(len(line) == 77 for line in ours)
    for p in big + [c]:
        pool.free(p)


ROW_LABELS = {
    "Allocated memory": "allocated_bytes", "Active memory": "active_bytes",
    "Requested memory": "requested_bytes", "GPU reserved memory": "reserved_bytes",
    "Non-releasable memory": "inactive_split_bytes", "Allocations": "allocation",
    "Active allocs": "active", "GPU reserved segments": "segment",
    "Non-releasable allocs": "inactive_split",
    "Reserved memory": "reserved_bytes", "Reserved segments": "segment",   # sim and host
}
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "": 1, "K": 1000,
         "M": 1000 ** 2}


def summary_rows(text):
    """{stats key prefix: [current, peak, allocated, freed] as (number, unit)} of a summary."""
    rows, family_name = {}, None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 5 or cells[0] == "Metric":
            continue
        label = cells[0]
        if label in ROW_LABELS:
            family_name, pool = ROW_LABELS[label], "all"
        elif label.startswith("from "):
            pool = "large_pool" if "large" in label else "small_pool"
        else:
            family_name, pool = {"Oversize allocations": "oversize_allocations",
                                 "Oversize GPU segments": "oversize_segments",
                                 "Oversize segments": "oversize_segments"}[label], None
        values = []
        for cell in cells[1:]:
            number, _, unit = cell.partition(" ")
            values.append((int(number), unit.strip()))
        rows[f"{family_name}.{pool}" if pool else family_name] = values
    return rows


def test_summary_rows_are_the_stats(sim):
    pool = sim()
    ptrs = [pool.alloc(n) for n in (1000, 700_000, 5 * MiB, 300 * MiB, 2 << 30)]
    pool.free(ptrs[1])
    pool.free(ptrs[3])
    text = pool.summary()
    stats = pool.stats()
    rows = summary_rows(text)
    assert len(rows) == 9 * 3 + 2
    for prefix, values in rows.items():
        for metric, (number, unit) in zip(METRICS, values):
            assert number == stats[f"{prefix}.{metric}"] // UNITS[unit], (prefix, metric)
    oom_line = text.splitlines()[3]
    assert f"OOMs: {stats['num_ooms']} " in oom_line
    assert f"alloc retries: {stats['num_alloc_retries']} " in oom_line
    for p in (ptrs[0], ptrs[2], ptrs[4]):
        pool.free(p)


def test_summary_counts_ooms_and_retries(sim):
    pool = sim()
    pool.device.fail_next(3)
    with pytest.raises(mempool.OutOfMemoryError):
        pool.alloc(MiB)
    line = pool.summary().splitlines()[3]
    assert re.search(r"OOMs: 1 +\| +alloc retries: 2 ", line)


# --------------------------------------------------------------------------- snapshot

SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size",
                "requested_size", "stream", "segment_type", "segment_pool_id",
                "is_expandable", "frames", "blocks"}


def block(address, size, requested, state):
    return {"address": address, "size": size, "requested_size": requested, "state": state,
            "frames": []}


def test_snapshot_has_pytorchs_segments_and_blocks(sim):
    pool = sim()
    scripted(pool)
    snap = pool.snapshot()
    assert snap["device_traces"] == [[]]     # not recording
    assert all(set(s) == SEGMENT_KEYS for s in snap["segments"])
    common = {"device": 0, "segment_pool_id": (0, 0), "is_expandable": False, "frames": []}
    assert snap["segments"] == [
        dict(common, address=BASE, total_size=2 * MiB, allocated_size=0, active_size=0,
             requested_size=0, stream=0, segment_type="small",
             blocks=[block(BASE, 2 * MiB, 3000, "inactive")]),   # a's size, kept once free
        dict(common, address=BASE + 2 * MiB, total_size=20 * MiB, allocated_size=0,
             active_size=5 * MiB, requested_size=5 * MiB, stream=S1, segment_type="large",
             blocks=[block(BASE + 2 * MiB, 5 * MiB, 5 * MiB, "active_pending_free"),
                     block(BASE + 7 * MiB, 15 * MiB, 0, "inactive")]),
        dict(common, address=BASE + 22 * MiB, total_size=30 * MiB, allocated_size=30 * MiB,
             active_size=30 * MiB, requested_size=30 * MiB, stream=0, segment_type="large",
             blocks=[block(BASE + 22 * MiB, 30 * MiB, 30 * MiB, "active_allocated")]),
    ]
    pool.device.complete(S2)


def test_snapshot_of_an_expandable_segment_shows_its_mapped_run(sim):
    pool = sim(expandable_segments=True, max_map_size=2 * MiB)   # one allocation per page
    a = pool.alloc(3 * MiB)                  # maps [0, 4) MiB
    b = pool.alloc(3 * MiB)                  # maps [4, 6) MiB: b is [3, 6) MiB
    pool.free(a)
    pool.trim(0)                             # unmaps the whole page [0, 2) MiB
    (seg,) = pool.snapshot()["segments"]
    assert seg["address"] == BASE + 2 * MiB and seg["total_size"] == 4 * MiB
    assert seg["is_expandable"] is True
    assert (seg["va_address"], seg["va_size"], seg["mapped_size"]) == \
        (BASE, pool.capacity, 4 * MiB)
    assert seg["blocks"] == [block(BASE + 2 * MiB, MiB, 0, "inactive"),
                             block(BASE + 3 * MiB, 3 * MiB, 3 * MiB, "active_allocated")]
    assert sum(s["total_size"] for s in pool.snapshot()["segments"]) == pool.reserved_bytes()
    pool.free(b)


def test_recorded_trace_in_the_snapshot(sim):
    pool = sim()
    pool.record_history(enabled=True, max_entries=100)
    scripted(pool)
    pool.device.complete(S2)
    pool.trim(0)                             # b completes, both idle segments go
    trace = [(e["action"], e.get("addr", e.get("device_free")) - BASE, e["size"], e["stream"])
             for e in pool.snapshot()["device_traces"][0]]
    assert trace == [
        ("segment_alloc", 0, 2 * MiB, 0),
        ("alloc", 0, 3000, 0),
        ("segment_alloc", 2 * MiB, 20 * MiB, S1),
        ("alloc", 2 * MiB, 5 * MiB, S1),
        ("segment_alloc", 22 * MiB, 30 * MiB, 0),
        ("alloc", 22 * MiB, 30 * MiB, 0),
        ("free_requested", 2 * MiB, 5 * MiB, S1),
        ("free_requested", 0, 3000, 0),
        ("free_completed", 0, 3000, 0),
        ("free_completed", 2 * MiB, 5 * MiB, S1),
        ("segment_free", 0, 2 * MiB, 0),
        ("segment_free", 2 * MiB, 20 * MiB, S1),
    ]
    entries = pool.snapshot()["device_traces"][0]
    assert all(set(e) == {"action", "addr", "size", "stream", "time_us", "frames"}
               for e in entries)
    times = [e["time_us"] for e in entries]
    assert times == sorted(times)


def test_expandable_segments_trace_maps_and_unmaps(sim):
    pool = sim(expandable_segments=True)
    pool.record_history(True, 10)
    pool.free(pool.alloc(3 * MiB))
    pool.empty_cache()
    # The empty_cache call comes before what it released, and names no buffer.
    assert [(a, p and p - BASE, n) for a, p, n, _, _ in pool.history()] == [
        ("segment_map", 0, 4 * MiB), ("alloc", 0, 3 * MiB), ("free_requested", 0, 3 * MiB),
        ("free_completed", 0, 3 * MiB), ("empty_cache", 0, 0), ("segment_unmap", 0, 4 * MiB)]
    assert [e["action"] for e in pool.snapshot()["device_traces"][0]] == [
        "segment_map", "alloc", "free_requested", "free_completed", "segment_unmap"]


@pytest.mark.parametrize("max_entries", [3000, 10 ** 12])
def test_the_history_ring_grows_as_it_fills_and_keeps_the_last_events(sim, max_entries):
    # Note [A ring that grows]: a generous max_entries costs nothing until events come
    # (10**12 entries at once would be 40 TB); the ring doubles up to it, then wraps.
    pool = sim()
    pool.record_history(True, max_entries)
    sizes = [512 + 512 * (i % 3) for i in range(2000)]
    for n in sizes:                              # alloc, free_requested, free_completed
        pool.free(pool.alloc(n))
    events = pool.history()
    allocs = [e[2] for e in events if e[0] == "alloc"]
    if max_entries == 3000:
        assert len(events) == 3000               # the last 1000 round trips, in order
        assert allocs == sizes[-1000:]
    else:
        assert allocs == sizes                   # every one of them
    times = [e[4] for e in events]
    assert times == sorted(times)


def test_snapshot_device_traces_are_indexed_by_device():
    pool = mempool.Pool(backend="sim", device=2)
    pool.record_history(True)
    pool.free(pool.alloc(512))
    snap = pool.snapshot()
    assert [len(t) for t in snap["device_traces"]] == [0, 0, 4]
    assert pool.snapshot()["segments"][0]["device"] == 2


# --------------------------------------------------------------------------- PyTorch's viewer


@pytest.fixture
def viz():
    return pytest.importorskip("torch.cuda._memory_viz")


def busy_snapshot(pool):
    """A pool with every block state, small and large segments, and a recorded trace with
    segment frees and an OOM."""
    pool.record_history(enabled=True, max_entries=1000)
    ptrs = [pool.alloc(n, S1 if i % 3 == 0 else 0)
            for i, n in enumerate((3000, 5 * MiB, 30 * MiB, 700_000, 12 * MiB, 2 * MiB))]
    pool.free(ptrs[3])
    pool.free(ptrs[4])
    pool.trim(0)
    pool.device.fail_next(3)
    with pytest.raises(mempool.OutOfMemoryError):
        pool.alloc(64 * MiB)
    pool.record_stream(ptrs[1], S2)
    pool.device.launch(S2)
    pool.free(ptrs[1])                       # pending (after the OOM: its chain would sync)
    return pool.snapshot(), ptrs


def test_pytorchs_segsum_accounts_for_every_byte(sim, viz):
    pool = sim(capacity="1GiB")
    snap, _ = busy_snapshot(pool)
    text = viz.segsum(snap)                  # asserts its own accounting adds up
    reserved = sum(s["total_size"] for s in snap["segments"])
    assert reserved == pool.reserved_bytes()
    assert f"segments: {len(snap['segments'])}\n" in text
    assert f"total_reserved: {viz.Bytes(reserved)}\n" in text
    allocated = sum(b["requested_size"] for s in snap["segments"] for b in s["blocks"]
                    if b["state"] == "active_allocated")
    assert f"total_allocated: {viz.Bytes(allocated)}\n" in text


def test_pytorchs_trace_printout_reads_the_recorded_trace(sim, viz):
    pool = sim(capacity="1GiB")
    snap, ptrs = busy_snapshot(pool)
    text = viz.trace(snap)
    n = len(snap["device_traces"][0])
    assert text.startswith(f"Device 0 ----------------\n{n} entries\n")
    assert "a = cudaMalloc(1099511627776, 2.0MiB)\n" in text
    assert "b = a[0:2.9KiB]\n" in text                         # 3000 bytes requested
    assert "raise OutOfMemoryError # 64.0MiB requested" in text
    assert text.count("cudaFree(") == sum(e["action"] == "segment_free"
                                          for e in snap["device_traces"][0])


def test_pytorchs_flamegraph_inputs_cover_every_block(sim, viz):
    pool = sim(capacity="1GiB")
    snap, _ = busy_snapshot(pool)
    lines = viz.segments(snap, format_flamegraph=lambda text: text).splitlines()
    blocks = [b for s in snap["segments"] for b in s["blocks"]]
    # One line per block with what was requested, plus one for the rest ('<gaps>'): the
    # rounding of allocated blocks, all of a free one.
    slack = [b for b in blocks if b["requested_size"] != b["size"]]
    assert len(slack) > len([b for b in blocks if b["state"] == "inactive"])
    assert len(lines) == len(blocks) + len(slack)
    assert sum(int(line.rsplit(" ", 1)[1]) for line in lines) == pool.reserved_bytes()
    assert {line.split(";")[2] for line in lines} == {
        "active_allocated", "active_pending_free", "inactive"}
    mem = viz.memory(snap, format_flamegraph=lambda text: text).splitlines()
    assert len(mem) == len(lines)


def test_pytorchs_compare_sees_released_segments(sim, viz):
    pool = sim()
    keep = pool.alloc(30 * MiB)
    pool.free(pool.alloc(12 * MiB))
    before = pool.snapshot()["segments"]
    pool.empty_cache()
    after = pool.snapshot()["segments"]
    out = io.StringIO()
    with redirect_stdout(out):
        lines = viz.compare(before, after, format_flamegraph=lambda text: text)
    assert f"only_before = [{BASE + 30 * MiB}]" in out.getvalue()
    # The released segment's free block, accounted by the size last requested of it (as
    # PyTorch's snapshot shows a free block): no gap.
    seg = f"only_before;stream_0;seg_{BASE + 30 * MiB};inactive"
    assert lines == f"{seg};<non-python> {12 * MiB}\n", lines
    pool.free(keep)


@pytest.mark.parametrize("plot", ["trace_plot", "segment_plot"])
def test_pytorchs_html_viewers_embed_the_snapshot_unchanged(sim, viz, plot):
    pool = sim(capacity="1GiB")
    snap, _ = busy_snapshot(pool)
    html = getattr(viz, plot)(snap)
    files = json.loads(re.search(r"const local_files = (.*)\n", html).group(1))
    assert pickle.loads(base64.b64decode(files[0]["base64"])) == snap
    out = io.StringIO()
    with redirect_stdout(out):               # pairs every free with its alloc
        viz.filter_alloc_free_pairs(pickle.loads(pickle.dumps(snap)))
    assert "without free_requested" not in out.getvalue()


def test_pytorchs_command_line_reads_a_pickled_snapshot(sim, tmp_path, viz):
    pool = sim(capacity="1GiB")
    snap, _ = busy_snapshot(pool)
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snap))
    html = tmp_path / "trace.html"
    outputs = []
    for args in (["stats", str(path)], ["trace_plot", str(path), "-o", str(html)]):
        run = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz"] + args,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        outputs.append(run.stdout)
    assert outputs[0] == viz.segsum(snap) + "\n"
    assert "Active Memory Timeline" in html.read_text()


# --------------------------------------------------------------------------- record_history


def test_history_is_off_by_default_and_a_ring_when_on(sim):
    pool = sim()
    pool.free(pool.alloc(512))
    assert pool.history() == []
    pool.record_history(enabled=True, max_entries=3)
    ptrs = [pool.alloc(512 * (i + 1)) for i in range(3)]
    # Six events (one segment_alloc, three allocs, ...); the ring keeps the last three.
    hist = pool.history()
    assert [(a, n) for a, _, n, _, _ in hist] == [("alloc", 512), ("alloc", 1024),
                                                   ("alloc", 1536)]
    assert [p for _, p, _, _, _ in hist] == ptrs
    pool.record_history(enabled=False)
    assert pool.history() == [] and pool.snapshot()["device_traces"] == [[]]
    for p in ptrs:
        pool.free(p)
    assert pool.history() == []


def test_recording_switched_off_records_nothing_and_changes_no_decision(sim):
    """What mempool/bench/test_tracing_overhead.py times, checked exactly: a pool whose
    recording was switched off records nothing, from Python or from the C loop, and hands
    out what a pool that never recorded hands out; recording on changes no decision either."""
    from mempool._core import bench_core_roundtrips

    def workload(pool):
        got = []
        live = [pool.alloc(n, stream=s) for n, s in ((512, 0), (3 * MiB, 5), (700_000, 0),
                                                        (12 * MiB, 9), (4096, 5))]
        got += live
        pool.record_stream(live[1], 9)
        for p in live[::2]:
            pool.free(p)
        got += [pool.alloc(n, stream=0) for n in (1000, 2 * MiB)]
        bench_core_roundtrips(pool, 4096, 500)       # the C path: no interpreter in the loop
        pool.free(live[1], stream=5)
        pool.device.complete_all()
        pool.empty_cache()
        got.append(pool.alloc(5 * MiB, stream=9))
        return got

    pools = {t: sim() for t in ("never", "off", "on")}
    pools["off"].record_history(enabled=True, max_entries=64)
    pools["off"].record_history(enabled=False)
    pools["on"].record_history(enabled=True, max_entries=64)
    results = {t: workload(pool) for t, pool in pools.items()}
    assert results["off"] == results["never"] == results["on"]
    for t in ("off", "on"):
        assert pools[t].layout() == pools["never"].layout()
        assert pools[t].stats() == pools["never"].stats()
    assert pools["off"].history() == [] and pools["off"].snapshot()["device_traces"] == [[]]
    assert len(pools["on"].history()) == 64          # the ring wrapped: it was recording


def test_enabling_again_starts_an_empty_ring(sim):
    pool = sim()
    pool.record_history(True, 10)
    pool.free(pool.alloc(512))
    assert len(pool.history()) == 4
    pool.record_history(True, 10)
    assert pool.history() == []


@pytest.mark.parametrize("max_entries, error, fragment", [
    (0, ValueError, "max_entries must be an int > 0"),
    (-1, ValueError, "max_entries must be an int > 0"),
    (1.5, ValueError, "got 1.5"),
    (True, ValueError, "got True"),
    ("100", ValueError, "got '100'"),
    (1 << 64, ValueError, "out of range"),
    (1 << 62, MemoryError, "no host memory"),  # 2**62 entries of 40 bytes: no such ring
])
def test_record_history_refuses_bad_sizes_and_keeps_recording_as_it_was(sim, max_entries,
                                                                         error, fragment):
    pool = sim()
    pool.record_history(True, 8)
    pool.free(pool.alloc(512))
    with pytest.raises(error, match=fragment):
        pool.record_history(True, max_entries)
    assert len(pool.history()) == 4          # still recording, nothing dropped
    pool.free(pool.alloc(512))               # alloc, free_requested, free_completed
    assert len(pool.history()) == 7


def test_record_history_refuses_a_non_bool_enabled(sim):
    with pytest.raises(TypeError, match="enabled must be True or False"):
        sim().record_history("yes")


# --------------------------------------------------------------------------- docs


def test_the_examples_of_docs_retention_run(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import pathlib
    text = (pathlib.Path(__file__).parents[2] / "docs" / "retention.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 4
    monkeypatch.chdir(tmp_path)              # the last example writes files
    namespace = {}
    with redirect_stdout(io.StringIO()):
        for code in blocks:
            exec(compile(code, "docs/retention.md", "exec"), namespace)
    assert (tmp_path / "timeline.html").exists() and (tmp_path / "snap.pickle").exists()
