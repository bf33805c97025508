"""Hyper-parameters of ``inference``: serve a base model plus LoRA adapters until cancelled or TTL."""

from __future__ import annotations

from dataclasses import dataclass, field

from opentinker_common.spec._parse import SpecError, num
from opentinker_common.spec.registry import register_workload

__all__ = ["InferenceConfig"]


@dataclass(frozen=True)
class InferenceConfig:
    """An ``inference`` task: an ``InferenceService`` for the task's ``model`` on a trainer node.

    The task is RUNNING while it serves and shows its address in ``Task.endpoint``; it ends
    SUCCEEDED when ``ttl_s`` runs out, CANCELLED when cancelled. Adapters (finished
    ``lora_finetune`` / ``sft`` / ``lora_session`` tasks, by id; running ``lora_finetune`` /
    ``sft`` ones from their newest checkpoint when a request arrives) and PPO policies
    (finished single-agent ``full_rl`` tasks, by id, for ``Act``) load on first use, up to
    ``max_resident_adapters`` of each.
    ``policies_only``: load no language model (``model`` is then only a label, e.g. ``mlp``);
    the server answers ``Act`` and refuses ``Generate``.

    ``checkpoint_task_id``: serve a full-weight (``hf_full``) checkpoint of that finished task
    (``sft`` with ``lora: false``, ``full_rl`` GRPO on a text environment) as the base model
    instead of ``model`` (then the label of the model it was trained from): its checkpoint at
    ``checkpoint_step`` (0: its newest), fetched from the artifact store; requests name the
    served model by that task's id.
    """

    ttl_s: float = num(3600.0, 0.0, 30 * 86400.0, min_exclusive=True, doc="seconds to serve before ending SUCCEEDED")
    max_resident_adapters: int = num(
        8, 1, 1024, doc="adapters kept loaded; the least recently used idle one is unloaded first"
    )
    max_concurrent_requests: int = num(
        16, 1, 4096, doc="requests decoding together in one batch; more wait in the queue"
    )
    max_batch_sequences: int = num(64, 1, 4096, doc="sequences (rows; n per request) decoding together")
    max_batch_tokens: int = num(
        65536, 1, 1 << 24, doc="key/value tokens the batch reserves, n * (prompt + max_tokens) per request"
    )
    max_queued_requests: int = num(
        64, 0, 65536, doc="requests waiting for room in the batch; more are refused with RESOURCE_EXHAUSTED"
    )
    port: int = num(0, 0, 65535, doc="port to listen on; 0 picks a free one")
    openai_port: int = num(
        -1,
        -1,
        65535,
        doc="port of the OpenAI-compatible HTTP endpoint (/v1/...) on this host; -1 (default): off, 0: any free",
    )
    dtype: str = field(default="auto", metadata={"choices": ("auto", "float32", "bfloat16", "float16")})
    packed_weights: bool = field(
        default=True,
        metadata={"doc": "on CPU, float32 Linear layers run on oneDNN-packed weights in place of the plain ones"},
    )
    policies_only: bool = False
    checkpoint_task_id: str = field(
        default="", metadata={"max_len": 200, "doc": "a finished full-weight task whose checkpoint is served"}
    )
    checkpoint_step: int = num(0, 0, 1 << 53, doc="step of that task's checkpoint; 0: its newest")

    def check(self, path: str) -> None:
        """Raises :class:`SpecError`: ``checkpoint_task_id`` with ``policies_only`` (no language
        model is loaded), or ``checkpoint_step`` without ``checkpoint_task_id``."""
        if self.checkpoint_task_id and self.policies_only:
            raise SpecError(
                f"{path}.policies_only",
                "false with checkpoint_task_id (a served checkpoint is a language model)",
                self.policies_only,
            )
        if self.checkpoint_step and not self.checkpoint_task_id:
            raise SpecError(
                f"{path}.checkpoint_step",
                "0 without checkpoint_task_id (the step of that task's checkpoint)",
                self.checkpoint_step,
            )


# Inference needs no environment; the default env (the text task) satisfies the spec.
register_workload("inference", InferenceConfig, env_kinds=("text",))
