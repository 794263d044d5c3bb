"""``python -m mempool run``: any script on the pool, without changing a line of it.

``python -m mempool run [OPTIONS] SCRIPT [ARGS]`` (or ``-m MODULE [ARGS]``) makes the
process's default pools PyTorch's CUDA allocator and CuPy's (:func:`mempool.run.install_default`),
then runs the script as ``python SCRIPT ARGS`` would. See "Zero-code adoption" in
docs/sharing.md.
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

from mempool.run import install_default

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
  -h, --help     show this help

With MEMPOOL_CHILDREN=1, child processes that multiprocessing starts by "spawn" or
"forkserver" install the same pools before they unpickle anything (=verbose: each says so
on stderr); by default they keep PyTorch's allocator."""

_launcher = None    # the __main__ the script replaced (mempool/__main__.py): its frames live on

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
        print(f"mempool run: error: {exc} (--help shows the usage)", file=sys.stderr)
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
