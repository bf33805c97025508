"""The data part of :class:`~opentinker_client.RLClient`: uploading datasets, listing and
downloading checkpoints, over the :class:`~opentinker_client.connection.SchedulerConnection` it
is given (``RLClient.upload_dataset``, ``list_checkpoints``, ``download_checkpoint``)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path, PurePosixPath
from typing import Any, Iterator, Mapping

from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_client._convert import checkpoint_from_proto, dataset_from_proto, task_from_proto
from opentinker_client.connection import SchedulerConnection
from opentinker_client.errors import InvalidArgumentError, OpenTinkerError
from opentinker_client.types import CheckpointInfo, DatasetInfo, TaskInfo
from opentinker_client.errors import from_spec_error
from opentinker_common.artifacts.deleted import deleted_words
from opentinker_common.spec import SpecError, validate_env_config
from opentinker_common.spec.prompts import DATASET_FORMATS, SAMPLE_LINES, check_sample, parse_prompt_line
from opentinker_common.spec.sft import MAX_BAD_LINES, MAX_LINE_BYTES, DatasetError, parse_chat_line

__all__ = ["DataCalls", "UPLOAD_CHUNK_BYTES", "check_task_dataset", "dataset_format"]

#: Bytes per UploadDataset message.
UPLOAD_CHUNK_BYTES = 1024 * 1024


def _safe_relative(path: str) -> PurePosixPath:
    """A manifest's file path, refused unless it is relative and stays below the folder."""
    p = PurePosixPath(path)
    if p.is_absolute() or not p.parts or any(part in ("..", "") for part in p.parts):
        raise OpenTinkerError(f"the scheduler sent an unsafe file path {path!r} in a checkpoint manifest; refused")
    return p


def dataset_format(env: Mapping[str, Any]) -> str:
    """The upload format of a task's ``dataset`` file for its environment: ``prompts`` for
    ``env_id: prompts``, else ``chat`` (sft's ``chat_jsonl``)."""
    return "prompts" if env.get("env_id") == "prompts" else "chat"


def _missing_dataset(path: str, source: str | None) -> str:
    """Why a task's ``dataset`` file at ``path`` is not there, naming the path tried and what it
    is relative to; when the task file ``source`` has a comment naming the file (as
    examples/word_problems_numeric.yaml does, with the command that makes it), that comment too."""
    tried = os.path.abspath(path)
    shown, where = path, ""
    if os.path.isabs(path):  # as given (a --set dataset= is made absolute from the current folder)
        pass
    elif source and os.path.isfile(source):  # a task file's `dataset:`, joined to the file's folder
        folder = os.path.dirname(source) or "."
        shown = os.path.relpath(path, folder)  # as the file writes it
        where = f"; a relative dataset: is read from the folder of {source} ({os.path.abspath(folder)})"
    else:
        where = f"; a relative path is read from the current folder ({os.getcwd()})"
    text = f"dataset: {shown}: no such file (tried {tried}{where})"
    if source and os.path.isfile(source):
        name = os.path.basename(path)
        with open(source, encoding="utf-8", errors="replace") as fh:
            hints = [line.strip().lstrip("#").strip() for line in fh if line.lstrip().startswith("#") and name in line]
        if hints:
            text += f"; {source} says how to make it: {hints[0]}"
    return text


def check_task_dataset(path: str, env: Mapping[str, Any], *, source: str | None = None) -> str:
    """Check a task's local ``dataset`` file as a submit does before uploading it, and return the
    id it has once uploaded (``sha256:<hex>`` of its bytes; the scheduler stores datasets by
    content). The checks: the file is there; every line, as :meth:`DataCalls.upload_dataset`
    checks them (:func:`dataset_format` of ``env``); for ``env_id: prompts``, the reward of
    ``env`` against the first :data:`~opentinker_common.spec.prompts.SAMPLE_LINES` lines, with
    the scheduler's own :func:`~opentinker_common.spec.prompts.check_sample`. ``RLClient``'s
    submit and its dry run (``estimate``) both go through here.

    Args:
        path: the file (relative to the current folder; a task file's ``dataset`` is already
            joined to that file's folder).
        env: the task's ``env`` mapping.
        source: the task file it was named in, if any (named when the file is missing).

    Raises:
        InvalidArgumentError: field ``dataset``: no such file (the message names the path tried
            and what it was relative to), a folder, a bad line (``path:line:column``), an empty
            file; or field ``spec.env_config.reward...``: a reward that cannot score the sample.
    """
    if not os.path.exists(path):
        raise InvalidArgumentError(_missing_dataset(path, source), field="dataset")
    if os.path.isdir(path):
        raise InvalidArgumentError(f"dataset: {path}: is a folder; expected one JSONL file", field="dataset")
    fmt = dataset_format(env)
    _check_dataset_file(path, fmt)
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(UPLOAD_CHUNK_BYTES):
            digest.update(chunk)
    dataset_id = f"sha256:{digest.hexdigest()}"
    if fmt == "prompts":
        try:
            reward = validate_env_config({**env, "dataset_id": dataset_id}).reward
            with open(path, "rb") as fh:
                check_sample(reward, (fh.readline(MAX_LINE_BYTES + 2).rstrip(b"\r\n") for _ in range(SAMPLE_LINES)))
        except SpecError as err:
            raise from_spec_error(err) from None
    return dataset_id


def _check_dataset_file(path: str, format: str = "chat") -> None:
    """Check every line of a JSONL file (``format`` ``chat`` or ``prompts``) with the scheduler's
    own rules before uploading it. Every bad line is named, up to :data:`MAX_BAD_LINES`.

    Raises:
        InvalidArgumentError: ``path:line:column: expected ...`` for the first bad line (the column
            where JSON syntax is wrong; ``path:line:`` for a line that is JSON but not a chat
            example; ``path:`` for a file with no example), field ``dataset``; ``violations``
            holds one ``("dataset", "path:line: ...")`` pair per bad line.
    """
    examples = 0
    bad: list[str] = []
    more = False
    parse = parse_prompt_line if format == "prompts" else parse_chat_line
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(iter(lambda: fh.readline(MAX_LINE_BYTES + 2), b""), start=1):
            try:
                if parse(raw.rstrip(b"\r\n"), lineno) is not None:
                    examples += 1
            except DatasetError as err:
                if len(bad) == MAX_BAD_LINES:
                    more = True
                    break
                bad.append(err.at(path))
    if not bad and not examples:
        bad.append(DatasetError(0, "at least one example (one JSON object per line); the file is empty").at(path))
    if bad:
        lines = bad + ([f"{path}: more bad lines after line-by-line check stopped at {MAX_BAD_LINES}"] if more else [])
        details = bad[0] if len(lines) == 1 else f"{len(bad)}{'+' if more else ''} bad lines; first: {bad[0]}"
        raise InvalidArgumentError(details, field="dataset", violations=[("dataset", line) for line in lines])


class DataCalls:
    """Files to and from the scheduler over ``connection``: datasets up, checkpoints down (see
    the ``RLClient`` method of each name for arguments, results and errors)."""

    def __init__(self, connection: SchedulerConnection) -> None:
        self.connection = connection

    def upload_dataset(
        self,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        timeout: float | None = None,
        format: str = "chat",
        checked: bool = False,
    ) -> DatasetInfo:
        """Stream the JSONL file at ``path`` in :data:`UPLOAD_CHUNK_BYTES` pieces; ``name``
        defaults to the file name, ``timeout`` (seconds, whole upload) to none, ``format`` (how the
        lines are checked) to ``chat``; ``checked``: :func:`check_task_dataset` checked the lines
        already (a submit), so they are not read twice here."""
        if format not in DATASET_FORMATS:
            raise InvalidArgumentError(
                f"format: expected one of {', '.join(DATASET_FORMATS)}, got {format!r}", field="format"
            )
        path = os.fspath(path)
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path}: is a folder; upload_dataset takes one JSONL file")
        size = os.path.getsize(path)
        label = name if name is not None else os.path.basename(path)
        if not checked:
            _check_dataset_file(path, format)  # here the error can name the file: train.jsonl:3:14: expected ...

        def chunks() -> Iterator[scheduler_pb2.UploadDatasetRequest]:
            with open(path, "rb") as fh:
                yield scheduler_pb2.UploadDatasetRequest(
                    name=label, total_bytes=size, chunk=fh.read(UPLOAD_CHUNK_BYTES), format=format
                )
                while chunk := fh.read(UPLOAD_CHUNK_BYTES):
                    yield scheduler_pb2.UploadDatasetRequest(chunk=chunk)

        response = self.connection.upload("UploadDataset", chunks(), timeout=timeout)
        return dataset_from_proto(response.dataset)

    def upload_adapter(
        self, folder: str | os.PathLike[str], *, model: str | None, name: str | None, timeout: float | None = None
    ) -> TaskInfo:
        """Stream the PEFT adapter folder ``folder`` (every regular file below it) as
        ``ImportAdapter``: a header with each file's path, size and SHA-256, then the bytes in
        :data:`UPLOAD_CHUNK_BYTES` pieces. ``model`` defaults to the adapter's
        ``base_model_name_or_path``, ``name`` to the folder's name."""
        import json

        root = Path(folder)
        if not root.is_dir():
            raise InvalidArgumentError(f"{root}: expected a PEFT adapter folder", field="folder")
        config = root / "adapter_config.json"
        if not config.is_file() or not (root / "adapter_model.safetensors").is_file():
            raise InvalidArgumentError(
                f"{root}: expected a PEFT adapter folder (adapter_config.json and adapter_model.safetensors, as "
                "PeftModel.save_pretrained writes them)",
                field="folder",
            )
        if model is None:
            try:
                model = str(json.loads(config.read_text()).get("base_model_name_or_path") or "")
            except ValueError as exc:
                raise InvalidArgumentError(f"{config}: expected JSON ({exc})", field="folder") from None
        files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
        header = scheduler_pb2.ImportAdapterHeader(model=model, name=name if name is not None else root.name)
        for f in files:
            digest = hashlib.sha256()
            with open(f, "rb") as fh:
                while chunk := fh.read(UPLOAD_CHUNK_BYTES):
                    digest.update(chunk)
            header.files.add(
                path=f.relative_to(root).as_posix(), size_bytes=f.stat().st_size, sha256=digest.hexdigest()
            )

        def messages() -> Iterator[scheduler_pb2.ImportAdapterRequest]:
            yield scheduler_pb2.ImportAdapterRequest(header=header)
            for i, f in enumerate(files):
                with open(f, "rb") as fh:
                    offset = 0
                    while chunk := fh.read(UPLOAD_CHUNK_BYTES):
                        yield scheduler_pb2.ImportAdapterRequest(
                            chunk=scheduler_pb2.CheckpointChunk(file_index=i, offset=offset, data=chunk)
                        )
                        offset += len(chunk)

        response = self.connection.upload("ImportAdapter", messages(), timeout=timeout)
        return task_from_proto(response.task)

    def list_checkpoints(self, task_id: str) -> list[CheckpointInfo]:
        """The task's checkpoints, oldest first."""
        request = scheduler_pb2.ListCheckpointsRequest(task_id=task_id)
        response = self.connection.unary("ListCheckpoints", request)
        return [checkpoint_from_proto(c) for c in response.checkpoints]

    def artifacts_deletion(self, task_id: str) -> str:
        """How the task's artifacts were deleted, in words (:func:`deleted_words`), or ``""``."""
        response = self.connection.unary("ListCheckpoints", scheduler_pb2.ListCheckpointsRequest(task_id=task_id))
        return deleted_words(response.artifacts_deleted) if response.HasField("artifacts_deleted") else ""

    def download_checkpoint(
        self, task_id: str, dest: str | os.PathLike[str], *, step: int | None = None, timeout: float | None = None
    ) -> Path:
        """Stream a checkpoint folder (the newest, or the one at ``step``) into ``dest`` (created;
        must not exist or be empty) and check every file's size and SHA-256 against the manifest.
        Files are written beside ``dest`` and moved into place only when all of them check out, so
        nothing half-written is left. The folders are created 0700 and the files 0600: weights are
        private to the user who fetched them. ``timeout``: seconds for the whole download.

        Returns:
            ``dest`` as a Path.

        Raises:
            NotFoundError: no such task or step. FailedPreconditionError: the scheduler cannot read
            the folder. OpenTinkerError: a size or hash mismatch, or an unsafe path in the manifest
            (the download is discarded). FileExistsError: ``dest`` exists and is not an empty folder.
        """
        dest = Path(dest)
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise FileExistsError(f"{dest} exists and is not an empty folder")
        tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        os.chmod(tmp, 0o700)  # model weights are private: the folder is the user's alone (as on the cluster)
        request = scheduler_pb2.DownloadCheckpointRequest(task_id=task_id, step=step or 0)
        handles: dict[int, Any] = {}
        try:
            with self.connection.stream("DownloadCheckpoint", request, timeout=timeout, plaintext_hint=False) as msgs:
                self._receive(msgs, tmp, handles)
            if dest.exists():
                dest.rmdir()
            os.replace(tmp, dest)
            return dest
        finally:
            for h in handles.values():
                h.close()
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def _receive(msgs: Iterator[Any], tmp: Path, handles: dict[int, Any]) -> None:
        """Write the manifest's files below ``tmp`` from the chunks of ``msgs`` (open files in
        ``handles``, by file index) and check each one's size and SHA-256."""
        files: list[tuple[Path, Any]] = []
        digests: dict[int, Any] = {}
        sizes: dict[int, int] = {}
        for msg in msgs:
            kind = msg.WhichOneof("message")
            if kind == "manifest":
                for f in msg.manifest.files:
                    target = tmp.joinpath(*_safe_relative(f.path).parts)
                    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                    files.append((target, f))
            elif kind == "chunk":
                c = msg.chunk
                if not 0 <= c.file_index < len(files):
                    raise OpenTinkerError(f"checkpoint download: chunk for unknown file {c.file_index}")
                if c.file_index not in handles:
                    handles[c.file_index] = open(
                        os.open(files[c.file_index][0], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb"
                    )
                    digests[c.file_index] = hashlib.sha256()
                    sizes[c.file_index] = 0
                if c.offset != sizes[c.file_index]:
                    raise OpenTinkerError(
                        f"checkpoint download: chunk at offset {c.offset} of {files[c.file_index][1].path}, "
                        f"expected {sizes[c.file_index]}"
                    )
                handles[c.file_index].write(c.data)
                digests[c.file_index].update(c.data)
                sizes[c.file_index] += len(c.data)
        for h in handles.values():
            h.close()
        for i, (target, f) in enumerate(files):
            got_size = sizes.get(i, 0)
            got_hash = digests[i].hexdigest() if i in digests else hashlib.sha256().hexdigest()
            if i not in handles:
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            if got_size != f.size_bytes or got_hash != f.sha256:
                raise OpenTinkerError(
                    f"checkpoint download: {f.path} arrived with {got_size} bytes, sha256 {got_hash}; "
                    f"expected {f.size_bytes} bytes, sha256 {f.sha256}"
                )
