"""``python -m mempool COMMAND``: the command line lives in mempool/cli."""
import sys

from mempool.cli import main

if __name__ == "__main__":
    sys.exit(main())
