"""Uploaded datasets: JSONL chat examples for ``sft`` or RL prompts, validated on arrival, stored by content.

Layout under ``<state_dir>/datasets``: ``<hex>.jsonl`` (the bytes as uploaded) and
``<hex>.json`` (name, size, example count), where ``<hex>`` is the file's SHA-256; the dataset id
is ``sha256:<hex>``. With an ``s3`` artifact store every dataset is also kept there
(``datasets/<hex>``, :meth:`DatasetStore.publish` before the upload is answered), and a
scheduler that lacks one on its disk (another one, after a failover) takes it from there
(:meth:`DatasetStore.restore`). An upload is written to a temporary file in the same folder while its lines
are checked and its hash computed, and renamed into place only when it is complete and valid:
nothing half-written is ever visible, and the same bytes uploaded twice are stored once.

The line rules are :func:`opentinker_common.spec.sft.parse_chat_line` for the ``chat`` format
and :func:`opentinker_common.spec.prompts.parse_prompt_line` for ``prompts`` (both shared with
the client and the trainer); the metadata records every format the bytes passed as
(``formats``), so the same file uploaded as both is stored once and usable as either. Errors are
the scheduler's domain errors (``InvalidArgument`` naming the line, ``ResourceExhausted``,
``NotFound``), which the servicer maps to gRPC status codes.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterable, Iterable, Iterator

from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_common.spec import control_character_problem
from opentinker_common.spec.prompts import DATASET_FORMATS, parse_prompt_line
from opentinker_common.spec.sft import MAX_LINE_BYTES, DatasetError, is_dataset_id, parse_chat_line

from opentinker_scheduler.errors import InvalidArgument, NotFound, ResourceExhausted
from opentinker_common.datasets import DEFAULT_MAX_DATASET_BYTES

__all__ = [
    "DEFAULT_MAX_DATASET_BYTES",
    "DOWNLOAD_CHUNK_BYTES",
    "DatasetStore",
    "DatasetUpload",
    "LineValidator",
    "receive_upload",
    "validate_chat_jsonl",
]

#: Largest chunk DownloadDataset sends, in bytes (1 MiB).
DOWNLOAD_CHUNK_BYTES = 1024 * 1024
_NAME_MAX = 256


def validate_chat_jsonl(lines: Iterable[str | bytes]) -> int:
    """Check every line of a chat JSONL dataset; return the number of examples.

    Raises:
        InvalidArgument: the first bad line, as ``dataset line <n>: expected ...``, or an empty
            dataset (``dataset: expected at least one example``).
    """
    v = LineValidator()
    for line in lines:
        v.line(line if isinstance(line, bytes) else line.encode("utf-8"))
    return v.finish()


class LineValidator:
    """Checks a JSONL byte stream line by line as chunks arrive (lines may span chunks).

    Holds at most one partial line (bounded by ``MAX_LINE_BYTES``) in memory.

    Args:
        name: the file's name as the uploader gave it; errors then read
            ``dataset <name>:<line>:<column>: expected ...`` (``<name>:<line>:`` when the line is
            JSON but not a chat example, ``<name>:`` for the file as a whole), else
            ``dataset line <n>: expected ...``.
        format: ``chat`` (sft examples) or ``prompts`` (RL prompts).
    """

    def __init__(self, name: str = "", format: str = "chat") -> None:
        self.name = name
        self.parse = parse_prompt_line if format == "prompts" else parse_chat_line
        self.lineno = 0
        self.examples = 0
        self._partial = bytearray()

    def line(self, raw: bytes) -> None:
        """Check one complete line (without its newline).

        Raises:
            InvalidArgument: naming the line number and what was expected.
        """
        self.lineno += 1
        try:
            if self.parse(raw.rstrip(b"\r"), self.lineno) is not None:
                self.examples += 1
        except DatasetError as exc:
            raise InvalidArgument(f"dataset {exc.at(self.name) if self.name else exc}") from None

    def feed(self, chunk: bytes) -> None:
        """Check every line that ``chunk`` completes; keep the rest for the next chunk."""
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                break
            self._partial += chunk[start:nl]
            self.line(bytes(self._partial))
            self._partial.clear()
            start = nl + 1
        self._partial += chunk[start:]
        if len(self._partial) > MAX_LINE_BYTES:
            where = f"{self.name}:{self.lineno + 1}" if self.name else f"line {self.lineno + 1}"
            raise InvalidArgument(f"dataset {where}: expected a line of at most {MAX_LINE_BYTES} bytes")

    def finish(self) -> int:
        """Check the last line (a file need not end with a newline); return the example count.

        Raises:
            InvalidArgument: a bad last line, or no examples at all.
        """
        if self._partial:
            self.line(bytes(self._partial))
            self._partial.clear()
        if self.examples == 0:
            where = f"dataset {self.name}" if self.name else "dataset"
            raise InvalidArgument(
                f"{where}: expected at least one example (one JSON object per line), got an empty dataset"
            )
        return self.examples


def _hex_of(dataset_id: str) -> str:
    if not is_dataset_id(dataset_id):
        raise InvalidArgument(f"dataset_id: expected sha256:<64 lowercase hex digits>, got {dataset_id!r}")
    return dataset_id.removeprefix("sha256:")


@dataclass(eq=False)
class DatasetUpload:
    """One upload in progress: bytes go to a temporary file while they are hashed and checked.

    Call :meth:`write` per chunk, then :meth:`commit`; on any error call :meth:`abort` (the
    temporary file is removed, nothing else changed).
    """

    store: "DatasetStore"
    name: str
    total_bytes: int
    tmp: Path
    received: int = 0
    #: Who uploads it (its announced bytes count against that owner's quota while it runs).
    owner: str = ""
    format: str = "chat"

    def __post_init__(self) -> None:
        self._hash = hashlib.sha256()
        self._check = LineValidator(self.name, self.format)
        self._fh = open(self.tmp, "wb")  # noqa: SIM115 - closed in commit/abort
        self.store._open.add(self)

    def write(self, chunk: bytes) -> None:
        """Append ``chunk``.

        Raises:
            ResourceExhausted: more bytes than announced would exceed the store's limit.
            InvalidArgument: more bytes than announced, or a bad line.
        """
        self.received += len(chunk)
        if self.received > self.store.max_bytes:
            raise ResourceExhausted(f"dataset: larger than this scheduler's limit of {self.store.max_bytes} bytes")
        if self.received > self.total_bytes:
            raise InvalidArgument(f"total_bytes: announced {self.total_bytes} bytes, received more")
        self._hash.update(chunk)
        self._check.feed(chunk)
        self._fh.write(chunk)

    def commit(self) -> scheduler_pb2.DatasetInfo:
        """Finish: check the end, rename into place (or keep the identical stored copy).

        The answer carries this upload's own ``name``, also when the same bytes were stored
        before under another owner's name (names are per owner: the store only says that
        identical bytes exist).

        Raises:
            InvalidArgument: fewer bytes than announced, a bad last line, or no examples.
        """
        if self.received != self.total_bytes:
            raise InvalidArgument(f"total_bytes: announced {self.total_bytes} bytes, received {self.received}")
        examples = self._check.finish()
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        hex_ = self._hash.hexdigest()
        info = scheduler_pb2.DatasetInfo(
            dataset_id=f"sha256:{hex_}",
            name=self.name,
            size_bytes=self.received,
            num_examples=examples,
            format=self.format,
        )
        self.store._open.discard(self)
        meta = self.store.root / f"{hex_}.json"
        if self.store.exists(info.dataset_id):
            # Stored already (by this owner or another): answered with this uploader's own name.
            self.tmp.unlink(missing_ok=True)
            formats = self.store.formats(info.dataset_id)
            if self.format not in formats:  # the same bytes, now checked as this format too
                m = json.loads(meta.read_text())
                m["formats"] = [*formats, self.format]
                meta_tmp = meta.with_name(f".{hex_}.{secrets.token_hex(4)}.json.tmp")
                meta_tmp.write_text(json.dumps(m))
                os.replace(meta_tmp, meta)
            return info
        meta_tmp = self.tmp.with_suffix(".json.tmp")
        meta_tmp.write_text(
            json.dumps(
                {
                    "name": self.name,
                    "size_bytes": self.received,
                    "num_examples": examples,
                    "formats": [self.format],
                }
            )
        )
        os.replace(self.tmp, self.store.root / f"{hex_}.jsonl")
        os.replace(meta_tmp, meta)  # the metadata last: a dataset counts as stored once it exists
        return info

    def abort(self) -> None:
        """Drop the upload: close and remove the temporary file."""
        self.store._open.discard(self)
        if not self._fh.closed:
            self._fh.close()
        self.tmp.unlink(missing_ok=True)


class DatasetStore:
    """Datasets under ``root``, content-addressed by SHA-256 (see the module docstring).

    Args:
        root: folder (created if missing); temporary files of interrupted uploads left there by a
            crash are removed at start.
        max_bytes: largest dataset accepted, in bytes.
    """

    def __init__(self, root: Path, *, max_bytes: int = DEFAULT_MAX_DATASET_BYTES, mirror=None) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        #: An artifact store every dataset is also kept in (``datasets/<hex>``: ``data.jsonl``,
        #: ``meta.json``), so a scheduler that does not hold it on its disk (another one, after a
        #: failover) fetches it from there (:meth:`restore`); None: this folder only.
        self.mirror = mirror
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob("upload-*"):
            stale.unlink(missing_ok=True)
        #: Uploads in progress (the event loop's only; their announced bytes are promised).
        self._open: set[DatasetUpload] = set()

    def begin(
        self,
        name: str,
        total_bytes: int,
        format: str = "chat",
        *,
        owner: str = "",
        stored_bytes: int = 0,
        max_owner_bytes: int = 0,
        min_free_bytes: int = 0,
    ) -> DatasetUpload:
        """Start an upload of ``total_bytes`` bytes by ``owner`` whose lines are checked as
        ``format`` (``chat``, the default, or ``prompts``; ``""`` means ``chat``).

        Args:
            stored_bytes: bytes of datasets ``owner`` has stored already.
            max_owner_bytes: most bytes of datasets one owner may store, counting the uploads it has
                in progress (0 = no limit; ``limits.max_dataset_bytes_per_owner``).
            min_free_bytes: free bytes the dataset folder's disk must keep after this upload and
                every one in progress (``limits.min_free_disk_bytes``).

        Raises:
            InvalidArgument: a bad name (over 256 characters, or with control characters), size or format.
            ResourceExhausted: ``total_bytes`` is over the size limit, the owner's quota or the free
                disk; the message gives the numbers and the config key.
        """
        format = format or "chat"
        if format not in DATASET_FORMATS:
            raise InvalidArgument(f"format: expected one of {', '.join(DATASET_FORMATS)}, got {format[:40]!r}")
        if not isinstance(name, str) or len(name) > _NAME_MAX:
            raise InvalidArgument(f"name: expected at most {_NAME_MAX} characters, got {len(name)} characters")
        problem = control_character_problem(name)
        if problem:
            raise InvalidArgument(f"name: expected a name without control characters, got {problem}")
        if total_bytes <= 0:
            raise InvalidArgument(
                f"total_bytes: expected the file's size in bytes (> 0), got {total_bytes} "
                "(an empty dataset has no examples)"
            )
        if total_bytes > self.max_bytes:
            raise ResourceExhausted(
                f"total_bytes: {total_bytes} bytes is over this scheduler's dataset limit of {self.max_bytes} bytes"
            )
        if max_owner_bytes:
            uploading = sum(u.total_bytes for u in self._open if u.owner == owner)
            if stored_bytes + uploading + total_bytes > max_owner_bytes:
                more = f" and is uploading {uploading} more" if uploading else ""
                raise ResourceExhausted(
                    f"total_bytes: owner {owner!r} stores {stored_bytes} bytes of datasets{more}; {total_bytes} "
                    f"more would pass the limit of {max_owner_bytes} bytes per owner "
                    "(limits.max_dataset_bytes_per_owner)"
                )
        free = shutil.disk_usage(self.root).free
        promised = sum(u.total_bytes - u.received for u in self._open)
        if free - promised - total_bytes < min_free_bytes:
            raise ResourceExhausted(
                f"total_bytes: {total_bytes} bytes would leave less than {min_free_bytes} bytes free on the "
                f"scheduler's dataset disk ({free} bytes free, {promised} promised to uploads in progress) "
                "(limits.min_free_disk_bytes)"
            )
        return DatasetUpload(
            self, name, total_bytes, self.root / f"upload-{secrets.token_hex(8)}.part", owner=owner, format=format
        )

    def path(self, dataset_id: str) -> Path:
        """The stored file of ``dataset_id``.

        Raises:
            InvalidArgument: not a dataset id. NotFound: no such dataset.
        """
        hex_ = _hex_of(dataset_id)
        file = self.root / f"{hex_}.jsonl"
        if not (self.root / f"{hex_}.json").exists() or not file.exists():
            raise NotFound(f"dataset {dataset_id} not found (upload it first with UploadDataset)")
        return file

    def info(self, dataset_id: str, *, missing_ok: bool = False) -> scheduler_pb2.DatasetInfo | None:
        """What is known about ``dataset_id``; None when missing and ``missing_ok``.

        Raises:
            InvalidArgument: not a dataset id. NotFound: no such dataset (unless ``missing_ok``).
        """
        hex_ = _hex_of(dataset_id)
        meta = self.root / f"{hex_}.json"
        if not meta.exists():
            if missing_ok:
                return None
            raise NotFound(f"dataset {dataset_id} not found (upload it first with UploadDataset)")
        m = json.loads(meta.read_text())
        return scheduler_pb2.DatasetInfo(
            dataset_id=dataset_id,
            name=m["name"],
            size_bytes=m["size_bytes"],
            num_examples=m["num_examples"],
            format=m.get("formats", ["chat"])[0],
        )

    def formats(self, dataset_id: str) -> list[str]:
        """The formats ``dataset_id``'s lines passed as at upload (a dataset stored before formats
        existed is ``chat``); empty when there is no such dataset."""
        if not self.exists(dataset_id):
            return []
        meta = self.root / f"{dataset_id.removeprefix('sha256:')}.json"
        return list(json.loads(meta.read_text()).get("formats", ["chat"]))

    def head(self, dataset_id: str, max_lines: int, max_bytes: int = 8 * 1024 * 1024) -> list[bytes]:
        """The first ``max_lines`` lines of ``dataset_id`` (newlines stripped), reading at most
        ``max_bytes`` bytes (the sample checked at submit).

        Raises:
            InvalidArgument, NotFound: as :meth:`path`.
        """
        lines: list[bytes] = []
        read = 0
        with open(self.path(dataset_id), "rb") as fh:
            while len(lines) < max_lines and read < max_bytes and (raw := fh.readline(max_bytes - read)):
                read += len(raw)
                lines.append(raw.rstrip(b"\r\n"))
        return lines

    def exists(self, dataset_id: str) -> bool:
        """True when ``dataset_id`` is a stored dataset (False for ids of the wrong shape too)."""
        return is_dataset_id(dataset_id) and (self.root / f"{dataset_id.removeprefix('sha256:')}.json").exists()

    def publish(self, dataset_id: str) -> None:
        """Put the stored dataset (bytes and metadata) into the :attr:`mirror` under
        ``datasets/<hex>``. Blocking (network I/O): call it in a thread.

        Raises:
            NotFound: no such dataset here. StoreUnavailable, StoreAuthError, StoreFull: it is
                not in the mirror (a dataset that is not there must not be recorded as uploaded).
        """
        if self.mirror is None:
            return
        hex_ = _hex_of(dataset_id)
        self.path(dataset_id)  # NotFound
        folder = self.root / f".publish-{hex_}-{secrets.token_hex(4)}"
        folder.mkdir()
        try:
            for src, name in ((f"{hex_}.jsonl", "data.jsonl"), (f"{hex_}.json", "meta.json")):
                try:
                    os.link(self.root / src, folder / name)
                except OSError:
                    shutil.copyfile(self.root / src, folder / name)
            self.mirror.put_folder(f"datasets/{hex_}", folder, meta={"dataset_id": dataset_id})
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def restore(self, dataset_id: str) -> bool:
        """Fetch ``dataset_id`` from the :attr:`mirror` into this folder when it is not here
        (every file's SHA-256 checked, and the bytes against the id); True when it is here now.
        Blocking (network I/O): call it in a thread.

        Raises:
            StoreUnavailable, StoreAuthError: the mirror cannot be read now. ArtifactCorrupt:
                the mirrored bytes are not the dataset's (nothing is kept).
        """
        from opentinker_common.artifacts import ArtifactCorrupt, ArtifactNotFound

        if self.exists(dataset_id) or self.mirror is None or not is_dataset_id(dataset_id):
            return self.exists(dataset_id)
        hex_ = _hex_of(dataset_id)
        folder = self.root / f".restore-{hex_}-{secrets.token_hex(4)}"
        try:
            try:
                self.mirror.get_folder(f"datasets/{hex_}", folder)
            except ArtifactNotFound:
                return False
            digest = hashlib.sha256()
            with open(folder / "data.jsonl", "rb") as fh:
                while block := fh.read(DOWNLOAD_CHUNK_BYTES):
                    digest.update(block)
            if digest.hexdigest() != hex_:
                got = digest.hexdigest()
                raise ArtifactCorrupt(f"datasets/{hex_}: its bytes hash to sha256:{got}, not {dataset_id}")
            os.replace(folder / "data.jsonl", self.root / f"{hex_}.jsonl")
            os.replace(folder / "meta.json", self.root / f"{hex_}.json")  # the metadata last, as on upload
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return True

    def chunks(self, dataset_id: str, size: int = DOWNLOAD_CHUNK_BYTES) -> Iterator[bytes]:
        """The stored bytes of ``dataset_id`` in chunks of at most ``size`` bytes.

        Raises:
            InvalidArgument, NotFound: as :meth:`path`.
        """
        file = self.path(dataset_id)
        with open(file, "rb") as fh:
            while chunk := fh.read(size):
                yield chunk


async def receive_upload(
    store: DatasetStore, requests: AsyncIterable[scheduler_pb2.UploadDatasetRequest], **begin
) -> scheduler_pb2.DatasetInfo:
    """Consume an ``UploadDataset`` client stream into ``store``; return the stored dataset.

    The first message must carry ``total_bytes`` (and may carry ``name``); later ones only chunks.
    ``begin``: the owner and limits, passed to :meth:`DatasetStore.begin`.
    Raises the errors of :meth:`DatasetStore.begin`, :meth:`DatasetUpload.write` and
    :meth:`DatasetUpload.commit`; on any error (also a cancelled stream) the partial upload is
    removed.
    """
    upload: DatasetUpload | None = None
    try:
        async for req in requests:
            if upload is None:
                upload = store.begin(req.name, req.total_bytes, req.format, **begin)
            elif req.name or req.total_bytes or req.format:
                raise InvalidArgument("name, total_bytes, format: expected only in the first message of the stream")
            if req.chunk:
                upload.write(req.chunk)
        if upload is None:
            raise InvalidArgument(
                "UploadDataset: expected a first message with name and total_bytes, got an empty stream"
            )
        return upload.commit()
    except BaseException:
        if upload is not None:
            upload.abort()
        raise
