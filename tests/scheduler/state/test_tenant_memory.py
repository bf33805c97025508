"""A task's GPU memory estimate from its spec: the LoRA fields and the model's config.json, or None
(counted in tasks only) where the scheduler cannot know it."""

from __future__ import annotations

import json

from opentinker_scheduler.policy.placement import MemoryNeed
from opentinker_scheduler.state.tenant_memory import memory_need

from tests.support.scheduler_core import spec

CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 1000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_estimate_from_spec_and_config(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    model = str(tmp_path)
    # base: 2*1000*64 embeddings + head, 2 layers of (2*64*64 + 2*64*32 + 3*64*128 + 2*64), final norm; bf16
    base = 2 * (2 * 1000 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64)
    # defaults: rank 16 on q, k, v, o: 2 layers * 16 * ((64+64) + 2*(64+32) + (64+64)); 16 bytes each
    assert memory_need(spec(1, model), model) == MemoryNeed(base, 16 * 2 * 16 * 448)
    got = memory_need(spec(1, model, lora_rank=4, target_modules=["down_proj"], dtype="float32"), model)
    assert got == MemoryNeed(2 * base, 16 * 2 * 4 * (128 + 64))


def test_unknown_means_counted_in_tasks_only(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    model = str(tmp_path)
    assert memory_need(spec(1, model), None) is None  # not shareable
    assert memory_need(spec(1, model, target_modules=["router_gate"]), model) is None  # no size for the module
    assert memory_need(spec(1, str(tmp_path / "absent")), str(tmp_path / "absent")) is None


def test_an_inference_task_serving_adapters_shares_like_lora_work_counting_its_resident_adapters(tmp_path) -> None:
    from opentinker_scheduler.policy.placement import share_key
    from opentinker_scheduler.state.tenant_memory import serves_own_weights

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    model = str(tmp_path)
    base = 2 * (2 * 1000 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64)
    serve = spec(1, model, max_resident_adapters=3)
    serve.workload_type = "inference"
    assert not serves_own_weights(serve) and share_key("inference", model, 1) == model
    # 3 resident adapters of rank 16 on q, k, v, o, float32 weights only (4 bytes: no gradient, no optimizer)
    assert memory_need(serve, model) == MemoryNeed(base, 3 * 4 * 2 * 16 * 448)
    assert share_key("inference", model, 2) is None and share_key("inference", model, 0) is None  # one GPU only
    for hp in ({"policies_only": True}, {"checkpoint_task_id": "full-1"}):
        own = spec(1, model, **hp)
        own.workload_type = "inference"
        assert serves_own_weights(own) and share_key("inference", model, 1, own_weights=True) is None
    assert not serves_own_weights(spec(1, model, policies_only=True))  # not an inference task


def test_a_training_session_shares_like_lora_work_unless_it_trains_all_weights(tmp_path) -> None:
    from opentinker_scheduler.policy.placement import share_key
    from opentinker_scheduler.state.store import TaskRow
    from opentinker_scheduler.state.tenant_memory import trains_all_weights

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    model = str(tmp_path)
    session = spec(1, model, lora_rank=8)
    session.workload_type = "lora_session"
    assert not trains_all_weights(session) and share_key("lora_session", model, 1) == model
    assert memory_need(session, model) == memory_need(spec(1, model, lora_rank=8), model)  # as a LoRA task's
    assert share_key("lora_session", model, 0) is None  # on the CPU: a worker of its own
    full = spec(1, model, lora=False)
    full.workload_type = "lora_session"
    assert trains_all_weights(full) and share_key("lora_session", model, 1, own_weights=True) is None
    assert not trains_all_weights(spec(1, model, lora=False))  # not a session

    def row(s) -> TaskRow:
        return TaskRow("t", "o", s, 1, 1, 1, 1, 3, None, 0.0, 0.0)

    assert row(session).share_key == model and row(full).share_key is None  # what placement uses
