"""Traces in the formats mempool imports: a PyTorch memory snapshot and an RMM log, as
those libraries write them, for the trace, CLI and plot tests; and a small corpus of
training traces for the corpus's tests."""
import json

from mempool.tools import corpus
from mempool.tools import trace as mtrace

MiB = 1 << 20

FRAMES = [{"filename": "train.py", "line": 12, "name": "forward"}]


def trace_entry(action, addr, size, stream=0, t=0):
    e = {"action": action, "size": size, "stream": stream, "time_us": t, "frames": FRAMES}
    e["device_free" if action == "oom" else "addr"] = addr
    return e


def torch_snapshot():
    """A snapshot as torch.cuda.memory._snapshot() returns it: segments with blocks, and a
    trace per device whose recording began after buffer 0xA000 was allocated."""
    base = 0x7F0000000000
    trace = [
        trace_entry("free_requested", 0xA000, 1024, 0, 100),          # allocated before recording
        trace_entry("free_completed", 0xA000, 1024, 0, 100),
        trace_entry("segment_alloc", base, 20 << 20, 0, 105),
        trace_entry("alloc", base, 3_000_000, 0, 105),
        trace_entry("alloc", base + (3 << 20), 1_000_000, 0, 107),
        trace_entry("free_requested", base, 3_000_000, 0, 110),
        trace_entry("free_completed", base, 3_000_000, 0, 111),
        trace_entry("oom", 8 << 30, 1 << 30, 0, 112),
        trace_entry("snapshot", 0, 0, 0, 113),
        trace_entry("alloc", base, 2_000_000, 0, 120),
    ]
    blocks = [
        {"address": base, "size": 2 << 20, "requested_size": 2_000_000,
         "state": "active_allocated", "frames": FRAMES},
        {"address": base + (2 << 20), "size": 1 << 20, "requested_size": 0,
         "state": "inactive", "frames": []},
        {"address": base + (3 << 20), "size": 1 << 20, "requested_size": 1_000_000,
         "state": "active_allocated", "frames": FRAMES},
        {"address": base + (4 << 20), "size": 16 << 20, "requested_size": 0,
         "state": "inactive", "frames": []},
    ]
    old = 0x7E0000000000
    segments = [
        {"device": 0, "address": base, "total_size": 20 << 20, "stream": 0,
         "segment_type": "large", "segment_pool_id": (0, 0), "allocated_size": 3 << 20,
         "active_size": 3 << 20, "requested_size": 3_000_000, "is_expandable": False,
         "frames": [], "blocks": blocks},
        # A buffer allocated before recording and never freed: only the segments know it.
        {"device": 0, "address": old, "total_size": 2 << 20, "stream": 0,
         "segment_type": "small", "segment_pool_id": (0, 0), "allocated_size": 512,
         "active_size": 512, "requested_size": 100, "is_expandable": False, "frames": [],
         "blocks": [{"address": old, "size": 512, "requested_size": 100,
                     "state": "active_allocated", "frames": FRAMES},
                    {"address": old + 512, "size": (2 << 20) - 512, "requested_size": 0,
                     "state": "inactive", "frames": []}]},
    ]
    return {"segments": segments, "device_traces": [trace, []],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
                                   "max_split_size": -1}}


RMM_LOG = """Thread,Time,Action,Pointer,Size,Stream
140573312345856,23:59:59.999000,allocate,0x7f8a40000000,1024,0x0
140573312345856,23:59:59.999500,allocate,0x7f8a40000400,2048,0x7f8a38001020
140573312345856,00:00:00.000250,free,0x7f8a40000000,1024,0x0
140573312345857,00:00:00.001000,allocate failure,0x0,1099511627776,0x0
140573312345856,00:00:00.002000,free,0x7f8a40000400,2048,0x7f8a38001020
"""


def training_trace(seed, steps=4):
    """Parameters, then per step activations of a size that changes with the step."""
    ev, ident, starts = [], 0, []

    def alloc(n):
        nonlocal ident
        ident += 1
        ev.append(mtrace.Event("alloc", ident, n, 0, len(ev) * 1000))
        return ident

    def free(i, n):
        ev.append(mtrace.Event("free", i, n, 0, len(ev) * 1000))

    for _ in range(4):
        alloc(3 * MiB)
    for s in range(steps):
        starts.append(len(ev))
        sizes = [(seed + s + k) % 5 * MiB + 4096 * (k + 1) for k in range(12)]
        ids = [alloc(n) for n in sizes]
        for i, n in reversed(list(zip(ids, sizes))):
            free(i, n)
    return mtrace.Trace(ev, {"step_starts": starts})


CORPUS = (("a", "tuning"), ("b", "tuning"), ("c", "held-out"), ("d", "held-out"))


def make_corpus(tmp_path, absent=("later",), traces=CORPUS):
    """A corpus in `tmp_path`: a training trace per (name, half) of `traces`, and entries
    for the names in `absent` whose files are not there."""
    entries = []
    for k, (name, half) in enumerate(traces):
        mtrace.save(training_trace(k), tmp_path / f"{name}.jsonl.gz")
        entries.append({"name": name, "half": half, "file": f"{name}.jsonl.gz",
                        "script": "tests"})
    for name in absent:
        entries.append({"name": name, "half": "held-out", "file": f"{name}.jsonl.gz"})
    write(tmp_path, {"format": corpus.FORMAT, "version": corpus.VERSION, "traces": entries})
    return tmp_path


def write(folder, manifest):
    (folder / corpus.MANIFEST).write_text(json.dumps(manifest))
