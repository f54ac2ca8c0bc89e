"""Summarise a py-spy raw (collapsed-stack) profile: self and inclusive share per function.

python bench/pyspy_summary.py profile.txt [--top 25]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def frame_name(frame: str) -> str:
    """'func (path/to/file.py:12)' -> 'func file.py' (line numbers merged)."""
    name, _, location = frame.partition(" (")
    return f"{name} {Path(location.split(':')[0]).name}" if location else name


def summarise(lines: list[str]) -> tuple[int, Counter[str], Counter[str]]:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not count.isdigit():
            continue
        samples = int(count)
        total += samples
        frames = [frame_name(f) for f in stack.split(";")]
        own[frames[-1]] += samples
        for name in set(frames):
            inclusive[name] += samples
    return total, own, inclusive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    total, own, inclusive = summarise(args.profile.read_text().splitlines())
    print(f"{total} samples")
    for title, counts in (("self", own), ("inclusive", inclusive)):
        print(f"--- {title}")
        for name, samples in counts.most_common(args.top):
            print(f"{samples / total:6.1%}  {name}")


if __name__ == "__main__":
    main()
