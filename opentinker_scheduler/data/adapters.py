"""Importing a PEFT LoRA adapter folder made elsewhere (``SchedulerService.ImportAdapter``).

The stream's header names every file (path, size, SHA-256); the chunks are written to a private
folder under the scheduler's state folder, each file checked against the header, the folder
checked as a LoRA adapter (:func:`check_adapter_folder`), then put into the artifact store under
the new task's final-checkpoint key. The task itself is made by the core
(:meth:`~opentinker_scheduler.state.client_api.ClientApi.import_adapter`) only after that, so a
failed import leaves neither files nor a task.

What is checked here, without torch (the scheduler has none): ``adapter_config.json`` is a JSON
object with ``peft_type`` ``LORA`` and a positive integer ``r``; ``adapter_model.safetensors`` has
a valid safetensors header whose tensors are all LoRA weights named as PEFT saves them
(``base_model.model.<module>.lora_A.weight`` ...), with at least one ``lora_A`` and one
``lora_B``. PEFT itself loads a file whose keys lack that prefix without a word and trains from
a zero ``lora_B`` (see ``opentinker_trainer/lora_keys.py``); the trainer checks at load that every
targeted module of the model got its weights, and fails the task naming the keys otherwise.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import AsyncIterable

from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_common.documents import DocumentError, Limits, load_json

from opentinker_scheduler.errors import InvalidArgument, ResourceExhausted

__all__ = ["MAX_ADAPTER_BYTES", "MAX_ADAPTER_FILES", "ReceivedAdapter", "check_adapter_folder", "receive_adapter"]

#: Most files an imported adapter folder may have.
MAX_ADAPTER_FILES = 64
#: Most bytes in all (4 GiB).
MAX_ADAPTER_BYTES = 4 * 1024**3
#: Largest safetensors header read (the JSON before the tensors), in bytes.
_MAX_HEADER = 100 * 1024 * 1024
_HEADER_LIMITS = Limits(max_bytes=_MAX_HEADER)
_LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


@dataclass
class ReceivedAdapter:
    """A checked adapter folder on the scheduler's disk (remove it with :meth:`discard`)."""

    folder: Path
    model: str
    name: str
    total_bytes: int

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _safe_path(path: str, index: int) -> PurePosixPath:
    p = PurePosixPath(path)
    if not path or p.is_absolute() or any(part in ("..", ".", "") for part in p.parts) or "\\" in path:
        raise InvalidArgument(f"header.files[{index}].path: expected a relative path inside the folder, got {path!r}")
    return p


def _lora_part(key: str) -> str | None:
    for part in _LORA_PARTS:
        if f".{part}." in key or key.endswith(f".{part}"):
            return part
    return None


def check_adapter_folder(folder: Path) -> None:
    """Refuse a folder that is not a PEFT LoRA adapter (see the module docstring).

    Raises:
        InvalidArgument: naming the file and what was expected.
    """
    config_file, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for f in (config_file, weights):
        if not f.is_file():
            raise InvalidArgument(f"{f.name}: expected in the adapter folder (PEFT's save_pretrained writes it)")
    try:
        config = load_json(config_file.read_bytes())
    except DocumentError as exc:
        raise InvalidArgument(f"adapter_config.json: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        got = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise InvalidArgument(f"adapter_config.json: expected peft_type LORA, got {got!r}")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise InvalidArgument(f"adapter_config.json: expected r, the LoRA rank, a positive integer, got {r!r}")
    with open(weights, "rb") as fh:
        head = fh.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < size <= min(_MAX_HEADER, weights.stat().st_size - 8):
            raise InvalidArgument("adapter_model.safetensors: expected a safetensors file (its header is not there)")
        try:
            header = load_json(fh.read(size), _HEADER_LIMITS)
        except DocumentError:
            raise InvalidArgument("adapter_model.safetensors: expected a safetensors file (bad header)") from None
    keys = sorted(k for k in header if k != "__metadata__") if isinstance(header, dict) else []
    not_lora = [k for k in keys if _lora_part(k) is None]
    if not_lora:
        raise InvalidArgument(
            f"adapter_model.safetensors: expected LoRA tensors only, got {len(not_lora)} other(s): "
            f"{', '.join(not_lora[:5])}{' ...' if len(not_lora) > 5 else ''}"
        )
    unprefixed = [k for k in keys if not k.startswith("base_model.model.")]
    if unprefixed:
        raise InvalidArgument(
            f"adapter_model.safetensors: expected keys named as PEFT saves them "
            f"(base_model.model.<module>.lora_A.weight), got {', '.join(unprefixed[:5])}"
            f"{' ...' if len(unprefixed) > 5 else ''}: PEFT would load none of them"
        )
    parts = {_lora_part(k) for k in keys}
    if not ({"lora_A", "lora_B"} <= parts or {"lora_embedding_A", "lora_embedding_B"} <= parts):
        raise InvalidArgument(
            "adapter_model.safetensors: expected lora_A and lora_B tensors, got " + str(sorted(parts))
        )


async def receive_adapter(
    requests: AsyncIterable[scheduler_pb2.ImportAdapterRequest], tmp_root: Path, *, default_model: str = ""
) -> ReceivedAdapter:
    """Consume an ``ImportAdapter`` stream into a new folder under ``tmp_root`` and check it.

    Raises:
        InvalidArgument: no header first, a second header, a bad path, a file not as announced,
            not a LoRA adapter, no model (and no default).
        ResourceExhausted: more than :data:`MAX_ADAPTER_FILES` files or :data:`MAX_ADAPTER_BYTES`.
    On any error (a cancelled stream too) the folder is removed.
    """
    folder = Path(tmp_root) / f"import-{secrets.token_hex(8)}"
    folder.mkdir(parents=True, mode=0o700)
    handles: dict[int, object] = {}
    try:
        header: scheduler_pb2.ImportAdapterHeader | None = None
        targets: list[Path] = []
        sizes: list[int] = []
        digests: list = []
        async for req in requests:
            kind = req.WhichOneof("message")
            if header is None:
                if kind != "header":
                    raise InvalidArgument("header: expected the header (model, name, files) as the first message")
                header = req.header
                if len(header.files) > MAX_ADAPTER_FILES:
                    raise ResourceExhausted(f"header.files: at most {MAX_ADAPTER_FILES} files, got {len(header.files)}")
                total = sum(f.size_bytes for f in header.files)
                if total > MAX_ADAPTER_BYTES:
                    raise ResourceExhausted(f"header.files: at most {MAX_ADAPTER_BYTES} bytes in all, got {total}")
                seen: set[str] = set()
                for i, f in enumerate(header.files):
                    rel = _safe_path(f.path, i)
                    if str(rel) in seen:
                        raise InvalidArgument(f"header.files[{i}].path: {f.path!r} appears twice")
                    seen.add(str(rel))
                    target = folder.joinpath(*rel.parts)
                    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                    targets.append(target)
                    sizes.append(0)
                    digests.append(hashlib.sha256())
                continue
            if kind != "chunk":
                raise InvalidArgument("header: expected only in the first message of the stream")
            c = req.chunk
            if not 0 <= c.file_index < len(targets):
                raise InvalidArgument(f"chunk.file_index: expected 0..{len(targets) - 1}, got {c.file_index}")
            i = c.file_index
            if c.offset != sizes[i]:
                raise InvalidArgument(f"chunk.offset: expected {sizes[i]} for {header.files[i].path}, got {c.offset}")
            if sizes[i] + len(c.data) > header.files[i].size_bytes:
                raise InvalidArgument(
                    f"{header.files[i].path}: more than the {header.files[i].size_bytes} bytes announced"
                )
            if i not in handles:
                handles[i] = open(os.open(targets[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")
            handles[i].write(c.data)  # type: ignore[attr-defined]
            digests[i].update(c.data)
            sizes[i] += len(c.data)
        if header is None:
            raise InvalidArgument("header: expected the header (model, name, files) as the first message")
        for h in handles.values():
            h.close()  # type: ignore[attr-defined]
        for i, f in enumerate(header.files):
            if i not in handles:
                targets[i].touch(mode=0o600)
            if sizes[i] != f.size_bytes or digests[i].hexdigest() != f.sha256:
                raise InvalidArgument(
                    f"{f.path}: arrived with {sizes[i]} bytes, sha256 {digests[i].hexdigest()}; "
                    f"announced {f.size_bytes} bytes, sha256 {f.sha256 or '(none)'}"
                )
        check_adapter_folder(folder)
        model = header.model or default_model
        if not model:
            raise InvalidArgument("header.model: expected the base model the adapter was trained on")
        return ReceivedAdapter(folder=folder, model=model, name=header.name, total_bytes=sum(sizes))
    except BaseException:
        for h in handles.values():
            h.close()  # type: ignore[attr-defined]
        shutil.rmtree(folder, ignore_errors=True)
        raise
