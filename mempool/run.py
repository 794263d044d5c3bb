"""``python -m mempool run``: any script on the pool, without changing a line of it.

``python -m mempool run [OPTIONS] SCRIPT [ARGS]`` (or ``-m MODULE [ARGS]``) makes the
process's default pools PyTorch's CUDA allocator and CuPy's, where those are installed, then
runs the script as ``python SCRIPT ARGS`` would. :func:`install_default` does the first half
for code that is already running (``python -c``, a notebook); ``import mempool.auto`` calls it.

The pool's settings come from, in order: ``--conf``; ``MEMPOOL_CONF``; PyTorch's own
``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF`` (PyTorch's order), read as PyTorch
reads it (``mempool/_config.py``). See "Zero-code adoption" in docs/sharing.md.
"""
import atexit
import builtins
import importlib.machinery
import importlib.util
import io
import marshal
import os
import runpy
import signal
import sys
import types
import warnings
from typing import NamedTuple

__all__ = ["install_default", "Installed", "main"]

# PyTorch's allocator variables, in the order PyTorch reads them: the first one set wins.
PYTORCH_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")

USAGE = """\
usage: python -m mempool run [OPTIONS] SCRIPT [ARGS ...]
       python -m mempool run [OPTIONS] -m MODULE [ARGS ...]

Run SCRIPT (or MODULE) as python would, with mempool's default pools as PyTorch's CUDA
allocator and CuPy's, where those are installed.

options:
  --conf STRING  the pool's settings (default: MEMPOOL_CONF, else PyTorch's
                 PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF, read as PyTorch reads it)
  --no-torch     leave PyTorch's allocator alone
  --no-cupy      leave CuPy's allocator alone
  --report       print each pool's memory summary at exit
  -h, --help     show this help"""


class Installed(NamedTuple):
    """What :func:`install_default` did."""

    source: str        # where the settings came from: "--conf", a variable, or "defaults"
    conf: str          # the settings, canonical spelling ("" = every default)
    pools: dict        # device -> the default pool made for it
    hooked: dict       # framework -> the devices it allocates from the pool on
    skipped: dict      # framework -> why it was left alone

    def describe(self) -> str:
        """One line: the pools, their settings, and what was hooked or why not."""
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
_launcher = None    # the __main__ the script replaced (mempool/__main__.py): its frames live on


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


def install_default(conf=None, torch=True, cupy=True):
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
    ``LOCAL_RANK`` (one process per GPU) limits the pools to that device.
    """
    global _installed
    if _installed is not None:
        return _installed
    for name, flag in (("torch", torch), ("cupy", cupy)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    from mempool import _config
    import mempool
    source, text = _conf_source(conf)
    canonical = _config.canonical_conf(text, source if source == "--conf"
                                       else f"environment variable {source}")
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
    return _installed


# --------------------------------------------------------------------------- the command


class _UsageError(Exception):
    pass


class _Args(NamedTuple):
    conf: object
    torch: bool
    cupy: bool
    report: bool
    module: bool           # target is a module name (-m), not a path
    target: str
    rest: list


def _parse_args(argv):
    """The options before the target; everything after the target is the script's."""
    conf, torch, cupy, report = None, True, True, False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            return None
        if arg == "--no-torch":
            torch = False
        elif arg == "--no-cupy":
            cupy = False
        elif arg == "--report":
            report = True
        elif arg == "--conf" or arg.startswith("--conf="):
            if arg == "--conf":
                i += 1
                if i == len(argv):
                    raise _UsageError("--conf needs a value: --conf STRING")
                conf = argv[i]
            else:
                conf = arg[len("--conf="):]
        elif arg == "-m" or (arg.startswith("-m") and not arg.startswith("--")):
            name = arg[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
            if not name:
                raise _UsageError("-m needs a module name: -m MODULE [ARGS]")
            rest = argv[i + (1 if arg[2:] else 2):]
            return _Args(conf, torch, cupy, report, True, name, rest)
        elif arg == "--":
            if i + 1 == len(argv):
                raise _UsageError("no script given after --")
            return _Args(conf, torch, cupy, report, False, argv[i + 1], argv[i + 2:])
        elif arg.startswith("-"):
            raise _UsageError(f"unknown option {arg!r}")
        else:
            return _Args(conf, torch, cupy, report, False, arg, argv[i + 1:])
        i += 1
    raise _UsageError("no script given: SCRIPT [ARGS] or -m MODULE [ARGS]")


def _say(text):
    print(f"mempool run: {text}", file=sys.stderr, flush=True)


def _install_reporting(args):
    """install_default, with its warnings as lines of ours rather than ones pointing into
    runpy; every other warning goes on as it would have."""
    from mempool._config import ConfigWarning
    with warnings.catch_warnings(record=True) as caught:
        try:
            return install_default(args.conf, torch=args.torch, cupy=args.cupy)
        finally:
            for w in caught:
                if issubclass(w.category, ConfigWarning):
                    _say(f"warning: {w.message}")
                else:
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file,
                                         w.line)


def _report_at_exit():
    import mempool
    for device, pool in sorted(mempool._default_pools.items()):
        print(f"mempool run: device {device} pool at exit\n{pool.summary(abbreviated=True)}",
              file=sys.stderr)


def _main_module(file, loader=None):
    """A fresh ``__main__`` module, as the interpreter makes for a script."""
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    main.__spec__ = None
    main.__loader__ = loader
    if file is not None:
        main.__file__ = file
    return main


def _script_code(path):
    """The code of a script file, compiled as ``python path`` compiles it (or a .pyc)."""
    with io.open_code(path) as f:
        data = f.read()
    if data[:len(importlib.util.MAGIC_NUMBER)] == importlib.util.MAGIC_NUMBER:
        return marshal.loads(data[16:])      # a .pyc: 16-byte header, then the code
    return compile(data, path, "exec", dont_inherit=True)


def _die_by_sigint():
    """End the process as Python does after an uncaught KeyboardInterrupt: by SIGINT, so
    that the parent sees the signal (exit status -2, or 130 in a shell)."""
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    return 130                               # where the signal does not end the process


def _execute(run, main):
    """``run()`` with `main` as the program's ``__main__``; the exit status, as the
    interpreter sets it.

    ``SystemExit`` goes on up to the interpreter, which ends the process with its code as it
    would for the script. Any other exception is printed by ``sys.excepthook`` with the
    frames of this module dropped, so that the traceback is the one Python prints, and the
    status is 1.
    """
    global _launcher
    _launcher = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        run()
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        exc.__traceback__ = tb
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
        if hasattr(sys, "last_exc"):
            sys.last_exc = exc
        sys.excepthook(type(exc), exc, tb)
        if isinstance(exc, KeyboardInterrupt):
            return _die_by_sigint()
        return 1
    return 0


def _run_path(path, rest):
    sys.argv = [path] + rest
    if not os.path.isfile(path):
        # A directory or zip application: runpy does what the interpreter does with it.
        return _execute(lambda: runpy.run_path(path, run_name="__main__"),
                        sys.modules["__main__"])
    abspath = os.path.abspath(path)
    if not sys.flags.safe_path:
        sys.path[0] = os.path.dirname(os.path.realpath(path))
    try:
        code = _script_code(abspath)
    except SyntaxError as exc:
        exc.__traceback__ = None              # Python prints a script's SyntaxError bare
        sys.excepthook(type(exc), exc, None)
        return 1
    main = _main_module(abspath, loader=importlib.machinery.SourceFileLoader("__main__",
                                                                             abspath))
    return _execute(lambda: exec(code, main.__dict__), main)


def _run_module(name, rest):
    sys.argv = ["-m"] + rest
    if not sys.flags.safe_path:
        sys.path[0] = os.getcwd()
    # The function python -m itself calls: the same lookup (a package runs its __main__),
    # the same errors, argv[0] and module attributes, and the same frames in a traceback. It
    # runs the module in the namespace of sys.modules["__main__"], a fresh one here.
    return _execute(lambda: runpy._run_module_as_main(name, alter_argv=True),
                    _main_module(None))


def main(command, argv):
    """``python -m mempool run ...``; the exit status."""
    try:
        args = _parse_args(list(argv))
    except _UsageError as exc:
        print(f"mempool run: {exc}\n\n{USAGE}", file=sys.stderr)
        return 2
    if args is None:
        print(USAGE)
        return 0
    if not args.module and not os.path.exists(args.target):
        _say(f"can't open file {os.path.abspath(args.target)!r}: [Errno 2] No such file or "
             "directory")
        return 2
    try:
        installed = _install_reporting(args)
    except (ValueError, TypeError, Warning) as exc:
        _say(f"error: {exc}")
        return 2
    except Exception as exc:
        _say(f"could not install the pool: {type(exc).__name__}: {exc}")
        return 1
    _say(installed.describe())
    if args.report:
        atexit.register(_report_at_exit)   # first in, so it runs after the script's own
    if args.module:
        return _run_module(args.target, args.rest)
    return _run_path(args.target, args.rest)
