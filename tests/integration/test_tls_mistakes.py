"""TLS and API-key mistakes a user makes, and the errors they get: real schedulers on
loopback, certificates made with ``cryptography``, the CLI in-process and as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N
from opentinker_client import InferenceClient, RLClient, UnavailableError
from opentinker_client.cli.commands import main as cli_main
from opentinker_client.errors import INFERENCE_PLAINTEXT_HINT, SCHEDULER_PLAINTEXT_HINT, closed_by_peer
from opentinker_common.net.bearer import authorization_problem, clean_api_key
from opentinker_common.net.tls import channel_credentials

from tests.support.inference_double import serve_recording_inference
from tests.support.security import LoopbackScheduler, make_certs

AUTH = "auth: {enabled: true}\n"
TLS = "tls: {cert: certs/server.pem, key: certs/server.key}\n"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("tls") / "certs")


@pytest.fixture(scope="module")
def tls_sched(certs):
    """A scheduler with TLS (server certificate only) and API keys on."""
    base = certs.ca.parent.parent
    s = LoopbackScheduler(base / "state", AUTH + TLS, base_dir=base)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in (
        "OPENTINKER_API_KEY",
        "OPENTINKER_TLS_CA",
        "OPENTINKER_TLS_CERT",
        "OPENTINKER_TLS_KEY",
        "SCHEDULER_URL",
    ):
        monkeypatch.delenv(var, raising=False)


def _admin_key(s: LoopbackScheduler) -> str:
    return (s.config.state_dir / "admin.key").read_text().strip()


# ---------------------------------------------------------------------- a private key as the CA


def test_a_private_key_or_a_non_certificate_given_as_the_ca_is_refused_naming_the_argument(
    certs, tmp_path, capsys
) -> None:
    with pytest.raises(
        ValueError, match=r"^root_certificates: '.*server\.key' holds a private key, not a CA certificate$"
    ):
        channel_credentials(certs.server_key)
    with pytest.raises(ValueError, match=r"^root_certificates: .* holds a private key"):
        RLClient("https://localhost:1", root_certificates=certs.node_key)
    with pytest.raises(ValueError, match=r"^root_certificates: .* holds a private key"):
        InferenceClient("https://localhost:1", root_certificates=certs.node_key)
    bundle = tmp_path / "bundle.pem"  # a certificate and its key in one file: still a key
    bundle.write_bytes(certs.server_cert.read_bytes() + certs.server_key.read_bytes())
    with pytest.raises(ValueError, match="holds a private key"):
        channel_credentials(bundle)
    other = tmp_path / "params.pem"  # PEM, but no certificate in it
    other.write_text("-----BEGIN EC PARAMETERS-----\nBggqhkjOPQMBBw==\n-----END EC PARAMETERS-----\n")
    with pytest.raises(
        ValueError, match=r"^root_certificates: .*params\.pem' holds no -----BEGIN CERTIFICATE----- block"
    ):
        channel_credentials(other)
    # The mTLS pair the wrong way round.
    with pytest.raises(ValueError, match=r"^client_cert: .* holds no -----BEGIN CERTIFICATE----- block"):
        channel_credentials(certs.ca, certs.node_key, certs.node_key)
    with pytest.raises(ValueError, match=r"^client_key: .* holds no PRIVATE KEY block"):
        channel_credentials(certs.ca, certs.node_cert, certs.node_cert)
    assert channel_credentials(certs.ca, certs.node_cert, certs.node_key) is not None  # the right files still work
    # The CLI: exit 2, one line naming the argument.
    assert cli_main(["--scheduler-url", "https://localhost:1", "--tls-ca", str(certs.server_key), "list"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and err.startswith("error: root_certificates:")
        and "holds a private key, not a CA certificate" in err
    )


# --------------------------------------------------------------- whitespace around an API key


def test_surrounding_whitespace_of_an_api_key_is_stripped_and_inner_whitespace_is_a_value_error(
    tls_sched, certs, monkeypatch, capsys
) -> None:
    admin = _admin_key(tls_sched)
    file_text = (tls_sched.config.state_dir / "admin.key").read_text()
    assert file_text != file_text.strip()  # the key file ends in a newline, as files do
    with RLClient(tls_sched.target, api_key=file_text, root_certificates=certs.ca) as c:
        assert c.list_tasks() == []  # not INTERNAL: Invalid metadata
        _, user_key = c.keys.create("carol", "user")
    monkeypatch.setenv("OPENTINKER_API_KEY", f"  {user_key}\r\n")
    with RLClient(tls_sched.target, root_certificates=certs.ca) as c:
        assert c.list_tasks() == []
    # The CLI: from the environment and from --api-key "$(cat key)"-style values.
    assert cli_main(["--scheduler-url", tls_sched.target, "--tls-ca", str(certs.ca), "list"]) == 0
    monkeypatch.delenv("OPENTINKER_API_KEY")
    assert (
        cli_main(["--scheduler-url", tls_sched.target, "--tls-ca", str(certs.ca), "--api-key", admin + "\n", "list"])
        == 0
    )
    capsys.readouterr()
    # Inner whitespace or control characters: a ValueError naming the argument, never the key.
    secret = admin.split("_", 2)[2]
    for bad in (
        admin[:20] + " " + admin[20:],
        admin[:20] + "\x00" + admin[20:],
        admin + "\nsecond line",
        admin[:10] + "é" + admin[10:],
    ):
        for make in (
            lambda: RLClient(tls_sched.target, api_key=bad, root_certificates=certs.ca),
            lambda: InferenceClient("127.0.0.1:1", api_key=bad),
        ):
            with pytest.raises(ValueError) as err:
                make()
            assert str(err.value).startswith("api_key: expected an API key of printable ASCII characters")
            assert secret[:8] not in str(err.value) and "not shown" in str(err.value)
    assert (
        cli_main(
            ["--scheduler-url", tls_sched.target, "--tls-ca", str(certs.ca), "--api-key", admin[:20] + " x", "list"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("error: --api-key: expected an API key") and err.count("\n") == 1 and secret[:8] not in err
    monkeypatch.setenv("OPENTINKER_API_KEY", "otk_a\tb")
    assert cli_main(["--scheduler-url", tls_sched.target, "--tls-ca", str(certs.ca), "list"]) == 2
    assert capsys.readouterr().err.startswith("error: $OPENTINKER_API_KEY: expected an API key")
    assert clean_api_key(None) == "" and clean_api_key(" \n") == ""  # blank: no key is sent


@pytest.fixture(scope="module")
def inference_double(certs):
    """(servicer, plaintext port, TLS port)."""
    with serve_recording_inference(certs) as served:
        yield served


def test_inference_client_strips_the_key_too(inference_double, monkeypatch) -> None:
    servicer, plain, _ = inference_double
    servicer.seen.clear()
    with InferenceClient(f"127.0.0.1:{plain}", api_key="otk_0000aaaa_x\n") as c:
        c.list_adapters()
    monkeypatch.setenv("OPENTINKER_API_KEY", " otk_0000bbbb_y \n")
    with InferenceClient(f"127.0.0.1:{plain}") as c:
        c.list_adapters()
    assert servicer.seen == ["Bearer otk_0000aaaa_x", "Bearer otk_0000bbbb_y"]


# ---------------------------------------------------------- plaintext against a TLS endpoint


def test_plaintext_against_a_tls_scheduler_says_it_may_serve_tls(tls_sched, certs) -> None:
    with RLClient(tls_sched.target, api_key=_admin_key(tls_sched), timeout=20) as c:
        with pytest.raises(UnavailableError) as err:
            c.list_tasks()
    assert "Socket closed" in err.value.details and err.value.details.endswith(SCHEDULER_PLAINTEXT_HINT)
    assert (
        "https://host:port" in SCHEDULER_PLAINTEXT_HINT and "--tls-ca / $OPENTINKER_TLS_CA" in SCHEDULER_PLAINTEXT_HINT
    )
    # Over TLS (here with the wrong CA) the hint would mislead: it is not given.
    with RLClient(tls_sched.target, root_certificates=certs.other_ca, timeout=20) as c:
        with pytest.raises(UnavailableError) as err:
            c.list_tasks()
    assert SCHEDULER_PLAINTEXT_HINT not in err.value.details and "CERTIFICATE_VERIFY_FAILED" in err.value.raw_details
    assert "its certificate is not signed by the CA given (--tls-ca / $OPENTINKER_TLS_CA)" in err.value.details
    # A scheduler that is simply not there is not "closed by the peer": no hint either.
    with RLClient("127.0.0.1:1", timeout=20) as c:
        with pytest.raises(UnavailableError) as err:
            c.list_tasks()
    assert SCHEDULER_PLAINTEXT_HINT not in err.value.details


def test_plaintext_against_a_tls_inference_server_says_it_may_serve_tls(inference_double, certs) -> None:
    _, plain, secure = inference_double
    with InferenceClient(f"127.0.0.1:{secure}", timeout=20) as c:
        with pytest.raises(UnavailableError) as err:
            c.list_adapters()
    assert closed_by_peer(err.value.details) and err.value.details.endswith(INFERENCE_PLAINTEXT_HINT)
    with InferenceClient(f"https://localhost:{plain}", root_certificates=certs.ca, timeout=20) as c:  # TLS to plaintext
        with pytest.raises(UnavailableError) as err:
            c.list_adapters()
    assert INFERENCE_PLAINTEXT_HINT not in err.value.details


# ------------------------------------------------ serve makes one real call before it answers


def _served_adapter_world(s: LoopbackScheduler, endpoint: str) -> str:
    """On the scheduler's loop: a finished lora_finetune task with a checkpoint, and a RUNNING
    inference task for the same model that reports ``endpoint``. Returns the lora task's id."""
    core = s.core
    node, _ = core.node_register(N.Register(node_id="n1", max_tasks=4))
    spec = C.TaskSpec(workload_type="lora_finetune", model="/models/m", resources=C.Resources(gpu_count=0))
    trained = core.api.submit(spec, owner="anonymous")
    core.schedule()
    core.node_report(node, N.TaskReport(task_id=trained.task_id, attempt=1, state=C.TASK_STATE_RUNNING))
    ck = C.Checkpoint(step=1, path="/ck/step_1", format="peft_lora", final=True)
    core.node_report(
        node, N.TaskReport(task_id=trained.task_id, attempt=1, state=C.TASK_STATE_SUCCEEDED, checkpoint=ck)
    )
    serving = core.api.submit(
        C.TaskSpec(workload_type="inference", model="/models/m", resources=C.Resources(gpu_count=0)), owner="anonymous"
    )
    core.schedule()
    core.node_report(
        node, N.TaskReport(task_id=serving.task_id, attempt=1, state=C.TASK_STATE_RUNNING, endpoint=endpoint)
    )
    return trained.task_id


def test_serve_fails_at_once_with_a_wrong_inference_ca_in_the_library_and_the_cli(
    tmp_path, inference_double, certs, capsys
) -> None:
    servicer, _, secure = inference_double
    s = LoopbackScheduler(tmp_path / "state")
    try:
        trained = s.do(_served_adapter_world, s, f"https://localhost:{secure}")
        with RLClient(s.target, min_poll_interval=0) as c:
            servicer.seen.clear()
            servicer.calls.clear()
            with c.serve(trained, root_certificates=certs.ca) as llm:
                assert llm.tls and llm.adapter == trained
            assert servicer.calls == ["Generate"]  # serve made one real call, which loads the adapter
            with pytest.raises(UnavailableError, match="CERTIFICATE_VERIFY_FAILED"):
                c.serve(trained, root_certificates=certs.other_ca)
        capsys.readouterr()
        assert cli_main(["--scheduler-url", s.target, "serve", trained, "--inference-ca", str(certs.other_ca)]) == 2
        out, err = capsys.readouterr()
        assert (
            "served by" not in out
            and err.startswith("error: ")
            and err.rstrip().endswith("[UNAVAILABLE]")
            and err.count("\n") == 1
        )
        assert cli_main(["--scheduler-url", s.target, "serve", trained, "--inference-ca", str(certs.ca)]) == 0
        assert "served by inference task" in capsys.readouterr().out
    finally:
        s.close()


# ---------------------------------------------------- no gRPC log lines on the CLI's stderr


def test_the_cli_prints_one_error_line_without_grpc_log_lines(tls_sched, certs) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRPC_", "OPENTINKER_", "SCHEDULER_URL"))}
    cli = [str(Path(sys.executable).with_name("opentinker"))]
    if not Path(cli[0]).exists():  # pragma: no cover - an installation without console scripts
        cli = [sys.executable, "-m", "opentinker_client"]
    for argv in (
        ["--scheduler-url", tls_sched.target, "list"],  # plaintext to TLS: Socket closed
        ["--scheduler-url", f"https://{tls_sched.target}", "list"],  # TLS without the CA: handshake failed
    ):
        r = subprocess.run(
            [*cli, "--timeout", "20", *argv], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
        )
        assert r.returncode == 2
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith("[UNAVAILABLE]"), r.stderr
        assert "Handshake failed" not in r.stderr
    assert lines[0].count("--tls-ca CA.pem") == 1  # the fix, said once
    r = subprocess.run(
        [sys.executable, "-m", "opentinker_client", "--scheduler-url", tls_sched.target, "--timeout", "20", "list"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.splitlines() == [r.stderr.strip()] and SCHEDULER_PLAINTEXT_HINT in r.stderr


def test_https_mistakes_get_one_line_naming_the_fix(tls_sched, certs, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRPC_", "OPENTINKER_", "SCHEDULER_URL"))}

    def cli(*argv: str) -> str:
        r = subprocess.run(
            [sys.executable, "-m", "opentinker_client", "--timeout", "20", *argv, "list"],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=120,
        )
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
        assert "SSL_ERROR" not in r.stderr and "failed to connect to all addresses" not in r.stderr, r.stderr
        return r.stderr.strip()

    target = tls_sched.target
    where = f"error: cannot talk TLS to the scheduler at {target}: "
    # https:// to a TLS scheduler whose CA the client was not given (a private CA).
    assert cli("--scheduler-url", f"https://{target}") == (
        f"{where}its certificate is not signed by a CA this client trusts (unable to get local issuer certificate); "
        "pass the CA that signed the scheduler's certificate: --tls-ca CA.pem or $OPENTINKER_TLS_CA "
        "(RLClient(root_certificates=...)) [UNAVAILABLE]"
    )
    # The wrong CA given.
    assert cli("--scheduler-url", f"https://{target}", "--tls-ca", str(certs.other_ca)).startswith(
        f"{where}its certificate is not signed by the CA given (--tls-ca / $OPENTINKER_TLS_CA)"
    )
    # https:// to a scheduler that serves plaintext; and one whose certificate names another host
    # (the node's certificate: CN node-a, no 127.0.0.1).
    base = certs.ca.parent.parent
    plain = LoopbackScheduler(tmp_path / "plain", "")
    named = LoopbackScheduler(tmp_path / "named", "tls: {cert: certs/node.pem, key: certs/node.key}\n", base_dir=base)
    try:
        assert cli("--scheduler-url", f"https://{named.target}", "--tls-ca", str(certs.ca)).startswith(
            f"error: cannot talk TLS to the scheduler at {named.target}: its certificate does not name '127.0.0.1'"
        )
        assert cli("--scheduler-url", f"https://{plain.target}") == (
            f"error: cannot talk TLS to the scheduler at {plain.target}: it answered without TLS (the scheduler serves "
            f"plaintext when its config has no tls:); use http://{plain.target} (or {plain.target}), or turn tls: on "
            "in the scheduler's config [UNAVAILABLE]"
        )
    finally:
        plain.close()
        named.close()


def test_library_users_keep_grpcs_own_verbosity() -> None:
    code = "import os, opentinker_client; print(os.environ.get('GRPC_VERBOSITY', '<unset>'))"
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    ).stdout.strip()
    assert out == "<unset>"
    env["GRPC_VERBOSITY"] = "DEBUG"  # and a user's own choice wins in the CLI too
    code = (
        "import sys; sys.argv[0] = '/x/bin/opentinker'; "
        "import os, opentinker_client; print(os.environ['GRPC_VERBOSITY'])"
    )
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
        ).stdout.strip()
        == "DEBUG"
    )


def test_authorization_problem_names_known_schemes_only() -> None:
    md = lambda v: (("authorization", v),)  # noqa: E731
    assert authorization_problem(()) is None and authorization_problem(md("Bearer otk_x")) is None
    assert (
        authorization_problem(md("Basic dXNlcjpwYXNz"))
        == "malformed authorization metadata: expected 'Bearer otk_...', got a 'Basic' value"
    )
    assert authorization_problem(md("otk_0123abcd_secretsecret")).endswith(
        "got a bare key without the 'Bearer ' scheme"
    )
    assert authorization_problem(md("Bearer")).endswith("got a 'Bearer' value without a key")
    assert authorization_problem(md("hunter2 more")).endswith("got a value without a known scheme")  # never echoed
    assert authorization_problem(md("x"), expected="Bearer <token>").startswith(
        "malformed authorization metadata: expected 'Bearer <token>'"
    )
