"""What an artifact is: a folder of files, each with its relative path, size and SHA-256.

An artifact lives under a *key* (``tasks/<task_id>/a<attempt>/step_<n>``): ``/``-separated
segments of letters, digits and ``._-``, none starting with ``.`` (those names are the store's
own). Its :class:`Manifest` lists the files; the manifest's own SHA-256 (of its canonical JSON,
:meth:`Manifest.to_json`) names the whole content, and an :class:`ArtifactRef` carries key and
that hash. A store writes the manifest last: an artifact exists once, and only once, every file
is stored and verified.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from opentinker_common.artifacts.errors import ArtifactCorrupt, InvalidArtifact

__all__ = [
    "CHUNK_BYTES",
    "MAX_FILES",
    "MAX_KEY_CHARS",
    "FileEntry",
    "Manifest",
    "ArtifactRef",
    "check_key",
    "check_rel_path",
    "folder_files",
    "scan_folder",
    "sha256_file",
    "checkpoint_key",
]

#: Bytes read or sent at a time (1 MiB), also the largest chunk of an upload or download message.
CHUNK_BYTES = 1024 * 1024
#: Most files in one artifact.
MAX_FILES = 10_000
#: Longest key (characters).
MAX_KEY_CHARS = 512
#: Longest relative path of a file inside an artifact (characters).
MAX_PATH_CHARS = 1024
MANIFEST_VERSION = 1

_SEGMENT = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9._\-]*")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def check_key(key: str) -> str:
    """``key`` when it is a valid artifact key, else :class:`InvalidArtifact` naming the rule."""
    if not isinstance(key, str) or not key:
        raise InvalidArtifact("artifact key: expected a non-empty key such as tasks/<task_id>/a1/step_10, got ''")
    if len(key) > MAX_KEY_CHARS:
        raise InvalidArtifact(f"artifact key: expected at most {MAX_KEY_CHARS} characters, got {len(key)}")
    for seg in key.split("/"):
        if not _SEGMENT.fullmatch(seg):
            raise InvalidArtifact(
                f"artifact key {key[:80]!r}: each /-separated part must be letters, digits and ._- "
                f"not starting with '.', got {seg[:40]!r}"
            )
    return key


def check_rel_path(path: str) -> str:
    """``path`` when it is a clean relative file path (``/``-separated, no ``.``/``..`` parts,
    no NUL or backslash), else :class:`InvalidArtifact`."""
    if not isinstance(path, str) or not path or len(path) > MAX_PATH_CHARS:
        raise InvalidArtifact(f"file path: expected a relative path of 1 to {MAX_PATH_CHARS} characters, got {path!r}")
    if path.startswith("/") or "\\" in path or "\x00" in path or any(ord(c) < 32 for c in path):
        raise InvalidArtifact(f"file path {path[:80]!r}: expected a relative /-separated path, no control characters")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise InvalidArtifact(f"file path {path[:80]!r}: expected no empty, '.' or '..' parts")
    return path


@dataclass(frozen=True)
class FileEntry:
    """One file of an artifact: ``path`` relative to the folder, ``size_bytes``, ``sha256`` (64 hex)."""

    path: str
    size_bytes: int
    sha256: str

    def __post_init__(self) -> None:
        check_rel_path(self.path)
        if not isinstance(self.size_bytes, int) or self.size_bytes < 0:
            raise InvalidArtifact(f"file {self.path!r}: size_bytes must be an integer >= 0, got {self.size_bytes!r}")
        if not isinstance(self.sha256, str) or not _HEX64.fullmatch(self.sha256):
            raise InvalidArtifact(f"file {self.path!r}: sha256 must be 64 lowercase hex digits, got {self.sha256!r}")


@dataclass(frozen=True)
class ArtifactRef:
    """A committed artifact: its ``key``, the SHA-256 of its manifest and its size in bytes."""

    key: str
    manifest_sha256: str
    total_bytes: int = 0


@dataclass(frozen=True)
class Manifest:
    """The files of the artifact at ``key``, sorted by path; ``meta`` holds small string facts
    (``format``, ``step``) that travel with it."""

    key: str
    files: tuple[FileEntry, ...]
    meta: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_key(self.key)
        if len(self.files) > MAX_FILES:
            raise InvalidArtifact(f"artifact {self.key}: at most {MAX_FILES} files, got {len(self.files)}")
        seen: set[str] = set()
        for f in self.files:
            if f.path in seen:
                raise InvalidArtifact(f"artifact {self.key}: file {f.path!r} listed twice")
            seen.add(f.path)
        object.__setattr__(self, "files", tuple(sorted(self.files, key=lambda f: f.path)))
        object.__setattr__(self, "meta", {str(k): str(v) for k, v in dict(self.meta).items()})

    @property
    def total_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    def to_json(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces): the bytes the manifest hash is taken of."""
        doc = {
            "version": MANIFEST_VERSION,
            "key": self.key,
            "files": [{"path": f.path, "size_bytes": f.size_bytes, "sha256": f.sha256} for f in self.files],
            "meta": dict(self.meta),
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_json()).hexdigest()

    def ref(self) -> ArtifactRef:
        return ArtifactRef(self.key, self.sha256, self.total_bytes)

    @classmethod
    def from_json(cls, data: bytes, *, key: str | None = None, expect_sha256: str = "") -> "Manifest":
        """Parse manifest bytes. ``expect_sha256``: refuse bytes whose hash differs.

        Raises:
            ArtifactCorrupt: unreadable, another key than ``key``, or the hash differs.
        """
        if expect_sha256 and hashlib.sha256(data).hexdigest() != expect_sha256:
            raise ArtifactCorrupt(
                f"artifact {key or '?'}: manifest hash {hashlib.sha256(data).hexdigest()[:16]}... "
                f"is not the recorded {expect_sha256[:16]}...; refusing it"
            )
        try:
            doc = json.loads(data)
            m = cls(
                key=doc["key"],
                files=tuple(FileEntry(f["path"], int(f["size_bytes"]), f["sha256"]) for f in doc["files"]),
                meta=doc.get("meta", {}),
            )
        except (ValueError, KeyError, TypeError, InvalidArtifact) as exc:
            raise ArtifactCorrupt(f"artifact {key or '?'}: unreadable manifest ({exc})") from None
        if key is not None and m.key != key:
            raise ArtifactCorrupt(f"artifact {key}: its manifest names another key ({m.key!r})")
        return m


def sha256_file(path: Path) -> tuple[int, str]:
    """``(size in bytes, SHA-256 hex)`` of the file at ``path``."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


def folder_files(folder: Path) -> list[Path]:
    """Every regular file under ``folder`` (symlinks skipped), in walk order, not read.

    Raises:
        InvalidArtifact: ``folder`` is not a folder or holds too many files.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise InvalidArtifact(f"{folder}: not a folder")
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if p.is_symlink() or not p.is_file():
                continue
            found.append(p)
            if len(found) > MAX_FILES:
                raise InvalidArtifact(f"{folder}: more than {MAX_FILES} files")
    return found


def scan_folder(folder: Path, found: list[Path] | None = None) -> list[tuple[Path, FileEntry]]:
    """Every regular file under ``folder`` (``found``: :func:`folder_files`, when listed already),
    with its entry, sorted by path.

    Raises:
        InvalidArtifact: ``folder`` is not a folder, holds too many files or a file whose relative
            path is not allowed.
    """
    folder = Path(folder)
    if found is None:
        found = folder_files(folder)
    out = []
    for p, (size, sha) in zip(found, _hash_all(found)):
        out.append((p, FileEntry(p.relative_to(folder).as_posix(), size, sha)))
    out.sort(key=lambda pe: pe[1].path)
    return out


#: Files at least this large (64 MiB) are hashed side by side, one thread each (SHA-256 releases
#: the GIL): a full-weight checkpoint's weights and optimizer state take the time of the larger.
PARALLEL_HASH_BYTES = 64 * 1024 * 1024


def _hash_all(paths: list[Path]) -> list[tuple[int, str]]:
    """``sha256_file`` of each path, in order; the large ones in parallel threads."""
    sizes = [p.stat().st_size for p in paths]
    large = [i for i, n in enumerate(sizes) if n >= PARALLEL_HASH_BYTES]
    workers = min(len(large), os.cpu_count() or 1, 8)
    if workers < 2:
        return [sha256_file(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers, thread_name_prefix="artifact-hash") as pool:
        futures = {i: pool.submit(sha256_file, paths[i]) for i in large}
        return [futures[i].result() if i in futures else sha256_file(p) for i, p in enumerate(paths)]


def checkpoint_key(task_id: str, attempt: int, step: int, *, final: bool = False, name: str = "") -> str:
    """Key of a task's checkpoint: ``tasks/<task_id>/a<attempt>/step_<step>`` (``.../final_<step>``
    for the final one), or ``.../<name>`` for a checkpoint that has a name of its own (a training
    session's ``state_<name>`` and ``sampler_<name>``: several may be written at one step, each its
    own). The attempt keeps a resumed attempt's writes apart from complete ones.

    Raises:
        InvalidArtifact: a key the store cannot hold (:func:`check_key`)."""
    last = name or f"{'final' if final else 'step'}_{int(step)}"
    return check_key(f"tasks/{task_id}/a{int(attempt)}/{last}")


def task_prefix(task_id: str) -> str:
    """Prefix of every artifact of a task (``tasks/<task_id>/``)."""
    check_key(f"tasks/{task_id}")
    return f"tasks/{task_id}/"


def entries_by_path(files: Iterable[FileEntry]) -> dict[str, FileEntry]:
    return {f.path: f for f in files}
