"""The GPU memory estimate of a shareable LoRA task (:class:`~opentinker_scheduler.policy.placement.MemoryNeed`),
from its spec and its base model's ``config.json`` (:mod:`opentinker_common.lora_memory`).

The scheduler reads ``config.json`` where it can see it: ``spec.model`` a model folder on its disk,
or a hub id in its local Hugging Face cache (it never downloads). A model it cannot read, a shape
it does not know (a ``target_modules`` name the estimate has no size for, a config without the
sizes), gives None: that task is counted in tasks per GPU only. Reads are cached per model and
dtype for the scheduler's life.
"""

from __future__ import annotations

import functools

from opentinker_common import lora_memory
from opentinker_common.spec.structs import struct_value
from opentinker_common.spec.lm_fields import DEFAULT_TARGET_MODULES
from opentinker_scheduler.policy.placement import MemoryNeed


@functools.lru_cache(maxsize=256)
def _shape(model: str, dtype: str) -> lora_memory.ModelShape | None:
    config = lora_memory.read_model_config(model)
    if config is None:
        return None
    try:
        return lora_memory.ModelShape.from_config(config, dtype)
    except ValueError:
        return None


def serves_own_weights(spec) -> bool:
    """Whether an ``inference`` ``TaskSpec`` serves weights other than its base model's with
    adapters (``policies_only``: no language model; ``checkpoint_task_id``: another task's full
    weights), so it cannot share a model host (False for every other workload)."""
    if spec.workload_type != "inference" or not spec.HasField("hyperparameters"):
        return False
    fields = spec.hyperparameters.fields
    policies = fields["policies_only"].bool_value if "policies_only" in fields else False
    full = fields["checkpoint_task_id"].string_value if "checkpoint_task_id" in fields else ""
    return bool(policies or full)


def trains_all_weights(spec) -> bool:
    """Whether a ``lora_session`` ``TaskSpec`` trains every weight of its model (``lora: false``),
    so it cannot share a model host (False for every other workload)."""
    if spec.workload_type != "lora_session" or not spec.HasField("hyperparameters"):
        return False
    fields = spec.hyperparameters.fields
    return "lora" in fields and not fields["lora"].bool_value


def memory_need(spec, key: str | None) -> MemoryNeed | None:
    """The estimate of a ``TaskSpec`` (``common_pb2.TaskSpec``) whose share key is ``key``
    (:func:`~opentinker_scheduler.policy.placement.share_key`): None unless ``key`` is set (a
    shareable LoRA task) and the model's shape is known. Its ``hyperparameters`` give
    ``lora_rank`` (default 16), ``target_modules`` (default the attention projections) and
    ``dtype`` (default auto). An ``inference`` task's tenant bytes are its resident adapters'
    (:func:`opentinker_common.lora_memory.serving_bytes`: ``max_resident_adapters``, default 8,
    adapters of rank 16 on the attention projections, the rank and targets being those of
    adapters it has not seen yet)."""
    if key is None:
        return None
    # Only the keys read below are converted (the resolved hyperparameters hold every default).
    fields = spec.hyperparameters.fields if spec.HasField("hyperparameters") else {}

    def hp(key: str, default):
        return struct_value(fields[key]) if key in fields else default

    dtype = hp("dtype", "auto")
    shape = _shape(spec.model, dtype if isinstance(dtype, str) else "auto")
    if shape is None:
        return None
    try:
        if spec.workload_type == "inference":
            tenant = lora_memory.serving_bytes(shape, int(hp("max_resident_adapters", 8)))
        else:
            rank, modules = hp("lora_rank", 16), hp("target_modules", DEFAULT_TARGET_MODULES)
            if isinstance(modules, str):
                modules = (modules,)
            tenant = lora_memory.tenant_bytes(shape, int(rank), tuple(modules))
    except (TypeError, ValueError):
        return None
    return MemoryNeed(base_bytes=lora_memory.base_bytes(shape), tenant_bytes=tenant)
