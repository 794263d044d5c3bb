"""Command line: ``python -m mempool COMMAND``.

Commands: ``demo`` (the main job), ``bench`` (the latency suite), ``replay``, ``tune`` and
``plot`` (traces). Each lives in its own module; this file only dispatches.
"""
import importlib
import sys

COMMANDS = {
    "demo": ("mempool.demo", "run the demo on a real GPU if there is one, else on the simulated device"),
    "bench": ("mempool.cli_bench", "run the allocation latency suite and print one table"),
    "replay": ("mempool.cli_trace", "replay an allocation trace under a configuration"),
    "tune": ("mempool.cli_trace", "search settings that use least memory for a trace"),
    "plot": ("mempool.cli_trace", "draw a snapshot's segment map or a trace's memory over time"),
    "run": ("mempool.run", "run a script with the pool as PyTorch's and CuPy's allocator"),
}


def usage() -> str:
    lines = ["usage: python -m mempool COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<8} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"mempool: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    # Every command module exposes main(command, argv) -> exit code.
    return int(module.main(name, rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
