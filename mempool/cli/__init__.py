"""The command line: ``python -m mempool COMMAND``.

Commands: ``demo`` (the main job), ``bench`` (the latency suite), ``replay``, ``tune`` and
``plot`` (traces), ``run`` (a script on the pool), ``build-torch`` (the PyTorch allocator,
ahead of time). Each lives in its own module, which exposes ``main(command, argv) -> exit
code``; this package only dispatches. The work behind the trace commands is the offline tools'
(mempool/tools), importable without the command line.
"""
import importlib
import os
import sys

COMMANDS = {
    "demo": ("mempool.cli.demo", "run the demo on a real GPU if there is one, else on the simulated device"),
    "bench": ("mempool.cli.bench", "run the allocation latency suite and print one table"),
    "replay": ("mempool.cli.trace", "replay an allocation trace under a configuration"),
    "tune": ("mempool.cli.trace", "search settings that use least memory for a trace"),
    "plot": ("mempool.cli.trace", "draw a snapshot's segment map or a trace's memory over time"),
    "run": ("mempool.cli.run", "run a script with the pool as PyTorch's and CuPy's allocator"),
    "build-torch": ("mempool.torch_build", "compile mempool's PyTorch allocator now (cached)"),
}
def usage() -> str:
    lines = ["usage: python -m mempool COMMAND [ARGS]", "       python -m mempool --version",
             "", "commands:"]
    lines += [f"  {name:<11} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
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
    module = importlib.import_module(COMMANDS[name][0])
    # Every command module exposes main(command, argv) -> exit code.
    try:
        rc = int(module.main(name, rest) or 0)
        sys.stdout.flush()                   # inside the try: a closed pipe shows here
        return rc
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as other command-line tools do;
        # stdout goes to devnull so the interpreter's final flush cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


