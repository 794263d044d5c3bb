"""The crash-seeking fuzzer of mempool's public surface, run in a child process.

tests/project/test_fuzz_surface.py starts one child per target; the child runs hypothesis batches
until its time is up. Each example makes a fresh pool (or none, for the module targets),
then calls public functions, methods and properties with arbitrary Python values: boundary
ints, floats (NaN and infinities), None, bytes, strings, tuples and lists of every length,
objects whose ``__index__``, ``__cuda_stream__``, ``ptr`` or ``__dlpack__`` misbehave, and
the surface's own objects. After every call:

- the pools' invariants hold (``check_invariants``);
- an exception is one a caller can act on: never SystemError, OverflowError, IndexError,
  KeyError, ZeroDivisionError or an InvariantError, nor a C conversion's bare message;
- a call refused with TypeError, ValueError or BufferError changed nothing: the pool's
  layout, options, pinned streams and the Buffer's export state are as before.

At the end of each example everything is dropped and the pool must be empty again (no
reference leaked by a refused export or a failed call).

A segfault or abort kills the child: the parent reports the seed, the batch and the last
calls, which the child appends to a log file before making each one. Reproduce with

    python tests/fuzz_surface_driver.py --target TARGET --seed SEED --first-batch BATCH

Run alone it fuzzes for ``--seconds``; the parent sets the budget from MEMPOOL_FUZZ_SECONDS.
"""
import argparse
import faulthandler
import functools
import gc
import inspect
import math
import os
import sys
import time

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import mempool
from mempool import _config, _core

# Exceptions that mean the surface failed to say what was wrong (or worse).
DISALLOWED = (SystemError, OverflowError, IndexError, KeyError, ZeroDivisionError,
              mempool.InvariantError, RecursionError, UnboundLocalError, NameError,
              AssertionError)
# Messages of C conversions that escaped a check: they name no argument.
BARE_MESSAGES = ("int too large to convert", "can't convert negative", "too large to convert",
                 "Python int too large", "object of type 'NoneType'", "'NoneType' object")
REFUSED = (TypeError, ValueError, BufferError)
RAISED = object()     # what call() returns when the call raised


class Boom(Exception):
    """Raised by the odd objects: the surface may let it through (it is the caller's)."""


def fresh(exc):
    """A new instance to raise: raising the drawn one would hang a traceback on it, and
    hypothesis keeps drawn values, so the frames (and the Buffers in them) would outlive
    the example and look like a leak."""
    return type(exc)(*exc.args)


# ---- odd objects -------------------------------------------------------------------------------

class Index:
    """An object with an __index__ that returns `value` (or raises it)."""

    def __init__(self, value):
        self.value = value

    def __index__(self):
        if isinstance(self.value, BaseException):
            raise fresh(self.value)
        return self.value

    def __repr__(self):
        return f"Index({self.value!r})"


class CudaStream:
    def __init__(self, value, callable_=True):
        self.value = value
        if not callable_:
            self.__cuda_stream__ = value

    def __getattr__(self, name):
        if name == "__cuda_stream__":
            def proto():
                if isinstance(self.value, BaseException):
                    raise fresh(self.value)
                return self.value
            return proto
        raise AttributeError(name)

    def __repr__(self):
        return f"CudaStream({self.value!r})"


class Ptr:
    def __init__(self, ptr, attr="ptr"):
        setattr(self, attr, ptr)
        self.attr = attr

    def __repr__(self):
        return f"Ptr({getattr(self, self.attr)!r}, {self.attr!r})"


class FakeDLPack:
    """Claims DLPack and hands out junk."""

    def __init__(self, capsule, device):
        self.capsule, self.device = capsule, device

    def __dlpack__(self, **kwargs):
        if isinstance(self.capsule, BaseException):
            raise fresh(self.capsule)
        return self.capsule

    def __dlpack_device__(self):
        return self.device

    def __repr__(self):
        return f"FakeDLPack({self.capsule!r}, {self.device!r})"


BOUNDARY_INTS = [0, 1, -1, 2, 3, 7, 511, 512, 513, 4096, 1 << 20, (1 << 20) + 1, 20 << 20,
                 1 << 30, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 53, 2 ** 62, 2 ** 63 - 1, 2 ** 63,
                 2 ** 64 - 2, 2 ** 64 - 1, 2 ** 64, 2 ** 70, -(2 ** 31), -(2 ** 63), -(2 ** 64)]
FLOATS = [0.0, -0.0, 0.5, 1.0, 1.5, 1e-300, 5e-324, 1e300, math.nan, math.inf, -math.inf]
STRINGS = ["", "0", "1", "512", "1GB", "1.5GB", "0.5", "none", "None", "unlimited", "True",
           "false", "-1", "１", "１GB", "0x10", "1e3", "nan", "inf", "18446744073709551616",
           "backend:sim", "backend:sim,limit:0.5", "[256:1,>:8]", "sim", "host", "cuda", "x"]


def leaves():
    return st.one_of(
        st.sampled_from(BOUNDARY_INTS), st.integers(),
        st.sampled_from(FLOATS), st.floats(allow_nan=True, allow_infinity=True),
        st.none(), st.booleans(),
        st.sampled_from(STRINGS), st.text(max_size=12),
        st.binary(max_size=8),
    )


def conf_strings():
    """Conf strings made of real keys (ours and PyTorch's) and odd values."""
    keys = sorted(_config.OPTIONS) + ["max_split_size_mb", "per_process_memory_fraction",
                                      "bogus", ""]
    value = st.one_of(st.sampled_from(STRINGS), st.sampled_from(BOUNDARY_INTS).map(str),
                      st.text(max_size=6))
    item = st.tuples(st.sampled_from(keys), value).map(lambda kv: f"{kv[0]}:{kv[1]}")
    return st.lists(item, max_size=4).map(",".join).map(
        lambda c: "backend:sim," + c if "backend" not in c else c)


def values():
    """Arbitrary Python values, nested tuples and lists of every length included."""
    base = leaves()
    nested = st.recursive(base, lambda inner: st.one_of(
        st.lists(inner, max_size=5).map(tuple), st.lists(inner, max_size=5),
        st.dictionaries(st.sampled_from([0, 1, ">", "x", 256]), inner, max_size=3)),
        max_leaves=8)
    exc = st.sampled_from([Boom("boom"), TypeError("odd"), ValueError("odd"),
                           OverflowError("odd")])
    odd = st.one_of(
        st.builds(Index, st.one_of(base, exc)),
        st.builds(CudaStream, st.one_of(nested, exc), st.booleans()),
        st.builds(Ptr, base, st.sampled_from(["ptr", "cuda_stream"])),
        st.builds(FakeDLPack, st.one_of(base, exc), st.one_of(nested, exc)),
        st.just(object()),
    )
    # Separate branches, so that each kind comes up often (one_of picks among branches).
    short_tuples = st.lists(st.sampled_from(BOUNDARY_INTS[:8] + [None, 1.5, "1"]),
                            max_size=4).map(tuple)
    return st.one_of(st.sampled_from(BOUNDARY_INTS), short_tuples, base, nested, odd,
                     conf_strings())


# ---- the surface ---------------------------------------------------------------------------------

# Dunders that are part of the public surface of their class.
PUBLIC_DUNDERS = {
    "Pool": ["__repr__"],
    "Buffer": ["__repr__", "__dlpack__", "__dlpack_device__", "__array_interface__",
               "__cuda_array_interface__"],
    "SimDevice": [], "HostDevice": [],
}
# Names not fuzzed with arbitrary values, and why. Every other public name is.
SPECIAL = {
    "save_trace": "writes a file: called with a path in the example's temporary directory "
                  "or a non-path value only (an int is a file descriptor: 1 would write "
                  "into the log)",
    "hold_allocs": "a valid timeout holds the next allocation up to an hour: called with "
                   "timeouts of at most 10 ms, or invalid ones",
    "hold_syncs": "as hold_allocs, for stream synchronizations",
    "hold_event_creates": "as hold_allocs, for event creations",
    "hold_va_reserves": "as hold_allocs, for address-space reservations",
    "close": "a closed pool answers every later call with PoolClosedError, which would end "
             "the example (tests/core/test_close.py covers it): called with values of 'force' "
             "that are not a bool only, which are refused and change nothing",
}


def public_names(cls):
    names = [n for n in dir(cls) if not n.startswith("_")]
    return sorted(set(names) | set(PUBLIC_DUNDERS.get(cls.__name__, [])))


def _is_data(cls, name):
    attr = inspect.getattr_static(cls, name)
    return not callable(attr) or isinstance(attr, property) or \
        type(attr).__name__ in ("getset_descriptor", "member_descriptor")


def module_functions():
    """(label, function) of every public module-level function the surface offers."""
    import mempool.cupy as mcupy
    import mempool.jax as mjax
    import mempool.torch as mtorch
    out = []
    for label, module, names in (
            ("mempool", mempool, [n for n in mempool.__all__ if n not in (
                "Pool", "Buffer", "OutOfMemoryError", "InvariantError", "OptionError",
                "SimDevice", "HostDevice")]),
            ("mempool._config", _config, [n for n in _config.__all__ if n not in (
                "OPTIONS", "Option")]),
            ("mempool.torch", mtorch, [n for n in dir(mtorch) if not n.startswith("_")
                                       and inspect.isfunction(getattr(mtorch, n))]),
            ("mempool.cupy", mcupy, [n for n in dir(mcupy) if not n.startswith("_")
                                     and inspect.isfunction(getattr(mcupy, n))
                                     and getattr(mcupy, n).__module__ == mcupy.__name__]),
            ("mempool.jax", mjax, [n for n in dir(mjax) if not n.startswith("_")
                                   and inspect.isfunction(getattr(mjax, n))]),
    ):
        for name in names:
            out.append((f"{label}.{name}", getattr(module, name)))
    out.append(("mempool.Pool.from_conf", mempool.Pool.from_conf))
    out.append(("mempool.SharedHandle.from_bytes", mempool.SharedHandle.from_bytes))
    out.append(("mempool.Pool", mempool.Pool))
    return out


def keyword_names(fn):
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]


# ---- one example ---------------------------------------------------------------------------------

POOL_CONFIGS = {
    "pool-sim": [dict(backend="sim", capacity="2GB"),
                 dict(backend="sim", capacity="1GB", limit="256MB", release_threshold=0),
                 dict(backend="sim", capacity="1GB", roundup_power2_divisions=4,
                      max_split_size="32MB", cross_stream_reuse=False)],
    "pool-sim-expandable": [dict(backend="sim", capacity="1GB", expandable_segments=True,
                                 granularity="2MB"),
                            dict(backend="sim", capacity="1GB", expandable_segments=True,
                                 release_threshold="4MB", initial_pool_size="8MB")],
    "pool-host": [dict(backend="host", capacity="256MB"),
                  dict(backend="host", capacity="256MB", expandable_segments=True,
                       release_threshold=0)],
    "module": [dict(backend="sim", capacity="1GB")],
    "inputs": [],           # no pool: hostile files, conf strings and command lines
}


class Log:
    """The calls, appended before each one is made (unbuffered: a crash keeps them)."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if path else None

    def write(self, line):
        if self.fd is not None:
            os.write(self.fd, (line[:400] + "\n").encode("utf-8", "replace"))


LOG = Log(None)


class World:
    """What one example holds: pools, their objects, addresses, buffers, consumers."""

    def __init__(self, config, tmpdir):
        self.pool = mempool.Pool(**config)
        self.pools = [self.pool]
        self.addresses = []       # from pool.alloc
        self.buffers = [self.pool.empty((2, 8), "float32")]
        self.consumers = []       # numpy arrays and capsules over Buffers
        self.other = []           # anything else a call returned
        self.tmpdir = tmpdir

    def objects(self):
        return [self.pool, self.pool.device] + self.buffers

    def buffer_bases(self):
        return {b.ptr - b.offset for b in self.buffers if b.ptr}

    def snapshot(self):
        state = []
        for p in self.pools:
            state.append((p.layout(), repr(p.options), sorted(p.pinned_streams)))
        state.append([b.exported for b in self.buffers])
        return state


# An index into a list of the world's objects is drawn from a fixed range and taken modulo
# the list's length: a draw whose bounds follow the world's state makes hypothesis refuse
# the run ("Inconsistent data generation") when that state differs between two runs of
# one prefix, as it does once an optional framework (JAX) keeps what its first call made.
INDEX = st.integers(0, 255)


def pick(data, items, label):
    """One of `items`, drawn by index: hypothesis keeps what it draws (to print a failing
    example), and a Buffer it kept would look like a leak at the end of the example."""
    return items[data.draw(INDEX, label=label) % len(items)]


class _Ref:
    def __init__(self, i):
        self.i = i


VALUES = None
STREAMS = st.sampled_from([0, 1, 2, 7, 9, 0x10])
SMALL = st.sampled_from(BOUNDARY_INTS[:12])
# Parameters that take a tuple (or a shape): short and long tuples come up half the time.
TUPLE_PARAMS = {"max_version", "dl_device", "shape"}
TUPLES = st.lists(st.sampled_from(BOUNDARY_INTS[:6] + BOUNDARY_INTS[-6:] + [None, 1.5]),
                  max_size=5).map(tuple)


def draw_value(data, world, label):
    global VALUES
    if VALUES is None:
        VALUES = values()
    if label in TUPLE_PARAMS and data.draw(st.booleans(), label=f"{label} as a tuple"):
        return data.draw(TUPLES, label=label)
    choices = [VALUES, SMALL]
    refs = []
    if world is not None:
        refs = world.addresses + world.objects() + world.consumers[-2:]
        choices.append(INDEX.map(_Ref))   # one of refs, or the index itself when none
        choices.append(STREAMS)
    value = data.draw(st.one_of(choices), label=label)
    if isinstance(value, _Ref):
        return refs[value.i % len(refs)] if refs else value.i
    return value


def draw_args(data, world, fn, name):
    """Arguments for `fn`: most of its parameters, by position or keyword, each an
    arbitrary value; sometimes one missing or one too many."""
    if name == "save_trace":
        return (data.draw(st.sampled_from([os.path.join(world.tmpdir, "t.jsonl"), None, 1.5,
                                           (), object()]), label="path"),), {}
    if name == "close":
        return (data.draw(st.sampled_from([None, 0, 1, "yes", 1.5, (), object()]),
                          label="force"),), {}
    if name in ("hold_allocs", "hold_syncs", "hold_event_creates", "hold_va_reserves"):
        return (data.draw(st.sampled_from([0, 1, 2, -1, 2 ** 64, None]), label="n"),
                data.draw(st.sampled_from([0.001, 0.01, 0, -1, math.nan, math.inf, 1e9,
                                           "1", None]), label="timeout")), {}
    params = None
    for target in (fn, getattr(fn, "__init__", None)):
        try:
            params = [p for p in inspect.signature(target).parameters.values()
                      if p.name != "self"]
        except (TypeError, ValueError):
            continue
        if target is fn or any(p.kind != p.VAR_POSITIONAL and p.kind != p.VAR_KEYWORD
                               for p in params):
            break
        params = None
    if params is None:
        nargs = data.draw(st.integers(0, 3), label="nargs")
        return tuple(draw_value(data, world, f"arg{i}") for i in range(nargs)), {}
    args, kwargs = [], {}
    for p in params:
        if p.kind == p.VAR_POSITIONAL:
            continue
        if p.kind == p.VAR_KEYWORD:
            # **options: real option names, some misspelt.
            keys = sorted(_config.OPTIONS) + ["bogus", "max_split_size_mb"]
            for key in data.draw(st.lists(st.sampled_from(keys), max_size=3, unique=True),
                                 label="options"):
                kwargs[key] = draw_value(data, world, key)
            continue
        how = data.draw(st.integers(0, 9), label=f"{p.name}?")
        if how == 0:
            continue                                   # left to its default (or missing)
        value = draw_value(data, world, p.name)
        if p.kind == p.POSITIONAL_OR_KEYWORD and how < 6 and not kwargs:
            args.append(value)
        else:
            kwargs[p.name] = value
    if data.draw(st.integers(0, 19), label="extra?") == 0:
        args.append(draw_value(data, world, "extra"))
    return tuple(args), kwargs


def check_exception(exc, what):
    if isinstance(exc, Boom):
        return
    if isinstance(exc, DISALLOWED) and not str(exc) == "odd":
        raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}") from exc
    message = str(exc)
    if message != "odd" and any(b in message for b in BARE_MESSAGES):
        raise AssertionError(f"{what} raised an unclear {type(exc).__name__}: {exc}") from exc


def call(world, what, fn, args, kwargs, receiver_kind):
    LOG.write(f"{what}(*{args!r}, **{kwargs!r})")
    before = world.snapshot() if world is not None and receiver_kind != "module" else None
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:
        check_exception(exc, what)
        if before is not None and isinstance(exc, REFUSED) and not _from_odd_object(exc):
            after = world.snapshot()
            if after != before:
                raise AssertionError(f"{what} was refused ({type(exc).__name__}: {exc}) but "
                                     f"changed the pool or buffers:\n{before}\n{after}")
        return RAISED
    finally:
        if world is not None:
            for p in world.pools:
                p.check_invariants()
    return result


def _from_odd_object(exc):
    # A user object that raised (our odd objects raise with the message "odd" or Boom) may
    # stop a call after a step it was entitled to take; only the surface's own refusals
    # must change nothing.
    cur = exc
    while cur is not None:
        if str(cur) == "odd" or isinstance(cur, Boom):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def keep(world, result):
    if result is RAISED:
        return
    if isinstance(result, mempool.Buffer):
        world.buffers.append(result)
    elif isinstance(result, mempool.Pool):
        world.pools.append(result)
    elif type(result) is int and world is not None and result not in world.addresses:
        world.other.append(result)
    elif result is not None:
        world.consumers.append(result)


def step_pool(data, world, target):
    """One call of a method or property of one of the world's objects."""
    objs = {"pool": world.pool, "device": world.pool.device}
    if world.buffers:
        objs["buffer"] = pick(data, world.buffers, "buffer")
    # Weighted by how many public names each has, so every name comes up about as often.
    kinds = [k for k in sorted(objs) for _ in public_names(type(objs[k]))]
    kind = data.draw(st.sampled_from(kinds), label="receiver")
    obj = objs[kind]
    name = data.draw(st.sampled_from(public_names(type(obj))), label="name")
    what = f"{kind}.{name}"
    if _is_data(type(obj), name):
        if data.draw(st.integers(0, 9), label="set?") == 0:
            value = draw_value(data, world, "value")
            LOG.write(f"{what} = {value!r}")
            try:
                setattr(obj, name, value)
            except (AttributeError, TypeError):
                pass
            else:
                raise AssertionError(f"{what} could be set to {value!r}")
            return
        keep(world, call(world, what, lambda: getattr(obj, name), (), {}, kind))
        return
    fn = getattr(obj, name)
    args, kwargs = draw_args(data, world, fn, name)
    ptr = args[0] if args else kwargs.get("ptr")
    if name in ("free", "record_stream", "block_info", "access_devices") and kind == "pool":
        # A Buffer's block freed behind its back is the caller's bug (as freeing a CuPy
        # array's pointer): the fuzzer does not free other owners' memory.
        if type(ptr) is int and ptr in world.buffer_bases():
            return
    result = call(world, what, fn, args, kwargs, kind)
    if name == "alloc" and kind == "pool" and type(result) is int:
        world.addresses.append(result)
        return
    if name == "free" and kind == "pool" and type(ptr) is int and ptr in world.addresses:
        if result is not RAISED:
            world.addresses.remove(ptr)
        return
    keep(world, result)


def step_good(data, world):
    """A call that succeeds, so that the odd calls meet a pool with something in it."""
    pool = world.pool
    choice = data.draw(st.sampled_from(["alloc", "free", "empty", "export", "consume",
                                        "launch", "complete"]), label="good")
    stream = data.draw(st.sampled_from([0, 7, 9]), label="stream")
    nbytes = data.draw(st.sampled_from([0, 1, 512, 4096, 1 << 20, 3 << 20, 25 << 20]),
                       label="nbytes")
    try:
        if choice == "alloc":
            LOG.write(f"good: pool.alloc({nbytes}, {stream})")
            world.addresses.append(pool.alloc(nbytes, stream))
        elif choice == "free" and world.addresses:
            ptr = world.addresses.pop(data.draw(INDEX) % len(world.addresses))
            LOG.write(f"good: pool.free({ptr:#x})")
            pool.free(ptr)
        elif choice == "empty":
            LOG.write(f"good: pool.empty({nbytes // 4}, 'float32', {stream})")
            world.buffers.append(pool.empty(nbytes // 4, "float32", stream=stream))
        elif choice == "export" and world.buffers:
            buf = pick(data, world.buffers, "buffer")
            LOG.write(f"good: export {buf!r}")
            if buf.backend == "sim":
                world.consumers.append(_core._export_simulated(buf, stream=9,
                                                               max_version=(1, 0)))
            else:
                world.consumers.append(buf.__dlpack__(max_version=(1, 0)))
        elif choice == "consume" and world.buffers and world.pool.backend == "host":
            import numpy
            buf = pick(data, world.buffers, "buffer")
            LOG.write(f"good: numpy.from_dlpack({buf!r})")
            world.consumers.append(numpy.from_dlpack(buf))
        elif choice == "launch":
            pool.device.launch(stream)
        elif choice == "complete":
            pool.device.complete(stream)
    except (mempool.OutOfMemoryError, BufferError):
        pass
    pool.check_invariants()


def step_module(data, world, functions):
    label, fn = data.draw(st.sampled_from(functions), label="function")
    args, kwargs = draw_args(data, world, fn, label.rsplit(".", 1)[1])
    keep(world, call(world, label, fn, args, kwargs, "module"))


def finish(world):
    """Drop everything; the pool must be whole and empty again."""
    LOG.write("finish")
    # A handle no process imported pins its block (the hold in flight: docs/sharing.md,
    # "Other processes"): the world takes each one it made and lets it go again.
    for handle in [c for c in world.consumers if isinstance(c, mempool.SharedHandle)]:
        try:
            world.pool.import_(handle).close()
        except (ValueError, RuntimeError, mempool.PoolClosedError):
            pass        # stale (given back already) or another pool's
    for ptr in world.addresses:
        try:
            world.pool.free(ptr)
        except ValueError:
            pass        # freed already through another spelling of the address (Index(p))
    world.addresses.clear()
    world.buffers.clear()
    world.consumers.clear()
    world.other.clear()
    for p in world.pools:
        if not p.closed:
            p.collect_shared()   # the exported blocks every consumer let go of
    if world.pool.used_bytes():
        gc.collect()             # only when reference counting left something (a cycle)
    for p in world.pools:
        if p.backend == "sim":
            p.device.release_held()
            p.device.complete_all()
        p.check_invariants()
    used = world.pool.used_bytes()
    assert used == 0, f"{used} bytes still used once every holder was dropped: a leak"


def sweep(target, tmpdir, functions):
    """Every public name of the target called once, with no arguments, before the random
    batches: the names are reached whatever the seed and however few batches the time
    allows, so a check that every name is called depends on neither."""
    LOG.write("sweep")
    if target == "module":
        for label, fn in functions:
            if label.rsplit(".", 1)[1] not in SPECIAL:
                call(None, label, fn, (), {}, "module")
        return
    world = World(POOL_CONFIGS[target][0], tmpdir)
    try:
        objs = {"pool": world.pool, "device": world.pool.device, "buffer": world.buffers[0]}
        for kind, obj in objs.items():
            for name in public_names(type(obj)):
                what = f"{kind}.{name}"
                if _is_data(type(obj), name):
                    keep(world, call(world, what, functools.partial(getattr, obj, name), (), {}, kind))
                elif name not in SPECIAL:
                    keep(world, call(world, what, getattr(obj, name), (), {}, kind))
                else:
                    LOG.write(f"{what}(...) (special: {SPECIAL[name][:40]})")
        del objs, obj                # the Buffer they hold would look like a leak
        finish(world)
    finally:
        for p in world.pools:
            if p.backend == "sim":
                p.device.release_held()


def make_test(target, tmpdir, functions):
    if target == "inputs":
        import fuzz_inputs                  # beside this file
        return fuzz_inputs.make_test(tmpdir, LOG, conf_strings(), STRINGS)
    configs = POOL_CONFIGS[target]

    @given(st.data())
    def example(data):
        config = data.draw(st.sampled_from(configs), label="config")
        LOG.write(f"example: Pool(**{config!r})")
        world = World(config, tmpdir)
        try:
            for _ in range(data.draw(st.integers(1, 25), label="steps")):
                how = data.draw(st.integers(0, 9), label="how")
                if how < 3:
                    step_good(data, world)
                elif target == "module" or how == 9:
                    step_module(data, world, functions)
                else:
                    step_pool(data, world, target)
            finish(world)
        finally:
            for p in world.pools:
                if p.backend == "sim":
                    p.device.release_held()
    return example


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, choices=sorted(POOL_CONFIGS))
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--first-batch", type=int, default=0)
    ap.add_argument("--batches", type=int, default=None,
                    help="run exactly this many batches, whatever the time (the work, and "
                         "so what is called, then depends on the seed alone)")
    ap.add_argument("--examples", type=int, default=100, help="examples per batch")
    ap.add_argument("--log", default=None, help="append each call here before making it")
    ap.add_argument("--tmpdir", default=None)
    args = ap.parse_args(argv)
    global LOG
    LOG = Log(args.log)
    faulthandler.enable()
    tmpdir = args.tmpdir or os.getcwd()
    functions = module_functions() if args.target != "inputs" else []
    gc.freeze()                  # the imports' objects: a collection then walks only ours
    end = time.monotonic() + args.seconds
    batch = args.first_batch
    if batch == 0 and args.target != "inputs":
        sweep(args.target, tmpdir, functions)
    calls = 0
    while True:
        print(f"fuzz target={args.target} seed={args.seed} batch={batch}", flush=True)
        LOG.write(f"batch {batch} (seed {args.seed})")
        test = make_test(args.target, tmpdir, functions)
        test = seed(args.seed * 1_000_003 + batch)(test)
        test = settings(max_examples=args.examples, deadline=None, database=None,
                        derandomize=False, print_blob=True,
                        phases=[Phase.explicit, Phase.generate, Phase.shrink],
                        suppress_health_check=list(HealthCheck))(test)
        test()
        calls += args.examples
        batch += 1
        if args.batches is not None:
            if batch - args.first_batch >= args.batches:
                break
        elif time.monotonic() >= end:
            break
    print(f"fuzz target={args.target} done: {batch - args.first_batch} batches, "
          f"{calls} examples", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
