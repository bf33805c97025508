"""Bad input to the Tinker API gets a Tinker-shaped refusal (category ``user``, the field named,
the right HTTP status) and harms nobody: the model trains on afterwards. Authentication is on:
another owner's model is not found, and a key without the ``tml-`` form is refused."""

from __future__ import annotations

import httpx
import pytest
import zstandard
from tinker import types
from tinker._version import __version__ as sdk_version

from opentinker_client import RLClient
from tests.support.gateway import PROTO, Gateway, create_model, fb_body, model_names, post, result
from tests.support.procs import Cluster, wait_connected

MAX_BODY_MB = 1


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    """A scheduler with API keys on, one trainer, a gateway (1 MiB bodies, 2 s seq_id gaps), the
    keys of alice and bob, and a model of alice's."""
    tmp = tmp_path_factory.mktemp("bad-input")
    config = (
        "heartbeat_interval: 0.5\nlease: 3\nauth: {enabled: true}\n"
        f"paths: {{model_dirs: [{tiny_model_dir.parent}]}}\n"
        "workload_types:\n  - type: lora_session\n    priority: 3\n" + model_names(tiny_model_dir)
    )
    cluster = Cluster(tmp, config)
    gateway = None
    try:
        cluster.start_scheduler()
        admin = cluster.admin_key()
        with RLClient(cluster.url, api_key=admin) as root:
            _, node_key = root.keys.create("rack-1", "node")
            _, alice = root.keys.create("alice", "user")
            _, bob = root.keys.create("bob", "user")
        cluster.start_trainer("node-a", "--api-key", node_key)
        with RLClient(cluster.url, api_key=admin) as root:
            wait_connected(root, 1)
        gateway = Gateway(
            tmp,
            f"127.0.0.1:{cluster.port}",
            "--max-body-mb",
            str(MAX_BODY_MB),
            "--gap-timeout-s",
            "2",
        )
        http = httpx.Client(base_url=gateway.url, timeout=120)
        model_id = create_model(http, f"tml-{alice}")
        yield {"http": http, "alice": f"tml-{alice}", "bob": f"tml-{bob}", "model": model_id, "root": admin}
    finally:
        if gateway is not None:
            gateway.close()
        cluster.close()


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
    r = post(http, "forward_backward", key, content=fb_body(model, 1, weights=wrong), headers=PROTO)
    assert r.status_code == 400 and r.json()["category"] == "user"
    assert r.json()["detail"].startswith("data[0].loss_fn_inputs.weights: expected dtype float32")
    short = types.TensorData(data=[1.0] * 3, dtype="float32", shape=[3])
    r = post(http, "forward_backward", key, content=fb_body(model, 1, weights=short), headers=PROTO)
    assert r.status_code == 400 and "expected 5 values" in r.json()["detail"]
    r = post(http, "forward_backward", key, content=fb_body(model, 1, loss_fn="no_such_loss"), headers=PROTO)
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
