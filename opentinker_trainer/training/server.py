"""``opentinker.training.v1.TrainingService`` over grpc.aio, with health and reflection.

Thin: protobuf in and out, the call ordered by the session's :class:`~.sequencing.Sequencer`
and run on a worker thread, refusals mapped to status codes (:data:`~.errors.STATUS`); the work
is :class:`~.session.TrainingSession`'s. With an ``access`` checker every call is checked against
the scheduler with the caller's endpoint token, as the inference server does
(:class:`opentinker_trainer.inference.access.AccessChecker`): only the session task's owner or an
admin may call it.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from opentinker.training.v1 import training_pb2, training_pb2_grpc

from opentinker_common.net.grpc_options import server_options
from opentinker_common.spec.session import HELD_METADATA
from opentinker_trainer.inference.access import AccessChecker, AccessRefused
from opentinker_trainer.inference.server import serve_with_health
from opentinker_trainer.training.datums import Datum, Span, check_count
from opentinker_trainer.training.errors import BadRequest, OutOfOrder, SessionError, Stopping
from opentinker_trainer.training.sequencing import Sequencer
from opentinker_trainer.training.sampling import Sampled, SampleParams
from opentinker_trainer.training.session import KIND_SAMPLER, AdamParams, TrainingSession

__all__ = [
    "ERROR_DOMAIN",
    "SERVICE_NAME",
    "RunningTrainingServer",
    "TrainingServicer",
    "start_training_server",
]

SERVICE_NAME = training_pb2.DESCRIPTOR.services_by_name["TrainingService"].full_name
#: ``google.rpc.ErrorInfo.domain`` of a session's refusals (reason ``OUT_OF_ORDER``).
ERROR_DOMAIN = "opentinker.training"

#: Each LossFn by its Tinker name: LOSS_FN_<NAME> is <name>.
_LOSS = {value: name[len("LOSS_FN_") :].lower() for name, value in training_pb2.LossFn.items() if value}
#: The LossFnConfig fields, Tinker's loss_fn_config keys.
_CONFIG_KEYS = tuple(f.name for f in training_pb2.LossFnConfig.DESCRIPTOR.fields)
_STOP = {"stop": training_pb2.STOP_REASON_STOP, "length": training_pb2.STOP_REASON_LENGTH}


def datum_from_proto(d: training_pb2.Datum) -> Datum:
    return Datum(
        input_tokens=list(d.input_tokens),
        target_tokens=list(d.target_tokens),
        weights=list(d.weights),
        advantages=list(d.advantages),
        sampling_logprobs=list(d.sampling_logprobs),
        sequence_ratio_mask=list(d.sequence_ratio_mask),
        model_input_spans=[_span(s) for s in d.model_input_spans],
        loss_fn_input_spans=[_span(s) for s in d.loss_fn_input_spans],
    )


def _sample_digest(request: training_pb2.SampleRequest) -> tuple[str, bytes]:
    """A sample call's request, sequence number aside, as a short digest."""
    copy = training_pb2.SampleRequest()
    copy.CopyFrom(request)
    copy.sequence = 0
    return ("Sample", hashlib.blake2b(copy.SerializeToString(deterministic=True), digest_size=16).digest())


def _span(s: training_pb2.ProvenanceSpan) -> Span:
    return Span(sequence_id=s.sequence_id, offset=s.offset, length=s.length, sampled=s.sampled)


def params_from_proto(p: training_pb2.SamplingParams) -> SampleParams:
    """The session's :class:`~.sampling.SampleParams` of a request's ``params`` (unset fields:
    their documented defaults)."""
    return SampleParams(
        max_tokens=p.max_tokens or 64,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        return_logprobs=p.return_logprobs,
        prompt_logprobs=p.prompt_logprobs,
        topk_prompt_logprobs=p.topk_prompt_logprobs,
    )


def _prompt(r: training_pb2.SampleRequest) -> tuple[list[int] | None, list[tuple[str, str]] | None]:
    """A sample request's prompt: ``(tokens, None)`` or ``(None, messages)``."""
    which = r.WhichOneof("prompt")
    if which == "messages":
        return None, [(m.role, m.content) for m in r.messages.messages]
    return (list(r.tokens.tokens) if which == "tokens" else None), None


def _sequence(s: Sampled) -> training_pb2.SampledSequence:
    return training_pb2.SampledSequence(
        tokens=s.tokens,
        logprobs=s.logprobs,
        text=s.text,
        stop_reason=_STOP[s.stop_reason],
        sampling_logprobs=s.sampling_logprobs,
    )


def _topk(positions: list[list[tuple[int, float]]]) -> list[training_pb2.TopLogprobs]:
    return [training_pb2.TopLogprobs(tokens=[t for t, _ in pos], logprobs=[v for _, v in pos]) for pos in positions]


class TrainingServicer(training_pb2_grpc.TrainingServiceServicer):
    """The servicer of one session.

    Args:
        session: the session (its methods run on a worker thread, one at a time).
        sequencer: orders the calls; ``Sequencer(next_sequence)`` of a resumed session.
        access, task_id: check every call with the caller's key for task ``task_id`` (None: no checks).
        attempt: the task attempt serving the session (GetInfo).
        touch: called at each call (the workload's idle clock).
    """

    def __init__(
        self,
        session: TrainingSession,
        *,
        sequencer: Sequencer,
        access: AccessChecker | None = None,
        task_id: str = "",
        attempt: int = 1,
        touch: Callable[[], None] | None = None,
    ) -> None:
        if access is not None and not task_id:
            raise ValueError("task_id: expected the session task's id when access is checked")
        self.session = session
        self.seq = sequencer
        self.access = access
        self.task_id = task_id
        self.attempt = int(attempt)
        self.touch = touch or (lambda: None)
        self.stopping = False
        self.calls = 0

    # --- plumbing ---------------------------------------------------------------------------
    async def _admit(self, context) -> None:
        self.touch()
        self.calls += 1
        if self.access is not None:
            await self.access.check(context.invocation_metadata(), self.task_id)
        if self.stopping:
            raise Stopping("the session is stopping (cancelled, idle or past max_runtime); resume it to go on")

    async def _ordered(
        self,
        sequence: int,
        work: Callable[..., Any],
        respond: Callable[[Any], Any],
        context,
        size: int,
        *,
        key: Any = None,
        item: Any = None,
        what: Any = None,
    ) -> Any:
        """``respond(work())`` as call ``sequence`` of the session, ``work`` on a worker thread.
        A call ahead of the session's turn is held (``size`` request bytes): the initial metadata
        :data:`HELD_METADATA` tells the caller so at once, and the answer comes in its turn.
        With a ``key`` the call is joinable (:meth:`Sequencer.run`): ``work(join)`` gives the
        responses of the call and of those that joined it, and ``respond`` is not used. ``what``
        tells a retry from another call given the same number (:meth:`Sequencer.run`): a sample
        call's request; None for the calls a client sends only in their turn."""

        async def call():
            result = await asyncio.to_thread(work)
            return respond(result)

        async def joinable(join):
            return await asyncio.to_thread(work, join)

        run = call if key is None else joinable
        if self.seq.ahead(sequence):

            async def held() -> None:
                await context.send_initial_metadata(((HELD_METADATA, str(sequence)),))

            return await self.seq.run(sequence, run, size=size, held=held, key=key, item=item, what=what)
        self.seq.admit()
        try:
            return await self.seq.run(sequence, run, key=key, item=item, what=what)
        finally:
            self.seq.release()

    @staticmethod
    async def _abort(context, exc: BaseException) -> None:
        if isinstance(exc, AccessRefused):
            await context.abort(exc.code, exc.message)
        if isinstance(exc, OutOfOrder):
            info = error_details_pb2.ErrorInfo(
                reason="OUT_OF_ORDER", domain=ERROR_DOMAIN, metadata={"expected_sequence": str(exc.expected)}
            )
            packed = any_pb2.Any()
            packed.Pack(info)
            code = grpc.StatusCode.FAILED_PRECONDITION
            status = status_pb2.Status(code=code.value[0], message=str(exc), details=[packed])
            await context.abort_with_status(rpc_status.to_status(status))
        if isinstance(exc, SessionError):
            await context.abort(getattr(grpc.StatusCode, exc.status), str(exc))
        raise exc

    async def _read_batch(
        self, requests: AsyncIterator
    ) -> tuple[training_pb2.BatchHeader, Callable[[], list[Datum]], int]:
        """The header, a function giving the datums and the stream's bytes. A bad batch's refusal
        is raised by that function, called in the batch's turn, so that it uses up the batch's
        sequence number."""
        header = None
        datums: list[Datum] = []
        tokens = size = 0
        try:
            async for msg in requests:
                size += msg.ByteSize()
                which = msg.WhichOneof("part")
                if header is None:
                    if which != "header":
                        raise BadRequest("header: expected the batch header as the first message of the stream")
                    header = msg.header
                    if header.datum_count < 0:
                        raise BadRequest(f"header.datum_count: expected >= 0, got {header.datum_count}")
                    check_count(header.datum_count, 0, self.session.limits)
                    continue
                if which != "chunk":
                    raise BadRequest("header: expected one header, at the start of the stream; got a second one")
                for d in msg.chunk.datums:
                    datums.append(datum_from_proto(d))
                    tokens += len(d.input_tokens)
                check_count(len(datums), tokens, self.session.limits)  # refuse early, before the rest arrives
            if header is None:
                raise BadRequest("header: expected the batch header as the first message of the stream, got no message")
            if header.datum_count and header.datum_count != len(datums):
                raise BadRequest(
                    f"header.datum_count: the header announced {header.datum_count} datums, "
                    f"the stream carried {len(datums)}"
                )
        except SessionError as exc:
            if header is None:
                raise
            refusal = exc

            def refused() -> list[Datum]:
                raise refusal

            return header, refused, size
        return header, lambda: datums, size

    # --- the RPCs ---------------------------------------------------------------------------
    async def ForwardBackward(self, request_iterator, context):
        try:
            await self._admit(context)
            header, datums_of, size = await self._read_batch(request_iterator)
            loss_fn = _LOSS.get(header.loss_fn)
            cfg = header.loss_fn_config
            given = {key: getattr(cfg, key) for key in _CONFIG_KEYS if cfg.HasField(key)}
            sequence = header.sequence

            def respond(r):
                return training_pb2.ForwardBackwardResponse(
                    sequence=sequence,
                    outputs=[
                        training_pb2.DatumOutput(logprobs=lp, loss=loss) for lp, loss in zip(r.logprobs, r.losses)
                    ],
                    loss=r.loss,
                    metrics=r.metrics,
                    accumulated_calls=r.accumulated_calls,
                )

            def work():
                datums = datums_of()
                if loss_fn is None:
                    raise BadRequest(
                        f"header.loss_fn: expected one of {', '.join(training_pb2.LossFn.keys()[1:])}, "
                        f"got {header.loss_fn}"
                    )
                return self.session.forward_backward(datums, loss_fn, loss_fn_config=given)

            return await self._ordered(sequence, work, respond, context, size)
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await self._abort(context, exc)

    async def Forward(self, request_iterator, context):
        try:
            await self._admit(context)
            header, datums_of, size = await self._read_batch(request_iterator)
            sequence = header.sequence
            return await self._ordered(
                sequence,
                lambda: self.session.forward(datums_of()),
                lambda out: training_pb2.ForwardResponse(
                    sequence=sequence, outputs=[training_pb2.DatumOutput(logprobs=lp) for lp in out]
                ),
                context,
                size,
            )
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await self._abort(context, exc)

    async def OptimStep(self, request, context):
        try:
            await self._admit(context)
            a = request.adam

            def work():
                adam = AdamParams(
                    learning_rate=a.learning_rate,
                    beta1=a.beta1 if a.HasField("beta1") else 0.9,
                    beta2=a.beta2 if a.HasField("beta2") else 0.999,
                    eps=a.eps if a.HasField("eps") else 1e-8,
                    weight_decay=a.weight_decay if a.HasField("weight_decay") else 0.0,
                    max_grad_norm=a.max_grad_norm if a.HasField("max_grad_norm") else 1.0,
                )
                return self.session.optim_step(adam)

            return await self._ordered(
                request.sequence,
                work,
                lambda r: training_pb2.OptimStepResponse(sequence=request.sequence, step=r[0], grad_norm=r[1]),
                context,
                request.ByteSize(),
            )
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await self._abort(context, exc)

    async def Sample(self, request, context):
        try:
            await self._admit(context)
            params = params_from_proto(request.params)
            return await self._ordered(
                request.sequence,
                lambda join: self._sample(request, params, join),
                None,
                context,
                request.ByteSize(),
                key=("sample", params),
                item=request,
                what=_sample_digest(request),
            )
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await self._abort(context, exc)

    def _sample(
        self, first: training_pb2.SampleRequest, params: SampleParams, join: Callable[[], list]
    ) -> list[training_pb2.SampleResponse | SessionError]:
        """The answers of sample call ``first`` and of the sample calls with the same parameters
        that ``join`` gives while it decodes, in order: all in one continuous batch, or in
        several one after another when their ``n * (prompt + max_tokens)`` together exceed
        ``max_tokens_per_call``; once a call does not fit, no more calls join, so the answers
        wait for at most the calls already taken. A call that is refused (a bad prompt, ``n``)
        gets its refusal."""
        calls = [first]
        answers: dict[int, training_pb2.SampleResponse | SessionError] = {}
        prompts: dict[int, list[int]] = {}
        limit = self.session.limits.max_tokens_per_call
        done = 0  # calls[:done] are refused or in a batch
        joining = True  # until a call does not fit: later batches take only the calls already joined
        while done < len(calls):
            batch: list[int] = []
            tokens = 0

            def more() -> list[tuple[list[int], int, int | None]]:
                nonlocal done, tokens, joining
                jobs = []
                while True:
                    if done == len(calls):
                        joined = join() if joining else []
                        if not joined:
                            return jobs
                        calls.extend(joined)
                    r = calls[done]
                    n = r.n or 1
                    try:
                        if done not in prompts:
                            prompts[done] = self.session.prompt_tokens(*_prompt(r))
                            self.session.check_sample(prompts[done], n, params)
                    except SessionError as exc:
                        answers[done] = exc
                        done += 1
                        continue
                    cost = n * (len(prompts[done]) + params.max_tokens)
                    if batch and tokens + cost > limit:
                        joining = False
                        return jobs  # the next batch takes it
                    tokens += cost
                    batch.append(done)
                    jobs.append((prompts[done], n, r.seed if r.HasField("seed") else None))
                    done += 1

            for i, result in zip(batch, self.session.sample_together([], params, more)):
                answers[i] = training_pb2.SampleResponse(
                    sequence=calls[i].sequence,
                    prompt_tokens=result.prompt_tokens,
                    samples=[_sequence(s) for s in result.samples],
                    step=result.step,
                    prompt_logprobs=result.prompt_logprobs,
                    topk_prompt_logprobs=_topk(result.topk_prompt_logprobs),
                )
        return [answers[i] for i in range(len(calls))]

    async def SampleSnapshot(self, request, context):
        try:
            await self._admit(context)
            which = request.WhichOneof("weights")
            if which is None or (which == "base_model" and not request.base_model):
                raise BadRequest("weights: expected a sampler save's name (sampler) or base_model: true")
            sampler = request.sampler if which == "sampler" else None
            params = params_from_proto(request.params)
            prompts = []
            for p in request.prompts:
                kind = p.WhichOneof("prompt")
                prompts.append(
                    (
                        list(p.tokens.tokens) if kind == "tokens" else None,
                        [(m.role, m.content) for m in p.messages.messages] if kind == "messages" else None,
                        p.num_samples or 1,
                        p.seed if p.HasField("seed") else None,
                    )
                )
            record = [list(p.record_sequence_ids) for p in request.prompts]

            def work():
                jobs = []
                for i, (tokens, messages, n, seed) in enumerate(prompts):
                    try:
                        jobs.append((self.session.prompt_tokens(tokens, messages), n, seed))
                    except SessionError as exc:
                        raise type(exc)(f"prompts[{i}].{exc}") from None
                return self.session.sample_snapshot(jobs, params, sampler=sampler, record=record)

            self.seq.admit()
            try:
                results, step = await self.seq.exclusive(lambda: asyncio.to_thread(work))
            finally:
                self.seq.release()
            return training_pb2.SampleSnapshotResponse(
                results=[
                    training_pb2.SnapshotSamples(
                        prompt_tokens=r.prompt_tokens,
                        samples=[_sequence(s) for s in r.samples],
                        prompt_logprobs=r.prompt_logprobs,
                        topk_prompt_logprobs=_topk(r.topk_prompt_logprobs),
                    )
                    for r in results
                ],
                step=step,
            )
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await self._abort(context, exc)

    async def SaveState(self, request, context):
        try:
            await self._admit(context)
            seq = request.sequence
            return await self._ordered(
                seq,
                lambda: self.session.save_state(request.name, next_sequence=seq + 1),
                lambda s: training_pb2.SaveStateResponse(
                    sequence=seq, name=s.name, step=s.step, artifact_key=s.artifact_key
                ),
                context,
                request.ByteSize(),
            )
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await self._abort(context, exc)

    async def SaveWeightsForSampler(self, request, context):
        try:
            await self._admit(context)
            seq = request.sequence
            return await self._ordered(
                seq,
                lambda: self.session.save_state(request.name, next_sequence=seq + 1, kind=KIND_SAMPLER),
                lambda s: training_pb2.SaveWeightsForSamplerResponse(
                    sequence=seq,
                    name=s.name,
                    step=s.step,
                    artifact_key=s.artifact_key,
                    adapter=f"{self.task_id}@{s.step}" if self.task_id else "",
                ),
                context,
                request.ByteSize(),
            )
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await self._abort(context, exc)

    async def LoadState(self, request, context):
        try:
            await self._admit(context)
            seq = request.sequence
            ref = request.artifact
            artifact = (ref.key, ref.manifest_sha256, ref.total_bytes) if request.HasField("artifact") else None
            return await self._ordered(
                seq,
                lambda: self.session.load_state(request.name, with_optimizer=request.with_optimizer, artifact=artifact),
                lambda step: training_pb2.LoadStateResponse(sequence=seq, name=request.name, step=step),
                context,
                request.ByteSize(),
            )
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await self._abort(context, exc)

    async def GetInfo(self, request, context):
        try:
            await self._admit(context)
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await self._abort(context, exc)
        info = self.session.info()
        limits = self.session.limits
        return training_pb2.GetInfoResponse(
            model=info["model"],
            tokenizer=info["tokenizer"],
            chat_template=info["chat_template"],
            model_config_json=info["model_config_json"],
            lora_rank=int(info["lora"].get("lora_rank", 0)),
            lora_alpha=float(info["lora"].get("lora_alpha", 0.0)),
            target_modules=list(info["lora"].get("target_modules", ())),
            full_weights=bool(info["full"]),
            next_sequence=self.seq.next,
            step=info["step"],
            attempt=self.attempt,
            resumed_from=info["resumed_from"],
            max_datums_per_call=limits.max_datums_per_call,
            max_tokens_per_call=limits.max_tokens_per_call,
            max_in_flight_calls=limits.max_in_flight_calls,
            stop_token_ids=info["stop_token_ids"],
            accumulated_calls=info["accumulated_calls"],
            states=info["states"],
        )


@dataclass
class RunningTrainingServer:
    server: grpc.aio.Server
    port: int
    servicer: TrainingServicer
    health: Any
    started: float = 0.0

    async def stop(self, grace: float = 2.0) -> None:
        self.servicer.stopping = True
        await _maybe_await(self.health.enter_graceful_shutdown())
        await self.server.stop(grace)
        if self.servicer.access is not None:
            await self.servicer.access.close()


async def start_training_server(servicer: TrainingServicer, *, host: str = "0.0.0.0", port: int = 0, tls=None):
    """Serve ``servicer`` on ``host:port`` (0 = any free port), with health and reflection.

    Raises:
        OSError: the port cannot be bound.
    """
    server = grpc.aio.server(options=server_options(max_pings_without_data=False))
    training_pb2_grpc.add_TrainingServiceServicer_to_server(servicer, server)
    bound, health_servicer = await serve_with_health(server, SERVICE_NAME, host=host, port=port, tls=tls)
    return RunningTrainingServer(
        server=server, port=bound, servicer=servicer, health=health_servicer, started=time.monotonic()
    )


async def _maybe_await(value) -> None:
    if asyncio.iscoroutine(value):
        await value
