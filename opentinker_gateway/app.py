"""The HTTP routes of the Tinker API (``/api/v1/...``) over an OpenTinker scheduler.

Every request carries ``X-API-Key: tml-<OpenTinker API key>``: the gateway strips ``tml-`` and
calls the scheduler and the session workers with that key, so owners, roles, rotation and
revocation are the scheduler's. A training request returns its future (``request_id``) once
the session worker answered it, or 408 after a while so that the SDK sends it again;
``retrieve_future`` long-polls it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import time
import uuid
from datetime import datetime, timezone
from urllib.parse import quote
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import structlog
import zstandard
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from packaging.version import InvalidVersion, Version
from tinker.proto import tinker_public_pb2 as tpb

from opentinker.common.v1 import common_pb2
from opentinker.training.v1 import training_pb2

from opentinker_common.artifacts.checkpoint_lists import STATE_PREFIX
from opentinker_common.lora_targets import tinker_target_modules

from opentinker_gateway import wire
from opentinker_gateway.download_urls import Download, DownloadUrls
from opentinker_gateway.errors import SERVER, ApiError
from opentinker_gateway.models import Model, NotYet, Outcome
from opentinker_gateway.sampling import BASE_MODEL, SampleBatcher, sample_request
from opentinker_gateway.scheduler import TASK_NAME_PREFIX, Scheduler, SessionSpec

__all__ = ["GatewayConfig", "create_app", "SDK_VERSIONS"]

log = logging.getLogger(__name__)

#: The ``tinker`` SDK versions this gateway is tested with: [lowest, highest].
SDK_VERSIONS = ("0.38.0", "0.38.0")

_CHECKPOINT_NAME = re.compile(r"\A[A-Za-z0-9._-]{1,64}\Z")
#: The id the SDK gives a model it creates from a state: ``<session id>:train:<model_seq_id>``.
_SDK_MODEL_ID = re.compile(r"^ses-[0-9a-f]{1,64}:train:[0-9]{1,9}$")
_PROTO = "application/x-protobuf"
#: A session's checkpoint folder prefix -> Tinker's checkpoint type and tinker:// path segment.
_CHECKPOINT_KINDS = {"state": ("training", "weights"), "sampler": ("sampler", "sampler_weights")}
#: A tinker:// path segment -> the session's checkpoint folder prefix.
_FOLDER_PREFIX = {segment: prefix for prefix, (_, segment) in _CHECKPOINT_KINDS.items()}
#: Tinker's external weights (``save_weights_external``) are sampler saves named ``external.<name>``:
#: the adapter alone, PEFT format, listed as ``external_weights/<name>``.
_EXTERNAL = "external."
_EXTERNAL_KIND = ("external", "external_weights")
#: Most items one page of a REST listing holds.
_MAX_PAGE = 1000
#: Longest checkpoint TTL, in seconds: ten years, as Tinker.
_MAX_TTL_S = 10 * 365 * 86400
#: Seconds a checkpoint's download URLs work.
_DOWNLOAD_URL_S = 900
#: Seconds the gateway waits for a save with ``ttl_seconds`` to be listed, to set its expiry.
_SAVE_LISTED_S = 60.0
#: Largest body of a route that takes no API key (``client/config``, ``telemetry``), in bytes,
#: after zstd decompression too: anyone can send these, so they hold only this much.
MAX_KEYLESS_BODY_BYTES = 64 * 1024
#: Deepest nesting of arrays and objects in a JSON body; the SDK's bodies nest a few levels.
MAX_JSON_DEPTH = 64
#: Seconds the gateway trusts the scheduler's yes to an API key, and to the key's use of a model,
#: before it asks again. A revoked or rotated-out key stops working through the gateway within
#: this long; a busy SDK costs the scheduler one check per key and model in this time, not one a request.
GRANT_TTL_S = 5.0
#: Routes that take no API key. Every other ``/api/v1/`` route is refused (401) before its body is
#: read unless its key is one the scheduler knows.
KEYLESS_ROUTES = frozenset(
    {"/api/v1/healthz", "/api/v1/client/config", "/api/v1/client/dynamic_config", "/api/v1/telemetry"}
)
#: Checkpoint download URLs carry a sealed token instead of a key.
_DOWNLOAD_PREFIX = "/api/v1/checkpoint_files/"
#: Keys (and key, model pairs) held before the expired ones are dropped: those that stopped calling.
_MAX_GRANTS = 4096

log = structlog.get_logger("opentinker.gateway")


@dataclass
class GatewayConfig:
    """What a gateway serves.

    Attributes:
        scheduler: the scheduler's address (``host:port`` or a URL); its ``model_names:`` table
            maps Tinker model names (``HuggingFaceTB/SmolLM2-135M-Instruct``) to local model folders.
        max_body_bytes: largest request body, after zstd decompression too (413 above it).
        gap_timeout_s: seconds a request waits for a missing earlier ``seq_id``.
        long_poll_s: seconds ``retrieve_future`` waits before answering ``try_again``.
        answer_wait_s: seconds a training request waits for the session worker to answer or hold
            it before a 408, which the SDK answers by sending it again; below the SDK's 60 s read
            timeout, which would otherwise end the request first.
        heartbeat_timeout_s: a model's session task ends after this long without a request or a
            heartbeat of its Tinker session (the SDK sends one every 10 s).
        download_url_secret_file: a file holding the secret download URLs are sealed with; every
            instance given the same file serves the others' URLs. None: a random secret, so only
            this instance serves its URLs.
    """

    scheduler: str
    max_body_bytes: int = 256 * 1024 * 1024
    gap_timeout_s: float = 60.0
    long_poll_s: float = 20.0
    answer_wait_s: float = 20.0
    heartbeat_timeout_s: float = 300.0
    download_url_secret_file: Path | None = None


def _key(request: Request) -> str:
    """The OpenTinker API key of the ``tml-`` key the request carries."""
    raw = request.headers.get("x-api-key", "")
    if not raw:
        auth = request.headers.get("authorization", "")
        raw = auth[7:] if auth.lower().startswith("bearer ") else ""
    if not raw.startswith("tml-"):
        raise ApiError(
            "X-API-Key: expected tml-<your OpenTinker API key>, got "
            + ("nothing" if not raw else "a key without the tml- prefix"),
            status=401,
        )
    return raw[4:]


def _field(body: dict, name: str, kind: type, *, required: bool = True) -> Any:
    value = body.get(name)
    if value is None and not required:
        return None
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ApiError(
            f"{name}: expected {kind.__name__}, got {type(value).__name__ if value is not None else 'nothing'}"
        )
    return value


def _page(request: Request, *, default_limit: int) -> tuple[int, int]:
    """``(limit, offset)`` of a listing's query, as the SDK sends them. Raises ApiError 400."""
    out = []
    for name, default, low, high in (("limit", default_limit, 1, _MAX_PAGE), ("offset", 0, 0, None)):
        raw = request.query_params.get(name)
        value = int(raw) if raw is not None and raw.isdigit() else (default if raw is None else None)
        if value is None or value < low or (high is not None and value > high):
            expected = f"an integer in {low}..{high}" if high is not None else f"an integer >= {low}"
            raise ApiError(f"{name}: expected {expected}, got {raw!r}")
        out.append(value)
    return out[0], out[1]


def _ttl_seconds(body: dict) -> int | None:
    """The request's ``ttl_seconds``: 1 s to 10 years, or None (never expires). Raises ApiError 400."""
    ttl = body.get("ttl_seconds")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= _MAX_TTL_S):
        raise ApiError(f"ttl_seconds: expected an integer in 1..{_MAX_TTL_S} or null (never), got {ttl!r}")
    return ttl


def _parse_path(path: str, field_name: str) -> tuple[str, str, str]:
    """``(model id, kind, name)`` of ``tinker://<model id>/<weights|sampler_weights|external_weights>/<name>``."""
    parts = path[len("tinker://") :].split("/") if path.startswith("tinker://") else []
    if (
        len(parts) != 3
        or parts[1] not in ("weights", "sampler_weights", _EXTERNAL_KIND[1])
        or not parts[0]
        or not _CHECKPOINT_NAME.match(parts[2])
    ):
        raise ApiError(
            f"{field_name}: expected tinker://<model id>/weights/<name>, "
            f"tinker://<model id>/sampler_weights/<name> or tinker://<model id>/external_weights/<name>, "
            f"the name 1 to 64 letters, digits, '.', '_' or '-', "
            f"got {path[:200]!r}" + (f" ({len(path)} characters)" if len(path) > 200 else "")
        )
    return parts[0], parts[1], parts[2]


def _folder(kind: str, name: str) -> str:
    """The session's checkpoint folder of ``<kind>/<name>`` (a tinker:// path's last segments)."""
    if kind == _EXTERNAL_KIND[1]:
        return f"{_FOLDER_PREFIX['sampler_weights']}_{_EXTERNAL}{name}"
    return f"{_FOLDER_PREFIX[kind]}_{name}"


def _lora_shape(hyperparameters) -> tuple[int, list[str]]:
    """``(rank, sorted target modules)`` of a session task's hyperparameters."""
    hp = dict(hyperparameters)
    return int(hp.get("lora_rank", 0)), sorted(hp.get("target_modules") or ())


class Gateway:
    """The state of one gateway process: connections, models it has met, sample futures."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.scheduler: Scheduler | None = None
        self.models: dict[str, Model] = {}
        #: Monotonic time until which the scheduler's yes holds: to a key, to a (key, model id).
        self._keys: dict[str, float] = {}
        self._grants: dict[tuple[str, str], float] = {}
        self._model_locks: dict[str, asyncio.Lock] = {}
        self.samples: dict[str, asyncio.Future] = {}
        #: What ``/metrics`` shows.
        self.registry = CollectorRegistry()
        self.batcher = SampleBatcher(self.registry)
        self.creates: dict[str, asyncio.Task] = {}
        #: Seals and opens the tokens of download URLs (``external_weights_urls``).
        self.download_urls = (
            DownloadUrls.from_file(config.download_url_secret_file)
            if config.download_url_secret_file is not None
            else DownloadUrls.random()
        )
        #: Background jobs that give saves their ``ttl_seconds`` once listed.
        self.expiries: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.scheduler = Scheduler(self.config.scheduler)

    async def stop(self) -> None:
        for model in self.models.values():
            await model.close()
        if self.scheduler is not None:
            await self.scheduler.close()

    async def check_key(self, key: str) -> None:
        """Return when the scheduler takes ``key``, asked at most once in :data:`GRANT_TTL_S`.

        Raises:
            ApiError: 401 for a key the scheduler does not know (revoked, expired, never made);
                the scheduler's refusal otherwise (503 when it cannot be reached).
        """
        now = time.monotonic()
        if self._keys.get(key, 0.0) > now:
            return
        await self.scheduler.check_key(key)
        if len(self._keys) >= _MAX_GRANTS:
            self._keys = {k: t for k, t in self._keys.items() if t > now}
        self._keys[key] = time.monotonic() + GRANT_TTL_S

    async def model_dir(self, base_model: str, key: str, field_name: str = "base_model") -> str:
        """The local folder of Tinker model name ``base_model`` (the scheduler's ``model_names:``).

        Raises:
            ApiError: 400 naming the served names when it is not one of them.
        """
        names = await self.scheduler.model_names(key)
        folder = names.get(base_model)
        if folder is None:
            raise ApiError(
                f"{field_name}: expected one of {', '.join(sorted(names)) or '(none configured)'}, got {base_model!r}"
            )
        return folder

    async def base_model_of(self, model_dir: str, key: str) -> str:
        """The Tinker model name of local folder ``model_dir`` (the folder itself when none)."""
        names = await self.scheduler.model_names(key)
        return next((name for name, folder in names.items() if folder == model_dir), model_dir)

    async def task(self, model_id: str, key: str, field_name: str = "model_id") -> common_pb2.Task:
        """The session task of model ``model_id``: its task id, or ``<session>:train:<n>`` (the id
        the SDK gives a model it creates from a state) while that task runs.

        Raises:
            ApiError: 404 when no such task is visible to the key (another owner's too).
        """
        missing = ApiError(f"{field_name}: no model {model_id!r}", status=404)
        if _SDK_MODEL_ID.match(model_id):
            task = await self.scheduler.task_named(TASK_NAME_PREFIX + model_id, key)
            if task is None:
                raise missing
            return task
        try:
            task = await self.scheduler.get_task(model_id, key)
        except ApiError as exc:
            if exc.status in (400, 404):
                raise missing from None
            raise
        if task.spec.workload_type != "lora_session" or not task.spec.name.startswith(TASK_NAME_PREFIX):
            raise missing
        return task

    async def model(self, model_id: str, key: str) -> Model:
        """Model ``model_id`` (:meth:`task`) if the caller's key may use it.

        Raises:
            ApiError: 404 when no such task is visible to the key (another owner's too).
        """
        if not isinstance(model_id, str) or not model_id:
            raise ApiError("model_id: expected a model id from create_model")
        model = self.models.get(model_id)
        if model is not None and self._grants.get((key, model_id), 0.0) > time.monotonic():
            return model
        lock = self._model_locks.setdefault(model_id, asyncio.Lock())
        async with lock:
            task_id = (await self.task(model_id, key)).task_id
            now = time.monotonic()
            if len(self._grants) >= _MAX_GRANTS:
                self._grants = {g: t for g, t in self._grants.items() if t > now}
            self._grants[(key, model_id)] = now + GRANT_TTL_S
            model = self.models.get(task_id)  # one Model per task, under each of its ids
            if model is None:
                task = await self.scheduler.wait_serving(task_id, key)
                hp = dict(task.spec.hyperparameters)
                model = Model(
                    model_id,
                    task_id,
                    task.endpoint,
                    base_model=await self.base_model_of(task.spec.model, key),
                    model_dir=task.spec.model,
                    lora_rank=int(hp.get("lora_rank", 0)),
                    metadata=lambda: self.scheduler.endpoint_metadata(task_id, key),
                    serving=lambda: self.scheduler.wait_serving(task_id, key),
                    gap_timeout_s=self.config.gap_timeout_s,
                )
                self.models[task_id] = model
            self.models[model_id] = model
            return model

    async def forget(self, task_id: str) -> None:
        """Close the model of ``task_id`` and drop it under each of its ids."""
        gone = {mid: m for mid, m in self.models.items() if m.task_id == task_id}
        for mid in gone:
            del self.models[mid]
        for model in {id(m): m for m in gone.values()}.values():
            await model.close()


async def _body(request: Request, limit: int) -> bytes:
    """The request body, decompressed when ``Content-Encoding: zstd``; at most ``limit`` bytes."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise ApiError(f"body: at most {limit} bytes, got {size}", status=413)
    chunks = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise ApiError(f"body: at most {limit} bytes, got more", status=413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding != "zstd":
        raise ApiError(f"Content-Encoding: expected zstd or none, got {encoding!r}", status=415)
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(raw)
        out = reader.read(limit + 1)
        while len(out) <= limit:
            more = reader.read(limit + 1 - len(out))
            if not more:
                break
            out += more
    except zstandard.ZstdError as exc:
        raise ApiError(f"body: not valid zstd ({exc})") from None
    if len(out) > limit:
        raise ApiError(f"body: at most {limit} bytes once decompressed, got more", status=413)
    return out


async def _json(request: Request, limit: int) -> dict:
    """The request's JSON object, at most ``limit`` bytes (:func:`_body`) and :data:`MAX_JSON_DEPTH`
    levels deep.

    Raises:
        ApiError: 400 for a body that is not a JSON object or nests deeper; 413 and 415 as :func:`_body`.
    """
    raw = await _body(request, limit)
    deep = ApiError(f"body: expected JSON nested at most {MAX_JSON_DEPTH} levels deep, got deeper")
    try:
        body = json.loads(raw or b"{}")
    except RecursionError:
        raise deep from None
    except ValueError as exc:
        raise ApiError(f"body: expected JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ApiError(f"body: expected a JSON object, got {type(body).__name__}")
    if _depth_over(body, MAX_JSON_DEPTH):
        raise deep
    return body


def _depth_over(value: Any, limit: int) -> bool:
    """Whether the arrays and objects in ``value`` nest more than ``limit`` levels deep."""
    level = [value]
    for _ in range(limit):
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, (dict, list))]
        if not level:
            return False
    return True


def _check_version(body: dict) -> None:
    raw = body.get("sdk_version")
    low, high = SDK_VERSIONS
    try:
        version = Version(str(raw))
    except InvalidVersion:
        version = None
    if version is None or not Version(low) <= version <= Version(high):
        raise ApiError(
            f"sdk_version: this OpenTinker serves tinker SDK {low} to {high}, got {raw!r}; "
            f"pip install 'tinker>={low},<={high}'",
            status=400,
        )


@dataclass(frozen=True)
class _Kind:
    """A kind of sequenced request: its RPC, the Tinker answer of the session's response, and a
    payload the session refuses, to ask for a kept answer (:meth:`Model.kept`)."""

    rpc: str
    answer: Any
    probe: Any
    streamed: bool = False


def _fb_probe(request_cls):
    def probe(seq: int):
        return iter([request_cls(header=training_pb2.BatchHeader(sequence=seq, loss_fn=1))])

    return probe


def _kinds() -> dict[str, _Kind]:
    def path(model_id: str, kind: str, name: str) -> str:
        return f"tinker://{model_id}/{kind}/{name}"

    return {
        "fb": _Kind(
            "ForwardBackward",
            lambda m, r: Outcome(proto=wire.forward_backward_output(r.outputs, r.metrics)),
            _fb_probe(training_pb2.ForwardBackwardRequest),
            streamed=True,
        ),
        "fwd": _Kind(
            "Forward",
            lambda m, r: Outcome(proto=wire.forward_backward_output(r.outputs, {})),
            _fb_probe(training_pb2.ForwardRequest),
            streamed=True,
        ),
        "optim": _Kind(
            "OptimStep",
            lambda m, r: Outcome(
                json={"type": "optim_step", "metrics": {"grad_norm:mean": r.grad_norm, "step:max": float(r.step)}}
            ),
            lambda seq: training_pb2.OptimStepRequest(sequence=seq, adam=training_pb2.AdamParams(learning_rate=0)),
        ),
        "save": _Kind(
            "SaveState",
            lambda m, r: Outcome(json={"type": "save_weights", "path": path(m.task_id, "weights", r.name)}),
            lambda seq: training_pb2.SaveStateRequest(sequence=seq, name=""),
        ),
        "sampler": _Kind(
            "SaveWeightsForSampler",
            lambda m, r: Outcome(
                json={"type": "save_weights_for_sampler", "path": path(m.task_id, "sampler_weights", r.name)}
            ),
            lambda seq: training_pb2.SaveWeightsForSamplerRequest(sequence=seq, name=""),
        ),
        "external": _Kind(
            "SaveWeightsForSampler",
            lambda m, r: Outcome(
                json={
                    "type": "save_weights_external",
                    "path": path(m.task_id, _EXTERNAL_KIND[1], r.name.removeprefix(_EXTERNAL)),
                }
            ),
            lambda seq: training_pb2.SaveWeightsForSamplerRequest(sequence=seq, name=""),
        ),
        "ephemeral": _Kind(
            "SaveWeightsForSampler",
            lambda m, r: Outcome(
                json={"type": "save_weights_for_sampler", "sampling_session_id": f"{m.task_id}~{r.name}"}
            ),
            lambda seq: training_pb2.SaveWeightsForSamplerRequest(sequence=seq, name=""),
        ),
        "load": _Kind(
            "LoadState",
            lambda m, r: Outcome(
                json={"type": "load_weights", "path": path(m.task_id, "weights", r.name), "model_id": m.model_id}
            ),
            lambda seq: training_pb2.LoadStateRequest(sequence=seq, name=""),
        ),
    }


KINDS = _kinds()

#: Seconds between asks of the worker for a future's kept answer: first, most.
_POLL_WAIT = (0.05, 1.0)


def _digest(body: dict) -> str:
    """A hash of a JSON body: the same request sent again has the same one."""
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


#: Seconds a worker call may take (a save writes the artifact store; a step runs the model).
_CALL_TIMEOUT_S = 3600
#: Milliseconds the SDK waits before it sends a request answered 408 again.
_RETRY_AFTER_MS = "100"


class _KeysFirst:
    """ASGI middleware: a keyed route's key is checked (:meth:`Gateway.check_key`) before anything
    reads its body, so a client without a valid key makes the gateway read nothing. A refusal is
    Tinker-shaped and closes the connection, the body unread."""

    def __init__(self, app, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith("/api/v1/") and path not in KEYLESS_ROUTES and not path.startswith(_DOWNLOAD_PREFIX):
            try:
                await self.gateway.check_key(_key(Request(scope)))
            except ApiError as exc:
                log.info("request refused", status=exc.status, route=path, error=exc.message)
                refusal = JSONResponse(exc.body(), status_code=exc.status, headers={"Connection": "close"})
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(config: GatewayConfig) -> FastAPI:
    """The gateway's ASGI app."""
    gw = Gateway(config)
    app = FastAPI(title="OpenTinker Tinker API")
    app.state.gateway = gw
    app.add_middleware(_KeysFirst, gateway=gw)
    limit = config.max_body_bytes

    @app.exception_handler(ApiError)
    async def _refused(request: Request, exc: ApiError) -> JSONResponse:
        (log.warning if exc.status >= 500 else log.info)(
            "request refused",
            status=exc.status,
            category=exc.category,
            route=request.url.path,
            model_id=getattr(request.state, "model_id", None),
            error=exc.message,
        )
        headers = {"retry-after-ms": _RETRY_AFTER_MS} if exc.status == 408 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(Exception)
    async def _failed(request: Request, exc: Exception) -> JSONResponse:
        log.error("request failed", route=request.url.path, exc_info=exc)
        error = ApiError(f"internal error: {type(exc).__name__}", status=500, category="server")
        return JSONResponse(error.body(), status_code=500)

    async def submit(model: Model, seq_id: int, kind: str, message, digest: str) -> dict:
        """Send request ``seq_id`` of ``kind`` with ``message(sequence)``; its future's reply once
        the worker answered it, or holds it for its turn. Answered earlier, the request would be
        lost with this instance; unanswered, the SDK sends it again (same ``seq_id``) to any
        instance, and the worker answers it once. The SDK sends the first chunk of a batch only
        after the others got their futures: held by the worker, they survive this instance.

        Raises:
            ApiError: 408 after ``answer_wait_s``: the SDK sends the request again and so waits on
                for it.
        """
        k = KINDS[kind]

        def send(seq: int, md: tuple):  # the stub of the worker's endpoint now: it moves when the task resumes
            return getattr(model.stub, k.rpc)(message(seq), timeout=_CALL_TIMEOUT_S, metadata=md)

        model.submit(seq_id, k.rpc, send, lambda r: k.answer(model, r), digest=digest)
        log.debug("request accepted", model_id=model.model_id, seq_id=seq_id, kind=kind)
        if not await model.taken(seq_id, config.answer_wait_s):
            raise ApiError(
                f"seq_id: request {seq_id} of model {model.model_id} is not answered yet; "
                "send it again with the same seq_id to wait on",
                status=408,
                category=SERVER,
            ) from None
        return {"request_id": f"{model.model_id}#{seq_id}#{kind}", "model_id": model.model_id}

    async def refuse_in_turn(request: Request, refusal: ApiError, model_id: Any, seq_id: Any, kind: str, digest: str):
        """Use up ``seq_id`` of a request the gateway refuses, so the model's next request runs:
        its error is its answer, as on Tinker. Nothing to do without a model and a ``seq_id``."""
        request.state.model_id = model_id
        if refusal.status != 400 or isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < 1:
            return
        try:
            model = await gw.model(model_id, _key(request))
        except ApiError:
            return
        k = KINDS[kind]

        def send(seq: int, md: tuple):
            return getattr(model.stub, k.rpc)(k.probe(seq), timeout=_CALL_TIMEOUT_S, metadata=md)

        try:
            model.submit(seq_id, k.rpc, send, lambda r: Outcome(error=refusal), digest=digest, refused=refusal)
        except ApiError:  # seq_id names another request already: the refusal above stands
            pass

    # --- service ---------------------------------------------------------------------------
    @app.get("/api/v1/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/api/v1/client/config")
    async def client_config(request: Request) -> dict:
        _check_version(await _json(request, min(limit, MAX_KEYLESS_BODY_BYTES)))
        return {
            "pjwt_auth_enabled": False,
            "credential_default_source": "api_key",
            "use_pyqwest_transport": False,
            "parallel_fwdbwd_chunks": True,
            "proto_compress_fwdbwd": True,
            "sample_use_retrieve_futures": False,
            "sample_join_sampling_session": False,
            "custom_loss_server_side": False,
        }

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config(request: Request) -> dict:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(request: Request) -> dict:
        names = await gw.scheduler.model_names(_key(request))
        return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": True} for name in names]}

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request) -> dict:
        await _json(request, min(limit, MAX_KEYLESS_BODY_BYTES))
        return {"status": "accepted"}

    # --- sessions ---------------------------------------------------------------------------
    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict:
        _key(request)
        body = await _json(request, limit)
        _check_version(body)
        return {"type": "create_session", "session_id": f"ses-{uuid.uuid4().hex}"}

    @app.post("/api/v1/session_heartbeat")
    async def session_heartbeat(request: Request) -> dict:
        """Keeps the session's models alive: a GetInfo to each session worker restarts its idle
        clock (``heartbeat_timeout_s``)."""
        key = _key(request)
        session_id = _field(await _json(request, limit), "session_id", str)
        for task in await gw.scheduler.session_tasks(f"{TASK_NAME_PREFIX}{session_id}:", key):
            if task.endpoint:
                try:
                    await (await gw.model(task.task_id, key)).info()
                except ApiError:
                    pass  # a model that cannot be reached now is asked again at the next heartbeat
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> Response:
        key = _key(request)
        await _json(request, limit)
        for task in await gw.scheduler.session_tasks(f"{TASK_NAME_PREFIX}{session_id}:", key):
            await gw.scheduler.cancel(task.task_id, key, f"tinker session {session_id} finished")
            await gw.forget(task.task_id)
        return Response(content=b"null", media_type="application/json")

    # --- models -------------------------------------------------------------------------------
    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict:
        key = _key(request)
        body = await _json(request, limit)
        session_id = _field(body, "session_id", str)
        model_seq_id = _field(body, "model_seq_id", int)
        folder = await gw.model_dir(_field(body, "base_model", str), key)
        lora = body.get("lora_config") or {}
        if not isinstance(lora, dict):
            raise ApiError("lora_config: expected an object")
        rank = lora.get("rank", 32)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= 512:
            raise ApiError(f"lora_config.rank: expected an integer in 1..512, got {rank!r}")
        try:
            model_config = json.loads((Path(folder) / "config.json").read_text())
        except (OSError, ValueError):
            model_config = {"model_type": "llama"}
        try:
            targets = tinker_target_modules(
                train_mlp=bool(lora.get("train_mlp", True)),
                train_attn=bool(lora.get("train_attn", True)),
                train_unembed=bool(lora.get("train_unembed", True)),
                model_config=model_config,
            )
        except ValueError as exc:
            raise ApiError(f"lora_config.{exc}") from None
        optimizer = body.get("optimizer_config") or {"type": "adamw"}
        if optimizer.get("type", "adamw") != "adamw":
            raise ApiError(f"optimizer_config.type: expected adamw, got {optimizer.get('type')!r}")
        seed = lora.get("seed")
        spec = SessionSpec(
            folder,
            rank,
            targets,
            int(seed) if isinstance(seed, int) else 0,
            config.heartbeat_timeout_s,
            held_call_timeout_s=config.gap_timeout_s,
        )
        name = f"{TASK_NAME_PREFIX}{session_id}:train:{model_seq_id}"
        task_id = await gw.scheduler.submit_session(spec, name=name, key=key, request_id=name)
        return {"request_id": f"create#{task_id}", "model_id": task_id}

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict:
        key = _key(request)
        body = await _json(request, limit)
        model = await gw.model(body.get("model_id"), key)
        info = await model.info()
        return {
            "type": "get_info",
            "model_id": model.model_id,
            "model_data": {
                "arch": json.loads(info.model_config_json or "{}").get("model_type"),
                "model_name": model.base_model,
                "tokenizer_id": model.base_model,
            },
            "is_lora": not info.full_weights,
            "lora_rank": info.lora_rank,
            "model_name": model.base_model,
        }

    # --- training -----------------------------------------------------------------------------
    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict:
        key = _key(request)
        raw = await _body(request, limit)
        if _PROTO not in request.headers.get("content-type", ""):
            raise ApiError(f"Content-Type: expected {_PROTO} (tinker SDK >= 0.25), got JSON", status=415)
        msg = tpb.ForwardBackwardRequest()
        try:
            msg.ParseFromString(raw)
        except Exception as exc:  # noqa: BLE001 - a malformed body is the caller's
            raise ApiError(f"body: not a tinker ForwardBackwardRequest ({exc})") from None
        forward_only = msg.forward_only
        if msg.seq_id < 1:
            raise ApiError(f"seq_id: expected an integer >= 1, got {msg.seq_id}")
        digest = hashlib.sha256(raw).hexdigest()
        try:
            if not forward_only and msg.loss_fn not in wire.LOSSES:
                raise ApiError(f"loss_fn: expected one of {', '.join(wire.LOSSES)}, got {msg.loss_fn!r}")
            datums = wire.datums_from_proto(msg)
            loss_config = wire.loss_config(msg) if not forward_only else None
        except ApiError as exc:
            await refuse_in_turn(request, exc, msg.model_id, msg.seq_id, "fwd" if forward_only else "fb", digest)
            raise
        model = await gw.model(msg.model_id, key)

        def batch(seq: int):
            if forward_only:
                header = training_pb2.BatchHeader(sequence=seq, datum_count=len(datums))
                yield training_pb2.ForwardRequest(header=header)
                yield training_pb2.ForwardRequest(chunk=training_pb2.DatumChunk(datums=datums))
            else:
                header = training_pb2.BatchHeader(
                    sequence=seq, datum_count=len(datums), loss_fn=wire.LOSSES[msg.loss_fn], loss_fn_config=loss_config
                )
                yield training_pb2.ForwardBackwardRequest(header=header)
                yield training_pb2.ForwardBackwardRequest(chunk=training_pb2.DatumChunk(datums=datums))

        return await submit(model, msg.seq_id, "fwd" if forward_only else "fb", batch, digest)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict:
        key = _key(request)
        body = await _json(request, limit)
        seq_id = _field(body, "seq_id", int)
        digest = _digest(body)
        try:
            params = body.get("adam_params")
            if params is None:
                raise ApiError("adam_params: expected AdamParams (other optimizers are not served)")
            adam = wire.adam_params(params)
        except ApiError as exc:
            await refuse_in_turn(request, exc, body.get("model_id"), seq_id, "optim", digest)
            raise
        model = await gw.model(body.get("model_id"), key)
        return await submit(
            model, seq_id, "optim", lambda seq: training_pb2.OptimStepRequest(sequence=seq, adam=adam), digest
        )

    def checkpoint_name(body: dict, *, longest: int = 64) -> str:
        name = _field(body, "path", str)
        if not _CHECKPOINT_NAME.match(name) or len(name) > longest:
            raise ApiError(f"path: expected a name of 1 to {longest} letters, digits, '.', '_' or '-', got {name!r}")
        return name

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict:
        key = _key(request)
        body = await _json(request, limit)
        seq_id = _field(body, "seq_id", int)
        digest = _digest(body)
        try:
            name = checkpoint_name(body)
            ttl = _ttl_seconds(body)
        except ApiError as exc:
            await refuse_in_turn(request, exc, body.get("model_id"), seq_id, "save", digest)
            raise
        model = await gw.model(body.get("model_id"), key)
        reply = await submit(
            model, seq_id, "save", lambda seq: training_pb2.SaveStateRequest(sequence=seq, name=name), digest
        )
        expire_after_save(model, seq_id, f"state_{name}", ttl, key)
        return reply

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict:
        key = _key(request)
        body = await _json(request, limit)
        seq_id = _field(body, "seq_id", int)
        digest = _digest(body)
        try:
            ttl = _ttl_seconds(body)
            if body.get("path") is not None:
                name, kind = checkpoint_name(body), "sampler"
                if name.startswith(_EXTERNAL):
                    raise ApiError(
                        f"path: names that start with {_EXTERNAL!r} are save_weights_external's, got {name!r}"
                    )
            else:  # an ephemeral sampler: a save named after its request, sampled as a snapshot
                name, kind = f"sampler-{seq_id}", "ephemeral"
        except ApiError as exc:
            await refuse_in_turn(request, exc, body.get("model_id"), seq_id, "sampler", digest)
            raise
        model = await gw.model(body.get("model_id"), key)
        reply = await submit(
            model,
            seq_id,
            kind,
            lambda seq: training_pb2.SaveWeightsForSamplerRequest(sequence=seq, name=name),
            digest,
        )
        expire_after_save(model, seq_id, f"sampler_{name}", ttl, key)
        return reply

    @app.post("/api/v1/save_weights_external")
    async def save_weights_external(request: Request) -> dict:
        """The adapter in PEFT format (``adapter_config.json``, ``adapter_model.safetensors``), as a
        checkpoint ``external_weights/<name>`` of the model: a sampler save named ``external.<name>``."""
        key = _key(request)
        body = await _json(request, limit)
        seq_id = _field(body, "seq_id", int)
        digest = _digest(body)
        try:
            name = _EXTERNAL + checkpoint_name(body, longest=64 - len(_EXTERNAL))
            ttl = _ttl_seconds(body)
            if body.get("age_encryption_recipients"):
                raise ApiError("age_encryption_recipients: encrypted exports are not served; expected none")
        except ApiError as exc:
            await refuse_in_turn(request, exc, body.get("model_id"), seq_id, "external", digest)
            raise
        model = await gw.model(body.get("model_id"), key)
        reply = await submit(
            model,
            seq_id,
            "external",
            lambda seq: training_pb2.SaveWeightsForSamplerRequest(sequence=seq, name=name),
            digest,
        )
        expire_after_save(model, seq_id, _folder(_EXTERNAL_KIND[1], name.removeprefix(_EXTERNAL)), ttl, key)
        return reply

    def expire_after_save(model: Model, seq_id: int, folder: str, ttl: int | None, key: str) -> None:
        """Give the save of request ``seq_id`` (its folder ``folder``) its ``ttl_seconds`` once the
        scheduler lists it, a moment after it answers: in the background, on this instance."""
        done = model.future(seq_id)
        if ttl is None or done is None:
            return
        job = asyncio.ensure_future(expire_when_listed(model.task_id, folder, ttl, key, done))
        gw.expiries.add(job)
        job.add_done_callback(gw.expiries.discard)

    async def expire_when_listed(run_id: str, folder: str, ttl: int, key: str, done: asyncio.Future) -> None:
        if (await asyncio.shield(done)).error is not None:
            return
        deadline = time.monotonic() + _SAVE_LISTED_S
        try:
            while time.monotonic() < deadline:
                listing = await gw.scheduler.checkpoints(run_id, key)
                found = [c for c in listing.checkpoints if Path(c.path).name == folder]
                if found:
                    await gw.scheduler.set_checkpoint_ttl(run_id, found[-1].artifact.key, ttl, key)
                    return
                await asyncio.sleep(0.5)
        except ApiError as exc:
            log.warning("ttl_seconds of save %s of model %s not set: %s", folder, run_id, exc.message)
            return
        log.warning("ttl_seconds of save %s of model %s not set: not listed in %s s", folder, run_id, _SAVE_LISTED_S)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict:
        key = _key(request)
        body = await _json(request, limit)
        if body.get("session_id") is not None:
            return await create_from_state(body, key, _field(body, "path", str))
        seq_id = _field(body, "seq_id", int)
        digest = _digest(body)
        model = await gw.model(body.get("model_id"), key)
        artifact = None
        try:
            path = _field(body, "path", str)
            source, kind, name = _parse_path(path, "path")
            if kind != "weights":
                raise ApiError(f"path: expected a save_state path (tinker://<model id>/weights/<name>), got {path!r}")
            if source in (model.model_id, model.task_id):
                await not_deleted(path, "path", key)
            else:
                artifact = await other_runs_state(model, path, key)
        except ApiError as exc:
            await refuse_in_turn(request, exc, model.model_id, seq_id, "load", digest)
            raise
        with_optimizer = bool(body.get("optimizer"))
        return await submit(
            model,
            seq_id,
            "load",
            lambda seq: training_pb2.LoadStateRequest(
                sequence=seq, name=name, with_optimizer=with_optimizer, artifact=artifact
            ),
            digest,
        )

    async def other_runs_state(model: Model, path: str, key: str) -> common_pb2.ArtifactRef:
        """The stored state ``path`` of another run of the caller, to load into ``model``.

        Raises:
            ApiError: 404 for a state not listed (never saved, deleted, another owner's); 400 for
                one of another base model or LoRA shape than ``model``'s.
        """
        try:
            recorded = await saved(path, "path", key)
        except ApiError as exc:
            if exc.status == 404:
                raise ApiError(f"path: no state {path!r} (deleted, or never saved)", status=404) from None
            raise
        source = await gw.task(recorded.task_id, key, "path")
        if source.spec.model != model.model_dir:
            raise ApiError(
                f"path: {path!r} is a state of base model {await gw.base_model_of(source.spec.model, key)!r}, "
                f"this model trains {model.base_model!r}; load it with create_training_client_from_state"
            )
        theirs, mine = (
            _lora_shape(source.spec.hyperparameters),
            _lora_shape((await gw.task(model.task_id, key)).spec.hyperparameters),
        )
        for field_name, have, want in zip(("rank", "target modules"), theirs, mine):
            if have != want:
                raise ApiError(
                    f"path: {path!r} is a state of LoRA {field_name} {have}, this model's is {want}; "
                    "load it with create_training_client_from_state"
                )
        if not recorded.artifact.key:
            raise ApiError(f"path: {path!r} is not in the artifact store; it cannot be loaded into another run")
        return recorded.artifact

    async def create_from_state(body: dict, key: str, path: str) -> dict:
        """A new model starting from state ``path`` of any run of the caller
        (``create_training_client_from_state``): a ``lora_session`` task with ``init_from`` that
        run's task and ``init_state`` the state's name, with the run's LoRA shape. The state's
        optimizer state and step come too when ``optimizer`` is true. Its requests count from
        ``seq_id`` 1, as after ``create_model``.

        Raises:
            ApiError: 404 for a path that names no state the caller may read (another owner's too).
        """
        session_id = _field(body, "session_id", str)
        model_seq_id = _field(body, "model_seq_id", int)
        source_id, kind, name = _parse_path(path, "path")
        missing = ApiError(f"path: no state {path!r}", status=404)
        if kind != "weights":
            raise ApiError(f"path: expected a save_state path (tinker://<model id>/weights/<name>), got {path!r}")
        try:
            source = await gw.task(source_id, key, "path")
        except ApiError as exc:
            raise (missing if exc.status == 404 else exc) from None
        states = {Path(c.path).name for c in (await gw.scheduler.checkpoints(source.task_id, key)).checkpoints}
        if f"{STATE_PREFIX}{name}" not in states:
            raise missing
        base_model = body.get("base_model")
        if base_model is not None and await gw.model_dir(base_model, key) != source.spec.model:
            raise ApiError(
                f"base_model: expected {await gw.base_model_of(source.spec.model, key)!r}, the base model of {path!r}, "
                f"got {base_model!r}"
            )
        hp = dict(source.spec.hyperparameters)
        spec = SessionSpec(
            source.spec.model,
            int(hp.get("lora_rank", 32)),
            tuple(hp.get("target_modules") or ()),
            int(hp.get("seed", 0)),
            config.heartbeat_timeout_s,
            init_from=source.task_id,
            init_state=name,
            init_optimizer=bool(body.get("optimizer")),
            held_call_timeout_s=config.gap_timeout_s,
        )
        model_id = f"{session_id}:train:{model_seq_id}"
        name = TASK_NAME_PREFIX + model_id
        task_id = await gw.scheduler.submit_session(spec, name=name, key=key, request_id=name)
        return {"request_id": f"load#{task_id}#{path}", "model_id": model_id}

    # --- sampling -------------------------------------------------------------------------------
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        key = _key(request)
        body = await _json(request, limit)
        path = body.get("model_path")
        if path is None:
            return {"type": "create_sampling_session", "sampling_session_id": await base_sampler(body, key)}
        source, kind, name = _parse_path(path, "model_path")
        if kind != "sampler_weights":
            raise ApiError(f"model_path: expected a save_weights_for_sampler path (sampler_weights), got {path!r}")
        await gw.model(source, key)
        await not_deleted(path, "model_path", key)
        return {"type": "create_sampling_session", "sampling_session_id": f"{source}~{name}"}

    async def base_sampler(body: dict, key: str) -> str:
        """A sampler of the base model: the adapter off on a model of the same Tinker session."""
        base_model = _field(body, "base_model", str)
        folder = await gw.model_dir(base_model, key)
        session_id = _field(body, "session_id", str)
        for task in await gw.scheduler.session_tasks(f"{TASK_NAME_PREFIX}{session_id}:", key):
            if task.spec.model == folder:
                return f"{task.task_id}~{BASE_MODEL}"
        raise ApiError(
            f"base_model: a base-model sampler is served on a training client of the same base model in "
            f"this session; create_lora_training_client(base_model={base_model!r}) first"
        )

    async def sampler_model(sampler_id: Any, key: str) -> tuple[Model, str]:
        if not isinstance(sampler_id, str) or "~" not in sampler_id:
            raise ApiError(f"sampling_session_id: no sampler {sampler_id!r}", status=404)
        model_id, name = sampler_id.split("~", 1)
        return await gw.model(model_id, key), name

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request) -> dict:
        model, name = await sampler_model(sampler_id, _key(request))
        return {
            "sampler_id": sampler_id,
            "base_model": model.base_model,
            "model_path": None if name == BASE_MODEL else f"tinker://{model.model_id}/sampler_weights/{name}",
        }

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict:
        key = _key(request)
        body = await _json(request, limit)
        model, sampler = await sampler_model(body.get("sampling_session_id"), key)
        params, prompt = sample_request(body)
        request_id = f"{body.get('sampling_session_id')}#sample-{uuid.uuid4().hex}"
        sequence_ids = [f"{request_id}/{i}" for i in range(prompt.num_samples)]
        if body.get("record_stability_info"):  # the session keeps them for stable_reinforce
            prompt.record_sequence_ids.extend(sequence_ids)
        if len(gw.samples) > 65536:  # answered samples are kept for retried polls, the newest ones
            for done in [r for r, f in gw.samples.items() if f.done()][:32768]:
                del gw.samples[done]
        gw.samples[request_id] = gw.batcher.sample(model, sampler, params, prompt)
        return {"request_id": request_id, "sample_sequence_ids": sequence_ids}

    # --- training runs and checkpoints (REST) -------------------------------------------------
    async def run_task(run_id: str, key: str) -> common_pb2.Task:
        """The session task of training run ``run_id`` (a model id, :meth:`Gateway.task`). Raises
        ApiError 404 when the key may not see it, worded as for a missing run: another owner's run
        is not found either."""
        try:
            return await gw.task(run_id, key, "training_run_id")
        except ApiError as exc:
            if exc.status == 404:
                raise ApiError(f"training_run_id: no training run {run_id!r}", status=404) from None
            raise

    async def run_checkpoints(run_id: str, key: str) -> list[tuple[dict, common_pb2.Checkpoint]]:
        """The run's checkpoints, oldest first: each as Tinker's ``Checkpoint`` and as recorded."""
        out = []
        for c in (await gw.scheduler.checkpoints(run_id, key)).checkpoints:
            prefix, _, name = Path(c.path).name.partition("_")
            kind = _CHECKPOINT_KINDS.get(prefix)
            if prefix == "sampler" and name.startswith(_EXTERNAL):
                kind, name = _EXTERNAL_KIND, name.removeprefix(_EXTERNAL)
            if kind is None or not name:
                continue
            listed = {
                "checkpoint_id": f"{kind[1]}/{name}",
                "checkpoint_type": kind[0],
                "time": c.create_time.ToJsonString(),
                "tinker_path": f"tinker://{run_id}/{kind[1]}/{name}",
                "size_bytes": c.artifact.total_bytes if c.artifact.key else None,
                "expires_at": c.expire_time.ToJsonString() if c.HasField("expire_time") else None,
            }
            out.append((listed, c))
        return out

    async def training_run(task: common_pb2.Task, checkpoints: list[dict], key: str) -> dict:
        last = {t: [c for c in checkpoints if c["checkpoint_type"] == t][-1:] for t in ("training", "sampler")}
        return {
            "training_run_id": task.task_id,
            "base_model": await gw.base_model_of(task.spec.model, key),
            "model_owner": task.owner,
            "is_lora": True,
            "lora_rank": int(dict(task.spec.hyperparameters).get("lora_rank", 0)),
            "last_request_time": task.update_time.ToJsonString(),
            "last_checkpoint": (last["training"] or [None])[0],
            "last_sampler_checkpoint": (last["sampler"] or [None])[0],
        }

    async def listed_checkpoints(run_id: str, key: str) -> list[dict]:
        return [listed for listed, _ in await run_checkpoints(run_id, key)]

    @app.get("/api/v1/training_runs")
    async def list_training_runs(request: Request) -> dict:
        key = _key(request)
        limit, offset = _page(request, default_limit=20)
        runs = await gw.scheduler.runs(key)
        # One scheduler read per run, one after the other: the owner's read_rate bounds them.
        return {
            "training_runs": [
                await training_run(t, await listed_checkpoints(t.task_id, key), key)
                for t in runs[offset : offset + limit]
            ],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)},
        }

    @app.get("/api/v1/checkpoints")
    async def list_user_checkpoints(request: Request) -> dict:
        key = _key(request)
        limit, offset = _page(request, default_limit=100)
        found: list[tuple[dict, common_pb2.Checkpoint]] = []
        for t in await gw.scheduler.runs(key):
            found += await run_checkpoints(t.task_id, key)
        found.sort(key=lambda c: c[1].create_time.ToNanoseconds(), reverse=True)
        return {
            "checkpoints": [listed for listed, _ in found[offset : offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(found)},
        }

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def list_checkpoints(run_id: str, request: Request) -> dict:
        key = _key(request)
        task = await run_task(run_id, key)
        return {"checkpoints": await listed_checkpoints(task.task_id, key)}

    @app.get("/api/v1/training_runs/{run_id}")
    async def get_training_run(run_id: str, request: Request) -> dict:
        key = _key(request)
        task = await run_task(run_id, key)
        return await training_run(task, await listed_checkpoints(task.task_id, key), key)

    async def saved(path: str, field_name: str, key: str) -> common_pb2.Checkpoint:
        """The checkpoint ``path`` names (``tinker://<run>/<kind>/<name>``). Raises ApiError: 400 for
        a malformed path, 404 for one not listed (deleted, never saved, another owner's)."""
        run_id, _, _ = _parse_path(path, field_name)
        task = await run_task(run_id, key)
        for listed, recorded in await run_checkpoints(task.task_id, key):
            if listed["tinker_path"] == path:
                return recorded
        raise ApiError(f"{field_name}: no checkpoint {path!r} (deleted, or never saved)", status=404)

    async def not_deleted(path: str, field_name: str, key: str) -> None:
        """Raises ApiError 404 when the checkpoint ``path`` names was deleted. A save is listed only
        once the scheduler has recorded it, a moment after its future answers, so a path neither
        listed nor deleted goes on to the session worker, which knows its own saves."""
        run_id, kind, name = _parse_path(path, field_name)
        folder = _folder(kind, name)
        listing = await gw.scheduler.checkpoints(run_id, key)
        if any(Path(c.path).name == folder for c in listing.checkpoints):
            return
        if any(k.rsplit("/", 1)[-1] == folder for k in listing.deleted_keys):
            raise ApiError(f"{field_name}: checkpoint {path!r} was deleted", status=404)

    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(run_id: str, kind: str, name: str, request: Request) -> Response:
        key = _key(request)
        recorded = await saved(f"tinker://{run_id}/{kind}/{name}", "checkpoint_id", key)
        if not recorded.artifact.key:
            raise ApiError(f"checkpoint_id: {kind}/{name} is not in the artifact store; it cannot be deleted")
        await gw.scheduler.delete_checkpoint(recorded.task_id, recorded.artifact.key, key)
        return Response(content=b"null", media_type="application/json")

    @app.get("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls")
    async def checkpoint_urls(run_id: str, kind: str, name: str, request: Request) -> dict:
        """A URL per file of the checkpoint, as ``get_external_weights_urls`` answers: each fetched
        with no key for ``_DOWNLOAD_URL_S``, from any gateway instance that shares this one's
        download URL secret."""
        key = _key(request)
        recorded = await saved(f"tinker://{run_id}/{kind}/{name}", "checkpoint_id", key)
        manifest, chunks = await gw.scheduler.download(recorded.task_id, recorded.artifact.key, key)
        await chunks.aclose()
        expires = time.time() + _DOWNLOAD_URL_S
        token = gw.download_urls.seal(Download(key, recorded.task_id, recorded.artifact.key, expires))
        base = str(request.base_url).rstrip("/")
        return {
            "urls": {f.path: f"{base}/api/v1/checkpoint_files/{token}/{quote(f.path)}" for f in manifest.files},
            "expires": datetime.fromtimestamp(expires, timezone.utc).isoformat(),
        }

    @app.get("/api/v1/checkpoint_files/{token}/{path:path}")
    async def checkpoint_file(token: str, path: str) -> StreamingResponse:
        """One file of a checkpoint, streamed from the scheduler as it arrives."""
        download = gw.download_urls.open(token)
        manifest, chunks = await gw.scheduler.download(download.run_id, download.artifact_key, download.key)
        index = next((i for i, f in enumerate(manifest.files) if f.path == path), None)
        if index is None:
            await chunks.aclose()
            raise ApiError(f"path: the checkpoint has no file {path!r}", status=404)
        size = manifest.files[index].size_bytes

        async def body():
            sent = 0
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if chunk.file_index == index:
                        sent += len(chunk.data)
                        yield chunk.data
                    if sent >= size and chunk.file_index >= index:
                        return

        return StreamingResponse(body(), media_type="application/octet-stream", headers={"Content-Length": str(size)})

    @app.put("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
    async def set_checkpoint_ttl(run_id: str, kind: str, name: str, request: Request) -> Response:
        key = _key(request)
        ttl = _ttl_seconds(await _json(request, limit))
        recorded = await saved(f"tinker://{run_id}/{kind}/{name}", "checkpoint_id", key)
        await gw.scheduler.set_checkpoint_ttl(recorded.task_id, recorded.artifact.key, ttl, key)
        return Response(content=b"null", media_type="application/json")

    @app.post("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    async def publish_checkpoint(run_id: str, kind: str, name: str, request: Request) -> Response:
        _key(request)
        raise ApiError(
            "publish: public checkpoints are not served by this OpenTinker; a checkpoint is its owner's only",
            status=400,
        )

    # --- futures ------------------------------------------------------------------------------
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        key = _key(request)
        body = await _json(request, limit)
        request_id = _field(body, "request_id", str)
        try:
            outcome = await asyncio.wait_for(answer(request_id, key), timeout=config.long_poll_s)
        except (asyncio.TimeoutError, NotYet):
            log.debug("future not answered yet", request_id=request_id)
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if outcome.error is not None:
            return JSONResponse(outcome.error.failed())
        if outcome.proto is not None:
            return Response(content=outcome.proto, media_type=_PROTO)
        return JSONResponse(outcome.json)

    async def answer(request_id: str, key: str) -> Outcome:
        """The outcome of future ``request_id``: from memory, else the session's kept answer."""
        if request_id.startswith("load#"):  # a model created from a state serves once it loaded it
            _, task_id, path = (request_id.split("#", 2) + ["", ""])[:3]
            model = await gw.model(task_id, key)
            return Outcome(json={"type": "load_weights", "path": path, "model_id": model.model_id})
        if request_id.startswith("create#"):
            task_id = request_id[len("create#") :]
            await gw.model(task_id, key)
            return Outcome(json={"type": "create_model", "model_id": task_id})
        if "#sample-" in request_id:
            future = gw.samples.get(request_id)
            if future is None:
                raise ApiError(f"request_id: no sample {request_id!r} on this gateway; sample again", status=410)
            return await asyncio.shield(future)
        model_id, seq, kind = (request_id.split("#") + ["", ""])[:3]
        if not seq.isdigit() or kind not in KINDS:
            raise ApiError(f"request_id: no request {request_id!r}", status=404)
        model = await gw.model(model_id, key)
        seq_id = int(seq)
        k = KINDS[kind]

        def probe(s: int, md: tuple):
            return getattr(model.stub, k.rpc)(k.probe(s), timeout=_CALL_TIMEOUT_S, metadata=md)

        wait = _POLL_WAIT[0]
        while True:  # until answered; retrieve_future's long-poll bounds it
            future = model.future(seq_id)
            if future is not None:
                return await asyncio.shield(future)
            try:
                return await model.kept(seq_id, k.rpc, probe, lambda r: k.answer(model, r))
            except NotYet as exc:
                if exc.next_is_it and model.missing(seq_id):
                    lost = ApiError(
                        f"request_id: request {seq_id} of model {model_id} never reached its session worker, "
                        f"which waited {model.gap_timeout_s:g} s for it (the gateway instance that took it "
                        "stopped); it failed, and the model goes on with the next request",
                        category="server",
                    )
                    log.warning("request lost", model_id=model_id, seq_id=seq_id)
                    model.submit(seq_id, k.rpc, probe, lambda r: k.answer(model, r), digest=None, refused=lost)
                    continue
            await asyncio.sleep(wait)
            wait = min(wait * 2, _POLL_WAIT[1])

    return app
