"""Summarise `python -X importtime` output: the modules whose own import took longest, and the
top-level packages' cumulative time (where a start-up's "imports" phase goes).

    python bench/importtime_summary.py importtime.txt [--top 25]
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)$")


def parse(text: str) -> list[tuple[int, int, int, str]]:
    """(self µs, cumulative µs, depth, module) per line, in file order."""
    rows = []
    for line in text.splitlines():
        match = LINE.match(line)
        if match:
            own, cumulative, indent, module = match.groups()
            rows.append((int(own), int(cumulative), len(indent) // 2, module))
    return rows


def summary(rows: list[tuple[int, int, int, str]], top: int) -> str:
    by_package: dict[str, int] = defaultdict(int)
    for own, _, _, module in rows:
        by_package[module.split(".")[0]] += own
    total = sum(own for own, *_ in rows)
    lines = [f"{len(rows)} modules, {total / 1e6:.2f} s of import time in all", ""]
    lines.append("by top-level package (own time):")
    for package, own in sorted(by_package.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"  {own / 1e6:7.2f} s  {package}")
    lines += ["", "slowest modules (own time):"]
    for own, _, _, module in sorted(rows, key=lambda row: -row[0])[:top]:
        lines.append(f"  {own / 1e6:7.3f} s  {module}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    print(summary(parse(args.path.read_text()), args.top))


if __name__ == "__main__":
    main()
