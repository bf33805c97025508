"""API keys, roles, owner isolation, TLS and mTLS through a real scheduler gRPC server on loopback."""

from __future__ import annotations

import os
import stat

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N, node_pb2_grpc
from opentinker.scheduler.v1 import admin_pb2 as A, admin_pb2_grpc, scheduler_pb2 as S, scheduler_pb2_grpc
from opentinker_client import (
    DeadlineExceededError,
    NotFoundError,
    PermissionDeniedError,
    RLClient,
    UnauthenticatedError,
    UnavailableError,
)
from opentinker_client.cli.commands import main as cli_main
from opentinker_scheduler.security.auth import KeyStore, bearer_token, hash_key
from opentinker_scheduler.config import ConfigError, parse_config
from opentinker_scheduler.errors import FailedPrecondition, InvalidArgument, NotFound

from tests.support.security import AUTH_LOCAL_MODELS, LoopbackScheduler, make_certs, metadata


def _spec(model: str = "/models/m") -> C.TaskSpec:
    return C.TaskSpec(workload_type="lora_finetune", model=model, resources=C.Resources(gpu_count=0))


@pytest.fixture
def sched(tmp_path):
    with LoopbackScheduler(tmp_path / "state", AUTH_LOCAL_MODELS) as s:
        yield s


def _code(fn, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, **kwargs)
    return err.value.code(), err.value.details()


def test_bootstrap_admin_key_is_written_0600_and_stored_only_as_a_hash(sched) -> None:
    path = sched.config.state_dir / "admin.key"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = sched.admin_key
    assert key.startswith("otk_")
    db = (sched.config.state_dir / "scheduler.db").read_bytes() + b"".join(
        p.read_bytes() for p in sched.config.state_dir.glob("scheduler.db-*")
    )
    secret = key.split("_", 2)[2]
    assert secret.encode() not in db  # never in plain text
    rows = sched.do(lambda: sched.security.keys.list())
    assert [(r.owner, r.role) for r in rows] == [("admin", "admin")] and rows[0].key_hash == hash_key(key)


def test_refusals_no_key_wrong_key_malformed_header_revoked_key(sched) -> None:
    with sched.channel() as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        code, details = _code(stub.ListTasks, S.ListTasksRequest())
        assert code == grpc.StatusCode.UNAUTHENTICATED and "missing API key" in details
        code, details = _code(stub.ListTasks, S.ListTasksRequest(), metadata=metadata("otk_00000000_" + "x" * 43))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "unknown API key" in details
        code, _ = _code(stub.ListTasks, S.ListTasksRequest(), metadata=(("authorization", "Basic abc"),))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        # The right prefix with a wrong secret reads like an unknown key (no prefix oracle).
        admin = sched.admin_key
        code, details = _code(
            stub.ListTasks, S.ListTasksRequest(), metadata=metadata(admin[:-1] + ("A" if admin[-1] != "A" else "B"))
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED and "unknown API key" in details
        stub.ListTasks(S.ListTasksRequest(), metadata=metadata(admin))
        # Health needs no key.
        assert (
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status
            == health_pb2.HealthCheckResponse.SERVING
        )
        # Revoked: refused at once, no restart.
        admin_stub = admin_pb2_grpc.AdminServiceStub(ch)
        user = admin_stub.CreateApiKey(
            A.CreateApiKeyRequest(owner="alice", role=A.API_KEY_ROLE_USER), metadata=metadata(admin)
        )
        stub.ListTasks(S.ListTasksRequest(), metadata=metadata(user.api_key))
        admin_stub.RevokeApiKey(A.RevokeApiKeyRequest(prefix=user.key.prefix), metadata=metadata(admin))
        code, details = _code(stub.ListTasks, S.ListTasksRequest(), metadata=metadata(user.api_key))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "revoked" in details
        # Revoking again is idempotent.
        again = admin_stub.RevokeApiKey(A.RevokeApiKeyRequest(prefix=user.key.prefix), metadata=metadata(admin))
        assert not again.key.active


def test_owner_isolation_other_owner_gets_not_found_and_admin_sees_all(sched, tmp_path) -> None:
    admin = sched.admin_key
    with RLClient(sched.target, api_key=admin) as root:
        _, alice_key = root.keys.create("alice", "user")
        _, bob_key = root.keys.create("bob", "user")
    with (
        RLClient(sched.target, api_key=alice_key, min_poll_interval=0) as alice,
        RLClient(sched.target, api_key=bob_key) as bob,
    ):
        task_id = alice.submit_task(workload_type="lora_finetune", model="/models/m")
        assert alice.get_task(task_id).owner == "alice"
        for call in (bob.get_task, bob.get_metrics, bob.cancel, bob.list_checkpoints):
            with pytest.raises(NotFoundError, match="not found"):
                call(task_id)
        with pytest.raises(NotFoundError):
            next(iter(bob.watch(task_id)))
        assert [t.task_id for t in bob.list_tasks()] == []
        assert [t.task_id for t in alice.list_tasks()] == [task_id]
        # The answer for another owner's task is the same as for a task that does not exist.
        with pytest.raises(NotFoundError) as missing:
            bob.get_task("task-doesnotexist")
        with pytest.raises(NotFoundError) as other:
            bob.get_task(task_id)
        assert str(missing.value).replace("task-doesnotexist", "X") == str(other.value).replace(task_id, "X")
        assert alice.get_task(task_id).state == "pending"  # bob's cancel did nothing
    with sched.channel() as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        code, _ = _code(
            lambda: next(
                stub.DownloadCheckpoint(S.DownloadCheckpointRequest(task_id=task_id), metadata=metadata(bob_key))
            )
        )
        assert code == grpc.StatusCode.NOT_FOUND
        code, _ = _code(stub.ListCheckpoints, S.ListCheckpointsRequest(task_id=task_id), metadata=metadata(bob_key))
        assert code == grpc.StatusCode.NOT_FOUND
    with RLClient(sched.target, api_key=admin) as root:
        assert [t.task_id for t in root.list_tasks()] == [task_id]
        assert root.cancel(task_id).state == "cancelled"


def test_roles_node_key_cannot_call_client_rpcs_and_user_key_cannot_open_a_node_stream(sched) -> None:
    admin = sched.admin_key
    with RLClient(sched.target, api_key=admin) as root:
        _, node_key = root.keys.create("rack-1", "node")
        _, user_key = root.keys.create("alice", "user")
    with RLClient(sched.target, api_key=node_key) as as_node:
        with pytest.raises(PermissionDeniedError, match="node keys may open their node's stream"):
            as_node.submit_task(workload_type="lora_finetune", model="/models/m")
        with pytest.raises(PermissionDeniedError):
            as_node.list_tasks()
        with pytest.raises(PermissionDeniedError):
            as_node.keys.list()
    register = N.ConnectRequest(register=N.Register(node_id="node-x", max_tasks=1))
    with sched.channel() as ch:
        nodes = node_pb2_grpc.NodeServiceStub(ch)
        code, details = _code(lambda: next(nodes.Connect(iter([register]), metadata=metadata(user_key))))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "may not open a node stream" in details
        code, _ = _code(lambda: next(nodes.Connect(iter([register]))))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        first = next(nodes.Connect(iter([register]), metadata=metadata(node_key)))
        assert first.WhichOneof("command") == "registered"


def test_create_list_rotate_revoke_with_user_self_service(sched) -> None:
    admin = sched.admin_key
    with RLClient(sched.target, api_key=admin) as root:
        alice_info, alice_key = root.keys.create("alice", "user", description="laptop")
        _, bob_key = root.keys.create("bob", "user")
        assert alice_info.prefix in {k.prefix for k in root.keys.list()}
        assert all(not k.prefix.count("_") > 1 for k in root.keys.list())  # prefixes only
    with RLClient(sched.target, api_key=alice_key) as alice:
        assert [k.owner for k in alice.keys.list()] == ["alice"]
        with pytest.raises(PermissionDeniedError, match="admin keys only"):
            alice.keys.create("mallory", "admin")
        with RLClient(sched.target, api_key=bob_key) as bob:
            bob_prefix = bob.keys.list()[0].prefix
        with pytest.raises(NotFoundError):
            alice.keys.revoke(bob_prefix)
        with pytest.raises(NotFoundError):
            alice.keys.rotate(bob_prefix)
        new, new_key, old = alice.keys.rotate(alice_info.prefix)
        assert (
            new.owner == "alice"
            and new.role == "user"
            and new.description == "laptop"
            and not old.active
            and old.replaced_by == new.prefix
        )
    with RLClient(sched.target, api_key=alice_key) as stale:
        with pytest.raises(UnauthenticatedError, match=f"replaced by {new.prefix}"):
            stale.list_tasks()
    with RLClient(sched.target, api_key=new_key) as fresh:
        assert fresh.list_tasks() == []
        with pytest.raises(Exception, match="FAILED_PRECONDITION"):
            fresh.keys.rotate(old.prefix)


def test_rotation_with_grace_keeps_the_old_key_until_it_expires(sched) -> None:
    admin = sched.admin_key
    with RLClient(sched.target, api_key=admin) as root:
        info, key = root.keys.create("alice", "user")
        new, new_key, old = root.keys.rotate(info.prefix, grace=3600)
        assert old.active and old.expire_time is not None
    with RLClient(sched.target, api_key=key) as c:
        c.list_tasks()  # still fine within the grace period
        keys = sched.security.keys
        real = keys.clock
        keys.clock = lambda: real() + 3601
        try:
            with pytest.raises(UnauthenticatedError, match="expired after rotation"):
                c.list_tasks()
        finally:
            keys.clock = real
    with RLClient(sched.target, api_key=new_key) as c:
        c.list_tasks()


def test_admin_rpc_bad_input_is_invalid_argument_and_nothing_is_written(sched) -> None:
    admin = sched.admin_key
    with sched.channel() as ch:
        stub = admin_pb2_grpc.AdminServiceStub(ch)
        md = metadata(admin)
        before = len(stub.ListApiKeys(A.ListApiKeysRequest(include_inactive=True), metadata=md).keys)
        for req, field in (
            (A.CreateApiKeyRequest(owner="", role=A.API_KEY_ROLE_USER), "owner"),
            (A.CreateApiKeyRequest(owner="a b", role=A.API_KEY_ROLE_USER), "owner"),
            (A.CreateApiKeyRequest(owner="x" * 129, role=A.API_KEY_ROLE_USER), "owner"),
            (A.CreateApiKeyRequest(owner="alice"), "role"),
            (A.CreateApiKeyRequest(owner="alice", role=A.API_KEY_ROLE_USER, description="d" * 257), "description"),
        ):
            code, details = _code(stub.CreateApiKey, req, metadata=md)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field + ":"), details
        code, details = _code(stub.RevokeApiKey, A.RevokeApiKeyRequest(prefix="nope"), metadata=md)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("prefix:")
        code, _ = _code(stub.RevokeApiKey, A.RevokeApiKeyRequest(prefix="otk_00000000"), metadata=md)
        assert code == grpc.StatusCode.NOT_FOUND
        req = A.RotateApiKeyRequest(prefix=admin)
        req.grace.FromSeconds(31 * 86400)
        code, details = _code(stub.RotateApiKey, req, metadata=md)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("grace:")
        code, _ = _code(stub.ListAuditEvents, A.ListAuditEventsRequest(page_size=5000), metadata=md)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert len(stub.ListApiKeys(A.ListApiKeysRequest(include_inactive=True), metadata=md).keys) == before


def test_auth_off_keeps_anonymous_admin_and_admin_service_says_keys_are_off(tmp_path) -> None:
    s = LoopbackScheduler(tmp_path / "state")
    try:
        with RLClient(s.target) as c:
            task_id = c.submit_task(workload_type="lora_finetune", model="/models/m")
            assert c.get_task(task_id).owner == "anonymous"
            with pytest.raises(Exception, match="FAILED_PRECONDITION: API keys are off"):
                c.keys.list()
        assert not (tmp_path / "state" / "admin.key").exists()
    finally:
        s.close()


def test_bootstrap_admin_key_from_environment(tmp_path, monkeypatch) -> None:
    key = "otk_0123abcd_" + "k" * 43
    monkeypatch.setenv("OPENTINKER_BOOTSTRAP_ADMIN_KEY", key)
    s = LoopbackScheduler(tmp_path / "state", AUTH_LOCAL_MODELS)
    try:
        assert not (tmp_path / "state" / "admin.key").exists()
        with RLClient(s.target, api_key=key) as c:
            assert [k.prefix for k in c.keys.list()] == ["otk_0123abcd"]
    finally:
        s.close()


def test_keystore_unit_bad_key_formats_and_not_found(tmp_path, store_backend) -> None:
    from tests.support.stores import make_store

    store = make_store(tmp_path / "s")
    try:
        keys = KeyStore(store)
        with pytest.raises(InvalidArgument, match="api_key"):
            keys.import_key("otk_short", "a", "user")
        with pytest.raises(InvalidArgument, match="role"):
            keys.create("alice", "root")
        with pytest.raises(NotFound):
            keys.revoke("otk_deadbeef")
        row, key = keys.create("alice", "user")
        keys.revoke(row.prefix)
        with pytest.raises(FailedPrecondition):
            keys.rotate(row.prefix)
        assert bearer_token((("authorization", "Bearer  abc "),)) == "abc"
        assert bearer_token((("authorization", "Token abc"),)) == ""
        assert bearer_token(()) is None
    finally:
        store.close()


def test_auth_and_tls_config_errors_name_file_line_and_key(tmp_path) -> None:
    certs = make_certs(tmp_path / "certs")
    cases = {
        "auth: {enabled: yes please}\n": "auth.enabled",
        "auth: {enabled: true, extra: 1}\n": "auth.extra",
        "tls: {cert: certs/server.pem}\n": "tls.key",
        "tls: {cert: certs/nope.pem, key: certs/server.key}\n": "tls.cert",
        "tls: {cert: certs/server.pem, key: certs/server.key, client_ca: certs/ca.pem}\n": "tls.node_port",
        "tls: {cert: certs/server.pem, key: certs/server.key, client_auth: some}\n": "tls.client_auth",
    }
    (tmp_path / "certs" / "junk.pem").write_text("not pem")
    cases["tls: {cert: certs/junk.pem, key: certs/server.key}\n"] = "tls.cert"
    for text, key in cases.items():
        with pytest.raises(ConfigError, match=rf"x\.yaml:1:\d+: {key}"):
            parse_config(text, "x.yaml", base_dir=tmp_path)
    cfg = parse_config(
        "tls: {cert: certs/server.pem, key: certs/server.key, client_ca: certs/ca.pem, node_port: 0}\n",
        "x.yaml",
        base_dir=tmp_path,
    )
    assert cfg.tls.cert == certs.server_cert and cfg.tls.node_cert_required


# ---------------------------------------------------------------------------------------- TLS


def test_tls_succeeds_with_the_right_ca_and_fails_with_another_or_plaintext(tmp_path) -> None:
    certs = make_certs(tmp_path / "certs")
    s = LoopbackScheduler(
        tmp_path / "state", "tls: {cert: certs/server.pem, key: certs/server.key}\n", base_dir=tmp_path
    )
    try:
        with RLClient(s.target, root_certificates=certs.ca, timeout=5) as c:
            assert c.list_tasks() == []
        with RLClient(s.target, root_certificates=certs.other_ca, timeout=3) as c:
            with pytest.raises((UnavailableError, DeadlineExceededError)):  # handshake refused
                c.list_tasks()
        with RLClient(s.target, timeout=3) as c:  # plaintext to a TLS port
            with pytest.raises((UnavailableError, DeadlineExceededError)):  # handshake refused
                c.list_tasks()
    finally:
        s.close()


def _connect_node(target: str, creds, *, key: str = "") -> N.ConnectResponse:
    register = N.ConnectRequest(register=N.Register(node_id="node-a", max_tasks=1))
    with grpc.secure_channel(target, creds, options=(("grpc.ssl_target_name_override", "localhost"),)) as ch:
        stream = node_pb2_grpc.NodeServiceStub(ch).Connect(
            iter([register]), metadata=metadata(key) if key else None, timeout=5
        )
        return next(stream)


def test_mtls_node_port_needs_a_client_certificate_from_the_ca(tmp_path) -> None:
    certs = make_certs(tmp_path / "certs")
    text = (
        AUTH_LOCAL_MODELS
        + "tls: {cert: certs/server.pem, key: certs/server.key, client_ca: certs/ca.pem, node_port: 0}\n"
    )
    s = LoopbackScheduler(tmp_path / "state", text, base_dir=tmp_path)
    try:
        admin = s.admin_key
        with RLClient(s.target, api_key=admin, root_certificates=certs.ca) as root:
            _, node_key = root.keys.create("rack-1", "node")
        node_target = f"127.0.0.1:{s.running.node_port}"
        ca = certs.ca.read_bytes()
        good = grpc.ssl_channel_credentials(ca, certs.node_key.read_bytes(), certs.node_cert.read_bytes())
        assert _connect_node(node_target, good, key=node_key).WhichOneof("command") == "registered"
        # No client certificate, or one from another CA: the handshake fails.
        for creds in (
            grpc.ssl_channel_credentials(ca),
            grpc.ssl_channel_credentials(ca, certs.rogue_key.read_bytes(), certs.rogue_cert.read_bytes()),
        ):
            with pytest.raises(grpc.RpcError) as err:
                _connect_node(node_target, creds, key=node_key)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # The client port (server-side TLS only) refuses NodeService: no verified client certificate.
        with pytest.raises(grpc.RpcError) as err:
            _connect_node(s.target, grpc.ssl_channel_credentials(ca), key=node_key)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "client certificate" in err.value.details()
        # The node join is audited with the certificate's common name.
        joins = [r for r in s.do(s.security.audit.list, action="node.join") if r.outcome == "OK"]
        assert (
            joins
            and joins[0].detail["cert_cn"] == "node-a"
            and joins[0].detail["node_id"] == "node-a"
            and joins[0].owner == "rack-1"
        )
    finally:
        s.close()


def test_mtls_for_all_callers_with_client_auth_all(tmp_path) -> None:
    certs = make_certs(tmp_path / "certs")
    text = "tls: {cert: certs/server.pem, key: certs/server.key, client_ca: certs/ca.pem, client_auth: all}\n"
    s = LoopbackScheduler(tmp_path / "state", text, base_dir=tmp_path)
    try:
        with RLClient(
            s.target, root_certificates=certs.ca, client_cert=certs.node_cert, client_key=certs.node_key, timeout=5
        ) as c:
            assert c.list_tasks() == []
        with RLClient(s.target, root_certificates=certs.ca, timeout=3) as c:
            with pytest.raises((UnavailableError, DeadlineExceededError)):  # handshake refused
                c.list_tasks()
    finally:
        s.close()


def test_cli_keys_create_list_rotate_revoke(sched, capsys) -> None:
    admin = sched.admin_key
    base = ["--scheduler-url", sched.target, "--api-key", admin]
    assert cli_main([*base, "keys", "create", "carol", "--role", "user", "--description", "ci"]) == 0
    key = capsys.readouterr().out.strip().splitlines()[-1]  # (log lines go to stdout under pytest)
    assert key.startswith("otk_") and key.count("_") >= 2
    prefix = key[:12]
    assert cli_main([*base, "keys", "list"]) == 0
    listing = capsys.readouterr().out
    assert prefix in listing and key not in listing
    assert cli_main(["--scheduler-url", sched.target, "--api-key", key, "keys", "rotate", prefix]) == 0
    new_key = capsys.readouterr().out.strip().splitlines()[-1]
    assert new_key != key
    assert cli_main(["--scheduler-url", sched.target, "--api-key", key, "list"]) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert cli_main([*base, "keys", "revoke", new_key[:12]]) == 0
    assert "revoked" in capsys.readouterr().out
    assert cli_main(["--scheduler-url", sched.target, "--api-key", new_key, "list"]) == 2
    assert cli_main(["--scheduler-url", sched.target, "--api-key", key, "keys", "create", "x"]) == 2


# ------------------------------------------------------------------ node ids named by certificates


def _register(target: str, creds, node_id: str, key: str) -> N.ConnectResponse:
    register = N.ConnectRequest(register=N.Register(node_id=node_id, max_tasks=1))
    with grpc.secure_channel(target, creds, options=(("grpc.ssl_target_name_override", "localhost"),)) as ch:
        return next(node_pb2_grpc.NodeServiceStub(ch).Connect(iter([register]), metadata=metadata(key), timeout=10))


def _node_creds(certs, cn: str):
    cert, key = certs.nodes[cn]
    return grpc.ssl_channel_credentials(certs.ca.read_bytes(), key.read_bytes(), cert.read_bytes())


def _mtls_sched(tmp_path, extra: str = ""):
    from tests.support.security import make_node_certs

    certs = make_node_certs(
        tmp_path / "certs", {"node-a": ("node-a.cluster.local",), "node-b": (), "trainer-fleet": ()}
    )
    text = (
        AUTH_LOCAL_MODELS
        + f"tls: {{cert: certs/server.pem, key: certs/server.key, client_ca: certs/ca.pem, node_port: 0{extra}}}\n"
    )
    s = LoopbackScheduler(tmp_path / "state", text, base_dir=tmp_path)
    with RLClient(s.target, api_key=s.admin_key, root_certificates=certs.ca) as root:
        _, node_key = root.keys.create("rack-1", "node")
    return s, certs, node_key, f"127.0.0.1:{s.running.node_port}"


def test_node_id_must_be_the_certificates_common_name_or_a_dns_name(tmp_path) -> None:
    s, certs, key, node_target = _mtls_sched(tmp_path)
    try:
        assert s.config.tls.node_id_must_match_cert  # the default with a client_ca
        a, b = _node_creds(certs, "node-a"), _node_creds(certs, "node-b")
        assert _register(node_target, a, "node-a", key).WhichOneof("command") == "registered"  # the CN
        assert (
            _register(node_target, a, "node-a.cluster.local", key).WhichOneof("command") == "registered"
        )  # a DNS name
        assert _register(node_target, b, "node-b", key).WhichOneof("command") == "registered"
        # node-a's certificate may not register as node-b (nor as anything else), and the reverse.
        for creds, node_id, names in (
            (a, "node-b", "CN 'node-a', DNS names 'node-a.cluster.local'"),
            (b, "node-a", "CN 'node-b'"),
            (a, "node-a.evil", "CN 'node-a'"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                _register(node_target, creds, node_id, key)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert err.value.details().startswith(f"node id '{node_id}' does not match its certificate ({names}")
        # Refusals are audited with the certificate's name and the id asked for; nothing registered.
        refused = [r for r in s.do(s.security.audit.list, action="node.join") if r.outcome == "PERMISSION_DENIED"]
        assert {(r.detail["node_id"], r.detail["cert_cn"]) for r in refused} == {
            ("node-b", "node-a"),
            ("node-a", "node-b"),
            ("node-a.evil", "node-a"),
        }
        assert "node-a.evil" not in s.do(lambda: set(s.core.ledger.nodes))
    finally:
        s.close()


def test_one_fleet_certificate_for_all_nodes_when_matching_is_off(tmp_path) -> None:
    s, certs, key, node_target = _mtls_sched(tmp_path, ", node_id_must_match_cert: false")
    try:
        fleet = _node_creds(certs, "trainer-fleet")
        for node_id in ("gpu-node-01", "gpu-node-02"):
            assert _register(node_target, fleet, node_id, key).WhichOneof("command") == "registered"
        joins = [r for r in s.do(s.security.audit.list, action="node.join") if r.outcome == "OK"]
        assert {(r.detail["node_id"], r.detail["cert_cn"]) for r in joins} == {
            ("gpu-node-01", "trainer-fleet"),
            ("gpu-node-02", "trainer-fleet"),
        }
    finally:
        s.close()


def test_node_id_must_match_cert_config(tmp_path) -> None:
    certs = make_certs(tmp_path / "certs")
    base = "tls: {cert: certs/server.pem, key: certs/server.key"
    assert not parse_config(
        base + "}\n", "x.yaml", base_dir=tmp_path
    ).tls.node_id_must_match_cert  # no client certificates
    cfg = parse_config(
        base + ", client_ca: certs/ca.pem, client_auth: all, node_id_must_match_cert: false}\n",
        "x.yaml",
        base_dir=tmp_path,
    )
    assert cfg.tls.client_ca == certs.ca and not cfg.tls.node_id_must_match_cert
    with pytest.raises(
        ConfigError, match=r"x\.yaml:1:79: tls\.node_id_must_match_cert: expected false without tls\.client_ca"
    ):
        parse_config(base + ", node_id_must_match_cert: true}\n", "x.yaml", base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"x\.yaml:1:\d+: tls\.node_id_must_match_cert: expected true or false"):
        parse_config(
            base + ", client_ca: certs/ca.pem, node_port: 0, node_id_must_match_cert: maybe}\n",
            "x.yaml",
            base_dir=tmp_path,
        )


# ------------------------------------------------------------------ https:// and grpcs:// URLs


def test_https_url_means_tls_with_the_ca_or_else_the_system_roots(tmp_path, monkeypatch) -> None:
    certs = make_certs(tmp_path / "certs")
    monkeypatch.delenv("OPENTINKER_TLS_CA", raising=False)
    s = LoopbackScheduler(
        tmp_path / "state", "tls: {cert: certs/server.pem, key: certs/server.key}\n", base_dir=tmp_path
    )
    port = s.running.port
    try:
        for url in (f"https://localhost:{port}", f"grpcs://127.0.0.1:{port}"):
            with RLClient(url, root_certificates=certs.ca, timeout=10) as c:
                assert c.list_tasks() == []
        # No CA: the system's roots do not vouch for a self-signed test CA, and the error says so
        # (at once: the handshake fails, nothing waits for a deadline). 127.0.0.1, not localhost:
        # the server listens on IPv4 only, and gRPC would report the refused ::1 attempt last.
        with RLClient(f"https://127.0.0.1:{port}", timeout=20) as c:
            with pytest.raises(UnavailableError, match="not signed by a CA this client trusts.*--tls-ca CA.pem"):
                c.list_tasks()
        # The CLI takes --tls-ca (or $OPENTINKER_TLS_CA) with an https:// URL.
        assert cli_main(["--scheduler-url", f"https://localhost:{port}", "--tls-ca", str(certs.ca), "list"]) == 0
        monkeypatch.setenv("OPENTINKER_TLS_CA", str(certs.ca))
        assert cli_main(["--scheduler-url", f"https://localhost:{port}", "list"]) == 0
    finally:
        s.close()


def test_workers_make_the_same_tls_choice_as_their_node(tmp_path) -> None:
    """``worker_env(..., scheduler_tls=True)`` (an https:// node URL) makes a worker's channel TLS
    even without a CA; with the node's CA it reaches the scheduler."""
    from opentinker_trainer.scheduler_link import SCHEDULER_TLS_ENV, scheduler_channel, worker_env

    certs = make_certs(tmp_path / "certs")
    s = LoopbackScheduler(
        tmp_path / "state", "tls: {cert: certs/server.pem, key: certs/server.key}\n", base_dir=tmp_path
    )
    target = f"127.0.0.1:{s.running.port}"  # IPv4 only, as the server listens (see the test above)
    try:
        assert worker_env(target, scheduler_tls=True)[SCHEDULER_TLS_ENV] == "1" and SCHEDULER_TLS_ENV not in worker_env(
            target
        )
        for env, ok in (
            (worker_env(target, scheduler_tls=True, tls_ca=str(certs.ca)), True),
            (worker_env(target, scheduler_tls=True), False),
        ):
            channel, md = scheduler_channel(env=env)
            with channel:
                call = health_pb2_grpc.HealthStub(channel).Check
                if ok:
                    assert (
                        call(health_pb2.HealthCheckRequest(), timeout=10).status
                        == health_pb2.HealthCheckResponse.SERVING
                    )
                else:  # TLS against the system roots: a certificate error, not plaintext
                    with pytest.raises(grpc.RpcError) as err:
                        call(health_pb2.HealthCheckRequest(), timeout=10)
                    assert (
                        err.value.code() == grpc.StatusCode.UNAVAILABLE
                        and "CERTIFICATE_VERIFY_FAILED" in err.value.details()
                    )
    finally:
        s.close()
