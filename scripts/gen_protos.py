#!/usr/bin/env python3
"""Generate the Python stubs (`*_pb2.py`, `*_pb2.pyi`, `*_pb2_grpc.py`) beside the `.proto` files.

Run as `make proto`. With `--check`, generate into a temporary folder and exit 1 when the
checked-in stubs differ (the CI drift check, `make proto-check`).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out: Path) -> list[Path]:
    """Run protoc with `-I protos` into `out`; returns the .proto files compiled."""
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    sources = sorted(PROTOS.glob("opentinker/*/v1/*.proto"))
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(s) for s in sources],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sources


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail on drift instead of writing")
    args = parser.parse_args()
    if not args.check:
        generate(PROTOS)
        print(f"generated stubs under {PROTOS}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        sources = generate(Path(tmp))
        drift = []
        for src in sources:
            rel = src.relative_to(PROTOS).with_suffix("")
            for suffix in SUFFIXES:
                fresh = Path(tmp) / f"{rel}{suffix}"
                checked_in = PROTOS / f"{rel}{suffix}"
                if not checked_in.exists() or not filecmp.cmp(fresh, checked_in, shallow=False):
                    drift.append(str(checked_in.relative_to(ROOT)))
        if drift:
            print("generated stubs drifted from the .proto files; run `make proto`:", file=sys.stderr)
            for path in drift:
                print(f"  {path}", file=sys.stderr)
            return 1
    print("stubs match the .proto files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
