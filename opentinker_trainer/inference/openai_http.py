"""An OpenAI-compatible HTTP endpoint over the same :class:`~.runtime.ModelRuntime` (FastAPI on
uvicorn, in the server's event loop), so a trained adapter drops into any tool that speaks the
OpenAI API (the ``openai`` Python client, LangChain, curl).

Routes (the OpenAI API reference, https://platform.openai.com/docs/api-reference):

* ``GET /v1/models``: the base model by its name (:func:`base_model_id`: the task's
  ``spec.model``, a local folder by its last component) and the adapters this server has served
  that the caller may use, by the id a request gave it (its training task's id, or
  ``task@step``), resident or not: ``RLClient.serve`` and ``opentinker serve`` load the adapter
  they bind, so it is listed before its first request. The
  :data:`~.runtime.MAX_SERVED_ADAPTERS` most recently served are listed; one whose checkpoint no
  longer resolves (deleted) is left out and forgotten. ``model`` also accepts ``spec.model`` as
  written, and any other adapter of the caller (a ``lora_finetune``/``sft``/``lora_session``
  task on this base model), listed once it has been served.
* ``POST /v1/completions``: ``prompt`` (a string, or a list of one), ``max_tokens`` (default 16,
  as OpenAI), ``temperature``, ``top_p``, ``n``, ``stop``, ``seed``, ``logprobs`` (an integer:
  the chosen tokens' log-probabilities; alternatives are not computed, ``top_logprobs`` is
  empty), ``stream``.
* ``POST /v1/chat/completions``: ``messages`` (system/user/assistant, string content), the same
  settings (``max_tokens`` or ``max_completion_tokens``, default 256), ``logprobs`` (bool),
  ``stream`` with ``stream_options.include_usage``.

Streaming is server-sent events (``data: {json}`` per chunk, ``data: [DONE]`` last), one chunk
per token and choice; a client that disconnects cancels its request (its batch row is freed).
Log-probabilities are the raw model distribution (:mod:`.sampling`).

A request body is at most :data:`MAX_BODY_BYTES`: a longer one is refused with 413 from its
``Content-Length`` before it is read, or as soon as a chunked one passes the limit. The body
is read as JSON within :mod:`opentinker_common.documents`' bounds (64 levels of nesting; NaN
and Infinity are not JSON); ``seed`` is a 64-bit integer. Every refusal, and any unexpected
error, is a JSON error in OpenAI's shape, never a plain-text one.

Security is the gRPC server's: with an access checker every request needs
``Authorization: Bearer ote_...``, an endpoint token for this inference task (the ``openai``
package's ``api_key``; ``opentinker endpoint-token TASK`` prints one), checked with the scheduler
for the task and for an adapter's task exactly as :class:`~.server.InferenceService` does; with TLS the port speaks
HTTPS only. Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with the
HTTP status of the gRPC code (400 INVALID_ARGUMENT, 401, 403, 404, 413 a body over the limit,
429 RESOURCE_EXHAUSTED, 503 UNAVAILABLE, 500 anything else).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import re
import tempfile
import time
import uuid
from dataclasses import dataclass

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from opentinker_common.documents import DocumentError, Limits, load_json

from opentinker_trainer.inference.access import AccessChecker, AccessRefused
from opentinker_trainer.inference.adapters import AdapterNotFound, AdapterRefused, AdaptersBusy
from opentinker_trainer.inference.engine import SamplingParams
from opentinker_trainer.inference.resolve import adapter_not_found, split_adapter_name
from opentinker_trainer.inference.runtime import BadRequest, Busy, ModelRuntime, Prepared, WrongModel
from opentinker_trainer.inference.serve_tls import ServerTLS

__all__ = ["build_openai_app", "start_openai_server", "RunningOpenAIServer", "OpenAIError"]

CHAT_DEFAULT_MAX_TOKENS = 256
COMPLETION_DEFAULT_MAX_TOKENS = 16
#: The longest request body read, in bytes (a prompt of about a million tokens' worth of text).
MAX_BODY_BYTES = 4 << 20
_BODY_LIMITS = Limits(max_bytes=MAX_BODY_BYTES)
#: The seeds torch's generators take: a signed or unsigned 64-bit integer.
_SEED_RANGE = (-(2**63), 2**64 - 1)

_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
}
_CODES = (
    (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (WrongModel, grpc.StatusCode.NOT_FOUND),
    (AdapterNotFound, grpc.StatusCode.NOT_FOUND),
    (AdapterRefused, grpc.StatusCode.FAILED_PRECONDITION),
    (AdaptersBusy, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Busy, grpc.StatusCode.RESOURCE_EXHAUSTED),
)


class OpenAIError(Exception):
    """An error answered as OpenAI does: ``status`` (HTTP), ``kind`` (its ``type``), ``param``."""

    def __init__(self, status: int, kind: str, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.param, self.code = status, kind, message, param, code

    @classmethod
    def from_exception(cls, exc: Exception) -> "OpenAIError":
        if isinstance(exc, OpenAIError):
            return exc
        if isinstance(exc, AccessRefused):
            status, kind = _HTTP.get(exc.code, (500, "server_error"))
            return cls(status, kind, exc.message)
        for exc_type, code in _CODES:
            if isinstance(exc, exc_type):
                status, kind = _HTTP[code]
                return cls(status, kind, str(exc), _param_of(str(exc)))
        raise exc

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# "sampling.max_tokens: expected ..." or "messages[0].role: expected ...": the field a message names.
_FIELD = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*|\[\d+\])*): ")


def _param_of(message: str) -> str | None:
    """The request field that ``message`` names at its start, as the request calls it
    (``max_tokens`` for the runtime's ``sampling.max_tokens``), or None."""
    m = _FIELD.match(message)
    return m.group(1).removeprefix("sampling.") if m else None


def _too_large(size: str) -> OpenAIError:
    return OpenAIError(
        413,
        "invalid_request_error",
        f"the request body is {size} bytes; expected at most {MAX_BODY_BYTES} bytes (send a shorter prompt)",
        code="request_too_large",
    )


def _bad(param: str, expected: str, got) -> OpenAIError:
    return OpenAIError(400, "invalid_request_error", f"{param}: expected {expected}, got {got!r}", param)


def _number(body: dict, key: str, default, kind=float):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise _bad(key, "an integer" if kind is int else "a number", value)
    return kind(value)


def _sampling(body: dict, default_max: int) -> SamplingParams:
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise _bad("stop", "a string or a list of strings", stop)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
        raise _bad("max_tokens", "an integer", max_tokens)
    seed = body.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not _SEED_RANGE[0] <= seed <= _SEED_RANGE[1]
    ):
        raise _bad("seed", "an integer in [-2**63, 2**64 - 1]", seed)
    return SamplingParams(
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        max_tokens=max_tokens if max_tokens is not None else default_max,
        stop=stops,
        seed=seed,
        n=_number(body, "n", 1, int),
    )


@dataclass
class _Call:
    """A parsed request: what to run, and how to answer."""

    req: Prepared
    model_id: str
    chat: bool
    stream: bool
    logprobs: bool
    include_usage: bool


def base_model_id(model_name: str) -> str:
    """The id ``/v1/models`` gives the base model ``model_name``: a local folder (an absolute or
    relative path, ``~/...``) by its last component, which names the model without the
    server's file system; a hub id such as ``org/model`` as it is."""
    if model_name.startswith(("/", "./", "../", "~")):
        return os.path.basename(model_name.rstrip("/")) or model_name
    return model_name


def build_openai_app(runtime: ModelRuntime, *, access: AccessChecker | None = None, task_id: str = ""):
    """The FastAPI application serving ``runtime`` (see the module docstring).

    Raises:
        ValueError: ``access`` without ``task_id``.
    """
    if access is not None and not task_id:
        raise ValueError("task_id: expected the serving task's id when access is checked")
    app = FastAPI(title="OpenTinker inference (OpenAI-compatible)", docs_url=None, redoc_url=None)
    created = int(time.time())
    base_id = base_model_id(runtime.model_name)
    base_names = {runtime.model_name, base_id}

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # an unknown path, a wrong method
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            OpenAIError(exc.status_code, kind, str(exc.detail)).body(), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(OpenAIError(400, "invalid_request_error", str(exc)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):  # a bug: still OpenAI's shape, never a traceback
        body = OpenAIError(500, "server_error", f"the server failed: {type(exc).__name__}").body()
        return JSONResponse(body, status_code=500)

    async def admit(request: Request, adapter: str | None = None) -> None:
        if access is None:
            return
        metadata = (("authorization", request.headers.get("authorization", "")),)
        await access.check(metadata, task_id)
        if adapter:
            try:
                await access.check(metadata, split_adapter_name(adapter)[0], task_id)
            except AccessRefused as exc:
                if exc.code == grpc.StatusCode.PERMISSION_DENIED:
                    raise adapter_not_found(adapter) from None
                raise

    async def may_use(request: Request, task: str) -> bool:
        """Whether the caller may use adapters of task ``task`` (admitted to this endpoint)."""
        try:
            await admit(request, task)
        except AdapterNotFound:
            return False
        return True

    def error(exc: Exception):
        err = OpenAIError.from_exception(exc)
        return JSONResponse(err.body(), status_code=err.status)

    async def read_json(request: Request) -> dict:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise _too_large(declared)
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BODY_BYTES:
                raise _too_large(f"over {MAX_BODY_BYTES}")
        try:
            body = load_json(bytes(data), _BODY_LIMITS)
        except DocumentError as exc:
            raise OpenAIError(400, "invalid_request_error", f"the request body: {exc}") from None
        if not isinstance(body, dict):
            got = {list: "a list", str: "a string", bool: "a boolean"}.get(type(body), "a number or null")
            raise OpenAIError(400, "invalid_request_error", f"the request body: expected a JSON object, got {got}")
        return body

    def parse(body: dict, *, chat: bool) -> _Call:
        model_id = body.get("model")
        if not isinstance(model_id, str) or not model_id:
            raise _bad("model", f"a model id ({base_id!r} or an adapter's task id)", model_id)
        adapter = "" if model_id in base_names else model_id
        params = _sampling(body, CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETION_DEFAULT_MAX_TOKENS)
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _bad("messages", "a non-empty list of {role, content}", messages)
            pairs = []
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                    raise _bad(f"messages[{i}].content", "a string", m.get("content") if isinstance(m, dict) else m)
                pairs.append((str(m.get("role", "")), m["content"]))
            req = runtime.prepare(model="", adapter=adapter, text=None, messages=pairs, params=params)
            want_logprobs = bool(body.get("logprobs"))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise _bad("prompt", "a string (or a list of one string)", prompt)
            if body.get("echo"):
                raise _bad("echo", "false (echo is not supported)", body.get("echo"))
            req = runtime.prepare(model="", adapter=adapter, text=prompt, messages=None, params=params)
            lp = body.get("logprobs")
            if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or lp < 0):
                raise _bad("logprobs", "an integer >= 0 or null", lp)
            want_logprobs = lp is not None
        options = body.get("stream_options") or {}
        return _Call(
            req=req,
            model_id=model_id,
            chat=chat,
            stream=bool(body.get("stream")),
            logprobs=want_logprobs,
            include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        )

    def token_text(token_id: int) -> str:
        return runtime.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprobs_of(call: _Call, ids: list[int], lps: list[float], offset: int = 0):
        if not call.logprobs:
            return None
        texts = [token_text(t) for t in ids]
        if call.chat:
            return {
                "content": [
                    {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                    for s, lp in zip(texts, lps)
                ]
            }
        offsets, at = [], offset
        for s in texts:
            offsets.append(at)
            at += len(s)
        return {"tokens": texts, "token_logprobs": list(lps), "top_logprobs": None, "text_offset": offsets}

    async def complete(call: _Call) -> dict:
        n = call.req.params.n
        texts, ids, lps, finish = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
        usage = (0, 0)
        async for ev in runtime.run(call.req):
            if ev.usage is not None:
                usage = ev.usage
                continue
            texts[ev.index] += ev.text
            ids[ev.index].extend(ev.token_ids)
            lps[ev.index].extend(ev.logprobs)
            finish[ev.index] = ev.finish_reason or finish[ev.index]
        choices = []
        for i in range(n):
            choice = {"index": i, "finish_reason": finish[i], "logprobs": logprobs_of(call, ids[i], lps[i])}
            if call.chat:
                choice["message"] = {"role": "assistant", "content": texts[i]}
            else:
                choice["text"] = texts[i]
            choices.append(choice)
        return {
            "id": ("chatcmpl-" if call.chat else "cmpl-") + uuid.uuid4().hex,
            "object": "chat.completion" if call.chat else "text_completion",
            "created": int(time.time()),
            "model": call.model_id,
            "choices": choices,
            "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)},
        }

    async def stream(call: _Call, events, first):
        rid = ("chatcmpl-" if call.chat else "cmpl-") + uuid.uuid4().hex
        kind = "chat.completion.chunk" if call.chat else "text_completion"
        now = int(time.time())
        offsets = [0] * call.req.params.n

        def chunk(choices, usage=None) -> str:
            body = {"id": rid, "object": kind, "created": now, "model": call.model_id, "choices": choices}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        try:
            if call.chat:
                yield chunk(
                    [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        for i in range(call.req.params.n)
                    ]
                )
            ev = first
            while ev is not None:
                if ev.usage is not None:
                    if call.include_usage:
                        p, c = ev.usage
                        yield chunk([], {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
                else:
                    choice = {
                        "index": ev.index,
                        "finish_reason": ev.finish_reason,
                        "logprobs": logprobs_of(call, ev.token_ids, ev.logprobs, offsets[ev.index]),
                    }
                    offsets[ev.index] += sum(len(token_text(t)) for t in ev.token_ids) if call.logprobs else 0
                    if call.chat:
                        choice["delta"] = {"content": ev.text} if ev.text else {}
                    else:
                        choice["text"] = ev.text
                    yield chunk([choice])
                ev = await anext(events, None)
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()  # a client that went away: its batch row is freed

    async def handle(request: Request, *, chat: bool):
        try:
            await admit(request)
            call = parse(await read_json(request), chat=chat)
            await admit(request, call.req.adapter)
            if not call.stream:
                return JSONResponse(await complete(call))
            events = runtime.run(call.req)
            first = await anext(events)  # errors (queue full, adapter refused) before any byte is sent
        except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error, or re-raised
            return error(exc)
        return StreamingResponse(
            stream(call, events, first), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            await admit(request)
            served = dict(runtime.served_adapters)
            # One access check per task, however many of its versions were served.
            tasks = sorted({split_adapter_name(name)[0] for name in served})
            allowed = await asyncio.gather(*(may_use(request, task) for task in tasks))
            mine = {task for task, ok in zip(tasks, allowed) if ok}
            visible = await runtime.resolvable_adapters([n for n in served if split_adapter_name(n)[0] in mine])
        except Exception as exc:  # noqa: BLE001
            return error(exc)
        data = [{"id": base_id, "object": "model", "created": created, "owned_by": "opentinker"}]
        data += [
            {"id": name, "object": "model", "created": int(served[name]), "owned_by": "opentinker", "parent": base_id}
            for name in sorted(visible, key=served.__getitem__)
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


@dataclass
class RunningOpenAIServer:
    """A running endpoint: ``port`` and whether it speaks TLS (``https://``)."""

    server: object
    task: asyncio.Task
    port: int
    tls: bool

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start_openai_server(
    runtime: ModelRuntime,
    *,
    host: str = "0.0.0.0",
    port: int = 0,
    tls: ServerTLS | None = None,
    access: AccessChecker | None = None,
    task_id: str = "",
) -> RunningOpenAIServer:
    """Serve :func:`build_openai_app` with uvicorn on ``host:port`` (0 = any free port) in this
    event loop. ``tls``: (certificate chain PEM, private key PEM), HTTPS only.

    Raises:
        OSError: the port cannot be bound, or the server did not start.
        ValueError: ``access`` without ``task_id``.
    """
    import uvicorn

    app = build_openai_app(runtime, access=access, task_id=task_id)
    folder = None
    kw = {}
    if tls is not None:
        # uvicorn reads the certificate and key from files: a private folder, removed once loaded.
        folder = tempfile.mkdtemp(prefix="opentinker-openai-tls-")
        for name, data in (("cert.pem", tls[0]), ("key.pem", tls[1])):
            fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        kw = {"ssl_certfile": os.path.join(folder, "cert.pem"), "ssl_keyfile": os.path.join(folder, "key.pem")}
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))  # here, not in uvicorn (which exits the process when it cannot bind)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot serve the OpenAI-compatible endpoint on {host}:{port}: {exc.strerror}") from None
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, **kw)
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise OSError(f"the OpenAI-compatible endpoint on {host}:{bound} did not start")
            await asyncio.sleep(0.01)
    finally:
        if folder is not None:
            for name in ("cert.pem", "key.pem"):
                try:
                    os.unlink(os.path.join(folder, name))
                except FileNotFoundError:
                    pass
            os.rmdir(folder)
    return RunningOpenAIServer(server=server, task=task, port=bound, tls=tls is not None)
