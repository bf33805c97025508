"""``InferenceClient``: generate text from a served base model and its LoRA adapters.

From a trained task to answers in one call::

    from opentinker_client import RLClient

    with RLClient("http://scheduler-host:8888") as client:
        task_id = client.submit_task(workload_type="lora_finetune", hyperparameters={"steps": 20})
        client.wait(task_id)
        llm = client.serve(task_id)          # finds or starts an `inference` task, waits for it
        print(llm.generate(messages=[{"role": "user", "content": "What is 2 + 3?"}], temperature=0).text)

An :class:`InferenceClient` talks to the node that serves the model directly (the address comes
from the inference task, ``TaskInfo.endpoint``). Every error is an
:class:`~opentinker_client.errors.OpenTinkerError` subclass carrying the gRPC status.

Security: the client sends its API key (``api_key``, default ``$OPENTINKER_API_KEY``) as
``authorization: Bearer ...``; the server asks the scheduler whether that key may use the
inference task (and the adapter's task). An ``https://host:port`` endpoint (what a server with
TLS reports) is dialled with TLS, trusting ``root_certificates`` (default ``$OPENTINKER_TLS_CA``,
else the system's roots); ``host:port`` and ``http://host:port`` are plaintext.

Also here: the helpers behind :meth:`RLClient.serve`, :meth:`RLClient.list_checkpoints` and
:meth:`RLClient.download_checkpoint`. Torch-free.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import grpc

from opentinker.inference.v1 import inference_pb2, inference_pb2_grpc
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_client.convert import timestamp_to_datetime
from opentinker_common.net.url import parse_scheduler_url, redact_userinfo
from opentinker_client.errors import (
    INFERENCE_PLAINTEXT_HINT,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    OpenTinkerError,
    TaskFailedError,
    from_rpc_error,
)
from opentinker_common.net.grpc_options import client_keepalive, message_limits

if TYPE_CHECKING:  # pragma: no cover
    from opentinker_client.client import RLClient

__all__ = [
    "InferenceClient",
    "Generation",
    "Sample",
    "StreamChunk",
    "AdapterInfo",
    "CheckpointInfo",
    "ADAPTER_WORKLOADS",
    "parse_endpoint",
]

#: Workloads whose checkpoints are LoRA adapters an inference server can load.
ADAPTER_WORKLOADS = ("lora_finetune", "sft")
_FINISH = {inference_pb2.FINISH_REASON_STOP: "stop", inference_pb2.FINISH_REASON_LENGTH: "length"}
_BASE = object()  # "the client's default adapter" marker


@dataclass(frozen=True)
class Sample:
    """One completion.

    Attributes:
        text: decoded text without special tokens, cut before a matched stop string.
        token_ids: generated tokens, the stop token included.
        logprobs: per token, natural-log probability under the model's raw distribution
            (log-softmax of the logits at temperature 1, before temperature/top-k/top-p).
        finish_reason: ``"stop"`` (stop token or stop string) or ``"length"`` (max_tokens).
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str


@dataclass(frozen=True)
class Generation:
    """The answer to one :meth:`InferenceClient.generate` call."""

    samples: tuple[Sample, ...]
    prompt_tokens: int
    completion_tokens: int
    model: str
    adapter: str | None

    @property
    def text(self) -> str:
        """The first sample's text."""
        return self.samples[0].text if self.samples else ""


@dataclass(frozen=True)
class StreamChunk:
    """New output of sample ``index`` from :meth:`InferenceClient.generate_stream`.

    ``finish_reason`` is set on a sample's last chunk; the stream's very last chunk has
    ``usage`` = ``(prompt_tokens, completion_tokens)`` and no text.
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None = None
    usage: tuple[int, int] | None = None


@dataclass(frozen=True)
class AdapterInfo:
    """An adapter loaded on the server (``path``: its checkpoint folder's name, e.g. ``step_20``;
    ``size_bytes``: its LoRA tensors)."""

    name: str
    path: str
    size_bytes: int
    load_time: _dt.datetime | None
    last_used_time: _dt.datetime | None
    in_use: int


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint a task recorded (``path`` is a folder on the node that wrote it)."""

    task_id: str
    step: int
    path: str
    format: str
    final: bool
    attempt: int
    node_id: str
    create_time: _dt.datetime | None


def _channel_options() -> list[tuple[str, Any]]:
    return [*client_keepalive(), *message_limits()]


_TLS_SCHEMES = ("https://", "grpcs://")
_PLAIN_SCHEMES = ("http://", "grpc://")


def parse_endpoint(endpoint: str) -> tuple[str, bool]:
    """An inference endpoint -> ``(host:port target, use TLS)``.

    ``https://host:port`` and ``grpcs://host:port`` mean TLS; ``host:port``, ``http://host:port``
    and ``grpc://host:port`` plaintext. IPv6 hosts in brackets (``[::1]:9000``).

    Raises:
        ValueError: not a string, no port, a path, an unknown scheme ..., naming ``endpoint``.
    """
    if not isinstance(endpoint, str):
        raise ValueError(
            f"endpoint: expected a string such as host:port or https://host:port, got {type(endpoint).__name__}"
        )
    text = endpoint.strip()
    low = text.lower()
    tls = low.startswith(_TLS_SCHEMES)
    rest = text.split("://", 1)[1] if tls or low.startswith(_PLAIN_SCHEMES) else text
    if "://" in rest:
        scheme = rest.split("://", 1)[0] + "://"
        scheme = scheme if "@" not in endpoint else "***://"  # may hold a user:password@ part
        raise ValueError(
            f"endpoint: bad inference endpoint {redact_userinfo(endpoint)!r}: unknown scheme {scheme!r}; expected host:port, http://host:port or https://host:port (TLS)"
        )
    try:
        target = parse_scheduler_url(rest)
    except ValueError as exc:
        why = str(exc).split("': ", 1)[-1].split("; expected", 1)[0]
        raise ValueError(
            f"endpoint: bad inference endpoint {redact_userinfo(endpoint)!r}: {why}; expected host:port, http://host:port or https://host:port (TLS)"
        ) from None
    return target, tls


class InferenceClient:
    """A connection to one ``InferenceService``.

    Args:
        endpoint: ``host:port`` (or ``http://host:port``) of a plaintext server, or
            ``https://host:port`` (``grpcs://`` too) of a TLS one — the form the server's
            inference task reports. Or give ``scheduler_url`` and ``task_id`` (an
            ``inference`` task) and the endpoint is looked up, waiting up to ``ready_timeout``
            seconds for the task to run and report one.
        adapter: default adapter of every call (a finished lora_finetune/sft task id); ``None``
            is the base model.
        model: the base model name requests carry; ``""`` means whatever the server serves.
        timeout: deadline of each unary call, in seconds.
        api_key: sent as ``authorization: Bearer <key>`` on every call (the server checks it with
            the scheduler). ``None`` reads ``$OPENTINKER_API_KEY``; ``""`` sends none. Surrounding
            whitespace is stripped.
        root_certificates: PEM file of the CA that signed the server's certificate, for
            ``https://`` endpoints. ``None`` reads ``$OPENTINKER_TLS_CA``; unset = the system's
            roots. Also used for the scheduler when ``scheduler_url`` is given.

    Raises:
        ValueError: a bad ``endpoint``, a ``root_certificates`` file that cannot be read or
            is not a PEM certificate, or an ``api_key`` with inner whitespace or control
            characters (naming the argument, never the key).
        InvalidArgumentError: neither an endpoint nor scheduler_url + task_id.
        NotFoundError: no such inference task. TaskFailedError: it ended before serving.
        DeadlineExceededError: it did not report an endpoint within ``ready_timeout``.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        scheduler_url: str | None = None,
        task_id: str | None = None,
        adapter: str | None = None,
        model: str = "",
        timeout: float = 120.0,
        ready_timeout: float = 600.0,
        api_key: str | None = None,
        root_certificates: str | os.PathLike | None = None,
    ) -> None:
        from opentinker_common.net.bearer import clean_api_key

        if api_key is None:
            api_key = os.environ.get("OPENTINKER_API_KEY") or ""
        api_key = clean_api_key(api_key)  # surrounding whitespace stripped; inner whitespace is a ValueError
        if endpoint is None:
            if not (scheduler_url and task_id):
                raise InvalidArgumentError(
                    "endpoint: give an endpoint, or scheduler_url and the task_id of an inference task",
                    field="endpoint",
                )
            from opentinker_client.client import RLClient

            with RLClient(
                scheduler_url, min_poll_interval=0, api_key=api_key, root_certificates=root_certificates
            ) as rl:
                endpoint = wait_for_endpoint(rl, task_id, timeout=ready_timeout)
        self.target, self.tls = parse_endpoint(endpoint)
        self.endpoint = endpoint
        self.task_id = task_id
        self.adapter = adapter
        self.model = model
        self.timeout = float(timeout)
        self._api_key = api_key  # kept for with_adapter(); never shown in repr or errors
        self._root_certificates = root_certificates
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        if self.tls:
            from opentinker_common.net.tls import ENV_CA, channel_credentials

            ca = root_certificates if root_certificates is not None else os.environ.get(ENV_CA, "")
            # "" for the client pair: the inference server does not ask for client certificates.
            creds = (channel_credentials(ca, "", "") if ca else None) or grpc.ssl_channel_credentials()
            self._channel = grpc.secure_channel(self.target, creds, options=_channel_options())
        else:
            self._channel = grpc.insecure_channel(self.target, options=_channel_options())
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)
        # Plaintext: an UNAVAILABLE "Socket closed" gets a hint that the server may serve TLS.
        self._plaintext_hint = "" if self.tls else INFERENCE_PLAINTEXT_HINT

    def _error(self, err: grpc.RpcError) -> OpenTinkerError:
        return from_rpc_error(err, plaintext_hint=self._plaintext_hint)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "InferenceClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"InferenceClient(endpoint={self.endpoint!r}, adapter={self.adapter!r})"

    def with_adapter(self, adapter: str | None) -> "InferenceClient":
        """Another client on the same server whose default adapter is ``adapter``."""
        return InferenceClient(
            self.endpoint,
            adapter=adapter,
            model=self.model,
            timeout=self.timeout,
            api_key=self._api_key,
            root_certificates=self._root_certificates,
        )

    # --- requests ------------------------------------------------------------------------------
    def _request(self, cls, prompt, messages, adapter, sampling: Mapping[str, Any]):
        if (prompt is None) == (messages is None):
            raise InvalidArgumentError("prompt: give exactly one of prompt (text) or messages (chat)", field="prompt")
        req = cls(model=self.model, adapter=(self.adapter if adapter is _BASE else adapter) or "")
        if prompt is not None:
            req.text = prompt
        else:
            chat = req.messages
            for i, m in enumerate(messages):
                if not isinstance(m, Mapping) or "content" not in m:
                    raise InvalidArgumentError(
                        f"messages[{i}]: expected a mapping with role and content", field=f"messages[{i}]"
                    )
                chat.messages.add(role=str(m.get("role", "user")), content=str(m["content"]))
            if not messages:
                req.messages.SetInParent()
        s = req.sampling
        if sampling["temperature"] is not None:
            s.temperature = float(sampling["temperature"])
        if sampling["top_p"] is not None:
            s.top_p = float(sampling["top_p"])
        s.top_k = int(sampling["top_k"])
        s.max_tokens = int(sampling["max_tokens"])
        stop = sampling["stop"]
        s.stop.extend([stop] if isinstance(stop, str) else list(stop or ()))
        if sampling["seed"] is not None:
            s.seed = int(sampling["seed"])
        s.n = int(sampling["n"])
        s.ignore_eos = bool(sampling["ignore_eos"])
        return req

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        adapter: Any = _BASE,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int = 0,
        max_tokens: int = 64,
        stop: str | Sequence[str] = (),
        seed: int | None = None,
        n: int = 1,
        ignore_eos: bool = False,
    ) -> Generation:
        """Generate ``n`` completions of a raw ``prompt`` or chat ``messages``.

        Args:
            adapter: this call's adapter (a task id, or ``None`` for the base model); omitted
                means the client's default.
            temperature: 0 is greedy; ``None`` is the server default (1.0).
            top_p, top_k: nucleus and top-k sampling (``None``/0: off).
            max_tokens: most new tokens per sample.
            stop: string(s) that end a sample.
            seed: the same seed gives the same samples.

        Raises:
            InvalidArgumentError: bad settings; prompt + max_tokens beyond the context.
            NotFoundError: unknown adapter or base model.
            FailedPreconditionError: the adapter cannot be served (unfinished task, other base
                model, not a LoRA adapter of this model).
            ResourceExhaustedError: the server is at its request or adapter limit.
            UnavailableError: the server cannot be reached (also: a TLS endpoint dialled without
                TLS or with the wrong CA, or the scheduler cannot check the key).
            UnauthenticatedError: no API key, or an unknown, revoked or expired one.
            PermissionDeniedError: the key's owner may not use this inference task.
        """
        req = self._request(inference_pb2.GenerateRequest, prompt, messages, adapter, locals())
        try:
            resp = self._stub.Generate(req, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise self._error(err) from err
        return Generation(
            samples=tuple(
                Sample(s.index, s.text, tuple(s.token_ids), tuple(s.logprobs), _FINISH.get(s.finish_reason, ""))
                for s in resp.samples
            ),
            prompt_tokens=resp.usage.prompt_tokens,
            completion_tokens=resp.usage.completion_tokens,
            model=resp.model,
            adapter=resp.adapter or None,
        )

    def generate_stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        adapter: Any = _BASE,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int = 0,
        max_tokens: int = 64,
        stop: str | Sequence[str] = (),
        seed: int | None = None,
        n: int = 1,
        ignore_eos: bool = False,
    ) -> Iterator[StreamChunk]:
        """Like :meth:`generate`, yielding :class:`StreamChunk` s as tokens are chosen.

        Closing the iterator early (``break``) cancels the call; the server stops generating.
        Raises as :meth:`generate` (on the first ``next``).
        """
        req = self._request(inference_pb2.GenerateStreamRequest, prompt, messages, adapter, locals())
        call = self._stub.GenerateStream(req, metadata=self._metadata)
        try:
            for m in call:
                yield StreamChunk(
                    index=m.index,
                    text=m.text,
                    token_ids=tuple(m.token_ids),
                    logprobs=tuple(m.logprobs),
                    finish_reason=_FINISH.get(m.finish_reason),
                    usage=(m.usage.prompt_tokens, m.usage.completion_tokens) if m.HasField("usage") else None,
                )
        except grpc.RpcError as err:
            raise self._error(err) from err
        finally:
            call.cancel()

    def list_adapters(self) -> list[AdapterInfo]:
        """Adapters loaded on the server now that this key may use, most recently used first.

        Raises:
            UnavailableError: the server cannot be reached.
            UnauthenticatedError, PermissionDeniedError: as :meth:`generate`.
        """
        try:
            resp = self._stub.ListAdapters(
                inference_pb2.ListAdaptersRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as err:
            raise self._error(err) from err
        return [
            AdapterInfo(
                a.name,
                a.path,
                a.size_bytes,
                timestamp_to_datetime(a.load_time),
                timestamp_to_datetime(a.last_used_time),
                a.in_use,
            )
            for a in resp.adapters
        ]


# ---------------------------------------------------------------------------------------------
# From training to serving (behind RLClient.serve / list_checkpoints / download_checkpoint).


def wait_for_endpoint(client: "RLClient", task_id: str, *, timeout: float, poll_interval: float = 0.25) -> str:
    """Poll an inference task until it is RUNNING with an endpoint; return the endpoint.

    Raises:
        NotFoundError: no such task. TaskFailedError: it ended first.
        DeadlineExceededError: no endpoint within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        info = client.get_task(task_id)
        endpoint = getattr(info, "endpoint", "") or (info.proto.endpoint if info.proto is not None else "")
        if info.state == "running" and endpoint:
            return endpoint
        if info.done:
            raise TaskFailedError(info)
        if time.monotonic() >= deadline:
            raise DeadlineExceededError(
                f"inference task {task_id} did not start serving within {timeout:g} s (state: {info.state})"
            )
        time.sleep(poll_interval)


def serve_task(
    client: "RLClient",
    task_id: str,
    *,
    gpu_count: int = 0,
    ttl: float = 3600.0,
    max_resident_adapters: int = 8,
    timeout: float = 600.0,
    root_certificates: str | os.PathLike | None = None,
) -> InferenceClient:
    """A client bound to the adapter of finished task ``task_id``: reuses a running (or pending)
    ``inference`` task on the same base model, else submits one; waits until it serves.

    The returned client uses ``client``'s API key and ``root_certificates`` (default: the CA
    ``client`` was made with, else ``$OPENTINKER_TLS_CA``, else the system's roots). It has made
    one ``ListAdapters`` call already, so a server it cannot reach or that refuses its key fails
    here.

    Raises:
        FailedPreconditionError: the task is not a lora_finetune/sft task, has not finished, or
            has no checkpoint. NotFoundError: no such task. TaskFailedError: the inference task
            ended before serving. DeadlineExceededError: not serving within ``timeout``.
        UnavailableError: the inference server cannot be reached over TLS with
            ``root_certificates`` (a wrong CA), or at all. UnauthenticatedError,
            PermissionDeniedError: the server refuses the key (as :meth:`InferenceClient.list_adapters`).
    """
    task = client.get_task(task_id)
    if task.workload_type not in ADAPTER_WORKLOADS:
        raise FailedPreconditionError(
            f"task {task_id} is a {task.workload_type} task; only {' and '.join(ADAPTER_WORKLOADS)} tasks give adapters to serve"
        )
    if not task.done:
        raise FailedPreconditionError(
            f"task {task_id} is {task.state}; wait for it to finish (RLClient.wait) before serving its adapter"
        )
    if not task.checkpoint_path:
        raise FailedPreconditionError(
            f"task {task_id} ended {task.state} without a checkpoint; there is no adapter to serve"
        )
    server_id = None
    for t in client.list_tasks(states=["running", "assigned", "pending"], limit=1000):
        if t.workload_type == "inference" and t.model == task.model and t.gpu_count == gpu_count:
            server_id = t.task_id
            break
    if server_id is None:
        server_id = client.submit_task(
            workload_type="inference",
            model=task.model,
            gpu_count=gpu_count,
            hyperparameters={"ttl_s": float(ttl), "max_resident_adapters": int(max_resident_adapters)},
            name=f"serve {task.model}",
            max_attempts=3,
        )
    endpoint = wait_for_endpoint(client, server_id, timeout=timeout)
    if root_certificates is None:
        root_certificates = getattr(client, "_root_certificates", None)
    llm = InferenceClient(
        endpoint, adapter=task_id, model=task.model, api_key=_bearer(client), root_certificates=root_certificates
    )
    llm.task_id = server_id
    try:  # one real call: a wrong CA, a plaintext/TLS mix-up or a refused key fails here, not on first use
        llm.list_adapters()
    except BaseException:
        llm.close()
        raise
    return llm


def _bearer(client: "RLClient") -> str:
    """The API key ``client`` sends ("" for none), from its call metadata."""
    for key, value in getattr(client, "_metadata", ()):
        if key == "authorization" and value.startswith("Bearer "):
            return value[len("Bearer ") :]
    return ""


def checkpoint_from_proto(ck) -> CheckpointInfo:
    return CheckpointInfo(
        task_id=ck.task_id,
        step=ck.step,
        path=ck.path,
        format=ck.format,
        final=ck.final,
        attempt=ck.attempt,
        node_id=ck.node_id,
        create_time=timestamp_to_datetime(ck.create_time) if ck.HasField("create_time") else None,
    )


def _safe_relative(path: str) -> PurePosixPath:
    p = PurePosixPath(path)
    if p.is_absolute() or not p.parts or any(part in ("..", "") for part in p.parts):
        raise OpenTinkerError(f"the scheduler sent an unsafe file path {path!r} in a checkpoint manifest; refused")
    return p


def download_checkpoint(
    stub, metadata, task_id: str, dest: str | os.PathLike[str], *, step: int | None = None, timeout: float | None = None
) -> Path:
    """Stream a checkpoint folder into ``dest`` (created; must not exist or be empty) and check
    every file's size and SHA-256 against the manifest. Files are written beside ``dest`` and
    moved into place only when all of them check out, so nothing half-written is left. The
    folders are created 0700 and the files 0600: weights are private to the user who fetched them.

    Returns:
        ``dest`` as a Path.

    Raises:
        NotFoundError: no such task or step. FailedPreconditionError: the scheduler cannot read
        the folder. OpenTinkerError: a size or hash mismatch (the download is discarded).
        FileExistsError: ``dest`` exists and is not an empty folder.
    """
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise FileExistsError(f"{dest} exists and is not an empty folder")
    tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    os.chmod(tmp, 0o700)  # model weights are private: the folder is the user's alone (as on the cluster)
    call = stub.DownloadCheckpoint(
        scheduler_pb2.DownloadCheckpointRequest(task_id=task_id, step=step or 0), timeout=timeout, metadata=metadata
    )
    try:
        files: list[tuple[Path, Any]] = []
        handles: dict[int, Any] = {}
        digests: dict[int, Any] = {}
        sizes: dict[int, int] = {}
        for msg in call:
            kind = msg.WhichOneof("message")
            if kind == "manifest":
                for f in msg.manifest.files:
                    target = tmp.joinpath(*_safe_relative(f.path).parts)
                    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                    files.append((target, f))
            elif kind == "chunk":
                c = msg.chunk
                if not 0 <= c.file_index < len(files):
                    raise OpenTinkerError(f"checkpoint download: chunk for unknown file {c.file_index}")
                if c.file_index not in handles:
                    handles[c.file_index] = open(
                        os.open(files[c.file_index][0], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb"
                    )
                    digests[c.file_index] = hashlib.sha256()
                    sizes[c.file_index] = 0
                if c.offset != sizes[c.file_index]:
                    raise OpenTinkerError(
                        f"checkpoint download: chunk at offset {c.offset} of {files[c.file_index][1].path}, expected {sizes[c.file_index]}"
                    )
                handles[c.file_index].write(c.data)
                digests[c.file_index].update(c.data)
                sizes[c.file_index] += len(c.data)
        for h in handles.values():
            h.close()
        for i, (target, f) in enumerate(files):
            got_size = sizes.get(i, 0)
            got_hash = digests[i].hexdigest() if i in digests else hashlib.sha256().hexdigest()
            if i not in handles:
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            if got_size != f.size_bytes or got_hash != f.sha256:
                raise OpenTinkerError(
                    f"checkpoint download: {f.path} arrived with {got_size} bytes, sha256 {got_hash}; expected {f.size_bytes} bytes, sha256 {f.sha256}"
                )
        if dest.exists():
            dest.rmdir()
        os.replace(tmp, dest)
        return dest
    except grpc.RpcError as err:
        raise from_rpc_error(err) from err
    finally:
        call.cancel()
        for h in locals().get("handles", {}).values():
            h.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
