"""Hyper-parameters of ``lora_session``: a training session that serves ``TrainingService``.

A ``lora_session`` task holds one LoRA adapter on its base model (``spec.model``), or with
``lora: false`` all of the model's weights (where the device's memory allows: float32 weights,
gradients and AdamW's two moments are about 16 bytes per parameter), and lets its owner run
their own training loop client-side with primitives (forward_backward, optim_step, sample,
save/load state; ``docs/primitives.md``). The scheduler places it like any task (owner,
priority, ``max_runtime``); it is RUNNING while it serves, shows its address in
``Task.endpoint``, and ends SUCCEEDED after ``idle_timeout_s`` seconds without a call, CANCELLED
when cancelled.

With ``spec.init_from`` and ``init_state`` it starts from that task's state of that name (a
``SaveState``; the task may still run): its adapter, and with ``init_optimizer`` its AdamW state
and step too. Its own sequence numbers start at 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from opentinker_common.spec import lm_fields
from opentinker_common.spec._parse import SpecError, num
from opentinker_common.spec.registry import register_workload

__all__ = ["HELD_METADATA", "LoraSessionConfig", "STATE_NAME", "init_state"]

#: Initial metadata key a session worker sends at once for a call it holds until its turn (a call
#: ahead of the worker); the value is the call's sequence number. The gateway takes it as proof
#: that the worker has the request.
HELD_METADATA = "opentinker-held-sequence"

#: A state's name (``SaveState``): 1 to 64 letters, digits, ``.``, ``_`` or ``-``.
STATE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True)
class LoraSessionConfig:
    """A ``lora_session`` task: an adapter of ``lora_rank`` / ``lora_alpha`` on ``target_modules``,
    initialised from ``seed`` (or, with ``lora: false``, every weight of the model: the LoRA
    fields are then unused), trained by the owner's calls; bounds per call on datums, tokens and
    calls in flight (RESOURCE_EXHAUSTED beyond them)."""

    lora: bool = field(
        default=True,
        metadata={"doc": "train a LoRA adapter (true) or all weights (false: states are full hf_full checkpoints)"},
    )
    lora_rank: int = lm_fields.lora_rank()
    lora_alpha: float = lm_fields.lora_alpha()
    lora_dropout: float = lm_fields.lora_dropout()
    target_modules: tuple[str, ...] = lm_fields.target_modules()
    seed: int = num(0, 0, 2**31 - 1, doc="seeds the adapter's initial weights")
    idle_timeout_s: float = num(
        1800.0, 0.0, 30 * 86400.0, min_exclusive=True, doc="seconds without a call before the session ends SUCCEEDED"
    )
    max_datums_per_call: int = num(1024, 1, 1 << 20, doc="datums per ForwardBackward / Forward call")
    max_tokens_per_call: int = num(
        262_144,
        1,
        1 << 26,
        doc="input tokens per ForwardBackward / Forward call, and n * (prompt + max_tokens) per Sample",
    )
    max_in_flight_calls: int = num(4, 1, 1024, doc="calls running or waiting for the session at once")
    max_held_calls: int = num(
        64, 0, 4096, doc="calls ahead of the session's turn it holds to run in their turn (more are refused)"
    )
    max_held_bytes: int = num(256 << 20, 0, 1 << 34, doc="request bytes of the calls held at once")
    held_call_timeout_s: float = num(
        60.0, 0.0, 86400.0, min_exclusive=True, doc="seconds a held call waits for its turn before it is refused"
    )
    micro_batch_tokens: int = num(
        8192, 1, 1 << 24, doc="padded tokens per forward pass; a call's datums run in micro-batches of this many"
    )
    port: int = num(0, 0, 65535, doc="port to listen on; 0 picks a free one")
    dtype: str = field(default="auto", metadata={"choices": ("auto", "float32", "bfloat16", "float16")})
    init_state: str = field(
        default="",
        metadata={"doc": "a SaveState name of the spec.init_from task to start from (empty: its newest checkpoint)"},
    )
    init_optimizer: bool = field(
        default=False, metadata={"doc": "with init_state: take that state's AdamW state and step too"}
    )

    def check(self, path: str) -> None:
        if self.init_state and (not STATE_NAME.match(self.init_state) or self.init_state in (".", "..")):
            raise SpecError(f"{path}.init_state", "1 to 64 letters, digits, '.', '_' or '-'", self.init_state)
        if self.init_optimizer and not self.init_state:
            raise SpecError(f"{path}.init_optimizer", "false without init_state (only a named state has one)", True)
        if self.lora:
            lm_fields.check_target_modules(self.target_modules, path)


# A session needs no environment; the default env (the text task) satisfies the spec.
register_workload("lora_session", LoraSessionConfig, env_kinds=("text",))


def init_state(spec) -> str:
    """A ``lora_session`` TaskSpec's ``hyperparameters.init_state`` (``""`` when unset or not a
    string), read in place, before the spec is checked."""
    if spec.workload_type != "lora_session" or not spec.HasField("hyperparameters"):
        return ""
    value = spec.hyperparameters.fields.get("init_state")
    return value.string_value if value is not None and value.WhichOneof("kind") == "string_value" else ""
