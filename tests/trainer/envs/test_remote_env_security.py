"""The trainer's side of the access token and TLS: RemoteSession/ClientEnv against a real
EnvironmentServer on loopback (certificates made with ``cryptography``)."""

from __future__ import annotations

import pytest

from opentinker_client.hosting.server import EnvironmentServer
from opentinker_common.spec import validate_env_config
from opentinker_trainer.context import UserError
from opentinker_trainer.envs.remote import RemoteSession, close_all_sessions, make_client_env

from tests.support.environments import WalkRight as Corridor
from tests.support.security import make_certs


@pytest.fixture(autouse=True)
def fresh_sessions():
    close_all_sessions()
    yield
    close_all_sessions()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("env-certs"))


def config(server: EnvironmentServer, **change):
    return validate_env_config({**server.env_config, **change})


def play(env) -> tuple:
    env.reset()
    return env.step(1)


def test_right_token_plays_and_the_session_closes():
    with EnvironmentServer(Corridor()) as server:
        env = make_client_env(config(server), seed=None)
        assert play(env)[0] == 1
        assert server.servicer.session_count() == 1
        close_all_sessions()  # Close carries the token too
        assert server.servicer.session_count() == 0
        assert server.auth.refused == 0


def test_wrong_token_fails_at_once_naming_the_cause_not_the_token():
    with EnvironmentServer(Corridor(grace_s=60)) as server:
        wrong = "w" * 43
        env = make_client_env(config(server, token=wrong), seed=None)
        with pytest.raises(UserError) as err:
            env.reset()
        msg = str(err.value)
        assert f"the access token (env_config.token) did not match the environment server at {server.endpoint}" in msg
        assert "UNAUTHENTICATED" in msg
        assert wrong not in msg and server.token not in msg
        assert server.auth.refused == 1  # one call: UNAUTHENTICATED is not retried (grace_s=60 not waited)


def test_missing_token_against_a_server_that_requires_one():
    with EnvironmentServer(Corridor()) as server:
        data = {k: v for k, v in server.env_config.items() if k != "token"}
        env = make_client_env(validate_env_config(data), seed=None)
        with pytest.raises(UserError, match=r"requires an access token but the task's env_config.token is empty"):
            env.reset()


def test_server_without_token_check_serves_a_task_without_token():
    with EnvironmentServer(Corridor(), require_token=False) as server:
        assert play(make_client_env(config(server), seed=None))[0] == 1


def test_sessions_are_per_endpoint_and_credentials():
    with EnvironmentServer(Corridor()) as server:
        cfg = config(server)
        a = RemoteSession.shared(cfg.endpoint, timeout_s=1, grace_s=1, token=cfg.token)
        assert RemoteSession.shared(cfg.endpoint, timeout_s=1, grace_s=1, token=cfg.token) is a
        assert RemoteSession.shared(cfg.endpoint, timeout_s=1, grace_s=1, token="z" * 43) is not a
        assert cfg.token not in repr(a)


def test_tls_with_the_right_ca_plays(certs):
    with EnvironmentServer(Corridor(), tls_cert=certs.server_cert, tls_key=certs.server_key, tls_ca=certs.ca) as server:
        env = make_client_env(config(server), seed=3)  # seed: one reset at creation
        assert env.unwrapped.session.tls
        assert play(env)[0] == 1


def test_tls_with_another_ca_fails_after_grace_naming_tls(certs):
    with EnvironmentServer(Corridor(), tls_cert=certs.server_cert, tls_key=certs.server_key, tls_ca=certs.ca) as server:
        env = make_client_env(config(server, grace_s=0.5, tls_root_certificates=certs.other_ca.read_text()), seed=None)
        with pytest.raises(UserError) as err:
            env.reset()
    msg = str(err.value)
    assert msg.startswith(
        f"client environment at {server.endpoint} unreachable for grace_s=0.5 s: no EnvironmentService answered"
    )
    assert "its TLS handshake failed: env_config.tls_root_certificates" in msg and server.token not in msg
    assert server.servicer.session_count() == 0


def test_tls_spec_against_a_plaintext_server_fails_naming_tls(certs):
    with EnvironmentServer(Corridor()) as server:
        env = make_client_env(
            config(server, grace_s=0.5, tls=True, tls_root_certificates=certs.ca.read_text()), seed=None
        )
        with pytest.raises(
            UserError, match=r"unreachable for grace_s=0.5 s: no EnvironmentService answered .*its TLS handshake failed"
        ):
            env.reset()


def test_a_task_cannot_tell_what_listens_on_a_port(certs):
    """A closed port, an HTTP/1 server and a TLS EnvironmentServer dialled in plaintext all give the
    same error text: a task spec cannot be used to probe the trainer's network."""
    import http.server
    import threading

    http1 = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=http1.serve_forever, daemon=True).start()
    try:
        with (
            EnvironmentServer(Corridor()) as plain,
            EnvironmentServer(Corridor(), tls_cert=certs.server_cert, tls_key=certs.server_key) as tls,
        ):
            texts = {}
            for label, endpoint in (
                ("closed", "127.0.0.1:1"),
                ("http1", f"127.0.0.1:{http1.server_address[1]}"),
                ("tls", tls.endpoint),
            ):
                close_all_sessions()
                spec = validate_env_config({**plain.env_config, "endpoint": endpoint, "grace_s": 0.3})
                with pytest.raises(UserError) as err:
                    make_client_env(spec, seed=None).reset()
                texts[label] = str(err.value).replace(endpoint, "EP")
        assert len(set(texts.values())) == 1, texts
        assert "unreachable for grace_s=0.3 s: no EnvironmentService answered" in texts["closed"]
    finally:
        http1.shutdown()
        close_all_sessions()
