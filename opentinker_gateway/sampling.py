"""``asample``: Tinker's one-prompt sample requests, batched into the session's SampleSnapshot.

The cookbook sends one request per rollout. Requests for the same weights with the same
sampling parameters that arrive while a SampleSnapshot of those runs wait and go together in the
next one, so concurrent rollouts decode in one batch on the model host. A sampler names fixed
weights: a ``save_weights_for_sampler`` save of the model (exactly those weights, whatever
optimizer steps came after).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import numpy as np
from prometheus_client import CollectorRegistry, Histogram
from tinker.proto import tinker_public_pb2 as tpb

from opentinker.training.v1 import training_pb2

from opentinker_gateway.errors import ApiError, from_rpc
from opentinker_gateway.models import Model, Outcome

__all__ = ["BASE_MODEL", "SampleBatcher", "sample_request", "sample_response"]

#: The sampler name of the base model, the adapter off (no save is named so: save names start
#: with a letter or digit).
BASE_MODEL = "@base"


@dataclass
class _Waiting:
    prompt: training_pb2.SnapshotPrompt
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class SampleBatcher:
    """Batches the asample requests of one gateway process (see the module docstring).

    ``registry`` gets ``opentinker_gateway_sample_batch_prompts``: the prompts of each
    SampleSnapshot call, so an operator sees how many requests went together."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._waiting: dict[tuple, list[_Waiting]] = {}
        self._running: set[tuple] = set()
        self._prompts = Histogram(
            "opentinker_gateway_sample_batch_prompts",
            "asample requests sent together in one SampleSnapshot call",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=registry,
        )

    def sample(
        self, model: Model, sampler: str, params: training_pb2.SamplingParams, prompt: training_pb2.SnapshotPrompt
    ) -> asyncio.Future:
        """The future Outcome of one prompt on ``model``'s sampler save ``sampler``."""
        key = (model.model_id, sampler, params.SerializeToString(deterministic=True))
        item = _Waiting(prompt)
        self._waiting.setdefault(key, []).append(item)
        if key not in self._running:
            self._running.add(key)
            asyncio.ensure_future(self._drain(key, model, sampler, params))
        return item.future

    async def _drain(self, key: tuple, model: Model, sampler: str, params: training_pb2.SamplingParams) -> None:
        try:
            while self._waiting.get(key):
                batch = self._waiting.pop(key)
                self._prompts.observe(len(batch))
                await _run(model, sampler, params, batch)
        finally:
            self._running.discard(key)


async def _run(model: Model, sampler: str, params: training_pb2.SamplingParams, batch: list[_Waiting]) -> None:
    request = training_pb2.SampleSnapshotRequest(prompts=[w.prompt for w in batch], params=params)
    if sampler == BASE_MODEL:
        request.base_model = True
    else:
        request.sampler = sampler
    try:
        response = await model.stub.SampleSnapshot(request, timeout=3600, metadata=await model.metadata())
    except grpc.aio.AioRpcError as exc:
        error = from_rpc(exc, "asample")
        for w in batch:
            w.future.set_result(Outcome(error=error))
        return
    except ApiError as exc:
        for w in batch:
            w.future.set_result(Outcome(error=exc))
        return
    for w, result in zip(batch, response.results):
        w.future.set_result(Outcome(proto=sample_response(result)))


def sample_request(body: dict) -> tuple[training_pb2.SamplingParams, training_pb2.SnapshotPrompt]:
    """The session's sampling parameters and prompt of a Tinker ``SampleRequest`` body."""
    prompt = body.get("prompt")
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise ApiError("prompt: expected a ModelInput with chunks")
    tokens: list[int] = []
    for j, chunk in enumerate(prompt["chunks"]):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise ApiError(f"prompt.chunks[{j}]: expected an encoded_text chunk")
        values = chunk.get("tokens")
        if not isinstance(values, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in values):
            raise ApiError(f"prompt.chunks[{j}].tokens: expected a list of token ids")
        tokens += values
    n = body.get("num_samples", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64:
        raise ApiError(f"num_samples: expected an integer in 1..64, got {n!r}")
    for name in ("topk_sample_logprobs", "prompt_alt_tokens_k", "target_prompt_logprobs", "prompt_logprobs_last_n"):
        if body.get(name):
            raise ApiError(f"{name}: not served by this OpenTinker")
    p = body.get("sampling_params") or {}
    if not isinstance(p, dict):
        raise ApiError("sampling_params: expected an object")
    params = training_pb2.SamplingParams(
        max_tokens=_int(p, "max_tokens", 64),
        top_k=max(_int(p, "top_k", -1), 0),
        return_logprobs=True,
        prompt_logprobs=bool(body.get("prompt_logprobs")),
        topk_prompt_logprobs=_int(body, "topk_prompt_logprobs", 0, field="topk_prompt_logprobs"),
    )
    for name in ("temperature", "top_p"):
        value = p.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ApiError(f"sampling_params.{name}: expected a number, got {value!r}")
            setattr(params, name, float(value))
    stop = p.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list):
            raise ApiError(f"sampling_params.stop: expected a string or a list, got {stop!r}")
        if not stop:
            params.ignore_eos = True
        elif all(isinstance(s, str) for s in stop):
            params.stop.extend(stop)
        elif all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
            params.stop_token_ids.extend(stop)
        else:
            raise ApiError("sampling_params.stop: expected all strings or all token ids")
    snapshot = training_pb2.SnapshotPrompt(tokens=training_pb2.TokenPrompt(tokens=tokens), num_samples=n)
    seed = p.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ApiError(f"sampling_params.seed: expected an integer, got {seed!r}")
        snapshot.seed = seed
    return params, snapshot


def _int(body: dict, name: str, default: int, *, field: str | None = None) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"{field or 'sampling_params.' + name}: expected an integer, got {value!r}")
    return value


def sample_response(result: training_pb2.SnapshotSamples) -> bytes:
    """Tinker's protobuf ``SampleResponse`` of one prompt's samples: tokens and their log-probabilities
    under the model at temperature 1, and the prompt's log-probabilities when asked for."""
    out = tpb.SampleResponse()
    for s in result.samples:
        seq = out.sequences.add()
        length = s.stop_reason == training_pb2.STOP_REASON_LENGTH
        seq.stop_reason = tpb.STOP_REASON_LENGTH if length else tpb.STOP_REASON_STOP
        seq.tokens = np.asarray(list(s.tokens), dtype="<i4").tobytes()
        seq.logprobs = np.asarray(list(s.logprobs), dtype="<f4").tobytes()
    if len(result.prompt_logprobs):
        out.prompt_logprobs = np.asarray(list(result.prompt_logprobs), dtype="<f4").tobytes()
    rows = result.topk_prompt_logprobs
    k = max((len(r.tokens) for r in rows), default=0)
    if k:
        ids = np.zeros((len(rows), k), dtype="<i4")
        lps = np.full((len(rows), k), np.nan, dtype="<f4")
        for i, r in enumerate(rows):
            ids[i, : len(r.tokens)] = list(r.tokens)
            lps[i, : len(r.logprobs)] = list(r.logprobs)
        out.topk_prompt_logprobs.CopyFrom(
            tpb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(rows))
        )
    return out.SerializeToString()
