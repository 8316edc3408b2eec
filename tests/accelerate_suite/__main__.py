"""``python -m tests.accelerate_suite [nbaccel|accelerate|both] [CASE_ID ...]``: the whole
table, or the rows of the cases named (``test_notebook::test_monitoring``)."""

import sys

from tests.accelerate_suite.runner import table

if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "both"
    libs = ["nbaccel", "accelerate"] if which == "both" else [which]
    print(table(libs, sys.argv[2:] or None))
