"""A Tinker API gateway process (``python -m opentinker_gateway``) on loopback, for the tests of
the unmodified ``tinker`` SDK against a real scheduler and trainer."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import psutil
from tinker import types
from tinker._version import __version__ as sdk_version
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.support.procs import Cluster, Proc, free_port, wait_connected
from tests.support.waiting import wait_for

__all__ = [
    "ANSWERED_S",
    "AuthWorld",
    "Gateway",
    "MODEL_NAME",
    "PROTO",
    "STILL",
    "auth_world",
    "create_model",
    "fb_body",
    "hf_cache",
    "model_names",
    "post",
    "result",
    "sdk_datum",
    "session_worker",
]

#: The Tinker model name tests train; the scheduler's ``model_names:`` maps it to the test's model folder.
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: The headers of a protobuf forward_backward body.
PROTO = {"Content-Type": "application/x-protobuf"}
#: Seconds an SDK future may take to answer in a test; far below an SDK that spins forever.
ANSWERED_S = 120
#: A learning rate that leaves the weights as they were: every step sees the same gradient.
STILL = types.AdamParams(learning_rate=1e-9)


def sdk_datum(tokens: list[int]) -> types.Datum:
    """A cross-entropy datum of the SDK: predict each of ``tokens[1:]`` from the ones before."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def session_worker(trainer_pid: int) -> psutil.Process:
    """The one session worker process the trainer ``trainer_pid`` runs."""
    workers = [
        p for p in psutil.Process(trainer_pid).children() if "opentinker_trainer.worker" in " ".join(p.cmdline())
    ]
    assert len(workers) == 1, workers
    return workers[0]


def model_names(model_dir: Path, name: str = MODEL_NAME) -> str:
    """The scheduler config's ``model_names:`` section mapping Tinker model ``name`` to ``model_dir``."""
    return f"model_names:\n  - {{name: {name}, folder: {str(model_dir)!r}}}\n"


class Gateway:
    """``python -m opentinker_gateway`` for scheduler ``scheduler`` (``host:port``); ``extra`` are
    more flags. Ready once /healthz answers."""

    def __init__(self, tmp: Path, scheduler: str, *extra: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc = Proc(
            [
                "-m",
                "opentinker_gateway",
                "--scheduler",
                scheduler,
                "--port",
                str(self.port),
                *extra,
            ],
            tmp / f"gateway-{self.port}.log",
        )
        wait_for(self._healthy, what=f"the gateway on port {self.port} answers /healthz")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        if self.proc.popen.poll() is not None:
            raise RuntimeError(f"gateway exited: {self.proc.log_text()}")
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/healthz", timeout=2) as resp:
                return json.loads(resp.read()) == {"status": "ok"}
        except OSError:
            return False

    def close(self) -> None:
        self.proc.close()


def post(http: httpx.Client, path: str, key: str, *, headers: dict | None = None, **kwargs) -> httpx.Response:
    return http.post(f"/api/v1/{path}", headers={"X-API-Key": key, **(headers or {})}, **kwargs)


def result(http: httpx.Client, key: str, request_id: str) -> dict | bytes:
    """The answer of future ``request_id``, once it is not ``try_again``."""

    def answered():
        r = post(http, "retrieve_future", key, json={"request_id": request_id})
        assert r.status_code == 200, r.text
        if "protobuf" in r.headers["content-type"]:
            return r.content
        body = r.json()
        return None if body.get("type") == "try_again" else body

    return wait_for(answered, timeout=300, what=f"future {request_id} answered")


def create_model(http: httpx.Client, key: str) -> str:
    session = post(http, "create_session", key, json={"tags": [], "user_metadata": {}, "sdk_version": sdk_version})
    assert session.status_code == 200, session.text
    body = {
        "session_id": session.json()["session_id"],
        "model_seq_id": 0,
        "base_model": MODEL_NAME,
        "lora_config": {"rank": 2},
    }
    r = post(http, "create_model", key, json=body)
    assert r.status_code == 200, r.text
    assert result(http, key, r.json()["request_id"])["model_id"] == r.json()["model_id"]
    return r.json()["model_id"]


def fb_body(
    model_id: str, seq_id: int, *, loss_fn: str = "cross_entropy", weights=None, tokens=(1, 2, 3, 4, 5)
) -> bytes:
    """A protobuf forward_backward of one five-token datum, as the SDK encodes it."""
    tokens = list(tokens)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:] + [6], dtype="int64", shape=[5]),
            "weights": weights or types.TensorData(data=[1.0] * 5, dtype="float32", shape=[5]),
        },
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def hf_cache(root: Path, model_dir: Path) -> Path:
    """A Hugging Face hub cache holding ``model_dir`` as :data:`MODEL_NAME`, so that the cookbook's
    ``AutoTokenizer.from_pretrained(MODEL_NAME)`` loads offline: what ``make install`` places."""
    from scripts.prepare_model import place_in_hub_cache

    place_in_hub_cache(model_dir, root, MODEL_NAME)
    return root


@dataclass(frozen=True)
class AuthWorld:
    """What :func:`auth_world` starts: the cluster, its gateway and the SDK keys (``tml-``)."""

    cluster: Cluster
    gateway: "Gateway"
    alice: str
    bob: str
    admin: str


@contextlib.contextmanager
def auth_world(tmp: Path, model_dir: Path, *gateway_flags: str) -> Iterator[AuthWorld]:
    """A scheduler with API keys on serving ``model_dir`` as :data:`MODEL_NAME`, one trainer with a
    node key, a gateway with ``gateway_flags``, and the keys of alice, bob and the admin."""
    config = (
        "heartbeat_interval: 0.5\nlease: 3\nauth: {enabled: true}\n"
        f"paths: {{model_dirs: [{model_dir.parent}]}}\n"
        "workload_types:\n  - type: lora_session\n    priority: 3\n" + model_names(model_dir)
    )
    cluster = Cluster(tmp, config)
    gateway = None
    try:
        from opentinker_client import RLClient

        cluster.start_scheduler()
        admin = cluster.admin_key()
        with RLClient(cluster.url, api_key=admin) as root:
            _, node_key = root.keys.create("rack-1", "node")
            _, alice = root.keys.create("alice", "user")
            _, bob = root.keys.create("bob", "user")
        cluster.start_trainer("node-a", "--api-key", node_key)
        with RLClient(cluster.url, api_key=admin) as root:
            wait_connected(root, 1)
        gateway = Gateway(tmp, f"127.0.0.1:{cluster.port}", *gateway_flags)
        yield AuthWorld(cluster, gateway, f"tml-{alice}", f"tml-{bob}", f"tml-{admin}")
    finally:
        if gateway is not None:
            gateway.close()
        cluster.close()
