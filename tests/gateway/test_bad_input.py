"""Bad input to the Tinker API gets a Tinker-shaped refusal (category ``user``, the field named,
the right HTTP status) and harms nobody: the model trains on afterwards. Authentication is on:
another owner's model is not found, and a key without the ``tml-`` form is refused."""

from __future__ import annotations

import httpx
import pytest
import zstandard
from tinker import types
from tinker._version import __version__ as sdk_version
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.support.gateway import PROTO, auth_world, create_model, fb_body, post, result
from tests.support.waiting import wait_for

MAX_BODY_MB = 1


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    """A scheduler with API keys on, one trainer, a gateway (1 MiB bodies, 2 s seq_id gaps), the
    keys of alice and bob, and a model of alice's."""
    tmp = tmp_path_factory.mktemp("bad-input")
    with auth_world(tmp, tiny_model_dir, "--max-body-mb", str(MAX_BODY_MB), "--gap-timeout-s", "2") as w:
        http = httpx.Client(base_url=w.gateway.url, timeout=120)
        model_id = create_model(http, w.alice)
        keys = {"alice": w.alice, "bob": w.bob, "root": w.admin[4:]}
        yield {"http": http, "model": model_id, "gateway": w.gateway, **keys}


def next_seq(world) -> int:
    world["seq"] = world.get("seq", 0) + 1
    return world["seq"]


def test_a_key_without_the_tml_form_is_refused(world) -> None:
    r = world["http"].post("/api/v1/create_session", headers={"X-API-Key": world["alice"][4:]}, json={})
    assert r.status_code == 401 and r.json()["category"] == "user" and "tml-" in r.json()["detail"]


def test_an_sdk_outside_the_tested_range_is_refused_naming_it(world) -> None:
    r = post(world["http"], "client/config", world["alice"], json={"sdk_version": "0.24.1"})
    assert r.status_code == 400 and "sdk_version" in r.json()["detail"] and "0.38.0" in r.json()["detail"]


def test_another_owners_model_is_not_found(world) -> None:
    http, model = world["http"], world["model"]
    r = post(http, "get_info", world["bob"], json={"model_id": model})
    assert r.status_code == 404 and r.json()["category"] == "user"
    r = post(http, "forward_backward", world["bob"], content=fb_body(model, 1), headers=PROTO)
    assert r.status_code == 404
    path = f"tinker://{model}/sampler_weights/x"
    r = post(
        http,
        "create_sampling_session",
        world["bob"],
        json={"session_id": "s", "sampling_session_seq_id": 0, "model_path": path},
    )
    assert r.status_code == 404


def test_another_owners_state_is_missing_to_a_new_training_client(world) -> None:
    http, alice, model = world["http"], world["alice"], world["model"]
    r = post(http, "save_weights", alice, json={"model_id": model, "path": "shared", "seq_id": next_seq(world)})
    saved = result(http, alice, r.json()["request_id"])["path"]
    session = post(http, "create_session", world["bob"], json={"tags": [], "sdk_version": sdk_version}).json()

    def from_state(key: str, path: str) -> httpx.Response:
        body = {"session_id": session["session_id"], "model_seq_id": 0, "path": path, "optimizer": True}
        return post(http, "load_weights", key, json=body)

    stolen = from_state(world["bob"], saved)
    nothing = from_state(world["bob"], f"tinker://{model}/weights/no-such-state")
    assert stolen.status_code == nothing.status_code == 404 and stolen.json()["category"] == "user"
    assert stolen.json()["detail"] == f"path: no state {saved!r}", stolen.json()


def test_wrong_dtype_and_unknown_loss_are_user_errors_naming_the_field(world) -> None:
    http, key, model = world["http"], world["alice"], world["model"]
    wrong = types.TensorData(data=[1, 1, 1, 1, 1], dtype="int64", shape=[5])
    body = fb_body(model, next_seq(world), weights=wrong)
    r = post(http, "forward_backward", key, content=body, headers=PROTO)
    assert r.status_code == 400 and r.json()["category"] == "user"
    assert r.json()["detail"].startswith("data[0].loss_fn_inputs.weights: expected dtype float32")
    short = types.TensorData(data=[1.0] * 3, dtype="float32", shape=[3])
    r = post(http, "forward_backward", key, content=fb_body(model, next_seq(world), weights=short), headers=PROTO)
    assert r.status_code == 400 and "expected 5 values" in r.json()["detail"]
    r = post(
        http, "forward_backward", key, content=fb_body(model, next_seq(world), loss_fn="no_such_loss"), headers=PROTO
    )
    assert r.status_code == 400 and r.json()["detail"].startswith("loss_fn:") and "no_such_loss" in r.json()["detail"]


def test_oversized_bodies_and_zstd_bombs_are_refused(world) -> None:
    http, key = world["http"], world["alice"]
    r = post(http, "forward_backward", key, content=b"\0" * (MAX_BODY_MB * 1024 * 1024 + 1), headers=PROTO)
    assert r.status_code == 413 and r.json()["category"] == "user"
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 * 1024 * 1024))
    assert len(bomb) < 64 * 1024
    r = post(http, "forward_backward", key, content=bomb, headers={**PROTO, "Content-Encoding": "zstd"})
    assert r.status_code == 413 and "decompressed" in r.json()["detail"]


def test_a_seq_id_gap_fails_the_waiting_request_and_the_model_trains_on(world) -> None:
    http, key, model = world["http"], world["alice"], world["model"]
    first = next_seq(world)
    r = post(http, "forward_backward", key, content=fb_body(model, first + 1), headers=PROTO)
    assert r.status_code == 200
    failed = result(http, key, r.json()["request_id"])
    assert failed["category"] == "user" and failed["error"].startswith("seq_id:")
    assert f"expected request {first} next" in failed["error"]
    # The model is unharmed: the expected request runs, and a retry of it gets the same answer.
    body = fb_body(model, first)
    r = post(http, "forward_backward", key, content=body, headers=PROTO)
    again = post(http, "forward_backward", key, content=body, headers=PROTO)
    assert again.json()["request_id"] == r.json()["request_id"]
    answer = result(http, key, r.json()["request_id"])
    assert isinstance(answer, bytes) and answer == result(http, key, again.json()["request_id"])
    # The refused request, sent again in its turn, runs.
    r = post(http, "forward_backward", key, content=fb_body(model, first + 1), headers=PROTO)
    assert isinstance(result(http, key, r.json()["request_id"]), bytes)
    world["seq"] = first + 1


def test_a_seq_id_sent_again_with_another_body_is_refused(world) -> None:
    http, key, model = world["http"], world["alice"], world["model"]
    seq = next_seq(world)
    body = fb_body(model, seq)
    first = post(http, "forward_backward", key, content=body, headers=PROTO)
    assert first.status_code == 200
    other = post(http, "forward_backward", key, content=fb_body(model, seq, tokens=(7, 8, 9, 10, 11)), headers=PROTO)
    assert other.status_code == 409 and other.json()["category"] == "user"
    assert other.json()["detail"].startswith(
        f"seq_id: request {seq} of model {model} was sent before with another body"
    )
    again = post(http, "forward_backward", key, content=body, headers=PROTO)
    assert again.status_code == 200 and again.json()["request_id"] == first.json()["request_id"]
    assert isinstance(result(http, key, first.json()["request_id"]), bytes)


def test_a_checkpoint_path_without_a_valid_name_is_refused_by_load_weights(world) -> None:
    http, key, model = world["http"], world["alice"], world["model"]
    for name in ("", "x" * 100_000, "a\0b", "a\n"):
        body = {"model_id": model, "seq_id": next_seq(world), "path": f"tinker://{model}/weights/{name}"}
        r = post(http, "load_weights", key, json=body)
        assert r.status_code == 400 and r.json()["detail"].startswith("path: expected tinker://"), r.text
        assert len(r.json()["detail"]) < 1000
    # The refusals used up their seq_ids: the next request runs.
    r = post(http, "forward_backward", key, content=fb_body(model, next_seq(world)), headers=PROTO)
    assert isinstance(result(http, key, r.json()["request_id"]), bytes)


def test_external_weights_refused_naming_the_field(world) -> None:
    http, key, model = world["http"], world["alice"], world["model"]
    for route, extra, detail in (
        ("save_weights_external", {"path": "x" * 56}, "path: expected a name of 1 to 55 letters"),
        ("save_weights_external", {"path": "ok", "age_encryption_recipients": ["age1x"]}, "age_encryption_recipients:"),
        ("save_weights_for_sampler", {"path": "external.x"}, "path: names that start with 'external.'"),
    ):
        r = post(http, route, key, json={"model_id": model, "seq_id": next_seq(world), **extra})
        assert r.status_code == 400 and r.json()["detail"].startswith(detail), r.text
    # The refusals used up their seq_ids: the next request runs.
    r = post(http, "forward_backward", key, content=fb_body(model, next_seq(world)), headers=PROTO)
    assert isinstance(result(http, key, r.json()["request_id"]), bytes)


def test_a_refused_request_is_logged_without_the_key(world) -> None:
    http, key, model = world["http"], world["alice"], world["model"]
    wrong = types.TensorData(data=[1, 1, 1, 1, 1], dtype="int64", shape=[5])
    r = post(http, "forward_backward", key, content=fb_body(model, next_seq(world), weights=wrong), headers=PROTO)
    assert r.status_code == 400
    gateway = world["gateway"]
    lines = wait_for(
        lambda: [e for e in gateway.proc.log_events() if e.get("event") == "request refused" and "dtype" in e["error"]],
        what="the refusal's log line",
    )
    assert {k: lines[-1][k] for k in ("status", "category", "route", "model_id", "level")} == {
        "status": 400,
        "category": "user",
        "route": "/api/v1/forward_backward",
        "model_id": model,
        "level": "info",
    }
    text = gateway.proc.log_text()
    assert any(e.get("event") == "gateway starting" for e in gateway.proc.log_events())
    assert key[4:] not in text


def stable_reinforce_body(model_id: str, seq_id: int, *, sequence_id: str = "nope", prompt_run: int = 2, config=None):
    """A protobuf stable_reinforce forward_backward of one five-token datum whose provenance names
    ``sequence_id``: two prompt tokens, then three sampled; its input spans cover ``prompt_run`` + 3."""
    tokens = [1, 2, 3, 4, 5]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=[2, 3, 4, 5, 6], dtype="int64", shape=[5]),
            "logprobs": types.TensorData(data=[0.0, -1.0, -1.0, -1.0, -1.0], dtype="float32", shape=[5]),
            "advantages": types.TensorData(data=[0.0, 1.0, 1.0, 1.0, 1.0], dtype="float32", shape=[5]),
        },
        model_input_spans=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, length=prompt_run),
            types.SampledProvenanceSpan(sequence_id=sequence_id, length=3),
        ],
        loss_fn_input_spans=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=1),
            types.SampledProvenanceSpan(sequence_id=sequence_id, length=4),
        ],
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn="stable_reinforce", loss_fn_config=config
        ),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_bad_stable_reinforce_input_is_a_user_error_naming_the_field(world) -> None:
    """Spans that do not tile and a kl_coeff that is not a number are refused at once; a negative
    kl_coeff and a sequence id the session never recorded fail the request's future. Each refusal
    at the session spends the request's seq_id on that model, so those two use models of their own."""
    http, key, model = world["http"], world["alice"], world["model"]
    r = post(http, "forward_backward", key, content=stable_reinforce_body(model, 1, prompt_run=1), headers=PROTO)
    assert r.status_code == 400 and r.json()["category"] == "user", r.text
    assert r.json()["detail"] == (
        "data[0].model_input_spans: the spans cover 4 positions, the datum has 5; they must tile it exactly"
    )
    body = stable_reinforce_body(model, 1, config={"kl_coeff": "high"})
    r = post(http, "forward_backward", key, content=body, headers=PROTO)
    assert r.status_code == 400 and r.json()["detail"] == "loss_fn_config.kl_coeff: expected a number, got 'high'"

    for body, message in [
        (
            lambda m: stable_reinforce_body(m, 1, config={"kl_coeff": -0.5}),
            "ForwardBackward: loss_fn_config.kl_coeff: expected a number >= 0, got -0.5",
        ),
        (
            lambda m: stable_reinforce_body(m, 1, sequence_id="nope"),
            "ForwardBackward: datums[0].model_input_spans[0].sequence_id: no recorded sequence 'nope' in this session",
        ),
    ]:
        own = create_model(http, key)
        r = post(http, "forward_backward", key, content=body(own), headers=PROTO)
        assert r.status_code == 200, r.text
        failed = result(http, key, r.json()["request_id"])
        assert failed["category"] == "user" and failed["error"].startswith(message), failed
