"""`python -m shared.cache`: make a compile-cache pack after a start, or show what one is for.

    python -m shared.cache pack OUT.tar [--root DIR]   # OUT.tar.gz: gzip-compressed
    python -m shared.cache show PACK                    # a .tar/.tar.gz or an unpacked folder

`pack` reads the root the bundle's settings name (BUNDLE_COMPILE_CACHE_DIR, else
<BUNDLE_CACHE_DIR>/compile-cache, where the Cog runner keeps its caches) and the key its last
start recorded there. Run it after a start on the machine kind you deploy to, with the engine
stopped or idle. Errors are one line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import NoReturn

from pydantic import ValidationError

from shared.cache.layout import RECORD, managed_root, read_record, with_default_root
from shared.cache.pack import read_manifest, write_pack
from shared.errors import CompileCacheRefused
from shared.settings import Settings

MIB = 1024 * 1024
PROG = "python -m shared.cache"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Compile-cache packs: make one after a start, or show one.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    pack = sub.add_parser("pack", help="pack the caches of the last start into OUT (.tar or .tar.gz)")
    pack.add_argument("out", type=Path, metavar="OUT")
    pack.add_argument("--root", type=Path, help="the caches' root (default: from the BUNDLE_* settings)")
    show = sub.add_parser("show", help="print what a pack is valid for and what it holds")
    show.add_argument("pack", type=Path, metavar="PACK")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "pack":
            return pack(args.out, args.root)
        return show(args.pack)
    except (CompileCacheRefused, OSError, ValidationError) as exc:
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return 2


def pack(out: Path, root: Path | None) -> int:
    root = root or managed_root(with_default_root(Settings()))
    assert root is not None  # with_default_root always names one
    key = read_record(root)
    if key is None:
        raise CompileCacheRefused(
            f"no engine start is recorded in {root} ({RECORD}): start the bundle once with "
            f"BUNDLE_COMPILE_CACHE_DIR={root} (the Cog runner always keeps one), then pack"
        )
    written = write_pack(root, out, key, datetime.now(UTC).isoformat(timespec="seconds"))
    print(
        f"wrote {written.path}: {written.files} files, {written.bytes / MIB:.1f} MiB, for {key.device} "
        f"(compute capability {key.compute_capability}), vLLM {key.packages.get('vllm')}, model {key.model}"
    )
    for item in written.skipped:
        print(f"left out: {item}")
    return 0


def show(source: Path) -> int:
    manifest = read_manifest(source)
    summary = {
        "created": manifest.created,
        "files": len(manifest.files),
        "mib": round(manifest.total_bytes / MIB, 1),
        "valid_for": manifest.valid_for.model_dump(),
    }
    print(json.dumps(summary, indent=2))
    return 0


def _one_line(exc: Exception) -> str:
    if isinstance(exc, CompileCacheRefused):
        return exc.message
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        return f"bad setting {'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
