"""``python -m tests.accelerate_suite [nbaccel|accelerate|both]``: the whole table."""

import sys

from tests.accelerate_suite.runner import table

if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "both"
    print(table(["nbaccel", "accelerate"] if which == "both" else [which]))
