"""ImportAdapter's receiving end: an adapter folder arrives checked against its header and as a
PEFT LoRA adapter, or is refused naming the file and what was expected, leaving nothing."""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
from pathlib import Path

import pytest

from opentinker.scheduler.v1 import scheduler_pb2 as P
from opentinker_scheduler.data.adapters import receive_adapter
from opentinker_scheduler.errors import InvalidArgument, ResourceExhausted

CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
GOOD_KEYS = (
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
)


def safetensors(keys) -> bytes:
    """A valid safetensors file: one float32 zero per tensor."""
    header, offset = {}, 0
    for k in keys:
        header[k] = {"dtype": "F32", "shape": [1], "data_offsets": [offset, offset + 4]}
        offset += 4
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * offset


def messages(files: dict[str, bytes], *, model="acme/tiny", lie: dict | None = None, chunk=7):
    header = P.ImportAdapterHeader(model=model, name="mine")
    for path, data in files.items():
        size, sha = len(data), hashlib.sha256(data).hexdigest()
        size, sha = (lie or {}).get(path, (size, sha))
        header.files.add(path=path, size_bytes=size, sha256=sha)
    out = [P.ImportAdapterRequest(header=header)]
    for i, data in enumerate(files.values()):
        for off in range(0, len(data), chunk):
            out.append(
                P.ImportAdapterRequest(chunk=P.CheckpointChunk(file_index=i, offset=off, data=data[off : off + chunk]))
            )
    return out


def receive(msgs, root: Path, **kw):
    async def gen():
        for m in msgs:
            yield m

    return asyncio.run(receive_adapter(gen(), root, **kw))


def good_files(keys=GOOD_KEYS, config=None) -> dict[str, bytes]:
    return {
        "adapter_config.json": json.dumps(config or CONFIG).encode(),
        "adapter_model.safetensors": safetensors(keys),
        "tokenizer/tokenizer_config.json": b"{}",
    }


def test_a_peft_adapter_arrives_whole(tmp_path) -> None:
    got = receive(messages(good_files()), tmp_path)
    assert (got.model, got.name) == ("acme/tiny", "mine")
    assert json.loads((got.folder / "adapter_config.json").read_text())["r"] == 4
    assert (got.folder / "tokenizer" / "tokenizer_config.json").read_bytes() == b"{}"
    assert got.total_bytes == sum(len(v) for v in good_files().values())
    got.discard()
    assert list(tmp_path.iterdir()) == []
    # No model in the header: the scheduler's default model.
    assert receive(messages(good_files(), model=""), tmp_path, default_model="/models/m").model == "/models/m"


@pytest.mark.parametrize(
    ("files", "kw", "error", "message"),
    [
        (
            good_files(keys=[k.removeprefix("base_model.model.") for k in GOOD_KEYS]),
            {},
            InvalidArgument,
            "adapter_model.safetensors: expected keys named as PEFT saves them",
        ),
        (
            good_files(keys=[*GOOD_KEYS, "model.embed_tokens.weight"]),
            {},
            InvalidArgument,
            "expected LoRA tensors only, got 1 other(s): model.embed_tokens.weight",
        ),
        (good_files(keys=GOOD_KEYS[:1]), {}, InvalidArgument, "expected lora_A and lora_B tensors"),
        (good_files(config={"peft_type": "IA3", "r": 4}), {}, InvalidArgument, "expected peft_type LORA, got 'IA3'"),
        (good_files(config={"peft_type": "LORA", "r": 0}), {}, InvalidArgument, "expected r, the LoRA rank"),
        (
            {"adapter_config.json": json.dumps(CONFIG).encode()},
            {},
            InvalidArgument,
            "adapter_model.safetensors: expected in the adapter folder",
        ),
        (
            {**good_files(), "adapter_model.safetensors": b"not a safetensors file"},
            {},
            InvalidArgument,
            "expected a safetensors file",
        ),
        (
            good_files(),
            {"lie": {"adapter_config.json": (3, "0" * 64)}},
            InvalidArgument,
            "adapter_config.json: more than the 3 bytes announced",
        ),
        (
            good_files(),
            {"lie": {"adapter_config.json": (len(json.dumps(CONFIG)), "0" * 64)}},
            InvalidArgument,
            "adapter_config.json: arrived with",
        ),
        ({**good_files(), "../escape": b"x"}, {}, InvalidArgument, "expected a relative path inside the folder"),
        (good_files(), {"model": ""}, InvalidArgument, "header.model: expected the base model"),
        ({f"f{i}": b"" for i in range(65)}, {}, ResourceExhausted, "at most 64 files"),
    ],
)
def test_refusals_name_the_file_and_leave_nothing(tmp_path, files, kw, error, message) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        receive(messages(files, **kw), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_header_comes_first_and_once(tmp_path) -> None:
    msgs = messages(good_files())
    with pytest.raises(InvalidArgument, match="header: expected the header"):
        receive(msgs[1:], tmp_path)
    with pytest.raises(InvalidArgument, match="header: expected only in the first message"):
        receive([msgs[0], msgs[0]], tmp_path)
    with pytest.raises(InvalidArgument, match="header: expected the header"):
        receive([], tmp_path)
    assert list(tmp_path.iterdir()) == []
