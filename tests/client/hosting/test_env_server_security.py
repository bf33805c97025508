"""The access token and TLS of a client-hosted EnvironmentServer, over real gRPC on loopback
(certificates made with ``cryptography``)."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest

from opentinker.environment.v1 import environment_pb2 as pb
from opentinker.environment.v1 import environment_pb2_grpc as pb_grpc
from opentinker_client import Environment, InvalidArgumentError, RLClient
from opentinker_client.hosting.server import EnvironmentServer
from opentinker_common.spec import validate_env_config

from tests.support.environments import WalkRight
from tests.support.security import make_certs


@pytest.fixture
def servers():
    made = []

    def start(**kw):
        server = EnvironmentServer(WalkRight(), **kw).start()
        made.append(server)
        return server

    yield start
    for s in made:
        s.stop(grace=0)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("env-certs"))


def bearer(token: str):
    return (("authorization", f"Bearer {token}"),)


def reset(stub, metadata=()):
    return stub.Reset(pb.ResetRequest(session_id="s", items=[pb.ResetItem(env_index=0)]), timeout=5, metadata=metadata)


def stub_for(server, channel=None):
    return pb_grpc.EnvironmentServiceStub(channel or grpc.insecure_channel(server.endpoint))


# --- the token ---------------------------------------------------------------------------------


def test_calls_without_the_token_are_unauthenticated_and_nothing_runs(servers, caplog):
    server = servers()
    stub = stub_for(server)
    for call in (
        lambda: reset(stub),
        lambda: stub.Describe(pb.DescribeRequest(), timeout=5),
        lambda: stub.Close(pb.CloseRequest(session_id="s"), timeout=5),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "missing access token" in err.value.details() and "authorization: Bearer" in err.value.details()
    assert server.servicer.session_count() == 0  # refused before the servicer ran
    assert server.auth.refused == 3
    assert server.token not in caplog.text


@pytest.mark.parametrize(
    "metadata",
    [
        bearer("x" * 43),  # another token of the same shape
        (("authorization", "Basic dXNlcjpwYXNz"),),  # another scheme
        (("authorization", "Bearer "),),
        (("authorization", "Bearer two words-in-the-token-value"),),
        (("x-api-key", "x" * 43),),  # not the authorization header
    ],
)
def test_a_wrong_token_is_unauthenticated_without_echoing_it(servers, metadata):
    server = servers()
    with pytest.raises(grpc.RpcError) as err:
        reset(stub_for(server), metadata)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    details = err.value.details()
    assert "access token" in details and server.token not in details and "x" * 43 not in details


def test_the_right_token_is_served_and_health_and_reflection_stay_open(servers, caplog):
    caplog.set_level(logging.DEBUG, logger="opentinker_client")
    server = servers()
    stub = stub_for(server)
    assert reset(stub, bearer(server.token)).results[0].observation.discrete == 0
    # The scheme is case-insensitive (RFC 6750 / RFC 7235).
    assert reset(stub, (("authorization", f"bearer {server.token}"),)).results[0].observation.discrete == 0
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(server.endpoint)
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    out = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    assert "opentinker.environment.v1.EnvironmentService" in {
        s.name for r in out for s in r.list_services_response.service
    }
    assert server.auth.refused == 0
    # The token is in env_config (it travels with the task) but never in a log line or a repr.
    assert server.env_config["token"] == server.token
    assert server.token not in caplog.text
    assert server.token not in repr(server) and server.token not in repr(server.auth)
    assert server.token not in repr(validate_env_config(server.env_config))


def test_each_server_gets_its_own_random_token_or_the_given_one(servers):
    a, b = servers(), servers()
    assert a.token != b.token and len(a.token) == 43
    given = "my-own-token_0123456789"
    c = servers(token=given)
    assert c.token == given and c.env_config["token"] == given
    assert reset(stub_for(c), bearer(given)).results
    with pytest.raises(grpc.RpcError) as err:
        reset(stub_for(c), bearer(a.token))  # another server's token
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    "token, expected",
    [
        ("short", "16..256 characters"),
        ("x" * 257, "16..256 characters"),
        ("has spaces in it, sixteen+", "url-safe"),
        ("slash/and+plus=padding000", "url-safe"),
        ("", "16..256 url-safe characters"),
    ],
)
def test_a_bad_given_token_is_refused_before_binding(token, expected):
    with pytest.raises(InvalidArgumentError) as err:
        EnvironmentServer(WalkRight(), token=token)
    assert err.value.field == "token" and expected in str(err.value)
    if token:
        assert token not in str(err.value)


def test_require_token_false_serves_anyone_and_says_so(servers, caplog):
    caplog.set_level(logging.WARNING, logger="opentinker_client")
    server = servers(require_token=False)
    assert server.token == "" and "token" not in server.env_config and server.auth is None
    assert reset(stub_for(server)).results
    assert "WITHOUT an access token" in caplog.text
    assert validate_env_config(server.env_config).token == ""
    with pytest.raises(InvalidArgumentError) as err:
        EnvironmentServer(WalkRight(), require_token=False, token="my-own-token_0123456789")
    assert err.value.field == "token"


# --- TLS ---------------------------------------------------------------------------------------


def test_tls_with_the_right_ca_serves_and_env_config_carries_the_roots(servers, certs):
    server = servers(tls_cert=certs.server_cert, tls_key=certs.server_key, tls_ca=certs.ca)
    cfg = server.env_config
    assert cfg["tls"] is True and cfg["tls_root_certificates"] == certs.ca.read_text()
    assert validate_env_config(cfg).tls
    creds = grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())
    stub = stub_for(server, grpc.secure_channel(server.endpoint, creds))
    assert reset(stub, bearer(server.token)).results[0].observation.discrete == 0
    with pytest.raises(grpc.RpcError) as err:  # TLS does not replace the token
        reset(stub)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_tls_refuses_plaintext_and_a_client_trusting_another_ca(servers, certs):
    server = servers(tls_cert=certs.server_cert, tls_key=certs.server_key, tls_ca=certs.ca)
    with pytest.raises(grpc.RpcError) as err:
        reset(stub_for(server), bearer(server.token))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    other = grpc.ssl_channel_credentials(root_certificates=certs.other_ca.read_bytes())
    with pytest.raises(grpc.RpcError) as err:
        reset(stub_for(server, grpc.secure_channel(server.endpoint, other)), bearer(server.token))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert server.servicer.session_count() == 0


def test_tls_without_the_ca_trusts_system_roots(servers, certs):
    server = servers(tls_cert=certs.server_cert, tls_key=certs.server_key)
    assert server.env_config["tls"] is True and "tls_root_certificates" not in server.env_config


@pytest.mark.parametrize(
    "kwargs, field, expected",
    [
        ({"tls_cert": "CERT"}, "tls_key", "both tls_cert and tls_key"),
        ({"tls_key": "KEY"}, "tls_cert", "both tls_cert and tls_key"),
        ({"tls_ca": "CA"}, "tls_ca", "only with tls_cert"),
        ({"tls_cert": "CERT", "tls_key": "MISSING"}, "tls_key", "cannot read"),
        ({"tls_cert": "NOTPEM", "tls_key": "KEY"}, "tls_cert", "not a PEM file"),
        ({"tls_cert": "CERT", "tls_key": "CERT"}, "tls_key", "no PRIVATE KEY"),
        ({"tls_cert": "CERT", "tls_key": "KEY", "tls_ca": "KEY"}, "tls_ca", "private key"),
    ],
)
def test_bad_tls_files_are_refused_naming_the_argument(certs, tmp_path, kwargs, field, expected):
    files = {"CERT": certs.server_cert, "KEY": certs.server_key, "CA": certs.ca, "MISSING": tmp_path / "nope.pem"}
    (tmp_path / "notpem.txt").write_text("hello")
    files["NOTPEM"] = tmp_path / "notpem.txt"
    with pytest.raises(InvalidArgumentError) as err:
        EnvironmentServer(WalkRight(), **{k: files[v] for k, v in kwargs.items()})
    assert err.value.field == field and expected in str(err.value)


# --- through RLClient --------------------------------------------------------------------------


def test_serve_environment_passes_token_and_tls(certs):
    with RLClient(scheduler_url="127.0.0.1:1", timeout=1) as client:
        server = client.serve_environment(
            WalkRight(),
            token="client-given-token-0123",
            tls_cert=certs.server_cert,
            tls_key=certs.server_key,
            tls_ca=certs.ca,
        )
        cfg = server.env_config
        assert (
            cfg["token"] == "client-given-token-0123"
            and cfg["tls"]
            and "BEGIN CERTIFICATE" in cfg["tls_root_certificates"]
        )
        plain = client.serve_environment(WalkRight())
        assert len(plain.env_config["token"]) == 43 and "tls" not in plain.env_config
    assert server.stopped and plain.stopped


def test_submit_task_refuses_env_security_options_for_a_non_hosted_env(certs):
    with RLClient(scheduler_url="127.0.0.1:1", timeout=1) as client:
        with pytest.raises(InvalidArgumentError) as err:
            client.submit_task(env_config=Environment(), workload_type="lora_finetune", env_tls_cert=certs.server_cert)
        assert err.value.field == "env_tls_cert"
        with pytest.raises(InvalidArgumentError) as err:  # bad TLS input: refused before anything is served
            client.submit_task(env_config=WalkRight(), workload_type="lora_finetune", env_tls_cert=certs.server_cert)
        assert err.value.field == "tls_key"
        assert client._env_servers == []


def test_path_objects_and_strings_both_work(certs, servers):
    server = servers(tls_cert=str(certs.server_cert), tls_key=Path(certs.server_key), tls_ca=str(certs.ca))
    assert server.tls


def test_submit_refuses_a_bad_token_in_env_config_before_sending():
    bad = {
        "env_id": "client",
        "endpoint": "127.0.0.1:5",
        "action_space": 2,
        "observation_space": 5,
        "token": "bad token with spaces!",
    }
    with RLClient(scheduler_url="127.0.0.1:1", timeout=1) as client:
        with pytest.raises(InvalidArgumentError) as err:
            client.submit_task(env_config=bad, workload_type="full_rl")
    assert err.value.field == "spec.env_config.token" and "bad token" not in str(err.value)
