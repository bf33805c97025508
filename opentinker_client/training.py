"""Write your own training loop: a client of a ``lora_session`` task's ``TrainingService``.

Tinker-style primitives (docs/primitives.md)::

    from opentinker_client import RLClient

    with RLClient(scheduler_url="http://scheduler-host:8888") as client:
        session = client.create_training_session("HuggingFaceTB/SmolLM2-135M-Instruct", lora_rank=16)
        out = session.sample(prompt_tokens, n=8, max_tokens=32, seed=0).result()
        fb = session.forward_backward(datums, "importance_sampling")   # queued ...
        step = session.optim_step(learning_rate=1e-4)                   # ... behind it
        print(fb.result().loss, step.result().step)

Every method but :meth:`TrainingSession.get_info` returns a :class:`concurrent.futures.Future`
at once; the calls go to the server one after another in the order they were made (one worker
thread per session), each with the session's next sequence number, so queued calls apply in that
order. Consecutive sample calls go without waiting for the answers before them: the session
holds them for their turn and decodes those that wait together in one batch. A call the server
refused (a bad datum: ``InvalidArgumentError``) did not apply; a refusal in its turn uses up its
number, one before it does not, and the next call first asks which number comes. A call that
failed in transit (``UnavailableError``, ``DeadlineExceededError``) is retried with the same
number (idempotent: an applied call is answered from the server's cache), up to ``retries``
times; after that the next call first asks the server which number it expects.

``future.result(timeout=...)`` raises the call's typed error (:mod:`opentinker_client.errors`);
an out-of-order call is :class:`OutOfOrderError` (a ``FailedPreconditionError``) with the
number the server expects.

The tokenizer: :meth:`TrainingSession.get_tokenizer` loads it with ``transformers``'
``AutoTokenizer`` (no torch needed) from a folder of the model's tokenizer files, or the hub id
(:attr:`SessionInfo.tokenizer` names it). Nothing else here needs transformers.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import grpc

from opentinker.training.v1 import training_pb2, training_pb2_grpc
from opentinker_client.connection import resolve_api_key
from opentinker_client.endpoint_tokens import EndpointTokens
from opentinker_client.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    OpenTinkerError,
    OutOfOrderError,
    UnavailableError,
    from_rpc_error,
)
from opentinker_client.inference import parse_endpoint
from opentinker_common.net.bearer import bearer_metadata
from opentinker_common.net.grpc_options import client_keepalive, message_limits

__all__ = [
    "Datum",
    "ForwardBackwardOutput",
    "OptimStepOutput",
    "OutOfOrderError",
    "SampleOutput",
    "SampledSequence",
    "SavedStateInfo",
    "SessionInfo",
    "TrainingSession",
    "LOSS_FNS",
]

#: Loss names ``forward_backward`` takes (Tinker's).
_LOSS = {name[len("LOSS_FN_") :].lower(): value for name, value in training_pb2.LossFn.items() if value}
LOSS_FNS = tuple(_LOSS)
#: Bytes of datums per stream message (far under gRPC's 64 MiB messages).
CHUNK_BYTES = 1 << 20
#: ``google.rpc.ErrorInfo.domain`` of a session's refusals.
ERROR_DOMAIN = "opentinker.training"
#: Most sample calls sent ahead of their turn and not yet answered: the answers a session keeps
#: for retries (16), so a call sent again after the calls behind it were answered still finds its own.
PIPELINED_SAMPLES = 16


@dataclass(frozen=True)
class Datum:
    """One training sequence; every per-token field has ``len(input_tokens)`` values (or none).

    Position ``t`` reads ``input_tokens[:t+1]`` and predicts ``target_tokens[t]``.
    ``weights``: ``cross_entropy``'s per-token weights (empty = all 1). ``advantages``,
    ``sampling_logprobs`` (Tinker's ``logprobs`` input): the policy losses'.
    ``sequence_ratio_mask``: ``gspo``'s.
    """

    input_tokens: Sequence[int]
    target_tokens: Sequence[int]
    weights: Sequence[float] = ()
    advantages: Sequence[float] = ()
    sampling_logprobs: Sequence[float] = ()
    sequence_ratio_mask: Sequence[float] = ()

    @classmethod
    def from_sequence(
        cls,
        tokens: Sequence[int],
        *,
        prompt_length: int,
        advantage: float | None = None,
        sampling_logprobs: Sequence[float] | None = None,
        weight: float | None = None,
    ) -> "Datum":
        """A next-token datum of ``tokens`` (prompt then completion) that trains on the
        completion only: ``input_tokens = tokens[:-1]``, ``target_tokens = tokens[1:]``; the
        completion's positions get ``advantage`` (and its ``sampling_logprobs``, one per
        completion token) or ``weight``, the prompt's 0."""
        tokens = list(tokens)
        n = len(tokens) - 1
        k = n - (prompt_length - 1)  # completion tokens
        if prompt_length < 1 or k < 1:
            raise ValueError(f"tokens: expected a prompt of {prompt_length} >= 1 tokens and a completion after it")
        pad = [0.0] * (n - k)
        d: dict[str, Any] = {"input_tokens": tokens[:-1], "target_tokens": tokens[1:]}
        if weight is not None:
            d["weights"] = pad + [float(weight)] * k
        if advantage is not None:
            d["advantages"] = pad + [float(advantage)] * k
            lps = list(sampling_logprobs) if sampling_logprobs is not None else [0.0] * k
            if len(lps) != k:
                raise ValueError(f"sampling_logprobs: expected {k} values (one per completion token), got {len(lps)}")
            d["sampling_logprobs"] = pad + [float(x) for x in lps]
        return cls(**d)


@dataclass(frozen=True)
class ForwardBackwardOutput:
    """Per datum: ``logprobs`` of its target tokens and its ``losses``; ``loss`` their sum."""

    sequence: int
    logprobs: list[list[float]]
    losses: list[float]
    loss: float
    metrics: dict[str, float]
    accumulated_calls: int


@dataclass(frozen=True)
class OptimStepOutput:
    sequence: int
    step: int
    grad_norm: float


@dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]
    #: Each token's log-probability under the model at temperature 1, as ``forward`` gives it.
    logprobs: list[float]
    text: str
    stop_reason: str  # "stop" | "length"
    #: Each token's log-probability under the distribution that drew it (temperature and top_p
    #: applied): the ``sampling_logprobs`` of an importance-sampled datum.
    sampling_logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class SampleOutput:
    sequence: int
    prompt_tokens: list[int]
    samples: list[SampledSequence]
    step: int
    #: With ``prompt_logprobs``: one per prompt token, NaN first.
    prompt_logprobs: list[float] = field(default_factory=list)
    #: With ``topk_prompt_logprobs``: per prompt token, ``(token, logprob)`` pairs (none first).
    topk_prompt_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass(frozen=True)
class SavedStateInfo:
    """A saved state or sampler save: its name, the optimizer step it was saved at, its key in
    the artifact store; for a sampler save ``adapter``, the name an inference task serves it by
    (``<task id>@<step>``: ``RLClient.serve(task_id, step=step)`` binds a client to it)."""

    sequence: int
    name: str
    step: int
    artifact_key: str = ""
    adapter: str = ""


@dataclass(frozen=True)
class SessionInfo:
    model: str
    tokenizer: str
    chat_template: str
    model_config_json: str
    lora_rank: int
    lora_alpha: float
    target_modules: list[str]
    next_sequence: int
    step: int
    attempt: int
    resumed_from: str
    max_datums_per_call: int
    max_tokens_per_call: int
    max_in_flight_calls: int
    stop_token_ids: list[int]
    accumulated_calls: int
    states: list[str] = field(default_factory=list)
    #: Every weight of the model trains (``lora=False``): no adapter, ``lora_rank`` 0.
    full_weights: bool = False


_STOP = {training_pb2.STOP_REASON_STOP: "stop", training_pb2.STOP_REASON_LENGTH: "length"}


def _datum_proto(d: Datum | Mapping[str, Any], i: int) -> training_pb2.Datum:
    get = d.get if isinstance(d, Mapping) else (lambda k, default=(): getattr(d, k, default))
    try:
        return training_pb2.Datum(
            input_tokens=get("input_tokens", ()),
            target_tokens=get("target_tokens", ()),
            weights=get("weights", ()) or (),
            advantages=get("advantages", ()) or (),
            sampling_logprobs=get("sampling_logprobs", ()) or (),
            sequence_ratio_mask=get("sequence_ratio_mask", ()) or (),
        )
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"datums[{i}]: {exc}", field=f"datums[{i}]") from None


def batch_messages(header: training_pb2.BatchHeader, datums: Sequence[Any], request_cls) -> Iterator[Any]:
    """The stream of one batch: the header, then the datums in chunks of about :data:`CHUNK_BYTES`."""
    protos = [_datum_proto(d, i) for i, d in enumerate(datums)]
    header.datum_count = len(protos)
    yield request_cls(header=header)
    chunk: list[training_pb2.Datum] = []
    size = 0
    for p in protos:
        chunk.append(p)
        size += p.ByteSize()
        if size >= CHUNK_BYTES:
            yield request_cls(chunk=training_pb2.DatumChunk(datums=chunk))
            chunk, size = [], 0
    if chunk:
        yield request_cls(chunk=training_pb2.DatumChunk(datums=chunk))


def _copy(source: Future, target: Future) -> None:
    if source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())


def _error(err: grpc.RpcError) -> OpenTinkerError:
    mapped = from_rpc_error(err)
    if isinstance(mapped, FailedPreconditionError) and mapped.status is not None:
        from google.rpc import error_details_pb2

        for any_msg in mapped.status.details:
            if any_msg.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                any_msg.Unpack(info)
                if info.domain == ERROR_DOMAIN and info.reason == "OUT_OF_ORDER":
                    out = OutOfOrderError(mapped.details, code=mapped.code, status=mapped.status)
                    out.expected_sequence = int(info.metadata.get("expected_sequence", "-1"))
                    return out
    return mapped


class TrainingSession:
    """A connection to one training session (a ``lora_session`` task's endpoint).

    Args:
        endpoint: ``host:port`` or ``https://host:port`` (the task's ``Task.endpoint``).
        task_id: the session task (for messages and :meth:`RLClient.resume_training_session`).
        api_key: an endpoint token (``ote_...``, from ``opentinker endpoint-token TASK``), sent as
            ``authorization: Bearer <token>``; ``None`` reads ``$OPENTINKER_API_KEY``. The session
            refuses API keys: :class:`~opentinker_client.RLClient` passes ``tokens`` instead.
        tokens: where endpoint tokens come from (:class:`~opentinker_client.endpoint_tokens.EndpointTokens`);
            it takes precedence over ``api_key``.
        root_certificates: CA of the server's certificate for ``https://`` endpoints.
        timeout: seconds per call on the wire (a call's future waits as long as you ask).
        retries: resends of a call that failed in transit (same sequence number).

    The session's sequence number is taken from the server (:meth:`get_info`) when it opens.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        task_id: str = "",
        api_key: str | None = None,
        root_certificates: str | os.PathLike | None = None,
        timeout: float = 600.0,
        retries: int = 3,
        tokens: EndpointTokens | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.task_id = task_id
        self.timeout = float(timeout)
        self.retries = int(retries)
        target, tls = parse_endpoint(endpoint)
        options = [*client_keepalive(), *message_limits()]
        if tls:
            from opentinker_common.net.tls import ENV_CA, channel_credentials

            ca = root_certificates if root_certificates is not None else os.environ.get(ENV_CA, "")
            creds = (channel_credentials(ca, "", "") if ca else None) or grpc.ssl_channel_credentials()
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = training_pb2_grpc.TrainingServiceStub(self._channel)
        self._tokens = tokens
        self._static_metadata = bearer_metadata(resolve_api_key(api_key))
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="training-session")
        #: Waits for the answers of sample calls sent ahead (:meth:`_sent_ahead`).
        self._answers = ThreadPoolExecutor(max_workers=PIPELINED_SAMPLES, thread_name_prefix="training-answers")
        #: The answers of the sample calls sent ahead and not yet waited for, in order (worker only).
        self._pipelined: list[Future] = []
        self._unsure = False
        try:
            self.next_sequence = self.get_info().next_sequence
        except BaseException:
            self._channel.close()
            raise

    # --- plumbing ---------------------------------------------------------------------------
    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return self._tokens.metadata() if self._tokens is not None else self._static_metadata

    def close(self) -> None:
        """Wait for queued calls, then close the channel."""
        self._worker.shutdown(wait=True)
        self._answers.shutdown(wait=True)
        self._channel.close()

    def __enter__(self) -> "TrainingSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TrainingSession(task_id={self.task_id!r}, endpoint={self.endpoint!r})"

    def _submit(self, call: Callable[[int], Any], convert: Callable[[Any], Any]) -> Future:
        return self._worker.submit(self._ordered, call, convert)

    def _wait_pipelined(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` sample calls sent ahead are still unanswered (worker only)."""
        while len(self._pipelined) > keep:
            wait([self._pipelined.pop(0)])

    def _number(self) -> int:
        """The next call's sequence number (worker only): asked from the server when the fate of
        an earlier call is unknown, once no call sent ahead is unanswered."""
        if self._unsure:
            self._wait_pipelined()
            self.next_sequence = self.get_info().next_sequence
            self._unsure = False
        sequence = self.next_sequence
        self.next_sequence += 1
        return sequence

    def _ordered(self, call: Callable[[int], Any], convert: Callable[[Any], Any]) -> Any:
        """Run ``call(sequence)`` with the next number (in the worker thread), once the sample
        calls sent ahead are answered; retrying in transit."""
        self._wait_pipelined()
        return convert(self._send(call, self._number()))

    def _sent_ahead(self, call: Callable[[int], Any], send: Callable[[int], Any], convert: Callable[[Any], Any]):
        """Send ``send(sequence)`` (an RPC future) with the next number without waiting for the
        answers of the calls before it (in the worker thread); its answer is waited for on
        another thread. The session holds a call ahead of its turn and runs it in its turn, and
        draws sample calls that wait together in one batch. A call the session did not hold
        (holding full, or held past ``held_call_timeout_s``) or that failed in transit is sent
        again once the call before it is answered (``call``, with retries)."""
        self._wait_pipelined(keep=PIPELINED_SAMPLES - 1)
        sequence = self._number()
        before = self._pipelined[-1] if self._pipelined else None
        try:
            rpc = send(sequence)
        except BaseException:  # not sent (a bad argument): the number is free
            self.next_sequence = sequence
            raise

        def answer():
            try:
                return convert(rpc.result())
            except grpc.RpcError as err:
                mapped = _error(err)
            if before is not None:
                wait([before])
            transit = isinstance(mapped, (UnavailableError, DeadlineExceededError))
            ahead = isinstance(mapped, OutOfOrderError) and 0 <= mapped.expected_sequence < sequence
            # Not held, or held while the call before failed: that one may not have used its number.
            if not (transit or (ahead and (before is None or before.exception() is None))):
                self._unsure = True  # a refusal in its turn uses up the number, one before it does not
                raise mapped
            return convert(self._send(call, sequence))

        out = self._answers.submit(answer)
        self._pipelined.append(out)
        return out

    def _send(self, call: Callable[[int], Any], sequence: int) -> Any:
        """``call(sequence)``, retrying in transit."""
        for attempt in range(self.retries + 1):
            try:
                response = call(sequence)
            except Exception as err:
                if not isinstance(err, grpc.RpcError):
                    self._unsure = True  # it may not have reached the server: ask before the next call
                    raise
                mapped = _error(err)
                if isinstance(mapped, (UnavailableError, DeadlineExceededError)) and attempt < self.retries:
                    time.sleep(min(2.0**attempt * 0.2, 5.0))
                    continue
                if isinstance(mapped, (UnavailableError, DeadlineExceededError)):
                    self._unsure = True
                    mapped = type(mapped)(
                        f"training session {self.task_id or self.endpoint} at {self.endpoint} did not answer "
                        f"after {self.retries + 1} tries ({mapped.details}); if its worker or node was lost, "
                        f"the scheduler runs the task again: RLClient.resume_training_session("
                        f"{self.task_id or 'TASK_ID'!r}) connects to the new attempt, which resumes from the "
                        "newest save_state",
                        code=mapped.code,
                        status=mapped.status,
                    )
                else:  # a refusal in its turn uses up the number, one before it does not: ask
                    self._unsure = True
                raise mapped from None
            return response
        raise AssertionError("unreachable")  # pragma: no cover

    def _unary(self, method: str, request_of: Callable[[int], Any]) -> Callable[[int], Any]:
        stub = getattr(self._stub, method)
        return lambda seq: stub(request_of(seq), timeout=self.timeout, metadata=self._metadata())

    def _stream(self, method: str, header_of: Callable[[int], Any], datums: Sequence[Any], request_cls):
        stub = getattr(self._stub, method)
        datums = list(datums)
        return lambda seq: stub(
            batch_messages(header_of(seq), datums, request_cls), timeout=self.timeout, metadata=self._metadata()
        )

    # --- the primitives ---------------------------------------------------------------------
    def forward_backward(
        self,
        datums: Iterable[Datum | Mapping[str, Any]],
        loss_fn: str = "cross_entropy",
        *,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> "Future[ForwardBackwardOutput]":
        """Add the gradient of ``loss_fn`` (:data:`LOSS_FNS`) summed over ``datums`` to the
        session's accumulated gradient. ``loss_fn_config``: the loss's hyper-parameters by
        Tinker's keys (``clip_low_threshold``, ``clip_high_threshold``, ``beta``). Errors:
        InvalidArgumentError (names ``datums[i].field`` or ``loss_fn_config.key``),
        ResourceExhaustedError (the session's bounds), OutOfOrderError."""
        if loss_fn not in _LOSS:
            raise InvalidArgumentError(
                f"loss_fn: expected one of {', '.join(LOSS_FNS)}, got {loss_fn!r}", field="loss_fn"
            )
        config = training_pb2.LossFnConfig()
        for key, value in (loss_fn_config or {}).items():
            if key not in training_pb2.LossFnConfig.DESCRIPTOR.fields_by_name:
                raise InvalidArgumentError(
                    f"loss_fn_config.{key}: expected one of clip_low_threshold, clip_high_threshold, beta",
                    field=f"loss_fn_config.{key}",
                )
            setattr(config, key, float(value))

        def header(seq):
            return training_pb2.BatchHeader(sequence=seq, loss_fn=_LOSS[loss_fn], loss_fn_config=config)

        def convert(r):
            return ForwardBackwardOutput(
                sequence=r.sequence,
                logprobs=[list(o.logprobs) for o in r.outputs],
                losses=[o.loss for o in r.outputs],
                loss=r.loss,
                metrics=dict(r.metrics),
                accumulated_calls=r.accumulated_calls,
            )

        datums = list(datums)
        return self._submit(
            self._stream("ForwardBackward", header, datums, training_pb2.ForwardBackwardRequest), convert
        )

    def forward(self, datums: Iterable[Datum | Mapping[str, Any]]) -> "Future[list[list[float]]]":
        """Log-probabilities of each datum's target tokens under the current weights (no gradient)."""
        datums = list(datums)
        return self._submit(
            self._stream(
                "Forward", lambda seq: training_pb2.BatchHeader(sequence=seq), datums, training_pb2.ForwardRequest
            ),
            lambda r: [list(o.logprobs) for o in r.outputs],
        )

    def optim_step(
        self,
        learning_rate: float,
        *,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
    ) -> "Future[OptimStepOutput]":
        """Apply the accumulated gradient with AdamW (clipping its norm to ``max_grad_norm``; 0 = off)."""
        if not (isinstance(learning_rate, (int, float)) and math.isfinite(learning_rate) and learning_rate > 0):
            raise InvalidArgumentError(
                f"adam.learning_rate: expected a finite number > 0, got {learning_rate!r}", field="adam.learning_rate"
            )
        adam = training_pb2.AdamParams(
            learning_rate=float(learning_rate),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(eps),
            weight_decay=float(weight_decay),
            max_grad_norm=float(max_grad_norm),
        )
        return self._submit(
            self._unary("OptimStep", lambda seq: training_pb2.OptimStepRequest(sequence=seq, adam=adam)),
            lambda r: OptimStepOutput(r.sequence, r.step, r.grad_norm),
        )

    def sample(
        self,
        prompt_tokens: Sequence[int] | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        n: int = 1,
        max_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
        return_logprobs: bool = True,
        prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
    ) -> "Future[SampleOutput]":
        """``n`` completions of a prompt (tokens, or chat ``messages`` through the chat template)
        from the session's current weights. ``temperature`` 0 is greedy; ``top_k`` 0 is no limit.
        Each token's ``logprobs`` are the model's at temperature 1 (what :meth:`forward` gives),
        its ``sampling_logprobs`` those of the distribution that drew it. ``prompt_logprobs``:
        each prompt token's log-probability given the ones before (NaN first);
        ``topk_prompt_logprobs``: the k most likely ``(token, logprob)`` at each position."""
        if (prompt_tokens is None) == (messages is None):
            raise InvalidArgumentError("prompt: give exactly one of prompt_tokens or messages", field="prompt")

        def request(seq):
            params = training_pb2.SamplingParams(
                max_tokens=int(max_tokens),
                temperature=float(temperature),
                top_p=float(top_p),
                top_k=int(top_k),
                stop=list(stop),
                stop_token_ids=[int(t) for t in stop_token_ids],
                return_logprobs=bool(return_logprobs),
                prompt_logprobs=bool(prompt_logprobs),
                topk_prompt_logprobs=int(topk_prompt_logprobs),
            )
            req = training_pb2.SampleRequest(sequence=seq, n=int(n), params=params)
            if seed is not None:
                req.seed = int(seed)
            if prompt_tokens is not None:
                req.tokens.tokens.extend(int(t) for t in prompt_tokens)
            else:
                for m in messages:
                    req.messages.messages.add(role=str(m.get("role", "user")), content=str(m["content"]))
            return req

        def convert(r):
            return SampleOutput(
                r.sequence,
                list(r.prompt_tokens),
                [
                    SampledSequence(
                        list(s.tokens),
                        list(s.logprobs),
                        s.text,
                        _STOP.get(s.stop_reason, ""),
                        list(s.sampling_logprobs),
                    )
                    for s in r.samples
                ],
                r.step,
                list(r.prompt_logprobs),
                [list(zip(p.tokens, p.logprobs)) for p in r.topk_prompt_logprobs],
            )

        stub = self._stub.Sample
        sent = self._worker.submit(
            self._sent_ahead,
            self._unary("Sample", request),
            lambda seq: stub.future(request(seq), timeout=self.timeout, metadata=self._metadata()),
            convert,
        )
        out: Future = Future()

        def chain(done: Future) -> None:
            try:
                answer = done.result()
            except BaseException as exc:  # noqa: BLE001 - the caller's future carries it
                out.set_exception(exc)
                return
            answer.add_done_callback(lambda a: _copy(a, out))

        sent.add_done_callback(chain)
        return out

    def save_state(self, name: str) -> "Future[SavedStateInfo]":
        """Save adapter, optimizer and counters as state ``name`` (the task's newest checkpoint)."""
        return self._submit(
            self._unary("SaveState", lambda seq: training_pb2.SaveStateRequest(sequence=seq, name=name)),
            lambda r: SavedStateInfo(r.sequence, r.name, r.step, r.artifact_key),
        )

    def load_state(self, name: str, *, with_optimizer: bool = True) -> "Future[int]":
        """Load state ``name`` (and its optimizer and step); the future gives the step."""
        return self._submit(
            self._unary(
                "LoadState",
                lambda seq: training_pb2.LoadStateRequest(sequence=seq, name=name, with_optimizer=with_optimizer),
            ),
            lambda r: r.step,
        )

    def save_weights_for_sampler(self, name: str) -> "Future[SavedStateInfo]":
        """Save a frozen copy of the adapter (PEFT, no optimizer) as checkpoint ``name``: servable
        while the session runs (``RLClient.serve(session.task_id)``: the newest such save;
        ``step=info.step``: this one, also named by ``info.adapter``)."""
        return self._submit(
            self._unary(
                "SaveWeightsForSampler", lambda seq: training_pb2.SaveWeightsForSamplerRequest(sequence=seq, name=name)
            ),
            lambda r: SavedStateInfo(r.sequence, r.name, r.step, r.artifact_key, r.adapter),
        )

    def get_info(self) -> SessionInfo:
        """The session now (synchronous; not ordered with queued calls)."""
        try:
            r = self._stub.GetInfo(
                training_pb2.GetInfoRequest(), timeout=min(self.timeout, 60.0), metadata=self._metadata()
            )
        except grpc.RpcError as err:
            raise _error(err) from None
        return SessionInfo(
            model=r.model,
            tokenizer=r.tokenizer,
            chat_template=r.chat_template,
            model_config_json=r.model_config_json,
            lora_rank=r.lora_rank,
            lora_alpha=r.lora_alpha,
            target_modules=list(r.target_modules),
            next_sequence=r.next_sequence,
            step=r.step,
            attempt=r.attempt,
            resumed_from=r.resumed_from,
            max_datums_per_call=r.max_datums_per_call,
            max_tokens_per_call=r.max_tokens_per_call,
            max_in_flight_calls=r.max_in_flight_calls,
            stop_token_ids=list(r.stop_token_ids),
            accumulated_calls=r.accumulated_calls,
            states=list(r.states),
            full_weights=r.full_weights,
        )

    def get_tokenizer(self, source: str | os.PathLike | None = None):
        """The session's tokenizer, loaded client-side with ``transformers.AutoTokenizer`` from
        ``source`` (a folder with the model's tokenizer files, or a hub id; default: the
        session's base model name). Needs ``transformers`` and ``tokenizers``, not torch."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(source) if source is not None else self.get_info().model)
