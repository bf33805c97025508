"""Who may call an inference server: the access checker against a real scheduler on loopback (no
model), then a real InferenceService (tiny model) with endpoint-token checks and TLS, called by the
real InferenceClient and the openai package. Endpoints take endpoint tokens (ote_...) that the
scheduler issues; API keys stay with the scheduler."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N

from opentinker_client import (
    InferenceClient,
    NotFoundError,
    PermissionDeniedError,
    RLClient,
    UnauthenticatedError,
    UnavailableError,
)
from opentinker_client.connection import SchedulerConnection
from opentinker_client.endpoint_tokens import EndpointTokens
from opentinker_trainer.inference.access import AccessChecker, AccessRefused, authorization_value, credential_of
from opentinker_trainer.inference.serve_tls import read_server_tls, server_tls_from_env

from tests.support.procs import free_port
from tests.support.security import AUTH_LOCAL_MODELS, LoopbackScheduler, make_certs

PROMPT = "Once upon a time"


@dataclass
class World:
    sched: LoopbackScheduler
    admin: str
    alice: str
    bob: str
    node: str
    bob_prefix: str
    serving: str  # alice's inference task
    alice_adapter: str  # alice's lora_finetune task
    bob_adapter: str  # bob's lora_finetune task
    alice_other: str  # alice's second inference task
    bob_serving: str  # bob's inference task

    def token(self, key: str, task_id: str | None = None, ttl: float = 3600) -> str:
        """An endpoint token asked for with ``key`` (default: for :attr:`serving`)."""
        with RLClient(self.sched.target, api_key=key) as c:
            return c.endpoint_token(task_id or self.serving, ttl=ttl).token


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    sched = LoopbackScheduler(tmp_path_factory.mktemp("sched") / "state", AUTH_LOCAL_MODELS)
    try:
        admin = sched.admin_key
        with RLClient(sched.target, api_key=admin) as root:
            _, alice = root.keys.create("alice", "user")
            bob_info, bob = root.keys.create("bob", "user")
            _, node = root.keys.create("rack-1", "node")
        with RLClient(sched.target, api_key=alice) as c:
            serving = c.submit_task(workload_type="inference", model="/models/m")
            alice_adapter = c.submit_task(workload_type="lora_finetune", model="/models/m")
            alice_other = c.submit_task(workload_type="inference", model="/models/m")
        with RLClient(sched.target, api_key=bob) as c:
            bob_adapter = c.submit_task(workload_type="lora_finetune", model="/models/m")
            bob_serving = c.submit_task(workload_type="inference", model="/models/m")
        yield World(
            sched,
            admin,
            alice,
            bob,
            node,
            bob_info.prefix,
            serving,
            alice_adapter,
            bob_adapter,
            alice_other,
            bob_serving,
        )
    finally:
        sched.close()


def md(key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) if key else ()


async def _refusal(checker: AccessChecker, metadata, task_id: str) -> AccessRefused:
    with pytest.raises(AccessRefused) as err:
        await checker.check(metadata, task_id)
    return err.value


# ---------------------------------------------------------------------------- the checker alone


def test_the_scheduler_decides_with_the_callers_endpoint_token(world: World) -> None:
    alice, admin = world.token(world.alice), world.token(world.admin)
    bobs = world.token(world.bob, world.bob_serving)
    others = world.token(world.alice, world.alice_other)

    async def main() -> None:
        checker = AccessChecker(world.sched.target, env={}, ttl=60)
        try:
            await checker.check(md(alice), world.serving)  # the owner's token
            await checker.check(md(admin), world.serving)  # an admin's
            r = await _refusal(checker, md(None), world.serving)
            assert r.code == grpc.StatusCode.UNAUTHENTICATED and "missing endpoint token" in r.message
            forged = alice[:-4] + ("AAAA" if not alice.endswith("AAAA") else "BBBB")
            r = await _refusal(checker, md(forged), world.serving)
            assert r.code == grpc.StatusCode.UNAUTHENTICATED and "unknown endpoint token" in r.message
            # A token for another task, of another owner or of the same one, does not open this endpoint.
            for token, prefix in ((bobs, world.bob_prefix), (others, world.alice[:12])):
                r = await _refusal(checker, md(token), world.serving)
                assert r.code == grpc.StatusCode.PERMISSION_DENIED
                assert r.message == f"endpoint token of API key {prefix} may not use inference task {world.serving}"
            # A task that does not exist reads exactly like a task of another token.
            r2 = await _refusal(checker, md(bobs), "task-does-not-exist")
            assert r2.code == grpc.StatusCode.PERMISSION_DENIED and r2.message == (
                f"endpoint token of API key {world.bob_prefix} may not use inference task task-does-not-exist"
            )
            assert bobs.split(".")[1] not in r.message  # the signature never shows
        finally:
            await checker.close()

    asyncio.run(main())


def test_api_keys_are_refused_and_never_sent_to_the_scheduler(world: World) -> None:
    async def main() -> None:
        checker = AccessChecker(world.sched.target, env={}, ttl=60)
        try:
            for value in (f"Bearer {world.alice}", world.admin, f"Token {world.alice}"):
                with pytest.raises(AccessRefused) as err:
                    await checker.check((("authorization", value),), world.serving)
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
                assert f"opentinker endpoint-token {world.serving}" in err.value.message
                assert "not an API key" in err.value.message and world.alice[13:] not in err.value.message
            assert checker.scheduler_calls == 0
        finally:
            await checker.close()

    asyncio.run(main())


def test_decisions_are_cached_per_token_hash_and_task_for_the_ttl(world: World) -> None:
    now = [0.0]
    alice, admin = world.token(world.alice), world.token(world.admin)
    bobs = world.token(world.bob, world.bob_serving)

    async def main() -> None:
        checker = AccessChecker(world.sched.target, env={}, ttl=10, clock=lambda: now[0])
        try:
            await checker.check(md(alice), world.serving)
            await checker.check(md(alice), world.serving)
            assert checker.scheduler_calls == 1
            for _ in range(2):  # refusals are cached too
                await _refusal(checker, md(bobs), world.serving)
            assert checker.scheduler_calls == 2
            await checker.check(md(alice), world.alice_adapter, world.serving)  # an adapter: its own entry
            assert checker.scheduler_calls == 3
            now[0] = 10.5  # past the TTL: asked again
            await checker.check(md(alice), world.serving)
            assert checker.scheduler_calls == 4
            # Concurrent first requests share one round trip.
            await asyncio.gather(*(checker.check(md(admin), world.serving) for _ in range(20)))
            assert checker.scheduler_calls == 5
            # Only hashes of the authorization value are kept, never the token.
            kept = repr(checker._cache)
            for token in (alice, bobs, admin):
                assert token not in kept and token.split(".")[1] not in kept
            key = (hashlib.sha256(f"Bearer {alice}".encode()).hexdigest(), world.serving, world.serving)
            assert key in checker._cache
        finally:
            await checker.close()

    asyncio.run(main())


def test_an_expired_token_is_refused_also_before_the_cached_decision_ends(world: World) -> None:
    with RLClient(world.sched.target, api_key=world.alice) as c:
        short = c.endpoint_token(world.serving, ttl=5)

    async def main() -> None:
        checker = AccessChecker(world.sched.target, env={}, ttl=600)  # a yes would be kept 10 minutes
        try:
            await checker.check(md(short.token), world.serving)
            while time.time() < short.expire_time:  # the token's own expiry, as the scheduler set it
                await asyncio.sleep(0.05)
            r = await _refusal(checker, md(short.token), world.serving)
            assert r.code == grpc.StatusCode.UNAUTHENTICATED and "expired" in r.message
            assert checker.scheduler_calls == 2
        finally:
            await checker.close()

    asyncio.run(main())


def test_the_tokens_of_a_revoked_key_are_refused_once_the_ttl_has_passed(world: World) -> None:
    with RLClient(world.sched.target, api_key=world.admin) as root:
        info, carol = root.keys.create("alice", "user", description="a second key of alice, revoked below")
    token = world.token(carol)

    async def main() -> None:
        checker = AccessChecker(world.sched.target, env={}, ttl=0.2)
        try:
            await checker.check(md(token), world.serving)
            with RLClient(world.sched.target, api_key=world.admin) as root:
                root.keys.revoke(info.prefix)
            await asyncio.sleep(0.3)
            r = await _refusal(checker, md(token), world.serving)
            assert r.code == grpc.StatusCode.UNAUTHENTICATED and "revoked" in r.message
        finally:
            await checker.close()

    asyncio.run(main())


def test_an_unreachable_scheduler_is_unavailable_and_not_cached() -> None:
    async def main() -> None:
        checker = AccessChecker(f"127.0.0.1:{free_port()}", env={}, ttl=60, timeout=2)
        try:
            for _ in range(2):
                r = await _refusal(checker, md("ote_e30." + "x" * 43), "task-1")
                assert r.code == grpc.StatusCode.UNAVAILABLE and "scheduler" in r.message
            assert checker.scheduler_calls == 2
        finally:
            await checker.close()

    asyncio.run(main())


def test_with_scheduler_auth_off_everyone_passes(tmp_path) -> None:
    sched = LoopbackScheduler(tmp_path / "state")
    try:
        with RLClient(sched.target) as c:
            task = c.submit_task(workload_type="inference", model="/models/m")

        async def main() -> None:
            checker = AccessChecker(sched.target, env={}, ttl=1)
            try:
                await checker.check((), task)
                await checker.check(md("ote_e30." + "x" * 43), task)  # a token is ignored, as on the scheduler
                with RLClient(sched.target, api_key="otk_00000000_" + "x" * 43) as c:
                    assert c.endpoint_token(task).token == ""  # none needed, none issued
            finally:
                await checker.close()

        asyncio.run(main())
    finally:
        sched.close()


def test_the_scheduler_link_uses_the_nodes_tls_settings(tmp_path) -> None:
    certs = make_certs(tmp_path / "certs")
    sched = LoopbackScheduler(
        tmp_path / "state", AUTH_LOCAL_MODELS + f"tls: {{cert: {certs.server_cert}, key: {certs.server_key}}}\n"
    )
    try:
        admin = sched.admin_key
        target = f"localhost:{sched.running.port}"
        with RLClient(target, api_key=admin, root_certificates=certs.ca) as root:
            task = root.submit_task(workload_type="inference", model="/models/m")

            token = root.endpoint_token(task).token

        async def main() -> None:
            good = AccessChecker(env={"OPENTINKER_SCHEDULER_URL": target, "OPENTINKER_TLS_CA": str(certs.ca)}, ttl=1)
            bad = AccessChecker(target, env={"OPENTINKER_TLS_CA": str(certs.other_ca)}, ttl=1, timeout=3)
            try:
                await good.check(md(token), task)
                assert (await _refusal(bad, md(token), task)).code == grpc.StatusCode.UNAVAILABLE
            finally:
                await good.close()
                await bad.close()

        asyncio.run(main())
    finally:
        sched.close()


def test_checker_and_tls_settings_refuse_bad_input(tmp_path) -> None:
    with pytest.raises(ValueError, match="OPENTINKER_SCHEDULER_URL"):
        AccessChecker(env={})
    with pytest.raises(ValueError, match="ttl"):
        AccessChecker("127.0.0.1:1", env={}, ttl=0)
    with pytest.raises(ValueError, match="root_certificates"):
        AccessChecker("127.0.0.1:1", env={"OPENTINKER_TLS_CA": str(tmp_path / "missing.pem")})
    assert (
        credential_of("Bearer ote_eyJrIjoib3RrXzAxMjNhYmNkIn0." + "s" * 43) == "endpoint token of API key otk_0123abcd"
    )
    assert "s" * 10 not in credential_of("Bearer " + "s" * 40)
    certs = make_certs(tmp_path / "certs")
    assert read_server_tls(None, "") is None and server_tls_from_env({}) is None
    cert, key = read_server_tls(certs.server_cert, certs.server_key)
    assert b"CERTIFICATE" in cert and b"PRIVATE KEY" in key
    with pytest.raises(ValueError, match="--serve-tls-cert and --serve-tls-key: expected both"):
        read_server_tls(certs.server_cert, "")
    with pytest.raises(ValueError, match=r"--serve-tls-key: cannot read '.*nope.key'"):
        read_server_tls(certs.server_cert, tmp_path / "nope.key")
    with pytest.raises(ValueError, match="--serve-tls-cert: .* is not a PEM certificate"):
        read_server_tls(certs.server_key, certs.server_key)
    with pytest.raises(ValueError, match="OPENTINKER_SERVE_TLS_KEY: .* is not a PEM private key"):
        server_tls_from_env(
            {"OPENTINKER_SERVE_TLS_CERT": str(certs.server_cert), "OPENTINKER_SERVE_TLS_KEY": str(certs.ca)}
        )


# ------------------------------------------------------------------- a real server, tiny model


class RecordingChecker(AccessChecker):
    """The real checker, keeping every ``authorization`` value the server received."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[str] = []

    async def check(self, metadata, task_id: str, endpoint: str = "") -> None:
        self.seen.append(authorization_value(metadata))
        await super().check(metadata, task_id, endpoint)


class SecureServer:
    """An InferenceService with an access checker (and TLS when given) on a loopback port."""

    def __init__(self, runtime, sched_target: str, task_id: str, *, tls=None, ttl: float = 60) -> None:
        from opentinker_trainer.inference.server import start_inference_server

        self.runtime = runtime
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.access = RecordingChecker(sched_target, env={}, ttl=ttl)
        start = start_inference_server(runtime, host="127.0.0.1", port=0, tls=tls, access=self.access, task_id=task_id)
        self.server = asyncio.run_coroutine_threadsafe(start, self.loop).result(30)
        self.address = f"{'https://localhost' if tls else '127.0.0.1'}:{self.server.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.runtime.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def served(world: World, tiny_model_dir: Path, tmp_path_factory, certs):
    from tests.support.inference import make_adapter, tiny_runtime

    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        world.alice_adapter: make_adapter(tiny_model_dir, root / "alice", seed=1),
        world.bob_adapter: make_adapter(tiny_model_dir, root / "bob", seed=2),
    }
    s = SecureServer(
        tiny_runtime(tiny_model_dir, adapters),
        world.sched.target,
        world.serving,
        tls=read_server_tls(certs.server_cert, certs.server_key),
    )
    yield s
    s.close()


def _client(served: SecureServer, token: str | None, ca) -> InferenceClient:
    return InferenceClient(served.address, api_key=token or "", root_certificates=ca, timeout=30)


def test_the_client_sends_endpoint_tokens_never_its_api_key(world: World, served: SecureServer, certs) -> None:
    served.access.seen.clear()
    with SchedulerConnection(world.sched.target, timeout=30, api_key=world.alice) as scheduler:
        tokens = EndpointTokens(scheduler, world.serving)
        with InferenceClient(served.address, tokens=tokens, root_certificates=certs.ca, timeout=30) as llm:
            llm.generate(PROMPT, adapter=world.alice_adapter, max_tokens=2)
            assert [a.name for a in llm.with_adapter(None).list_adapters()] == [world.alice_adapter]
    assert served.access.seen and all(v.startswith("Bearer ote_") for v in served.access.seen)
    assert not any(world.alice in v for v in served.access.seen)
    # Given the API key itself, the server refuses it and says how to get a token.
    with _client(served, world.alice, certs.ca) as direct:
        with pytest.raises(UnauthenticatedError, match=f"opentinker endpoint-token {world.serving}"):
            direct.generate(PROMPT, max_tokens=2)


def test_a_client_given_the_scheduler_gets_tokens_there_and_sends_only_those(tmp_path, tiny_model_dir: Path) -> None:
    from tests.support.inference import tiny_runtime

    def running(core, owner: str):  # on the scheduler's loop: a CPU inference task of owner, assigned
        node, _ = core.node_register(N.Register(node_id="n1", max_tasks=4))
        spec = C.TaskSpec(workload_type="inference", model="/models/m", resources=C.Resources(gpu_count=0))
        task = core.api.submit(spec, owner=owner)
        core.schedule()
        return node, task.task_id

    with LoopbackScheduler(tmp_path / "state", AUTH_LOCAL_MODELS) as sched:
        with RLClient(sched.target, api_key=sched.admin_key) as root:
            _, alice = root.keys.create("alice", "user")
        node, task = sched.do(running, sched.core, "alice")
        server = SecureServer(tiny_runtime(tiny_model_dir), sched.target, task)
        try:
            report = N.TaskReport(task_id=task, attempt=1, state=C.TASK_STATE_RUNNING, endpoint=server.address)
            sched.do(sched.core.node_report, node, report)
            with InferenceClient(scheduler_url=sched.target, task_id=task, api_key=alice, timeout=30) as llm:
                llm.generate(PROMPT, max_tokens=2)
                assert llm.endpoint == server.address
            assert server.access.seen and all(v.startswith("Bearer ote_") for v in server.access.seen)
            assert not any(alice in v for v in server.access.seen)
        finally:
            server.close()


def test_owner_and_admin_are_served_others_are_refused(world: World, served: SecureServer, certs) -> None:
    with _client(served, world.token(world.alice), certs.ca) as alice:
        assert alice.tls and alice.target == f"localhost:{served.server.port}"
        base = alice.generate(PROMPT, adapter=None, temperature=0, max_tokens=4, ignore_eos=True)
        own = alice.generate(PROMPT, adapter=world.alice_adapter, temperature=0, max_tokens=4, ignore_eos=True)
        assert own.adapter == world.alice_adapter and len(own.samples[0].token_ids) == 4 and base.adapter is None
        streamed = [
            t
            for c in alice.generate_stream(
                PROMPT, adapter=world.alice_adapter, temperature=0, max_tokens=4, ignore_eos=True
            )
            for t in c.token_ids
        ]
        assert tuple(streamed) == own.samples[0].token_ids
    with _client(served, world.token(world.admin), certs.ca) as admin:
        assert (
            admin.generate(PROMPT, adapter=world.alice_adapter, temperature=0, max_tokens=4, ignore_eos=True).samples
            == own.samples
        )
    bobs = world.token(world.bob, world.bob_serving)
    for key, error, text in (
        (None, UnauthenticatedError, "missing endpoint token"),
        ("ote_e30." + "x" * 43, UnauthenticatedError, "malformed endpoint token"),
        (bobs, PermissionDeniedError, f"API key {world.bob_prefix} may not use inference task {world.serving}"),
        (world.alice, UnauthenticatedError, "not an API key"),
    ):
        with _client(served, key, certs.ca) as other:
            for call in (
                lambda: other.generate(PROMPT, max_tokens=2),
                lambda: list(other.generate_stream(PROMPT, max_tokens=2)),
                other.list_adapters,
            ):
                with pytest.raises(error) as err:
                    call()
                assert text in err.value.details
    # Bad input of a refused caller is refused for the key first (nothing about the request leaks).
    with _client(served, bobs, certs.ca) as bob:
        with pytest.raises(PermissionDeniedError):
            bob.generate(PROMPT, temperature=-1.0, max_tokens=2)


def test_another_owners_adapter_reads_exactly_like_one_that_does_not_exist(
    world: World, served: SecureServer, certs
) -> None:
    missing = "task-" + "0" * 12
    alice_token, admin_token = world.token(world.alice), world.token(world.admin)
    with _client(served, alice_token, certs.ca) as alice:
        with pytest.raises(NotFoundError) as theirs:
            alice.generate(PROMPT, adapter=world.bob_adapter, max_tokens=2)
        with pytest.raises(NotFoundError) as nothing:
            alice.generate(PROMPT, adapter=missing, max_tokens=2)
        with pytest.raises(NotFoundError) as streamed:
            list(alice.generate_stream(PROMPT, adapter=world.bob_adapter, max_tokens=2))
        with pytest.raises(NotFoundError) as versioned:  # a version of it (<task id>@<step>): checked as its task
            alice.generate(PROMPT, adapter=f"{world.bob_adapter}@3", max_tokens=2)
    assert theirs.value.details.replace(world.bob_adapter, "X") == nothing.value.details.replace(missing, "X")
    assert versioned.value.details.replace(f"{world.bob_adapter}@3", "X") == theirs.value.details.replace(
        world.bob_adapter, "X"
    )
    assert streamed.value.details == theirs.value.details
    assert "no task with that id" in theirs.value.details
    # An admin may serve bob's adapter; alice's listing still does not show it, the admin's does.
    with _client(served, admin_token, certs.ca) as admin:
        admin.generate(PROMPT, adapter=world.bob_adapter, max_tokens=2)
        admin.generate(PROMPT, adapter=world.alice_adapter, max_tokens=2)
        assert {a.name for a in admin.list_adapters()} == {world.alice_adapter, world.bob_adapter}
    with _client(served, alice_token, certs.ca) as alice:
        assert [a.name for a in alice.list_adapters()] == [world.alice_adapter]


def test_tls_needs_the_right_ca_and_health_stays_open(world: World, served: SecureServer, certs) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    token = world.token(world.alice)
    with _client(served, token, certs.other_ca) as wrong_ca:
        with pytest.raises(UnavailableError):
            wrong_ca.generate(PROMPT, max_tokens=2)
    plain_endpoint = f"127.0.0.1:{served.server.port}"
    with InferenceClient(plain_endpoint, api_key=token, timeout=5) as plain:
        assert not plain.tls
        with pytest.raises(UnavailableError):
            plain.generate(PROMPT, max_tokens=2)
    creds = grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())
    with grpc.secure_channel(f"localhost:{served.server.port}", creds) as ch:  # no key: health is public
        status = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="opentinker.inference.v1.InferenceService"), timeout=10
        )
        assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_revoking_the_key_reaches_its_tokens_on_a_serving_node_within_the_ttl(
    world: World, tiny_model_dir: Path
) -> None:
    from tests.support.inference import tiny_runtime

    with RLClient(world.sched.target, api_key=world.admin) as root:
        info, key = root.keys.create("alice", "user", description="revoked while serving")
    s = SecureServer(tiny_runtime(tiny_model_dir), world.sched.target, world.serving, ttl=0.2)
    try:
        with InferenceClient(s.address, api_key=world.token(key), timeout=30) as llm:
            llm.generate(PROMPT, max_tokens=2)
            with RLClient(world.sched.target, api_key=world.admin) as root:
                root.keys.revoke(info.prefix)
            time.sleep(0.3)
            with pytest.raises(UnauthenticatedError, match="revoked"):
                llm.generate(PROMPT, max_tokens=2)
    finally:
        s.close()


def test_the_trainer_checks_its_serve_tls_files_at_start(tmp_path, certs, capsys, monkeypatch) -> None:
    from opentinker_trainer.__main__ import main

    monkeypatch.delenv("OPENTINKER_SERVE_TLS_CERT", raising=False)
    monkeypatch.delenv("OPENTINKER_SERVE_TLS_KEY", raising=False)
    for argv, text in (
        (["--serve-tls-cert", str(certs.server_cert)], "--serve-tls-cert and --serve-tls-key: expected both"),
        (
            ["--serve-tls-cert", str(certs.server_cert), "--serve-tls-key", str(tmp_path / "gone.key")],
            "--serve-tls-key: cannot read",
        ),
        (
            ["--serve-tls-cert", str(certs.server_key), "--serve-tls-key", str(certs.server_key)],
            "is not a PEM certificate",
        ),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["--scheduler-url", "127.0.0.1:1", *argv])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert text in err and "Traceback" not in err
    monkeypatch.setenv("OPENTINKER_SERVE_TLS_CERT", str(certs.server_cert))  # the environment is checked the same way
    with pytest.raises(SystemExit):
        main(["--scheduler-url", "127.0.0.1:1"])
    assert "expected both" in capsys.readouterr().err


def test_workers_get_the_serve_tls_files_through_the_worker_env() -> None:
    from opentinker_trainer.scheduler_link import worker_env

    env = worker_env("127.0.0.1:1", serve_tls_cert="/pki/serve.pem", serve_tls_key="/pki/serve.key")
    assert env == {
        "OPENTINKER_SCHEDULER_URL": "127.0.0.1:1",
        "OPENTINKER_SERVE_TLS_CERT": "/pki/serve.pem",
        "OPENTINKER_SERVE_TLS_KEY": "/pki/serve.key",
    }
    assert "OPENTINKER_SERVE_TLS_CERT" not in worker_env("127.0.0.1:1")


def _cli_token(world: World, key: str, task_id: str, *ttl: str) -> str:
    """What ``opentinker endpoint-token TASK`` prints, run as a process with ``key``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENTINKER_", "SCHEDULER_URL"))}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "opentinker_client",
            "--scheduler-url",
            world.sched.target,
            "endpoint-token",
            task_id,
            *ttl,
        ],
        capture_output=True,
        text=True,
        env={**env, "OPENTINKER_API_KEY": key},
        timeout=120,
    )
    assert r.returncode == 0 and r.stderr.startswith("expires "), r.stderr
    return r.stdout.strip()


def test_the_openai_endpoint_takes_a_token_from_the_cli_over_tls(world: World, served: SecureServer, certs) -> None:
    openai = pytest.importorskip("openai")
    from opentinker_trainer.inference.openai_http import base_model_id, start_openai_server

    tls = read_server_tls(certs.server_cert, certs.server_key)
    start = start_openai_server(
        served.runtime, host="127.0.0.1", port=0, tls=tls, access=served.access, task_id=world.serving
    )
    http = asyncio.run_coroutine_threadsafe(start, served.loop).result(30)
    url = f"https://localhost:{http.port}/v1"

    def client(key: str) -> "openai.OpenAI":
        return openai.OpenAI(
            base_url=url, api_key=key, max_retries=0, http_client=openai.DefaultHttpxClient(verify=str(certs.ca))
        )

    messages = [{"role": "user", "content": "Hi"}]
    alice_token = _cli_token(world, world.alice, world.serving, "--ttl", "10m")
    assert alice_token.startswith("ote_") and world.alice not in alice_token
    try:
        with client(alice_token) as alice:
            chunks = list(
                alice.chat.completions.create(
                    model=world.alice_adapter, messages=messages, temperature=0, max_tokens=3, stream=True
                )
            )
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
            base = base_model_id(served.runtime.model_name)
            assert [m.id for m in alice.models.list().data] == [base, world.alice_adapter]
            with pytest.raises(openai.NotFoundError, match="no task with that id"):
                alice.chat.completions.create(model=world.bob_adapter, messages=messages, max_tokens=2)
        with client(_cli_token(world, world.bob, world.bob_serving)) as bob:
            with pytest.raises(openai.PermissionDeniedError, match=f"may not use inference task {world.serving}"):
                bob.completions.create(model=served.runtime.model_name, prompt=PROMPT, max_tokens=2)
        with client("ote_e30." + "x" * 43) as stranger:
            with pytest.raises(openai.AuthenticationError, match="malformed endpoint token"):
                stranger.models.list()
        with client(world.alice) as with_the_key:  # the API key itself: refused, with how to get a token
            with pytest.raises(openai.AuthenticationError, match=f"opentinker endpoint-token {world.serving}"):
                with_the_key.models.list()
        with openai.OpenAI(base_url=url, api_key=alice_token, max_retries=0) as untrusting:  # system roots only
            with pytest.raises(openai.APIConnectionError):
                untrusting.models.list()
    finally:
        asyncio.run_coroutine_threadsafe(http.stop(), served.loop).result(30)
