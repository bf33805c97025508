"""Supervised fine-tuning (``sft``) on a JSONL dataset of chat messages (env kind ``dataset``).

A dataset is a JSONL file, one example a line::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}]}

It reaches the trainer either uploaded to the scheduler (``SchedulerService.UploadDataset``, then
named by ``dataset_id: "sha256:<hex>"``) or as a ``path`` the trainer node can read. The line
checks (:func:`parse_chat_line`, :func:`validate_chat_lines`) live here, torch-free, so the client
(before uploading), the scheduler (while receiving) and the trainer (reading a ``path``) refuse the
same lines with the same words.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from opentinker_common.documents import DocumentError, Limits, load_json
from opentinker_common.spec._parse import SpecError, num
from opentinker_common.spec import lm_fields
from opentinker_common.spec.registry import register_env, register_workload

__all__ = [
    "CHAT_ROLES",
    "ChatDatasetConfig",
    "DatasetError",
    "MAX_BAD_LINES",
    "MAX_LINE_BYTES",
    "SFTConfig",
    "is_dataset_id",
    "parse_chat_line",
    "validate_chat_lines",
]

#: Roles a message may have. ``system`` only as the first message.
CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant")

#: Longest line (one example) accepted, in bytes.
MAX_LINE_BYTES = 4 * 1024 * 1024
_LINE_LIMITS = Limits(max_bytes=MAX_LINE_BYTES)
#: Bad lines a dataset check names before it stops reading: enough to fix a file in one pass.
MAX_BAD_LINES = 20

_DATASET_ID = re.compile(r"^sha256:[0-9a-f]{64}$")


def is_dataset_id(value: Any) -> bool:
    """True for a content address ``sha256:<64 lowercase hex digits>``."""
    return isinstance(value, str) and bool(_DATASET_ID.match(value))


class DatasetError(ValueError):
    """A dataset line (or the whole dataset) is not a chat example.

    Attributes:
        line: 1-based line number of the offending line; 0 for the dataset as a whole (empty).
        column: 1-based column of a JSON syntax error on that line, else ``None``.
        expected: what a valid line looks like, for a person to read.
    """

    def __init__(self, line: int, expected: str, got: Any = None, *, column: int | None = None) -> None:
        self.line = line
        self.column = column
        self.expected = expected
        where = f"line {line}" if line else "dataset"
        self.detail = f"expected {expected}"
        if got is not None:
            text = repr(got)
            self.detail += f", got {text[:80] + '...' if len(text) > 80 else text}"
        super().__init__(f"{where}: {self.detail}")

    def at(self, file: str) -> str:
        """The error as ``file:line:column: expected ...`` (``file:line:`` without a column,
        ``file:`` for the dataset as a whole)."""
        where = file if not self.line else f"{file}:{self.line}" + (f":{self.column}" if self.column else "")
        return f"{where}: {self.detail}"


def json_object_line(line: str | bytes, lineno: int, *, example: str, wanted: str) -> dict | None:
    """One JSONL line as a JSON object; None for a blank line. ``example`` (``{"messages":
    [...]}``) and ``wanted`` (``a "messages" list``) word the errors.

    Raises:
        DatasetError: naming ``lineno``: over :data:`MAX_LINE_BYTES`, not UTF-8, not JSON (with
            its column), or JSON that is not an object.
    """
    if isinstance(line, bytes):
        if len(line) > MAX_LINE_BYTES:
            raise DatasetError(lineno, f"a line of at most {MAX_LINE_BYTES} bytes", f"{len(line)} bytes")
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DatasetError(lineno, f"UTF-8 text (byte {exc.start} is not)") from None
    elif len(line) > MAX_LINE_BYTES:
        raise DatasetError(lineno, f"a line of at most {MAX_LINE_BYTES} bytes", f"{len(line)} characters")
    if not line.strip():
        return None
    try:
        obj = load_json(line, _LINE_LIMITS)
    except DocumentError as exc:
        at = f" at column {exc.column}" if exc.column else ""
        why = exc.problem.removeprefix("expected JSON: ")
        expected = f"a JSON object such as {example} (JSON error{at}: {why})"
        raise DatasetError(lineno, expected, column=exc.column) from None
    if not isinstance(obj, dict):
        raise DatasetError(lineno, f"a JSON object with {wanted}", type(obj).__name__)
    return obj


def parse_chat_line(line: str | bytes, lineno: int) -> list[dict[str, str]] | None:
    """Check one JSONL line; return its messages, or None for a blank line (skipped).

    A valid line is a JSON object with a ``messages`` list (other top-level keys, such as an
    ``id``, are ignored); each message is ``{"role": "system"|"user"|"assistant", "content":
    str}`` and nothing else; ``system`` may only come first; at least one ``assistant`` message
    has non-empty content (the tokens SFT trains on).

    Raises:
        DatasetError: naming ``lineno`` and what was expected.
    """
    obj = json_object_line(line, lineno, example='{"messages": [...]}', wanted='a "messages" list')
    if obj is None:
        return None
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DatasetError(lineno, 'a non-empty "messages" list', messages)
    out: list[dict[str, str]] = []
    trained = False
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise DatasetError(lineno, f'{where} to be an object {{"role": ..., "content": ...}}', msg)
        extra = sorted(set(msg) - {"role", "content"})
        if extra:
            raise DatasetError(lineno, f'{where} to have only "role" and "content"', extra[0])
        role, content = msg.get("role"), msg.get("content")
        if role not in CHAT_ROLES:
            raise DatasetError(lineno, f"{where}.role to be one of {', '.join(CHAT_ROLES)}", role)
        if role == "system" and i != 0:
            raise DatasetError(lineno, f'{where}: "system" only as the first message', role)
        if role == "assistant" and not any(m["role"] == "user" for m in out):
            raise DatasetError(lineno, f'{where}: a "user" message before the first "assistant" one', role)
        if not isinstance(content, str):
            raise DatasetError(lineno, f"{where}.content to be a string", content)
        trained = trained or (role == "assistant" and bool(content))
        out.append({"role": role, "content": content})
    if not trained:
        raise DatasetError(lineno, "at least one assistant message with non-empty content (the tokens SFT trains on)")
    return out


def validate_chat_lines(lines: Iterable[str | bytes]) -> int:
    """Check every line of a chat JSONL dataset; return the number of examples (non-blank lines).

    Raises:
        DatasetError: the first bad line (its 1-based number), or ``line 0`` when there are no
            examples at all.
    """
    count = 0
    for lineno, line in enumerate(lines, start=1):
        if parse_chat_line(line, lineno) is not None:
            count += 1
    if count == 0:
        raise DatasetError(0, "at least one example (the dataset is empty)")
    return count


@dataclass(frozen=True)
class ChatDatasetConfig:
    """``env_id: chat_jsonl``: a JSONL dataset of chat examples for ``sft``.

    Exactly one of ``dataset_id`` (``sha256:<hex>`` from ``RLClient.upload_dataset``; the
    scheduler checks it exists at submit) or ``path`` (an absolute path of a file on the trainer
    node; read, and its lines checked, when the task starts) names the data. ``eval_fraction`` of
    the examples (at least one when there are two or more) is held out for ``loss/eval``, chosen
    by ``seed``. Examples are cut to ``max_seq_len`` tokens.
    """

    env_id: str = "chat_jsonl"
    dataset_id: str | None = field(default=None, metadata={"max_len": 71})
    path: str | None = None
    eval_fraction: float = num(0.1, 0.0, 0.9, doc="share of examples held out for loss/eval; 0 = none")
    max_seq_len: int = num(512, 8, 131_072, doc="tokens per example; longer ones are cut at the end")
    seed: int = num(0, 0, 2**31 - 1, doc="seed of the train/eval split and of the shuffling")
    # The seed's Environment(action_space=..., observation_space=...) sizes: recorded, not used.
    action_space: int | None = num(None, 1, 1_000_000)
    observation_space: int | None = num(None, 1, 1_000_000)

    def check(self, path: str) -> None:
        if (self.dataset_id is None) == (self.path is None):
            raise SpecError(
                f"{path}.dataset_id",
                'exactly one of dataset_id ("sha256:<hex>", from upload_dataset) or path (a file on the trainer node)',
            )
        if self.dataset_id is not None and not is_dataset_id(self.dataset_id):
            raise SpecError(
                f"{path}.dataset_id", "sha256:<64 lowercase hex digits>, as upload_dataset returns", self.dataset_id
            )
        if self.path is not None and not self.path.startswith("/"):
            raise SpecError(f"{path}.path", "an absolute path of a JSONL file on the trainer node", self.path)


@dataclass(frozen=True)
class SFTConfig:
    """Hyper-parameters of ``sft``: next-token cross-entropy on the assistant tokens only.

    Trains a PEFT LoRA adapter (``lora: true``, the default) or all weights (``lora: false``).
    ``steps`` optimizer steps of ``batch_size`` examples each; ``steps: 0`` means ``epochs``
    passes over the training split. The learning rate warms up linearly over ``warmup_steps``
    and then follows ``lr_schedule``. Full-weight training usually wants a smaller
    ``learning_rate`` (1e-5 .. 5e-5) than LoRA (1e-4 .. 5e-4).
    """

    steps: int = num(0, 0, 1_000_000, doc="optimizer steps; 0 = epochs over the training split")
    epochs: int = num(1, 1, 10_000, doc="passes over the training split when steps is 0")
    batch_size: int = num(8, 1, 65_536, doc="examples per optimizer step")
    micro_batch_size: int = num(0, 0, 65_536, doc="examples per forward/backward pass; 0 = the whole batch")
    learning_rate: float = num(2e-4, 0.0, 1.0, min_exclusive=True)
    lr_schedule: str = field(default="constant", metadata={"choices": ("constant", "linear", "cosine")})
    warmup_steps: int = num(0, 0, 1_000_000)
    weight_decay: float = num(0.0, 0.0, 1.0)
    max_grad_norm: float = num(1.0, 0.0, 1e6, min_exclusive=True)
    lora: bool = True
    lora_rank: int = lm_fields.lora_rank()
    lora_alpha: float = lm_fields.lora_alpha()
    lora_dropout: float = lm_fields.lora_dropout()
    target_modules: tuple[str, ...] = lm_fields.target_modules()
    eval_every: int = num(0, 0, 1_000_000, doc="steps between loss/eval; 0 = only after the last step")
    max_eval_examples: int = num(256, 1, 1_000_000, doc="held-out examples scored per evaluation, at most")
    checkpoint_every: int = lm_fields.checkpoint_every()
    seed: int = num(0, 0, 2**31 - 1)
    dtype: str = field(default="auto", metadata={"choices": ("auto", "float32", "bfloat16", "float16")})

    def check(self, path: str) -> None:
        if self.lora:
            lm_fields.check_target_modules(self.target_modules, path)


register_env("chat_jsonl", ChatDatasetConfig, kind="dataset", description="a JSONL dataset of chat messages (sft)")
register_workload("sft", SFTConfig, env_kinds=("dataset",))
