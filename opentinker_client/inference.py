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

Security: the server takes endpoint tokens, not API keys (:mod:`opentinker_client.endpoint_tokens`).
A client that knows the scheduler (``scheduler_url`` and ``task_id``, or one made by
:class:`~opentinker_client.RLClient`) asks it for a token with its API key (``api_key``, default
``$OPENTINKER_API_KEY``), sends the token as ``authorization: Bearer ote_...`` and renews it
before it expires; the server asks the scheduler whether that token may use the inference task
(and the adapter's task). An ``https://host:port`` endpoint (what a server with
TLS reports) is dialled with TLS, trusting ``root_certificates`` (default ``$OPENTINKER_TLS_CA``,
else the system's roots); ``host:port`` and ``http://host:port`` are plaintext.

The values it returns are in :mod:`opentinker_client.types` (and importable from here).
Torch-free.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import grpc

from opentinker.inference.v1 import inference_pb2, inference_pb2_grpc
from opentinker_client._convert import adapter_from_proto, generation_from_proto, stream_chunk_from_proto
from opentinker_client.client_tasks import TaskCalls
from opentinker_client.connection import SchedulerConnection, resolve_api_key
from opentinker_client.endpoint_tokens import EndpointTokens
from opentinker_client.errors import INFERENCE_PLAINTEXT_HINT, InvalidArgumentError, OpenTinkerError, from_rpc_error
from opentinker_client.types import (
    ActResult,
    AdapterInfo,
    CheckpointInfo,
    Generation,
    Sample,
    Sampling,
    StreamChunk,
)
from opentinker_common.net.bearer import bearer_metadata
from opentinker_common.net.grpc_options import client_keepalive, message_limits
from opentinker_common.net.url import parse_scheduler_url, redact_userinfo

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Unpack

__all__ = [
    "InferenceClient",
    "Generation",
    "Sample",
    "StreamChunk",
    "AdapterInfo",
    "CheckpointInfo",
    "Sampling",
    "ADAPTER_WORKLOADS",
    "parse_endpoint",
]

#: Workloads whose checkpoints are LoRA adapters an inference server can load (a ``lora_session``
#: once it has ended: its newest ``save_weights_for_sampler`` or ``save_state``).
ADAPTER_WORKLOADS = ("lora_finetune", "sft", "lora_session")
_BASE = object()  # "the client's default adapter" marker

#: What each :class:`~opentinker_client.types.Sampling` key is when a call leaves it out.
_SAMPLING_DEFAULTS: Sampling = {
    "temperature": None,
    "top_p": None,
    "top_k": 0,
    "max_tokens": 64,
    "stop": (),
    "seed": None,
    "n": 1,
    "ignore_eos": False,
}


def _check_sampling(call: str, sampling: Mapping[str, Any]) -> None:
    """Raises the ``TypeError`` Python raises for a keyword ``InferenceClient.<call>`` does not take."""
    for key in sampling:
        if key not in _SAMPLING_DEFAULTS:
            raise TypeError(f"InferenceClient.{call}() got an unexpected keyword argument {key!r}")


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
    expected = "expected host:port, http://host:port or https://host:port (TLS)"
    if "://" in rest:
        scheme = rest.split("://", 1)[0] + "://"
        scheme = scheme if "@" not in endpoint else "***://"  # may hold a user:password@ part
        raise ValueError(
            f"endpoint: bad inference endpoint {redact_userinfo(endpoint)!r}: unknown scheme {scheme!r}; {expected}"
        )
    try:
        target = parse_scheduler_url(rest)
    except ValueError as exc:
        why = str(exc).split("': ", 1)[-1].split("; expected", 1)[0]
        raise ValueError(f"endpoint: bad inference endpoint {redact_userinfo(endpoint)!r}: {why}; {expected}") from None
    return target, tls


class InferenceClient:
    """A connection to one ``InferenceService``.

    Args:
        endpoint: ``host:port`` (or ``http://host:port``) of a plaintext server, or
            ``https://host:port`` (``grpcs://`` too) of a TLS one — the form the server's
            inference task reports. Or give ``scheduler_url`` and ``task_id`` (an
            ``inference`` task) and the endpoint is looked up, waiting up to ``ready_timeout``
            seconds for the task to run and report one.
        adapter: default adapter of every call (a finished lora_finetune/sft/lora_session task id); ``None``
            is the base model.
        policy: default policy of :meth:`act` (a finished single-agent full_rl task id).
        model: the base model name requests carry; ``""`` means whatever the server serves.
        timeout: deadline of each call, in seconds: a unary call, or a whole
            :meth:`generate_stream` (``DeadlineExceededError`` when it passes).
        api_key: with ``scheduler_url``, the API key that asks the scheduler for endpoint tokens;
            with only an ``endpoint``, an endpoint token (``ote_...``, from ``opentinker
            endpoint-token TASK``) sent as is. ``None`` reads ``$OPENTINKER_API_KEY``; ``""``
            sends none. Surrounding whitespace is stripped.
        tokens: where the endpoint tokens come from (:class:`EndpointTokens`); it takes
            precedence over ``api_key``.
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
        policy: str | None = None,
        model: str = "",
        timeout: float = 120.0,
        ready_timeout: float = 600.0,
        api_key: str | None = None,
        root_certificates: str | os.PathLike | None = None,
        tokens: EndpointTokens | None = None,
    ) -> None:
        api_key = resolve_api_key(api_key)  # surrounding whitespace stripped; inner whitespace is a ValueError
        self._connection: SchedulerConnection | None = None
        if endpoint is None:
            if not (scheduler_url and task_id):
                raise InvalidArgumentError(
                    "endpoint: give an endpoint, or scheduler_url and the task_id of an inference task",
                    field="endpoint",
                )
            self._connection = SchedulerConnection(
                scheduler_url, timeout=30.0, api_key=api_key, root_certificates=root_certificates
            )
            try:
                serving = TaskCalls(self._connection).wait_serving(task_id, timeout=ready_timeout)
            except BaseException:
                self._connection.close()
                raise
            tokens = tokens or EndpointTokens(self._connection, task_id)
            endpoint, openai_endpoint = serving.endpoint, serving.openai_endpoint
        else:
            openai_endpoint = ""
        self.target, self.tls = parse_endpoint(endpoint)
        self.endpoint = endpoint
        #: Base URL of the task's OpenAI-compatible API (``http(s)://host:port/v1``), ``""`` when it
        #: serves none or the client was made from an endpoint alone.
        self.openai_endpoint: str = openai_endpoint
        self.task_id = task_id
        self.adapter = adapter
        self.policy = policy
        self.model = model
        self.timeout = float(timeout)
        self._api_key = api_key  # kept for with_adapter(); never shown in repr or errors
        self._root_certificates = root_certificates
        self._tokens = tokens
        self._static_metadata = bearer_metadata(api_key)
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

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return self._tokens.metadata() if self._tokens is not None else self._static_metadata

    def close(self) -> None:
        self._channel.close()
        if self._connection is not None:
            self._connection.close()

    def __enter__(self) -> "InferenceClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"InferenceClient(endpoint={self.endpoint!r}, adapter={self.adapter!r})"

    def with_adapter(self, adapter: str | None) -> "InferenceClient":
        """Another client on the same server whose default adapter is ``adapter``; it shares this
        client's endpoint tokens (and their scheduler connection: keep this client open)."""
        other = InferenceClient(
            self.endpoint,
            adapter=adapter,
            model=self.model,
            timeout=self.timeout,
            api_key=self._api_key,
            root_certificates=self._root_certificates,
            tokens=self._tokens,
        )
        other.task_id, other.openai_endpoint = self.task_id, self.openai_endpoint
        return other

    # --- requests ------------------------------------------------------------------------------
    def _request(self, cls: Any, call: str, prompt: str | None, messages: Any, adapter: Any, sampling: Any) -> Any:
        """A ``cls`` request (``GenerateRequest`` or ``GenerateStreamRequest``) for method ``call``."""
        _check_sampling(call, sampling)
        sampling = {**_SAMPLING_DEFAULTS, **sampling}
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
        **sampling: Unpack[Sampling],
    ) -> Generation:
        """Generate ``n`` completions of a raw ``prompt`` or chat ``messages``.

        Args:
            prompt: raw text, sent as it is; or
            messages: chat messages (``{"role": ..., "content": ...}``), rendered with the
                model's chat template.
            adapter: this call's adapter (a task id, or ``None`` for the base model); omitted
                means the client's default.
            sampling: keywords of :class:`~opentinker_client.types.Sampling`:
                ``temperature`` (0 is greedy; ``None`` is the server default, 1.0), ``top_p``,
                ``top_k`` (nucleus and top-k sampling; ``None``/0: off), ``max_tokens`` (most
                new tokens per sample, default 64), ``stop`` (string(s) that end a sample),
                ``seed`` (the same seed gives the same samples), ``n`` (samples, default 1),
                ``ignore_eos``.

        Raises:
            TypeError: a keyword that is not a sampling setting.
            InvalidArgumentError: bad settings; prompt + max_tokens beyond the context.
            NotFoundError: unknown adapter or base model.
            FailedPreconditionError: the adapter cannot be served (unfinished task, other base
                model, not a LoRA adapter of this model).
            ResourceExhaustedError: the server is at its request or adapter limit.
            UnavailableError: the server cannot be reached (also: a TLS endpoint dialled without
                TLS or with the wrong CA, or the scheduler cannot check the key).
            UnauthenticatedError: no API key, or an unknown, revoked or expired one.
            PermissionDeniedError: the key's owner may not use this inference task.
            DeadlineExceededError: no answer within the client's ``timeout`` seconds.
        """
        req = self._request(inference_pb2.GenerateRequest, "generate", prompt, messages, adapter, sampling)
        try:
            resp = self._stub.Generate(req, timeout=self.timeout, metadata=self._metadata())
        except grpc.RpcError as err:
            raise self._error(err) from err
        return generation_from_proto(resp)

    def generate_stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        adapter: Any = _BASE,
        **sampling: Unpack[Sampling],
    ) -> Iterator[StreamChunk]:
        """Like :meth:`generate`, yielding :class:`StreamChunk` s as tokens are chosen.

        Closing the iterator early (``break``) cancels the call; the server stops generating.
        Raises as :meth:`generate`: ``TypeError`` at once, the others on the first ``next``;
        ``DeadlineExceededError`` when the whole stream takes longer than the client's ``timeout``
        seconds.
        """
        _check_sampling("generate_stream", sampling)
        return self._stream(prompt, messages, adapter, sampling)

    def _stream(self, prompt: str | None, messages: Any, adapter: Any, sampling: Any) -> Iterator[StreamChunk]:
        req = self._request(inference_pb2.GenerateStreamRequest, "generate_stream", prompt, messages, adapter, sampling)
        call = self._stub.GenerateStream(req, timeout=self.timeout, metadata=self._metadata())
        try:
            for m in call:
                yield stream_chunk_from_proto(m)
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
                inference_pb2.ListAdaptersRequest(), timeout=self.timeout, metadata=self._metadata()
            )
        except grpc.RpcError as err:
            raise self._error(err) from err
        return [adapter_from_proto(a) for a in resp.adapters]

    def act(self, observations: Any, *, policy: str | None = None) -> ActResult:
        """The greedy actions and values of a trained PPO policy for a batch of observations
        (``InferenceService.Act``).

        Args:
            observations: ``[B, *observation shape]``: nested lists, or anything with ``tolist()``
                (a numpy array, a torch tensor); a Discrete observation space: ``[B]`` integers.
            policy: the id of a finished single-agent full_rl task (default: this client's
                ``policy``, set by ``RLClient.serve`` of a full_rl task).

        Returns:
            :class:`~opentinker_client.types.ActResult`: ``actions`` (``[B]`` ints for a Discrete
            action space, else ``[B, *action shape]`` floats, clipped to the space), ``values``
            (``V(s)``, ``[B]``), the policy and its checkpoint step.

        Raises:
            InvalidArgumentError: no policy, ragged or empty observations, or a shape the policy
                does not observe (the message gives both). NotFoundError: no such task.
            FailedPreconditionError: not a finished single-agent full_rl task.
            ResourceExhaustedError, UnavailableError: as :meth:`generate`.
        """
        policy = policy if policy is not None else self.policy
        if not policy:
            raise InvalidArgumentError("policy: expected the id of a finished full_rl task", field="policy")
        shape, flat = _flatten(observations.tolist() if hasattr(observations, "tolist") else observations)
        request = inference_pb2.ActRequest(policy=policy, observations=inference_pb2.Tensor(shape=shape, values=flat))
        try:
            resp = self._stub.Act(request, timeout=self.timeout, metadata=self._metadata())
        except grpc.RpcError as err:
            raise self._error(err) from err
        actions = _unflatten(list(resp.actions.values), list(resp.actions.shape))
        if len(resp.actions.shape) == 1 and all(float(a).is_integer() for a in actions):
            actions = [int(a) for a in actions]  # a Discrete action space: integers
        return ActResult(actions=actions, values=list(resp.values), policy=resp.policy, step=int(resp.step))


def _flatten(nested: Any) -> tuple[list[int], list[float]]:
    """``(shape, row-major values)`` of a rectangular nested list (a scalar list is ``[B]``).

    Raises:
        InvalidArgumentError: ragged, empty, or not numbers (field ``observations``).
    """
    if not isinstance(nested, (list, tuple)) or not nested:
        raise InvalidArgumentError("observations: expected a non-empty batch [B, ...]", field="observations")
    shape: list[int] = []
    level: Any = nested
    while isinstance(level, (list, tuple)):
        shape.append(len(level))
        level = level[0] if level else None
    flat: list[float] = []

    def walk(x: Any, depth: int) -> None:
        if depth == len(shape):
            if isinstance(x, (list, tuple)) or not isinstance(x, (int, float)) or isinstance(x, bool):
                raise InvalidArgumentError(f"observations: expected numbers, got {x!r}", field="observations")
            flat.append(float(x))
            return
        if not isinstance(x, (list, tuple)) or len(x) != shape[depth]:
            raise InvalidArgumentError(
                f"observations: expected a rectangular batch of shape {shape}", field="observations"
            )
        for item in x:
            walk(item, depth + 1)

    walk(nested, 0)
    return shape, flat


def _unflatten(values: list[float], shape: list[int]) -> Any:
    """Row-major ``values`` back into nested lists of ``shape``."""
    if len(shape) <= 1:
        return values
    step = len(values) // shape[0] if shape[0] else 0
    return [_unflatten(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]
