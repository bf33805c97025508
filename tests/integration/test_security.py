"""Security end to end with real processes on loopback: a scheduler with API keys, TLS and an mTLS
node port; a trainer with a node key and a client certificate (reaching the scheduler through an
``https://`` URL); clients with user keys; revoking the node's key cuts the running trainer off."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from opentinker_client import NotFoundError, RLClient, UnauthenticatedError

from tests.support.procs import Cluster, free_port, wait_connected
from tests.support.security import auth_tls_config, make_certs, node_tls_args

TINY_HP = {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4}


def test_keys_tls_and_mtls_end_to_end(tmp_path: Path, tiny_model_dir: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    node_port = free_port()
    cluster = Cluster(tmp_path, auth_tls_config(certs, node_port, tiny_model_dir))
    try:
        cluster.start_scheduler()
        admin_key = cluster.admin_key()
        tls = {"root_certificates": certs.ca}
        with RLClient(cluster.url, api_key=admin_key, **tls) as root:
            _, node_key = root.keys.create("rack-1", "node", description="trainer node-a")
            _, alice_key = root.keys.create("alice", "user")
            bob_info, bob_key = root.keys.create("bob", "user")

            # A trainer holding a user key is refused for good and exits 1.
            wrong = cluster.start_trainer(
                "node-wrong",
                "--api-key",
                alice_key,
                *node_tls_args(certs),
                url=f"127.0.0.1:{node_port}",
            )
            assert wrong.popen.wait(timeout=60) == 1
            assert "PERMISSION_DENIED" in wrong.log_text()

            # The real trainer: node key + client certificate (CN node-a) on the mTLS node port.
            trainer = cluster.start_trainer(
                "node-a",
                "--api-key",
                node_key,
                *node_tls_args(certs),
                url=f"https://localhost:{node_port}",
            )
            wait_connected(root, 1)

        with RLClient(cluster.url, api_key=alice_key, min_poll_interval=0, **tls) as alice:
            task_id = alice.submit_task(
                workload_type="lora_finetune", gpu_count=0, model=str(tiny_model_dir), hyperparameters=TINY_HP
            )
            task = cluster.wait_done(alice, task_id)
            assert task.state == "succeeded" and task.owner == "alice"
            assert alice.get_metrics(task_id)["step"] == 2

        with RLClient(cluster.url, api_key=bob_key, **tls) as bob:
            for call in (bob.get_task, bob.get_metrics, bob.cancel, bob.list_checkpoints):
                with pytest.raises(NotFoundError):
                    call(task_id)
            assert bob.list_tasks() == []
            new_info, new_bob_key, _ = bob.keys.rotate(bob_info.prefix)  # self-service rotation
        with RLClient(cluster.url, api_key=bob_key, **tls) as stale:
            with pytest.raises(UnauthenticatedError, match="revoked"):
                stale.list_tasks()
        with RLClient(cluster.url, api_key=new_bob_key, **tls) as bob:
            assert bob.list_tasks() == []

        with RLClient(cluster.url, api_key=admin_key, **tls) as root:
            root.keys.revoke(new_info.prefix)
            actions = {(r.action, r.outcome) for r in root.keys.audit(limit=200)}
        with RLClient(cluster.url, api_key=new_bob_key, **tls) as revoked:
            with pytest.raises(UnauthenticatedError, match="revoked"):
                revoked.list_tasks()
        assert {
            ("key.create", "OK"),
            ("task.submit", "OK"),
            ("key.rotate", "OK"),
            ("key.revoke", "OK"),
            ("node.join", "OK"),
        } <= actions
        # Plaintext to the TLS port does not get through.
        with RLClient(cluster.url, api_key=admin_key, timeout=3) as plain:
            with pytest.raises(Exception, match="UNAVAILABLE|DEADLINE_EXCEEDED"):
                plain.list_tasks()
        # Revoking the node's key ends its open Connect stream; the trainer is refused and exits 1.
        with RLClient(cluster.url, api_key=admin_key, **tls) as root:
            node_prefix = next(k.prefix for k in root.keys.list() if k.owner == "rack-1")
            root.keys.revoke(node_prefix)
            assert trainer.popen.wait(timeout=60) == 1
            refused = [e for e in trainer.log_events() if e.get("event") == "scheduler refused this node"]
            assert refused and refused[0]["error"] == f"UNAUTHENTICATED: API key {node_prefix} was revoked"
            deadline = time.monotonic() + 30
            while any(n.connected for n in root.list_nodes()) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not any(n.connected for n in root.list_nodes())
        audit_lines = [e for e in cluster.scheduler.log_events() if e.get("event") == "audit"]
        assert any(e["action"] == "auth.refused" and e["outcome"] == "PERMISSION_DENIED" for e in audit_lines)
        assert any(e["action"] == "node.join" and e.get("cert_cn") == "node-a" for e in audit_lines)
    finally:
        cluster.close()
