"""The command line: ``python -m mempool COMMAND``.

Errors: every error of a command is one line on stderr and exit status 2; an interrupt
(Ctrl-C) is exit status 130. ``--debug`` before the command, or ``MEMPOOL_TRACEBACK=1`` in
the environment, shows the traceback instead.

Commands: ``demo`` (the main job), ``bench`` (the latency suite), ``replay``, ``tune`` and
``plot`` (traces), ``run`` (a script on the pool), ``build-torch`` (the PyTorch allocator,
ahead of time). Each lives in its own module, which exposes ``main(command, argv) -> exit
code``; this package only dispatches. The work behind the trace commands is the offline tools'
(mempool/tools), importable without the command line.
"""
import importlib
import os
import sys

from mempool.cli._args import DEBUG_ENV, EXIT_ERROR, EXIT_INTERRUPTED, one_line

COMMANDS = {
    "demo": ("mempool.cli.demo", "run the demo on a real GPU if there is one, else on the simulated device"),
    "bench": ("mempool.cli.bench", "run the allocation latency suite and print one table"),
    "replay": ("mempool.cli.trace", "replay an allocation trace under a configuration"),
    "tune": ("mempool.cli.trace", "search settings that use least memory for a trace"),
    "plot": ("mempool.cli.trace", "draw a snapshot's segment map or a trace's memory over time"),
    "run": ("mempool.cli.run", "run a script with the pool as PyTorch's and CuPy's allocator"),
    "build-torch": ("mempool.torch_build", "compile mempool's PyTorch allocator now (cached)"),
}
# Errors the commands raise for bad input or a missing device: their message says it all.
# Any other exception is a bug, and its line says how to see the traceback.
_USER_ERRORS = (ValueError, TypeError, OSError, RuntimeError, ImportError, MemoryError)


def usage() -> str:
    lines = ["usage: python -m mempool [--debug] COMMAND [ARGS]",
             "       python -m mempool --version", "", "commands:"]
    lines += [f"  {name:<11} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "Each command has --help. An error is one line on stderr, exit status 2;",
              "Ctrl-C exits with status 130. --debug (or the environment variable",
              f"{DEBUG_ENV}=1) shows an error's traceback instead."]
    return "\n".join(lines)


def _debug_env() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _error_line(name: str, exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if not isinstance(exc, _USER_ERRORS):
        text = f"{type(exc).__name__}: {text} (--debug shows the traceback)"
    return one_line(f"mempool {name}: error: {text}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_env()
    while argv and argv[0] == "--debug":
        debug = True
        argv.pop(0)
    if not argv:
        print(usage(), file=sys.stderr)
        return EXIT_ERROR
    if argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        # Read from the package, not its metadata: a source checkout built in place has none.
        from mempool import __version__
        print(f"mempool {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"mempool: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if name == "run":
        # The script's own errors and interrupts are the script's: run reports them as
        # python would (mempool/cli/run.py).
        return int(importlib.import_module(COMMANDS[name][0]).main(name, rest) or 0)
    # Every command module exposes main(command, argv) -> exit code.
    try:
        module = importlib.import_module(COMMANDS[name][0])
        rc = int(module.main(name, rest) or 0)
        sys.stdout.flush()                   # inside the try: a closed pipe shows here
        return rc
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as other command-line tools do;
        # stdout goes to devnull so the interpreter's final flush cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"mempool {name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the one place a command's error becomes a line
        if debug:
            raise
        print(_error_line(name, exc), file=sys.stderr)
        return EXIT_ERROR


