"""The default pools as PyTorch's and CuPy's allocators, for code that is already running.

:func:`install_default` makes the process's default pools PyTorch's CUDA allocator and
CuPy's, where those are installed: ``import mempool.auto`` calls it, and so does
``python -m mempool run`` (mempool/cli/run.py) before it runs a script.

The pool's settings come from, in order: ``--conf``; ``MEMPOOL_CONF``; PyTorch's own
``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF`` (PyTorch's order), read as PyTorch
reads it (``mempool/_config.py``). See "Zero-code adoption" in docs/sharing.md.
"""
import importlib.util
import os
from typing import NamedTuple

__all__ = ["install_default", "Installed"]

# PyTorch's allocator variables, in the order PyTorch reads them: the first one set wins.
PYTORCH_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


class Installed(NamedTuple):
    """What :func:`install_default` did."""

    source: str        # where the settings came from: "--conf", a variable, or "defaults"
    conf: str          # the settings, canonical spelling ("" = every default)
    pools: dict        # device -> the default pool made for it
    hooked: dict       # framework -> the devices it allocates from the pool on
    skipped: dict      # framework -> why it was left alone

    def describe(self) -> str:
        """One line: the pools, their settings, and what was hooked or why not."""
        if not self.pools:
            return f"no pool in this process ({self.skipped['torch']})"
        first = next(iter(self.pools.values()))
        devices = ", ".join(str(d) for d in self.pools)
        if self.source == "defaults":
            settings = "default settings"
        else:
            settings = f"settings from {self.source}: {self.conf or 'defaults'}"
        parts = [f"pool on {first.backend} device {devices} ({settings})"]
        for name in ("torch", "cupy"):
            if name in self.hooked:
                parts.append(f"{name}: hooked on device {', '.join(map(str, self.hooked[name]))}")
            else:
                parts.append(f"{name}: not hooked ({self.skipped[name]})")
        return "; ".join(parts)


_installed = None   # the Installed of this process: the pools go in once


def _conf_source(conf):
    """(source, text) of the pool's settings; empty variables count as unset."""
    if conf is not None:
        if not isinstance(conf, str):
            raise TypeError(f"conf: a conf string is a str, got {type(conf).__name__}")
        return "--conf", conf
    for var in ("MEMPOOL_CONF",) + PYTORCH_CONF_VARS:
        text = os.environ.get(var, "")
        if text.strip():
            return var, text
    return "defaults", ""


def _local_device():
    """The device of this process when a launcher (torchrun) runs one process per GPU."""
    rank = os.environ.get("LOCAL_RANK", "").strip()
    if not rank:
        return None
    if not rank.isdigit():
        raise ValueError(f"environment variable LOCAL_RANK: {rank!r} is not a device index "
                         "(an int >= 0)")
    return int(rank)


def _prepare_pytorch_env(source):
    """Leave in PyTorch's variables only what PyTorch still applies under the pool.

    PyTorch reads them itself (at import and when its pinned-memory allocator starts) and
    raises on a key it does not know (mempool's own) or a bool not spelled True/False, and
    checks ``backend`` against the allocator in use, which is now the pool. Its pinned
    host-memory settings stay: that allocator stays PyTorch's.
    """
    from mempool import _config
    for var in PYTORCH_CONF_VARS:
        text = os.environ.get(var)
        if text is None:
            continue
        kept, dropped = _config.split_pytorch_conf(text, f"environment variable {var}")
        if dropped and source != var:
            # Settings the user made for PyTorch's allocator that nothing will apply.
            _config._warn_once(("pytorch variable", var), (
                f"environment variable {var}: {', '.join(dropped)} configure PyTorch's CUDA "
                f"allocator, which the pool replaces; the pool's settings come from {source}, "
                "so they have no effect"))
        if kept:
            os.environ[var] = kept
        else:
            del os.environ[var]


def _hook_torch(primary, local):
    """Make the default pools PyTorch's CUDA allocator; the devices hooked."""
    import torch
    import mempool
    import mempool.torch
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "mempool: PyTorch has already initialised CUDA in this process, so its allocator "
            "can no longer be replaced; install the pool before the first CUDA tensor "
            "(import mempool.auto first, or start the script with python -m mempool run)")
    count = torch.cuda.device_count()      # does not initialise CUDA
    if count == 0:
        return None, "PyTorch sees no CUDA device"
    # One process per GPU (a launcher set LOCAL_RANK): only its own device, since a pool
    # holds its device's context and every process would otherwise hold one on every GPU.
    devices = [primary] if local is not None else list(range(count))
    pools = [mempool.default_pool(d) for d in devices]
    mempool.torch.install_all(pools)
    return devices, None


class _CupyRouter:
    """CuPy's allocator over several devices: each allocation from the default pool of
    CuPy's current device, made on first use there."""

    def __init__(self, runtime):
        self._get_device = runtime.getDevice
        self._malloc = {}   # device -> its pool's malloc; a dict store is atomic under the GIL

    def __call__(self, nbytes):
        device = self._get_device()
        malloc = self._malloc.get(device)
        if malloc is None:
            import mempool
            malloc = self._malloc[device] = mempool.default_pool(device).malloc
        return malloc(nbytes)


def _hook_cupy(pool):
    """Make the default pools CuPy's allocator; the devices hooked."""
    import cupy
    count = cupy.cuda.runtime.getDeviceCount()
    if count == 1:
        cupy.cuda.set_allocator(pool.malloc)
        return [pool.device_id]
    cupy.cuda.set_allocator(_CupyRouter(cupy.cuda.runtime))
    return list(range(count))


def install_default(conf: str | None = None, torch: bool = True,
                    cupy: bool = True) -> Installed:
    """Make mempool's default pools the allocator of PyTorch and CuPy in this process.

    Does what ``python -m mempool run`` does before it runs the script, for code that is
    already running (``python -c``, a notebook's first cell); ``import mempool.auto`` calls
    it with the defaults. It must run before PyTorch makes its first CUDA tensor.

    Parameters
    ----------
    conf : str, optional
        The pools' settings. Default: ``MEMPOOL_CONF``, else PyTorch's
        ``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF``, read as PyTorch reads it.
        Settings taken from elsewhere than ``MEMPOOL_CONF`` are written to it, so that
        ``mempool.default_pool()`` and child processes read the same.
    torch, cupy : bool
        Hook that framework where it is installed and the pool is on a GPU.

    Returns
    -------
    Installed
        The settings' source, the pools, and what was hooked (or why not). A second call
        returns the first call's result: the pools go in once per process.

    Raises
    ------
    ValueError
        A bad setting (naming the variable, key and value).
    RuntimeError
        PyTorch already initialised CUDA, or the pool could not be made or installed.

    Notes
    -----
    With PyTorch hooked, its allocator variables keep only the settings of its pinned
    host-memory allocator (the pool replaces the rest; see docs/sharing.md). A launcher's
    ``LOCAL_RANK`` (one process per GPU) limits the pools to that device. With
    ``MEMPOOL_CHILDREN=1``, the children that multiprocessing starts by "spawn" or
    "forkserver" install the same pools, with the same hooks, before they unpickle anything
    (mempool/_children.py); a bad ``MEMPOOL_CHILDREN`` is a ValueError. In multiprocessing's
    forkserver process it makes no pool (every child forks from there) and returns an
    Installed with none.
    """
    global _installed
    if _installed is not None:
        return _installed
    for name, flag in (("torch", torch), ("cupy", cupy)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    from mempool import _children, _config
    import mempool
    children = _children.mode()
    source, text = _conf_source(conf)
    canonical = _config.canonical_conf(text, source if source == "--conf"
                                       else f"environment variable {source}")
    if _children.in_forkserver():
        # Every child forks from this process: a pool or a CUDA context here would be each
        # child's, where a pool refuses. Each child installs its own (mempool/_children.py).
        _children.serve_forks()
        why = "the forkserver process: each child it starts installs its own"
        return Installed(source, canonical, {}, {}, {"torch": why, "cupy": why})
    if source not in ("MEMPOOL_CONF", "defaults"):
        os.environ["MEMPOOL_CONF"] = canonical
    local = _local_device()
    primary = 0 if local is None else local
    pool = mempool.default_pool(primary)     # the settings' checks, before anything is hooked
    hooked, skipped = {}, {}
    for name, wanted, label in (("torch", torch, "PyTorch"), ("cupy", cupy, "CuPy")):
        if not wanted:
            skipped[name] = f"--no-{name}"
        elif importlib.util.find_spec(name) is None:
            skipped[name] = f"{label} is not installed"
        elif pool.backend != "cuda":
            skipped[name] = f"the pool is not on a GPU (backend {pool.backend!r})"
    if "torch" not in skipped:
        _prepare_pytorch_env(source)             # before PyTorch first reads them
        devices, why = _hook_torch(primary, local)
        if devices is None:
            skipped["torch"] = why
        else:
            hooked["torch"] = devices
    if "cupy" not in skipped:
        hooked["cupy"] = _hook_cupy(pool)
    pools = {d: mempool.default_pool(d) for d in sorted({primary, *hooked.get("torch", ())})}
    _installed = Installed(source, canonical, pools, hooked, skipped)
    if children == "off":
        _children.withdraw()
    else:
        _children.propagate(torch, cupy)
    return _installed
