"""The data half of :class:`~opentinker_client.client.RLClient`: uploading datasets, listing and
downloading checkpoints. Mixed into ``RLClient``; it uses its stub and metadata."""

from __future__ import annotations

import os
from typing import Iterator

import grpc

from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_client.convert import DatasetInfo, dataset_from_proto
from opentinker_client.errors import OpenTinkerError, from_rpc_error

__all__ = ["DataMixin", "UPLOAD_CHUNK_BYTES"]

#: Bytes per UploadDataset message.
UPLOAD_CHUNK_BYTES = 1024 * 1024


class DataMixin:
    """``RLClient`` methods that move files: datasets up, checkpoints down."""

    def upload_dataset(
        self, path: str | os.PathLike[str], *, name: str | None = None, timeout: float | None = None
    ) -> DatasetInfo:
        """Upload a JSONL file of chat examples for ``sft`` tasks (one
        ``{"messages": [{"role": ..., "content": ...}, ...]}`` per line), streamed in 1 MiB chunks.

        The scheduler checks every line while it arrives and stores the file by content, so
        uploading the same bytes twice returns the same id and stores them once. Name it in a
        task with ``env_config={"env_id": "chat_jsonl", "dataset_id": info.dataset_id}``, or pass
        ``dataset=path`` to :meth:`submit_task`, which calls this first.

        Args:
            path: the local file.
            name: a name for people (default: the file name).
            timeout: seconds for the whole upload (default: none).

        Returns:
            :class:`~opentinker_client.convert.DatasetInfo` (``dataset_id`` ``sha256:<hex>``,
            ``num_examples``, ``size_bytes``).

        Raises:
            OSError: the file cannot be read.
            InvalidArgumentError: a bad line (the message names its number and what was
                expected) or an empty file.
            ResourceExhaustedError: larger than the scheduler's limit (256 MiB by default).
            UnavailableError: the scheduler cannot be reached.
        """
        path = os.fspath(path)
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path}: is a folder; upload_dataset takes one JSONL file")
        size = os.path.getsize(path)
        label = name if name is not None else os.path.basename(path)

        def chunks() -> Iterator[scheduler_pb2.UploadDatasetRequest]:
            with open(path, "rb") as fh:
                yield scheduler_pb2.UploadDatasetRequest(
                    name=label, total_bytes=size, chunk=fh.read(UPLOAD_CHUNK_BYTES)
                )
                while chunk := fh.read(UPLOAD_CHUNK_BYTES):
                    yield scheduler_pb2.UploadDatasetRequest(chunk=chunk)

        if self._closed:
            raise OpenTinkerError("this RLClient is closed")
        try:
            response = self._stub.UploadDataset(chunks(), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from err
        return dataset_from_proto(response.dataset)

    def list_checkpoints(self, task_id: str) -> list:
        """The checkpoints a task recorded, oldest first
        (:class:`~opentinker_client.inference.CheckpointInfo`).

        Raises:
            NotFoundError: no such task. InvalidArgumentError: empty id.
        """
        from opentinker_client.inference import checkpoint_from_proto

        self._check_task_id(task_id)
        response = self._unary("ListCheckpoints", scheduler_pb2.ListCheckpointsRequest(task_id=task_id))
        return [checkpoint_from_proto(c) for c in response.checkpoints]

    def download_checkpoint(self, task_id: str, dest: str | os.PathLike[str], *, step: int | None = None):
        """Download a checkpoint folder (the newest, or the one at ``step``) into ``dest``,
        verifying each file's size and SHA-256; returns ``dest`` as a Path.

        Raises:
            NotFoundError: no such task or step. FailedPreconditionError: the scheduler cannot
            read the folder. FileExistsError: ``dest`` is not an empty folder.
            OpenTinkerError: a file arrived damaged (nothing is left at ``dest``).
        """
        from opentinker_client.inference import download_checkpoint

        self._check_task_id(task_id)
        return download_checkpoint(self._stub, self._metadata, task_id, dest, step=step)
