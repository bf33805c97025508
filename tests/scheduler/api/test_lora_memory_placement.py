"""Shared LoRA tasks placed by their GPU memory estimate, through a real scheduler on loopback: the
pending reason names the numbers, and ListNodes shows each model host's estimate and each GPU's
booking. The node is registered on the scheduler's loop (no trainer process, no model host)."""

from __future__ import annotations

import json

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N
from opentinker_client import RLClient

from tests.support.security import LoopbackScheduler

#: SmolLM2-135M's sizes; in float32 its base is 513.1 MiB, a rank-64 adapter on q/k/v/o with its
#: gradients and AdamW moments 112.5 MiB.
CONFIG = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
          "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}  # fmt: skip
BASE, TENANT = 4 * 134_515_008, 30 * 64 * 3840 * 16


def test_tenants_fit_the_reported_gpu_memory_and_the_rest_say_why(tmp_path) -> None:
    model = tmp_path / "smollm2-shape"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    with LoopbackScheduler(tmp_path / "state") as sched, RLClient(sched.target) as client:
        # A 1 GiB GPU on a node whose model hosts take 8 tenants: memory, not the count, limits.
        device = C.Device(index=0, uuid="u0", name="g", simulated=True, memory_total_bytes=1024**3)
        register = N.Register(node_id="gpu-node-01", devices=[device], max_tasks=8, tenants_per_host=8)
        node, _ = sched.do(sched.core.node_register, register)
        hp = {"lora_rank": 64, "dtype": "float32"}
        tasks = [
            client.submit_task(workload_type="lora_finetune", model=str(model), gpu_count=1, hyperparameters=hp)
            for _ in range(5)
        ]
        states = {t: client.get_task(t).state for t in tasks}
        assert list(states.values()).count("pending") == 1
        waiting = next(t for t, s in states.items() if s == "pending")
        reason = client.get_task(waiting).pending_reason
        assert reason.startswith(
            f"not enough GPU memory for a LoRA tenant on {model}: it needs 112.5 MiB (adapter, gradients, "
            f"AdamW moments) on a GPU that holds {model}, or 625.6 MiB with the base model (513.1 MiB) on one "
            "that does not;"
        ), reason
        assert "the most free is 60.9 MiB of 1.00 GiB on gpu-node-01 GPU 0 by the scheduler's estimates" in reason
        # The node's heartbeat lists its host; ListNodes adds the scheduler's estimate.
        placed = [t for t in tasks if t != waiting]
        host = C.ModelHost(model=str(model), device_indices=[0], task_ids=placed, pid=1, max_tenants=8)
        sched.do(setattr, node, "model_hosts", [host])
        (info,) = client.list_nodes()
        (got,) = info.model_hosts
        assert (got.base_bytes_estimate, got.tenant_bytes_estimate) == (BASE, 4 * TENANT)
        assert [(g.index, g.booked_bytes, g.total_bytes) for g in info.gpu_memory_estimates] == [
            (0, BASE + 4 * TENANT, 1024**3)
        ]
        # A tenant that ends frees its bytes: the waiting task takes them.
        sched.do(sched.core.node_report, node, N.TaskReport(task_id=placed[0], attempt=1, state=C.TASK_STATE_SUCCEEDED))
        sched.do(sched.core.schedule)
        assert client.get_task(waiting).state == "assigned"
