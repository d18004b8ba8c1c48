"""``python -m benchmarks.serve``: exits 1 when a request failed."""

import sys

from benchmarks.serve.cli import main

if __name__ == "__main__":
    sys.exit(0 if main()["failures"] == 0 else 1)
