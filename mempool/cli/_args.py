"""What every command shares: an argument parser whose errors are one line, and the one
line an error becomes."""
import argparse

# Set in the environment (to anything but "" or "0"), as ``--debug`` before the command:
# errors show their traceback instead of one line.
DEBUG_ENV = "MEMPOOL_TRACEBACK"
# Exit statuses: 2 for every error (a usage error, a bad input, a failed run), 130 for an
# interrupt (128 + SIGINT, as a shell reports it).
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
# An error's line is cut here: a message that quotes a whole input stays readable.
LINE_MAX = 600


def one_line(text: str) -> str:
    """`text` on one line (its lines joined by '; '), at most LINE_MAX characters."""
    parts = [" ".join(line.split()) for line in str(text).splitlines()]
    line = "; ".join(p for p in parts if p)
    return line if len(line) <= LINE_MAX else line[:LINE_MAX - 3] + "..."


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, with a usage error said in one line on stderr (exit status 2)."""

    def error(self, message):
        self.exit(EXIT_ERROR, one_line(f"{self.prog}: error: {message} (--help shows the "
                                       "usage)") + "\n")
