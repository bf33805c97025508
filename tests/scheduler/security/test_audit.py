"""The audit log records submit, cancel, key changes and node joins (owner, action, task id, time,
outcome), as a structured log line and as a row that AdminService.ListAuditEvents returns."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest
from structlog.testing import capture_logs

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N, node_pb2_grpc
from opentinker.scheduler.v1 import scheduler_pb2 as S, scheduler_pb2_grpc
from opentinker.scheduler.v1 import admin_pb2 as A, admin_pb2_grpc
from opentinker_client import InvalidArgumentError, PermissionDeniedError, RLClient
from opentinker_scheduler.security.audit import REFUSAL_ROWS_BURST, REFUSAL_ROWS_PER_S, AuditLog
from tests.support.stores import make_store

from tests.support.http import http_get, metric_samples, metric_value
from tests.support.security import AUTH_LOCAL_MODELS, LoopbackScheduler, metadata


@pytest.fixture
def sched(tmp_path):
    with LoopbackScheduler(tmp_path / "state", AUTH_LOCAL_MODELS) as s:
        yield s


def test_each_action_is_recorded_with_owner_task_time_and_outcome(sched) -> None:
    admin = sched.admin_key
    t0 = time.time()
    with capture_logs() as logs:
        with RLClient(sched.target, api_key=admin) as root:
            alice_info, alice_key = root.keys.create("alice", "user")
            node_info, node_key = root.keys.create("rack-1", "node")
            with RLClient(sched.target, api_key=alice_key) as alice:
                task_id = alice.submit_task(workload_type="lora_finetune", model="/models/m")
                bad = C.TaskSpec(workload_type="lora_finetune", model="/models/m")
                bad.hyperparameters.update({"steps": 0})
                with (
                    grpc.insecure_channel(sched.target) as ch,
                    pytest.raises(grpc.RpcError),
                ):  # raw: RLClient checks locally
                    scheduler_pb2_grpc.SchedulerServiceStub(ch).SubmitTask(
                        S.SubmitTaskRequest(spec=bad), metadata=metadata(alice_key)
                    )
                alice.cancel(task_id, reason="changed my mind")
            root.keys.rotate(alice_info.prefix)
            root.keys.revoke(node_info.prefix)
            _, node_key = root.keys.create("rack-1", "node")
        with grpc.insecure_channel(sched.target) as ch:
            reg = N.ConnectRequest(register=N.Register(node_id="node-a", max_tasks=1, hostname="h1"))
            assert next(node_pb2_grpc.NodeServiceStub(ch).Connect(iter([reg]), metadata=metadata(node_key))).HasField(
                "registered"
            )
            with pytest.raises(grpc.RpcError):  # refused: logged, not stored
                next(node_pb2_grpc.NodeServiceStub(ch).Connect(iter([reg]), metadata=metadata(alice_key)))
        with RLClient(sched.target, api_key=admin) as root:
            records = root.keys.audit(limit=100)
    by_action = {}
    for r in records:
        by_action.setdefault(r.action, []).append(r)
    assert all(t0 - 1 <= r.time.timestamp() <= time.time() + 1 for r in records)
    submits = by_action["task.submit"]
    ok = [r for r in submits if r.outcome == "OK"]
    bad = [r for r in submits if r.outcome == "INVALID_ARGUMENT"]
    assert (
        len(ok) == 1
        and ok[0].owner == "alice"
        and ok[0].role == "user"
        and ok[0].task_id == task_id
        and ok[0].key_prefix == alice_info.prefix
    )
    # The submission's one record says what was asked for (the core logs no second line).
    assert ok[0].detail["workload_type"] == "lora_finetune" and ok[0].detail["gpu_count"] == 0
    assert isinstance(ok[0].detail["priority"], int)
    # A refusal is counted and, within its owner's budget, stored with its error.
    assert [r.detail["error"] for r in bad] == ["spec.hyperparameters.steps: expected an integer in [1, 100000], got 0"]
    assert sched.security.audit.refusals[("task.submit", "alice", "INVALID_ARGUMENT")] == 1
    (cancel,) = by_action["task.cancel"]
    assert (
        cancel.owner == "alice"
        and cancel.task_id == task_id
        and cancel.outcome == "OK"
        and cancel.detail["reason"] == "changed my mind"
    )
    assert [r.detail["for_owner"] for r in by_action["key.create"]] == ["rack-1", "rack-1", "alice"]  # newest first
    assert (
        by_action["key.rotate"][0].detail["target"] == alice_info.prefix and by_action["key.rotate"][0].owner == "admin"
    )
    assert by_action["key.revoke"][0].detail["target"] == node_info.prefix
    (join,) = by_action["node.join"]
    assert (
        join.owner == "rack-1" and join.role == "node" and join.detail["node_id"] == "node-a" and join.outcome == "OK"
    )
    assert "auth.refused" not in by_action
    # The same records went out as structured log lines of the opentinker.audit logger.
    lines = [e for e in logs if e.get("event") == "audit"]
    assert not [e for e in logs if e.get("event") == "task submitted"]  # the audit line is the one line
    assert {"task.submit", "task.cancel", "key.create", "key.rotate", "key.revoke", "node.join", "auth.refused"} <= {
        e["action"] for e in lines
    }
    refused = [e for e in lines if e["action"] == "auth.refused"]
    assert (
        refused[0]["outcome"] == "UNAUTHENTICATED"
        and "NodeService" in refused[0]["method"]
        and "revoked" in refused[0]["reason"]
    )
    json.dumps(lines)  # JSON-serializable as they are


def test_filters_paging_and_admin_only(sched) -> None:
    admin = sched.admin_key
    with RLClient(sched.target, api_key=admin) as root:
        for i in range(5):
            root.keys.create(f"u{i}", "user")
        _, user_key = root.keys.create("alice", "user")
        with RLClient(sched.target, api_key=user_key) as alice:
            alice.submit_task(workload_type="lora_finetune", model="/models/m")
            with pytest.raises(PermissionDeniedError, match="admin keys only"):
                alice.keys.audit()
        page = root.keys.audit(limit=3, action="key.create")
        assert len(page) == 3 and all(r.action == "key.create" for r in page)
        rest = root.keys.audit(limit=100, action="key.create", before_id=page[-1].id)
        assert len(rest) == 3 and rest[0].id < page[-1].id
        with pytest.raises(InvalidArgumentError, match="action"):
            root.keys.audit(action="task.delete")
    with grpc.insecure_channel(sched.target) as ch:
        with pytest.raises(grpc.RpcError) as err:
            admin_pb2_grpc.AdminServiceStub(ch).ListAuditEvents(A.ListAuditEventsRequest())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_auth_off_records_the_anonymous_owner(tmp_path) -> None:
    s = LoopbackScheduler(tmp_path / "state")
    try:
        with RLClient(s.target) as c:
            task_id = c.submit_task(workload_type="lora_finetune", model="/models/m")
        recs = s.do(lambda: s.security.audit.list(action="task.submit"))
        assert [(r.owner, r.role, r.task_id, r.outcome) for r in recs] == [("anonymous", "admin", task_id, "OK")]
    finally:
        s.close()


def test_audit_log_unit_survives_a_restart_and_odd_detail_values(tmp_path, store_backend) -> None:
    store = make_store(tmp_path / "s")
    AuditLog(store).record("task.submit", owner="o", role="user", task_id="t1", weird=object())
    store.close()
    store = make_store(tmp_path / "s")
    try:
        (rec,) = AuditLog(store).list()
        assert rec.task_id == "t1" and rec.owner == "o" and isinstance(rec.detail["weird"], str)
    finally:
        store.close()


def test_an_adapter_import_is_audited_and_takes_a_submit_token(tmp_path) -> None:
    """ImportAdapter makes a task as SubmitTask does: the same per-owner submit rate (one bucket
    for both) and an ``adapter.import`` audit record; refusals are counted and stored, as refused
    submits are."""
    from opentinker_client import ResourceExhaustedError

    from tests.scheduler.data.test_adapter_import import good_files

    folder = tmp_path / "adapter"
    for path, data in good_files().items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(data)
    config = AUTH_LOCAL_MODELS + "limits: {submit_rate: 0.001, submit_burst: 2}\n"
    with LoopbackScheduler(tmp_path / "state", config) as s:
        with RLClient(s.target, api_key=s.admin_key) as root:
            alice_info, alice_key = root.keys.create("alice", "user")
        with RLClient(s.target, api_key=alice_key) as alice:
            alice.upload_adapter(folder, model="acme/tiny", name="first")
            imported = alice.upload_adapter(folder, model="acme/tiny", name="mine")  # the burst of 2 is used
            with pytest.raises(ResourceExhaustedError, match=r"\(limits.submit_rate\)"):
                alice.upload_adapter(folder, model="acme/tiny", name="third")
            with pytest.raises(ResourceExhaustedError, match=r"submit rate limit"):
                alice.submit_task(workload_type="lora_finetune", model="/models/m")  # the same bucket
        with RLClient(s.target, api_key=s.admin_key) as root:
            records = [r for r in root.keys.audit(limit=100) if r.action == "adapter.import"]  # newest first
        counted = dict(s.security.audit.refusals)
    ok = [r for r in records if r.outcome == "OK"]
    refused = [r for r in records if r.outcome == "RESOURCE_EXHAUSTED"]
    assert len(ok) == 2 and ok[0].task_id == imported.task_id and ok[0].owner == "alice"
    assert ok[0].key_prefix == alice_info.prefix and ok[0].detail["model"] == "acme/tiny"
    assert ok[0].detail["total_bytes"] == sum(len(v) for v in good_files().values())
    assert len(refused) == 1 and "limits.submit_rate" in refused[0].detail["error"]
    assert counted == {
        ("adapter.import", "alice", "RESOURCE_EXHAUSTED"): 1,
        ("task.submit", "alice", "RESOURCE_EXHAUSTED"): 1,
    }


def test_a_flood_of_refusals_is_counted_and_stores_only_the_owners_budget_of_rows(tmp_path) -> None:
    """Refused submits and refused cancels: each is counted on /metrics; the owner's first
    REFUSAL_ROWS_BURST refusals are stored, the rest of the flood adds no row."""
    config = AUTH_LOCAL_MODELS + "limits: {submit_rate: 0.001, submit_burst: 1, rate_wait: 0}\n"  # answered at once
    flood = 3 * REFUSAL_ROWS_BURST
    with LoopbackScheduler(tmp_path / "state", config, http_port=0) as s:
        with RLClient(s.target, api_key=s.admin_key) as root:
            _, key = root.keys.create("mallory", "user")
        spec = C.TaskSpec(workload_type="lora_finetune", model="/models/m")
        rows = lambda: s.do(lambda: s.core.store.db.execute("SELECT COUNT(*) FROM audit_log").fetchone()[0])  # noqa: E731
        with grpc.insecure_channel(s.target) as ch:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            stub.SubmitTask(S.SubmitTaskRequest(spec=spec), metadata=metadata(key))  # the one token
            before, started = rows(), time.monotonic()
            for i in range(flood):
                with pytest.raises(grpc.RpcError) as err:
                    stub.SubmitTask(S.SubmitTaskRequest(spec=spec), metadata=metadata(key))
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                with pytest.raises(grpc.RpcError) as err:
                    stub.CancelTask(S.CancelTaskRequest(task_id=f"no-such-task-{i}"), metadata=metadata(key))
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
            refilled = (time.monotonic() - started) * REFUSAL_ROWS_PER_S
        stored = rows() - before
        assert REFUSAL_ROWS_BURST <= stored <= REFUSAL_ROWS_BURST + refilled + 1, (stored, refilled)
        url = f"http://127.0.0.1:{s.running.http.port}/metrics"
        admin = urllib.request.Request(url, headers={"Authorization": f"Bearer {s.admin_key}"})
        with urllib.request.urlopen(admin, timeout=10) as resp:
            samples = metric_samples(resp.read().decode())
        for action, code in (("task.submit", "RESOURCE_EXHAUSTED"), ("task.cancel", "NOT_FOUND")):
            assert (
                metric_value(samples, "opentinker_audit_refusals_total", action=action, owner="mallory", code=code)
                == flood
            )
        # Without a key: the action's total, no owner's name.
        status, body = http_get(url)
        assert status == 200 and b"mallory" not in body
        samples = metric_samples(body.decode())
        assert (
            metric_value(samples, "opentinker_audit_refusals_total", action="task.submit", code="RESOURCE_EXHAUSTED")
            == flood
        )


def test_the_records_of_a_transaction_commit_or_roll_back_with_it_in_order(tmp_path, store_backend) -> None:
    """Records made inside a (group) transaction are written when it commits, together, in the
    order they were made, more of them than one INSERT carries; a transaction that fails takes
    its records with it, and nothing is written before the commit."""
    store = make_store(tmp_path / "s")
    audit = AuditLog(store)
    n = store.AUDIT_ROWS_PER_INSERT + 5
    try:
        with store.batch():
            for i in range(n):
                audit.record("task.submit", owner=f"o{i}", role="user", task_id=f"t{i}")
            assert store._audit_rows and len(store._audit_rows) == n  # held for the commit
        with pytest.raises(RuntimeError), store.batch():
            audit.record("task.cancel", owner="x", role="user", task_id="lost")
            raise RuntimeError("a later write of the same transaction failed")
        records = audit.list(limit=1000)
        assert [r.task_id for r in reversed(records)] == [f"t{i}" for i in range(n)]
        assert "lost" not in {r.task_id for r in records}
        with pytest.raises(RuntimeError, match="open transaction"):
            store.add_audit((0.0, "o", "user", "", "task.submit", "t", "OK", "{}"))
    finally:
        store.close()


def test_a_record_of_the_open_transaction_is_read_back_before_it_commits(tmp_path, store_backend) -> None:
    """A read of the audit log on the store's connection sees the records of its open group
    transaction, as it sees the transaction's other writes (a refusal's record, answered before
    its group commits, is listed at once)."""
    store = make_store(tmp_path / "s")
    audit = AuditLog(store)
    try:
        with store.batch():
            audit.record("key.create", owner="a", role="user", outcome="PERMISSION_DENIED")
            assert [r.outcome for r in audit.list()] == ["PERMISSION_DENIED"]
            audit.record("key.revoke", owner="a", role="user", outcome="PERMISSION_DENIED")
        assert [r.action for r in audit.list()] == ["key.revoke", "key.create"]
    finally:
        store.close()
