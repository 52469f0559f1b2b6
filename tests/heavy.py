"""The fast tier's list: which tests `tests/run.sh --fast` leaves out.

    tests/run.sh --durations=0 -vv | tee /tmp/durations.txt
    python tests/heavy.py /tmp/durations.txt > tests/heavy.txt

A test function is heavy when its setup and call, summed over its parameters, took
more than `--over` seconds (default 1.0) in that run: it starts process trees,
servers or a training job. `tests/conftest.py` marks every test of the functions
listed in heavy.txt `heavy`; `tests/run.sh --fast` runs `-m "not slow and not xla
and not heavy"`. A new test is in the fast tier until the list is made again.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict

# pytest's --durations lines: "12.34s call     tests/test_x.py::test_y[param]"
_LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s+(setup|call|teardown)\s+(\S+::\S+)")


def function_id(nodeid: str) -> str:
    """A test's node id without its parameters: what heavy.txt lists."""
    return nodeid.split("[", 1)[0]


def heavy(lines: list[str], over: float) -> list[str]:
    """The functions whose durations in `lines` (pytest's report) add up to more than `over` s."""
    total: dict[str, float] = defaultdict(float)
    for line in lines:
        if m := _LINE.match(line):
            total[function_id(m.group(3))] += float(m.group(1))
    return sorted(name for name, seconds in total.items() if seconds > over)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", help="a pytest output with --durations=0 -vv")
    p.add_argument("--over", type=float, default=1.0, help="seconds (default 1.0)")
    a = p.parse_args(argv)
    with open(a.report) as f:
        names = heavy(f.readlines(), a.over)
    if not names:
        print(f"heavy.py: no --durations lines in {a.report}", file=sys.stderr)
        return 1
    print("# Made by tests/heavy.py (see there): tests/run.sh --fast leaves these out.")
    print("\n".join(names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
