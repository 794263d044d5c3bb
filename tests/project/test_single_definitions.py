"""Each fact the C core and the Python side share is defined once, and read from there.

The trace actions, block states and size policy are the C core's (mp_core.h), exported by
the extension (mempool/_policy.pxi); the Python modules read them from it. Asking whether a
GPU is usable has one answer (mempool._cuda.available); Pool.use is mempool.cupy.use;
a replay runs one loop. Each test fails if a copy comes back: either the copy's module is
found holding its own literal, or the single definition is replaced and the copy does not
follow.
"""
import ast
import contextlib
import importlib.util
import os
import random
import re
import sys
import types

import pytest

import mempool
from mempool import _config, _core, _cuda
from mempool.tools import replay as rp
from mempool.tools import report, trace

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "mempool")
MiB = 1 << 20


def _python_sources():
    for root, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(root, name)


def _string_constants(path):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings}


# ---- trace actions and block states --------------------------------------------------------

def test_trace_action_names_are_the_extensions():
    assert len(_core.TRACE_ACTIONS) == 10 and len(set(_core.TRACE_ACTIONS)) == 10
    assert report.TRACE_ACTIONS == dict(enumerate(_core.TRACE_ACTIONS))
    assert report.TRACE_ACTIONS[report.TRACE_OOM] == "oom"
    assert report.TRACE_ACTIONS[report.TRACE_EMPTY_CACHE] == "empty_cache"
    assert report.TRACE_ACTIONS[report.TRACE_TRIM] == "trim"
    alloc, free = _core.TRACE_ACTIONS.index("alloc"), _core.TRACE_ACTIONS.index("free_requested")
    empty = _core.TRACE_ACTIONS.index("empty_cache")
    trim = _core.TRACE_ACTIONS.index("trim")
    assert trace._HISTORY_ACTIONS == {alloc: "alloc", "alloc": "alloc",
                                      free: "free", "free_requested": "free",
                                      empty: "empty_cache", "empty_cache": "empty_cache",
                                      trim: "trim", "trim": "trim"}


def test_no_python_module_spells_the_core_only_trace_actions():
    # The actions only the core records ("alloc", "free_requested" and "oom" are read from
    # PyTorch's own traces too, so those are left out here). The import of PyTorch snapshots
    # (mempool/tools/trace.py) reads PyTorch's segment entries, spelled as PyTorch spells
    # them, to find the program's empty_cache calls: it alone may.
    core_only = {"free_completed", "segment_alloc", "segment_free", "segment_map",
                 "segment_unmap"}
    holders = {os.path.relpath(path, REPO) for path in _python_sources()
               if core_only & _string_constants(path)}
    assert holders <= {os.path.join("mempool", "tools", "trace.py")}, \
        f"trace action names copied into {sorted(holders)}"


def test_history_names_each_action_by_its_c_code():
    # Every action the core records, named through the one table: alloc, free_requested,
    # free_completed, segment_alloc and segment_free on a plain pool; segment_map and
    # segment_unmap with expandable segments; oom when the limit refuses; the empty_cache
    # and trim calls.
    pool = mempool.Pool(backend="sim", capacity="1GiB", limit=64 * MiB,
                        expandable_segments=True, release_threshold=0)
    pool.record_history(True)
    ptr = pool.alloc(4 * MiB)
    pool.free(ptr)
    with pytest.raises(mempool.OutOfMemoryError):
        pool.alloc(128 * MiB)
    pool.empty_cache()
    pool.trim(0)
    plain = mempool.Pool(backend="sim", capacity="1GiB")
    plain.record_history(True)
    plain.free(plain.alloc(512))
    plain.empty_cache()
    seen = {entry[0] for entry in pool.history()} | {entry[0] for entry in plain.history()}
    assert seen == set(_core.TRACE_ACTIONS)
    snap = pool.snapshot()
    assert {e["action"] for e in snap["device_traces"][0]} <= set(_core.TRACE_ACTIONS)


def test_block_states_are_the_extensions():
    states = (_core.BLOCK_FREE, _core.BLOCK_ALLOCATED, _core.BLOCK_PENDING,
              _core.BLOCK_UNMAPPED)
    assert len(set(states)) == 4
    assert (report.BLOCK_FREE, report.BLOCK_ALLOCATED, report.BLOCK_PENDING,
            report.BLOCK_UNMAPPED) == states
    pool = mempool.Pool(backend="sim")
    ptr = pool.alloc(512)
    blocks = pool.layout()[0]["blocks"]
    assert {b["state"] for b in blocks} == {_core.BLOCK_ALLOCATED, _core.BLOCK_FREE}
    pool.free(ptr)


# ---- the size policy -----------------------------------------------------------------------

POLICY = ("MIN_BLOCK", "SMALL_SIZE", "SMALL_SEGMENT", "LARGE_SEGMENT", "MIN_LARGE_ALLOC",
          "LARGE_ROUND", "LARGE_BUFFER", "MAX_ALLOC", "ROUNDUP_INTERVALS")


def test_config_binds_no_size_policy_constant_to_a_literal():
    with open(_config.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    copies = [target.id for node in tree.body if isinstance(node, ast.Assign)
              for target in node.targets
              if isinstance(target, ast.Name) and target.id in POLICY + ("MIN_MAX_SPLIT_SIZE",)
              and not isinstance(node.value, ast.Name)]
    assert copies == []
    for name in ("MAX_ALLOC", "ROUNDUP_INTERVALS"):
        assert getattr(_config, name) is getattr(_core, name)
    assert _config.MIN_MAX_SPLIT_SIZE is _core.LARGE_SEGMENT


def test_the_size_policy_read_from_the_extension_is_the_cores():
    # The exported constants describe what the core does: checked against the pool.
    pool = mempool.Pool(backend="sim")
    assert pool._round_size(1) == _core.MIN_BLOCK
    small = pool.alloc(_core.SMALL_SIZE)
    large = pool.alloc(_core.SMALL_SIZE + 1)
    big = pool.alloc(_core.MIN_LARGE_ALLOC + 1)
    sizes = {s["address"]: s["total_size"] for s in pool.layout()}
    segment_of = {a: max(addr for addr in sizes if addr <= a) for a in (small, large, big)}
    assert sizes[segment_of[small]] == _core.SMALL_SEGMENT
    assert sizes[segment_of[large]] == _core.LARGE_SEGMENT
    assert sizes[segment_of[big]] % _core.LARGE_ROUND == 0
    with pytest.raises(mempool.OutOfMemoryError):
        pool.alloc(_core.MAX_ALLOC + 1)
    assert len(_config.parse_roundup_divisions(4)) == _core.ROUNDUP_INTERVALS
    for p in (small, large, big):
        pool.free(p)


def test_max_split_size_floor_is_the_large_segment():
    assert _config.normalize({"max_split_size": _core.LARGE_SEGMENT})["max_split_size"] == \
        _core.LARGE_SEGMENT
    with pytest.raises(ValueError, match="below"):
        _config.normalize({"max_split_size": _core.LARGE_SEGMENT - 1})
    with pytest.raises(ValueError, match=r"at most 2\*\*62"):
        _config.normalize({"initial_pool_size": _core.MAX_ALLOC + 1})


@pytest.mark.parametrize("divisions", [0, 2, 4, 8, "[256:1,512:2,1024:4,>:8]"])
def test_round_size_is_the_pools_rounding_over_many_sizes(divisions):
    # mempool.round_size (the policy through _config's parsing of the divisions) and the
    # pool's own rounding agree, and a block of each size is that big (a large block may
    # keep an unsplit remainder of up to SMALL_SIZE: test_core_blocks).
    rng = random.Random(20)
    pool = mempool.Pool(backend="sim", capacity="1TiB", roundup_power2_divisions=divisions)
    sizes = [rng.randrange(1, 1 << rng.randrange(1, 36)) for _ in range(300)]
    sizes += [_core.SMALL_SIZE, _core.SMALL_SIZE + 1, _core.MIN_LARGE_ALLOC,
              _core.MIN_LARGE_ALLOC + 1]
    for n in sizes:
        rounded = mempool.round_size(n, divisions)
        assert pool._round_size(n) == rounded, n
        ptr = pool.alloc(n)
        slack = pool.block_info(ptr)[0] - rounded
        assert 0 <= slack <= (0 if n <= _core.SMALL_SIZE else _core.SMALL_SIZE), n
        pool.free(ptr)
        pool.empty_cache()       # the next request takes a fresh segment, not a cached block
    pool.check_invariants()


# ---- one GPU probe -------------------------------------------------------------------------

def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("answer", [True, False])
def test_every_gpu_question_asks_the_one_probe(monkeypatch, answer):
    monkeypatch.setattr(_cuda, "available", lambda: answer)
    common = _load(os.path.join(REPO, "examples", "_common.py"), "_examples_common")
    assert common.gpu_available() is answer
    from mempool.bench import benchkit
    assert benchkit.gpu_available.__wrapped__() is answer
    from mempool.cli import bench
    assert not hasattr(bench, "gpu_available")
    with open(bench.__file__, encoding="utf-8") as f:
        assert "_cuda.available()" in f.read()


def test_no_module_counts_devices_to_answer_whether_there_is_a_gpu():
    pattern = re.compile(r"getDeviceCount\(\)\s*>\s*0|torch\.cuda\.is_available\(\)")
    paths = list(_python_sources()) + [os.path.join(REPO, "examples", "_common.py")]
    holders = []
    for path in paths:
        if path.endswith(os.path.join("mempool", "bench", "contenders.py")):
            continue   # asks whether *PyTorch* has CUDA, to run its own contender
        with open(path, encoding="utf-8") as f:
            if pattern.search(f.read()):
                holders.append(os.path.relpath(path, REPO))
    assert holders == []


# ---- Pool.use is mempool.cupy.use ----------------------------------------------------------

def _fake_cupy():
    state = {"allocator": "cupy's own"}
    cuda = types.SimpleNamespace(get_allocator=lambda: state["allocator"],
                                 set_allocator=lambda a: state.__setitem__("allocator", a))
    return types.SimpleNamespace(cuda=cuda), state


def test_pool_use_is_mempool_cupy_use(monkeypatch):
    import mempool.cupy as mc
    pool = mempool.Pool(backend="sim")
    calls = []

    @contextlib.contextmanager
    def spy(p):
        calls.append(p)
        yield p

    monkeypatch.setattr(mc, "use", spy)
    with pool.use() as used:
        assert used is pool
    assert calls == [pool]


def test_pool_use_routes_and_restores_cupys_allocator(monkeypatch):
    fake, state = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    pool = mempool.Pool(backend="sim")
    with pool.use() as used:
        assert used is pool and state["allocator"] == pool.malloc
    assert state["allocator"] == "cupy's own"
    with pytest.raises(RuntimeError, match="never initialised"):
        mempool.Pool.__new__(mempool.Pool).use()


# ---- one replay loop -----------------------------------------------------------------------

def _trace_with_ooms():
    events = []
    for step in range(3):
        ids = []
        for k in range(6):
            ident = step * 100 + k
            events.append(trace.Event("alloc", ident, (k + 1) * 8 * MiB, 0, len(events)))
            ids.append(ident)
        for ident in ids:
            events.append(trace.Event("free", ident, 0, 0, len(events)))
    return trace.Trace(events)


def test_every_replay_runs_the_one_loop(monkeypatch):
    calls = []
    real = rp._run

    def counting(*args, **kwargs):
        calls.append(len(args[1]))
        return real(*args, **kwargs)

    monkeypatch.setattr(rp, "_run", counting)
    events = _trace_with_ooms()
    plain = rp.replay(events, limit=64 * MiB)
    assert calls and sum(calls) == plain.events
    calls.clear()
    series = rp.replay(events, limit=64 * MiB, timeseries=True)
    assert calls and sum(calls) == series.events
    calls.clear()
    pool, live = rp.pool_at(events, stop=5)
    assert calls == [5] and len(live) == 5
    for p in live:
        pool.free(p)
    # The same OOMs, wherever the loop was cut.
    assert plain.num_ooms == series.num_ooms > 0
    assert plain.peak_live_bytes == series.peak_live_bytes
    assert not hasattr(rp, "_fast_run")


def test_a_stepped_replay_keeps_its_steps_through_ooms():
    events = _trace_with_ooms()
    events.meta["step_starts"] = [0, 12, 24]
    r = rp.replay(events, limit=64 * MiB)
    assert r.num_ooms > 0 and r.steps is not None and len(r.steps) == 3
    unlimited = rp.replay(events)
    assert unlimited.num_ooms == 0 and len(unlimited.steps) == 3


# ---- the offline tools have one path each ----------------------------------------------------

@pytest.mark.parametrize("name", ["trace", "replay", "tune", "report", "plot"])
def test_a_tool_has_one_import_path(name):
    assert importlib.import_module(f"mempool.tools.{name}").__name__ == f"mempool.tools.{name}"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"mempool.{name}")


# ---- the options' facts: one owner each ----------------------------------------------------

def _trees():
    for path in _python_sources():
        with open(path, encoding="utf-8") as f:
            yield os.path.relpath(path, REPO), ast.parse(f.read(), path)


def _holders_of_literal(words):
    """The modules holding a tuple, list or set literal of all of `words`."""
    holders = set()
    for rel, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                values = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                if set(words) <= values:
                    holders.add(rel)
    return holders


def test_the_backend_names_are_the_cores_kinds():
    assert _config.BACKENDS == tuple(_core._BACKENDS)
    assert rp.BACKENDS is _config.BACKENDS
    assert not _holders_of_literal(("sim", "host", "cuda"))
    with pytest.raises(ValueError, match="accepted: 'sim', 'host' or 'cuda'"):
        _config.normalize({"backend": "gpu"})


def test_the_pool_handle_names_are_the_control_planes():
    assert _config.POOL_HANDLES is _cuda.POOL_HANDLES
    assert _holders_of_literal(_cuda.POOL_HANDLES) == {os.path.join("mempool", "_cuda.py")}
    assert _config.OPTIONS["pool_handle"].kind == "'create', 'default', 'current' or int"


def test_unlimited_is_spelled_once():
    from mempool import _conf_parse
    assert _config.UNLIMITED_END is _core.UNLIMITED == 2 ** 64 - 1
    holders = {rel for rel, tree in _trees() for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str)
               and "unlimited'" in node.value}
    assert holders == set(), f"'unlimited' spelled in messages of {sorted(holders)}"
    words = [rel for rel, tree in _trees() for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and node.value == "unlimited"]
    assert words == [os.path.join("mempool", "_conf_parse.py")]
    for key in ("limit", "max_split_size", "release_threshold"):
        with pytest.raises(ValueError) as info:
            _config.normalize({key: "lots"})
        assert _conf_parse._NONE_ACCEPTED in str(info.value)


def test_the_expandable_over_max_split_rule_is_one_function(monkeypatch):
    from mempool import _conf_options, _torch_settings
    both = {"expandable_segments": True, "max_split_size": "64MiB"}
    real = _conf_options.applied_max_split
    assert _config.overridden(both) == ["max_split_size"]
    monkeypatch.setattr(_conf_options, "applied_max_split", lambda size, expandable: size)
    assert _config.overridden(both) == []
    monkeypatch.setattr(_conf_options, "applied_max_split", real)
    asked = []
    monkeypatch.setattr(_config, "applied_max_split",
                        lambda size, expandable: asked.append((size, expandable))
                        or real(size, expandable))
    pool = mempool.Pool(backend="sim", expandable_segments=True)
    _torch_settings.apply("max_split_size_mb:64", [pool])
    assert asked == [(64 * MiB, True)]


def test_conf_strings_have_one_tokenizer(monkeypatch):
    from mempool import _torch_settings
    read = []
    real = _config._loose_entries
    monkeypatch.setattr(_config, "_loose_entries", lambda conf: read.append(conf) or real(conf))
    assert _torch_settings.device_allocator_keys(
        "pinned_use_background_threads:True, roundup_power2_divisions:[256:1,>:2]") == [
        "roundup_power2_divisions"]
    assert read == ["pinned_use_background_threads:True, roundup_power2_divisions:[256:1,>:2]"]
    # Only the tokenizer splits on brackets.
    splitters = set()
    for rel, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value in ("[", "]", ",:[]")
                    for c in [node.left] + node.comparators):
                splitters.add(rel)
    assert splitters == {os.path.join("mempool", "_conf_parse.py")}, splitters


def test_one_table_of_units_formats_sizes():
    from mempool import _conf_parse, _units
    units = {"KiB", "MiB", "GiB", "TiB", "PiB"}
    tables, formatters = set(), set()
    for rel, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                if len({e.value for e in ast.walk(node) if isinstance(e, ast.Constant)
                        and e.value in units}) >= 2:
                    tables.add(rel)
            if isinstance(node, ast.JoinedStr):
                for a, b in zip(node.values, node.values[1:]):
                    if isinstance(a, ast.FormattedValue) and isinstance(b, ast.Constant) \
                            and b.value.lstrip()[:3] in units:
                        formatters.add(rel)
    assert tables == {os.path.join("mempool", "_units.py")}, tables
    assert formatters <= {os.path.join("mempool", "_units.py")}, formatters
    assert _config.format_size is _units.format_size
    assert _conf_parse._mib(_core.LARGE_SEGMENT) == "20 MiB"
    assert report._format_size(800 << 30, 800 << 30) == "   800 GiB"   # PyTorch's layout


def test_every_default_is_the_configs(monkeypatch):
    # The Cython layer states no default of its own: the literals are gone, and a change in
    # _config reaches a new pool.
    stated = re.compile(r"^(cdef \w+ )?_?(DEFAULT|GiB)\w* = [^_\n]*\d", re.M)
    bare_intervals = re.compile(r"\[16\]|range\(16\)")
    for name in os.listdir(PACKAGE):
        if name.endswith((".pxi", ".pyx")):
            with open(os.path.join(PACKAGE, name), encoding="utf-8") as f:
                text = f.read()
            assert not stated.search(text), name
            assert not bare_intervals.search(text), name
    monkeypatch.setitem(_config.DEFAULT_CAPACITY, "sim", 3 << 30)
    assert mempool.Pool(backend="sim").device.capacity == 3 << 30
    assert mempool.Pool(backend="sim").options["granularity"] == _config.DEFAULT_GRANULARITY
    assert _core.DEFAULT_MAX_MAP == 1 << 30
    assert "None = 1 GiB" in _config.OPTIONS["max_map_size"].doc
