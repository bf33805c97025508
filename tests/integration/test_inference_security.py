"""The real ``inference`` workload with API keys and TLS, through real scheduler and trainer
processes on loopback: the scheduler has auth and TLS on (an mTLS node port), the trainer serves
with --serve-tls-cert/--serve-tls-key, and users reach the server with endpoint tokens that the
scheduler issued for their keys; the keys themselves are refused there."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from opentinker_client import (
    InferenceClient,
    NotFoundError,
    RLClient,
    TaskFailedError,
    UnauthenticatedError,
    UnavailableError,
)

from tests.support.procs import Cluster, free_port, wait_connected
from tests.support.security import auth_tls_config, make_certs, node_tls_args

WORKLOAD_TYPES = "workload_types:\n  - type: lora_finetune\n    priority: 1\n  - type: inference\n    priority: 3\n"
TINY_HP = {"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4}


def test_inference_with_api_keys_and_tls_end_to_end(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("OPENTINKER_INFERENCE_AUTH_TTL_S", "0.2")  # the trainer's workers inherit it
    certs = make_certs(tmp_path / "certs")
    node_port = free_port()
    cluster = Cluster(tmp_path, auth_tls_config(certs, node_port, tiny_model_dir, WORKLOAD_TYPES))
    tls = {"root_certificates": certs.ca}
    try:
        cluster.start_scheduler()
        admin_key = cluster.admin_key()
        with RLClient(cluster.url, api_key=admin_key, **tls) as root:
            _, node_key = root.keys.create("rack-1", "node")
            _, alice_key = root.keys.create("alice", "user")
            bob_info, bob_key = root.keys.create("bob", "user")
            spare_info, spare_key = root.keys.create("alice", "user", description="revoked below")
            cluster.start_trainer(
                "node-a",
                "--api-key",
                node_key,
                *node_tls_args(certs),
                "--serve-tls-cert",
                str(certs.server_cert),
                "--serve-tls-key",
                str(certs.server_key),
                url=f"127.0.0.1:{node_port}",
            )
            wait_connected(root)
        with RLClient(cluster.url, api_key=bob_key, **tls) as bob:
            bobs_task = bob.submit_task(
                workload_type="lora_finetune", gpu_count=0, model=str(tiny_model_dir), hyperparameters=TINY_HP
            )
            bob.cancel(bobs_task)

        with RLClient(cluster.url, api_key=alice_key, min_poll_interval=0, **tls) as alice:
            trained = alice.submit_task(
                workload_type="lora_finetune", gpu_count=0, model=str(tiny_model_dir), hyperparameters=TINY_HP
            )
            assert cluster.wait_done(alice, trained).state == "succeeded"
            llm = alice.serve(trained, ttl=600, timeout=180)  # alice's key and the CA go along
            endpoint = llm.endpoint
            assert endpoint.startswith("https://127.0.0.1:") and llm.tls
            assert alice.get_task(llm.task_id).endpoint == endpoint
            out = llm.generate("What is 2 + 3?", temperature=0, max_tokens=3)
            assert out.adapter == trained and 1 <= len(out.samples[0].token_ids) <= 3
            assert [a.name for a in llm.list_adapters()] == [trained]

            # Another owner's adapter reads exactly like one that does not exist.
            with pytest.raises(NotFoundError) as theirs:
                llm.generate("hi", adapter=bobs_task, max_tokens=2)
            with pytest.raises(NotFoundError) as missing:
                llm.generate("hi", adapter="task-000000000000", max_tokens=2)
            assert theirs.value.details.replace(bobs_task, "X") == missing.value.details.replace(
                "task-000000000000", "X"
            )
            llm.close()

        def token(key: str) -> str:
            with RLClient(cluster.url, api_key=key, **tls) as c:
                return c.endpoint_token(llm.task_id).token

        with InferenceClient(endpoint, api_key=token(admin_key), adapter=trained, **tls) as admin:
            assert admin.generate("What is 2 + 3?", temperature=0, max_tokens=3).samples == out.samples
        with RLClient(cluster.url, api_key=bob_key, **tls) as bob:
            with pytest.raises(NotFoundError):  # no token for another owner's task
                bob.endpoint_token(llm.task_id)
        with InferenceClient(endpoint, api_key=bob_key, **tls) as bob_llm:  # an API key: refused, not sent on
            with pytest.raises(UnauthenticatedError, match=f"opentinker endpoint-token {llm.task_id}"):
                bob_llm.generate("hi", max_tokens=2)
        with InferenceClient(endpoint, api_key="", **tls) as anonymous:
            with pytest.raises(UnauthenticatedError, match="missing endpoint token"):
                anonymous.generate("hi", max_tokens=2)
        alice_token = token(alice_key)
        with InferenceClient(endpoint.removeprefix("https://"), api_key=alice_token, timeout=5) as plain:
            with pytest.raises(UnavailableError):
                plain.generate("hi", max_tokens=2)
        with InferenceClient(endpoint, api_key=alice_token, root_certificates=certs.other_ca, timeout=5) as wrong_ca:
            with pytest.raises(UnavailableError):
                wrong_ca.generate("hi", max_tokens=2)

        # Revoking a key reaches its tokens on the serving node once the (0.2 s) cache entry has expired.
        with InferenceClient(endpoint, api_key=token(spare_key), **tls) as spare:
            spare.generate("hi", max_tokens=2)
            with RLClient(cluster.url, api_key=admin_key, **tls) as root:
                root.keys.revoke(spare_info.prefix)
            time.sleep(0.5)
            with pytest.raises(UnauthenticatedError, match="revoked"):
                spare.generate("hi", max_tokens=2)

        with RLClient(cluster.url, api_key=alice_key, **tls) as alice:
            alice.cancel(llm.task_id)
            with pytest.raises(TaskFailedError, match="CANCELLED"):
                cluster.wait_done(alice, llm.task_id)
        serving = [e for e in cluster.procs[-1].log_events() if e.get("event") == "serving"]
        assert (
            serving
            and serving[0]["tls"] is True
            and serving[0]["api_key_check"] is True
            and serving[0]["auth_cache_ttl_s"] == 0.2
        )
        assert (
            alice_key not in cluster.procs[-1].log_text()
            and alice_key.split("_", 2)[2] not in cluster.scheduler.log_text()
        )
    finally:
        cluster.close()
