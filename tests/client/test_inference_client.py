"""InferenceClient and evaluate(): local validation, typed errors, the evaluation arithmetic.
(The client against a real server: tests/trainer/test_inference_*.py and tests/integration.)"""

from __future__ import annotations

import pytest

from opentinker_client import InferenceClient, InvalidArgumentError, UnavailableError, evaluate
from opentinker_client.inference import Generation, Sample


class _Answers:
    """Stands in for an InferenceClient: answers each arithmetic question right or with 0."""

    adapter = "task-x"

    def __init__(self, right: bool) -> None:
        self.right = right
        self.calls: list[dict] = []

    def generate(self, *, messages, **kw) -> Generation:
        self.calls.append({"messages": messages, **kw})
        q = messages[-1]["content"]  # "What is a + b? Answer with just the number."
        a, b = q.split("What is ")[1].split("?")[0].split(" + ")
        text = f"The answer is {int(a) + int(b)}." if self.right else "0"
        return Generation((Sample(0, text, (), (), "stop"),), 1, 1, "m", kw.get("adapter", self.adapter))


def test_evaluate_scores_with_the_environment_reward_and_same_problems_each_time() -> None:
    good, bad = _Answers(True), _Answers(False)
    r = evaluate(good, episodes=10)
    assert r.mean_reward == 1.0 and r.stderr == 0.0 and r.episodes == 10 and r.adapter == "task-x"
    r0 = evaluate(bad, episodes=10, adapter=None)
    assert r0.adapter is None and r0.mean_reward == pytest.approx(
        sum(p.startswith("What is 0 + 0") for p in r0.prompts) / 10
    )
    assert r.prompts == r0.prompts  # the same problems for every model
    assert good.calls[0]["temperature"] == 0.0 and "adapter" not in good.calls[0]
    assert bad.calls[0]["adapter"] is None
    sys_prompt = evaluate(good, env={"env_id": "arithmetic", "system_prompt": "Be brief.", "max_digits": 2}, episodes=2)
    assert sys_prompt.mean_reward == 1.0 and good.calls[-1]["messages"][0] == {"role": "system", "content": "Be brief."}


def test_evaluate_refuses_bad_arguments_with_the_field() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        evaluate(_Answers(True), episodes=0)
    assert err.value.field == "episodes"
    with pytest.raises(InvalidArgumentError) as err:
        evaluate(_Answers(True), env="CartPole-v1")
    assert err.value.field == "env.env_id"
    with pytest.raises(InvalidArgumentError, match=r"env.max_digits"):
        evaluate(_Answers(True), env={"env_id": "arithmetic", "max_digits": 99})


def test_inference_client_checks_its_arguments_before_calling() -> None:
    with pytest.raises(InvalidArgumentError, match="endpoint"):
        InferenceClient()
    client = InferenceClient("127.0.0.1:1", timeout=2)
    with pytest.raises(InvalidArgumentError, match="exactly one of prompt"):
        client.generate()
    with pytest.raises(InvalidArgumentError, match="exactly one of prompt"):
        client.generate("x", messages=[{"role": "user", "content": "y"}])
    with pytest.raises(InvalidArgumentError, match=r"messages\[0\]"):
        client.generate(messages=["not a mapping"])
    with pytest.raises(UnavailableError):
        client.generate("hello", max_tokens=1)
    with pytest.raises(UnavailableError):
        list(client.generate_stream("hello", max_tokens=1))
    assert client.with_adapter("task-y").adapter == "task-y"
    client.close()


# ------------------------------------------------------------------ endpoints, API key and TLS

from opentinker_client.inference import parse_endpoint  # noqa: E402

from tests.support.inference_double import serve_recording_inference  # noqa: E402


def test_endpoints_say_whether_to_use_tls_and_bad_ones_name_the_argument() -> None:
    assert parse_endpoint("127.0.0.1:9000") == ("127.0.0.1:9000", False)
    assert parse_endpoint("http://node-7:9000") == ("node-7:9000", False)
    assert parse_endpoint("grpc://node-7:9000") == ("node-7:9000", False)
    assert parse_endpoint("https://Node-7:9000") == ("node-7:9000", True)
    assert parse_endpoint("grpcs://[::1]:9000") == ("[::1]:9000", True)
    for bad, why in (
        ("node-7", "the port is missing"),
        ("ftp://node-7:1", "unknown scheme 'ftp://'"),
        ("https://h:1/v1", "a path"),
        ("h:70000", "out of range"),
    ):
        with pytest.raises(ValueError, match=rf"^endpoint: bad inference endpoint .*{why}"):
            parse_endpoint(bad)
        with pytest.raises(ValueError, match=r"^endpoint: "):
            InferenceClient(bad)


def test_an_unreadable_ca_is_a_value_error_naming_root_certificates(tmp_path, monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"^root_certificates: cannot read .*missing\.pem"):
        InferenceClient("https://localhost:1", root_certificates=tmp_path / "missing.pem")
    (tmp_path / "junk.pem").write_text("not pem")
    monkeypatch.setenv("OPENTINKER_TLS_CA", str(tmp_path / "junk.pem"))
    with pytest.raises(ValueError, match=r"^root_certificates: .*junk\.pem' is not a PEM file"):
        InferenceClient("https://localhost:1")
    InferenceClient("localhost:1").close()  # a plaintext endpoint reads no CA


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    from tests.support.security import make_certs

    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def recording(certs):
    with serve_recording_inference(certs) as served:
        yield served


def test_the_api_key_is_sent_as_a_bearer_token_from_the_argument_or_the_environment(recording, monkeypatch) -> None:
    servicer, plain, _ = recording
    monkeypatch.setenv("OPENTINKER_API_KEY", "otk_0000aaaa_from-env")
    with InferenceClient(f"127.0.0.1:{plain}") as c:
        c.list_adapters()
        c.with_adapter("task-1").list_adapters()  # another client on the same server keeps the key
    with InferenceClient(f"http://127.0.0.1:{plain}", api_key="otk_0000bbbb_given") as c:
        c.list_adapters()
        assert "otk_0000bbbb" not in repr(c)
    with InferenceClient(f"127.0.0.1:{plain}", api_key="") as c:
        c.list_adapters()
    assert servicer.seen == [
        "Bearer otk_0000aaaa_from-env",
        "Bearer otk_0000aaaa_from-env",
        "Bearer otk_0000bbbb_given",
        None,
    ]


def test_https_endpoints_use_tls_with_the_given_or_environment_ca(recording, certs, monkeypatch) -> None:
    servicer, plain, secure = recording
    with InferenceClient(f"https://localhost:{secure}", api_key="k", root_certificates=certs.ca) as c:
        c.list_adapters()
        c.with_adapter("task-1").list_adapters()  # keeps the CA
    monkeypatch.setenv("OPENTINKER_TLS_CA", str(certs.ca))
    with InferenceClient(f"grpcs://localhost:{secure}", api_key="k") as c:
        c.list_adapters()
    assert servicer.seen == ["Bearer k"] * 3
    with InferenceClient(f"https://localhost:{secure}", root_certificates=certs.other_ca, timeout=5) as c:
        with pytest.raises(UnavailableError):
            c.list_adapters()
    with InferenceClient(f"localhost:{secure}", timeout=5) as c:  # plaintext to a TLS port
        with pytest.raises(UnavailableError):
            c.list_adapters()
    with InferenceClient(f"https://localhost:{plain}", timeout=5) as c:  # TLS to a plaintext port
        with pytest.raises(UnavailableError):
            c.list_adapters()
    assert len(servicer.seen) == 3


def test_evaluate_refuses_episode_counts_outside_1_to_10000() -> None:
    from opentinker_client.evaluate import MAX_EPISODES, evaluate

    for bad in (0, -5, MAX_EPISODES + 1, 99_999_999_999):
        with pytest.raises(InvalidArgumentError, match=r"episodes: expected an integer in \[1, 10000\]"):
            evaluate(object(), episodes=bad)


def test_a_keyword_that_is_no_sampling_setting_is_a_type_error_at_the_call() -> None:
    client = InferenceClient("127.0.0.1:1", timeout=2)
    with pytest.raises(
        TypeError, match=r"^InferenceClient.generate\(\) got an unexpected keyword argument 'temprature'"
    ):
        client.generate("x", temprature=0)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"generate_stream\(\) got an unexpected keyword argument 'maxtokens'"):
        client.generate_stream("x", maxtokens=3)  # type: ignore[call-arg]  # at once, before any next()
    stream = client.generate_stream()  # a bad prompt is still found on the first next()
    with pytest.raises(InvalidArgumentError, match="exactly one of prompt"):
        next(stream)
    client.close()
