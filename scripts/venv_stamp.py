"""Is the project venv's installed package set the one pyproject.toml and constraints.txt ask for?

``make install`` (and so ``make scheduler``, ``make trainer``, ``make test``) calls this first:

    python3 scripts/venv_stamp.py check .venv   # exit 0: up to date, prints nothing
                                                # exit 1: prints one line saying why it installs
    python3 scripts/venv_stamp.py write .venv   # after a successful install: record what was installed

The stamp ``VENV/.installed`` holds the SHA-256 of the install inputs (pyproject.toml,
constraints.txt and the Makefile's install command, passed as ``--spec``), not a time: a checkout,
``touch`` or an editor saving an unchanged pyproject.toml does not reinstall into a venv others may
share; a changed dependency or pin does. Standard library only (it runs before the venv exists).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

STAMP = ".installed"
INPUTS = ("pyproject.toml", "constraints.txt")


def inputs_hash(root: Path, spec: str = "") -> str:
    """SHA-256 (hex) of ``INPUTS`` under ``root`` (each name and its bytes; a missing file counts
    as empty) and the install command ``spec``."""
    h = hashlib.sha256()
    for name in INPUTS:
        path = root / name
        data = path.read_bytes() if path.is_file() else b""
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    h.update(b"spec\0" + spec.encode())
    return h.hexdigest()


def _mtime(path: Path) -> float:
    return path.stat().st_mtime if path.exists() else 0.0


def why_install(venv: Path, root: Path, spec: str = "") -> str | None:
    """None when ``venv`` holds what the inputs ask for; otherwise the one-line reason to install."""
    python = venv / "bin" / "python"
    if not python.exists():
        return f"installing into {venv}: it has no {python.relative_to(venv)} yet (a new venv)"
    stamp = venv / STAMP
    if not stamp.is_file():
        return f"installing into {venv}: no record of an install there ({stamp} is missing)"
    recorded = stamp.read_text(encoding="utf-8", errors="replace").split()
    if not recorded and stamp.stat().st_mtime >= max(_mtime(root / name) for name in INPUTS):
        # An empty stamp of the Makefile before hashes (``touch``) that is newer than the inputs:
        # that install is current; record its hash instead of reinstalling into a shared venv.
        stamp.write_text(inputs_hash(root, spec) + "\n", encoding="utf-8")
        return None
    if not recorded or recorded[0] != inputs_hash(root, spec):
        return f"installing into {venv}: {' or '.join(INPUTS)} (or the install command) changed since its last install"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="venv_stamp.py", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("check", "write"))
    parser.add_argument("venv", type=Path)
    parser.add_argument("--root", type=Path, default=Path("."), help="where pyproject.toml and constraints.txt are")
    parser.add_argument("--spec", default="", help="the install command; a change to it reinstalls too")
    args = parser.parse_args(argv)
    if args.action == "check":
        reason = why_install(args.venv, args.root, args.spec)
        if reason is None:
            return 0
        print(reason, flush=True)
        return 1
    (args.venv / STAMP).write_text(inputs_hash(args.root, args.spec) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
