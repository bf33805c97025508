"""TrainingService over real gRPC on loopback: the session of a tiny Llama behind the servicer,
called by the real client (futures, chunked datum streams, typed errors), with API keys checked
against a real scheduler as an inference server checks them."""

from __future__ import annotations

import asyncio
import math
import threading

import grpc
import torch
import pytest

from opentinker.training.v1 import training_pb2, training_pb2_grpc
from opentinker_client import (
    InvalidArgumentError,
    OutOfOrderError,
    PermissionDeniedError,
    ResourceExhaustedError,
    RLClient,
    TrainingSession,
    UnauthenticatedError,
    UnavailableError,
)
from opentinker_client import training as client_training
from opentinker_client.connection import SchedulerConnection
from opentinker_client.endpoint_tokens import EndpointTokens
from opentinker_client.training import Datum
from opentinker_trainer.inference.access import AccessChecker
from opentinker_trainer.training.sequencing import Sequencer
from opentinker_common.spec.session import HELD_METADATA
from opentinker_trainer.training.server import TrainingServicer, start_training_server
from opentinker_trainer.workloads.lora_session import open_session

from tests.support.security import AUTH_LOCAL_MODELS, LoopbackScheduler
from tests.support.waiting import wait_for
from tests.support.workers import worker_ctx


class Served:
    """A session server in a background event loop."""

    def __init__(self, session, sched_target: str, task_id: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servicer = servicer = TrainingServicer(
            session,
            sequencer=Sequencer(0, max_in_flight=session.limits.max_in_flight_calls),
            access=AccessChecker(sched_target, env={}, ttl=30, what="training session"),
            task_id=task_id,
        )
        self.running = asyncio.run_coroutine_threadsafe(
            start_training_server(servicer, host="127.0.0.1"), self.loop
        ).result(30)
        self.address = f"127.0.0.1:{self.running.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.running.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("served")
    sched = LoopbackScheduler(tmp / "state", AUTH_LOCAL_MODELS)
    try:
        with RLClient(sched.target, api_key=sched.admin_key) as root:
            _, alice = root.keys.create("alice", "user")
            _, bob = root.keys.create("bob", "user")
        with RLClient(sched.target, api_key=alice) as c:
            task = c.submit_task(workload_type="lora_session", model="/models/m")
            alice_token = c.endpoint_token(task).token
        with RLClient(sched.target, api_key=bob) as c:
            bob_token = c.endpoint_token(c.submit_task(workload_type="lora_session", model="/models/m")).token
        with RLClient(sched.target, api_key=sched.admin_key) as root:
            admin_token = root.endpoint_token(task).token
        ctx = worker_ctx(
            tmp,
            "session",
            workload_type="lora_session",
            model=tiny_model_dir,
            env_config={},
            hyperparameters={"lora_rank": 4, "max_datums_per_call": 64, "max_tokens_per_call": 4096},
            task_id=task,
        )
        served = Served(open_session(ctx)[0], sched.target, task)
        try:
            yield {
                "served": served,
                "alice": alice,
                "alice_token": alice_token,
                "bob_token": bob_token,
                "admin_token": admin_token,
                "task": task,
                "target": sched.target,
            }
        finally:
            served.close()
    finally:
        sched.close()


def batch(n: int = 4, length: int = 9, advantage: float = 1.0) -> list[Datum]:
    out = []
    for i in range(n):
        toks = [(13 * i + 7 * t + 3) % 300 + 30 for t in range(length + 1)]
        out.append(Datum.from_sequence(toks, prompt_length=4, advantage=advantage * (1 - 2 * (i % 2))))
    return out


def test_queued_calls_apply_in_order_and_retries_are_idempotent(world, monkeypatch) -> None:
    scheduler = SchedulerConnection(world["target"], timeout=30, api_key=world["alice"])
    tokens = EndpointTokens(scheduler, world["task"])  # as RLClient connects a session: tokens, never the key
    with scheduler, TrainingSession(world["served"].address, tokens=tokens, task_id=world["task"]) as s:
        start = s.get_info()
        assert start.lora_rank == 4 and start.next_sequence == s.next_sequence
        # Queued before waiting: forward_backward, then optim_step behind it, then a forward.
        monkeypatch.setattr(client_training, "CHUNK_BYTES", 64)  # several chunks per stream
        data = batch()
        fb = s.forward_backward(data, "importance_sampling")
        step = s.optim_step(learning_rate=1e-2)
        after = s.forward(data)
        out = fb.result(timeout=60)
        assert len(out.logprobs) == 4 and all(len(lp) == 9 for lp in out.logprobs) and out.accumulated_calls == 1
        assert step.result(timeout=60).step == start.step + 1
        assert after.result(timeout=60) != out.logprobs  # the step changed the weights
        info = s.get_info()
        assert info.next_sequence == start.next_sequence + 3 and info.accumulated_calls == 0

        # A retry of the applied optim_step (same number): its kept response, no second step.
        stub = training_pb2_grpc.TrainingServiceStub(s._channel)
        md = s._metadata()
        assert md[0][1].startswith("Bearer ote_")
        again = stub.OptimStep(
            training_pb2.OptimStepRequest(
                sequence=start.next_sequence + 1, adam=training_pb2.AdamParams(learning_rate=1)
            ),
            metadata=md,
        )
        assert again.step == start.step + 1 and s.get_info().step == start.step + 1

        # A number ahead of the expected one is held for its turn, as its initial metadata says;
        # when its turn does not come in time: OUT_OF_ORDER with the expected number, nothing applied.
        monkeypatch.setattr(world["served"].servicer.seq, "hold_s", 0.5)
        ahead = training_pb2.OptimStepRequest(
            sequence=info.next_sequence + 5, adam=training_pb2.AdamParams(learning_rate=1)
        )
        held = stub.OptimStep.future(ahead, metadata=md)
        assert dict(held.initial_metadata())[HELD_METADATA] == str(info.next_sequence + 5)
        with pytest.raises(grpc.RpcError) as err:
            held.result(timeout=60)
        mapped = client_training._error(err.value)
        assert isinstance(mapped, OutOfOrderError) and mapped.expected_sequence == info.next_sequence
        assert f"sequence {info.next_sequence + 5}: expected {info.next_sequence} (held 0.5 s" in str(mapped)
        assert s.get_info().next_sequence == info.next_sequence and s.get_info().step == start.step + 1


def test_bad_calls_are_typed_errors_that_use_up_their_sequence_number(world) -> None:
    with TrainingSession(world["served"].address, api_key=world["alice_token"]) as s:
        before = s.get_info()
        good = batch(2)
        bad = [good[0], Datum(good[1].input_tokens, good[1].target_tokens[:-2], advantages=good[1].advantages)]
        with pytest.raises(InvalidArgumentError, match=r"datums\[1\].target_tokens: expected 9 values"):
            s.forward_backward(bad, "cross_entropy").result(timeout=60)
        with pytest.raises(InvalidArgumentError, match="datums: expected at least one datum"):
            s.forward_backward([], "ppo").result(timeout=60)
        with pytest.raises(ResourceExhaustedError, match=r"at most 64 per call \(max_datums_per_call\), got 65"):
            s.forward([good[0]] * 65).result(timeout=60)
        with pytest.raises(ResourceExhaustedError, match=r"at most 4096 input tokens per call .* got 4500"):
            s.forward(batch(10, length=450)).result(timeout=60)
        with pytest.raises(Exception, match="no gradient accumulated"):
            s.optim_step(learning_rate=1e-3).result(timeout=60)
        # Each refusal is the answer of its number, as on Tinker: the session goes on with the next.
        after = s.get_info()
        assert after.next_sequence == before.next_sequence + 5 and after.step == before.step
        assert after.accumulated_calls == before.accumulated_calls
        # A retry of a refused number gets the same refusal and runs nothing.
        stub = training_pb2_grpc.TrainingServiceStub(s._channel)
        retry = training_pb2.OptimStepRequest(
            sequence=before.next_sequence + 4, adam=training_pb2.AdamParams(learning_rate=1)
        )
        with pytest.raises(grpc.RpcError, match="no gradient accumulated"):
            stub.OptimStep(retry, metadata=s._metadata())
        # Sampling from chat messages, with the sampler's logprobs.
        out = s.sample(messages=[{"role": "user", "content": "2+2?"}], n=2, max_tokens=3, seed=1).result(timeout=60)
        assert len(out.samples) == 2 and all(len(x.logprobs) == len(x.tokens) for x in out.samples)
        assert all(len(x.sampling_logprobs) == len(x.tokens) for x in out.samples)
        assert s.get_info().next_sequence == before.next_sequence + 6


def test_only_the_owner_or_an_admin_may_call_the_session(world) -> None:
    with TrainingSession(world["served"].address, api_key=world["admin_token"]) as admin:
        assert admin.get_info().model
    with pytest.raises(PermissionDeniedError, match=f"may not use training session {world['task']}"):
        TrainingSession(world["served"].address, api_key=world["bob_token"])  # a token of another session
    with pytest.raises(UnauthenticatedError, match="missing endpoint token"):
        TrainingSession(world["served"].address, api_key="")
    with pytest.raises(UnauthenticatedError, match=f"opentinker endpoint-token {world['task']}"):
        TrainingSession(world["served"].address, api_key=world["alice"])  # the API key itself


def test_a_full_weight_session_says_so_and_trains_over_grpc(world, tiny_model_dir, tmp_path) -> None:
    ctx = worker_ctx(
        tmp_path, "full", workload_type="lora_session", model=tiny_model_dir, env_config={},
        hyperparameters={"lora": False}, task_id=world["task"],
    )  # fmt: skip
    served = Served(open_session(ctx)[0], world["target"], world["task"])
    try:
        with TrainingSession(served.address, api_key=world["alice_token"], task_id=world["task"]) as s:
            info = s.get_info()
            assert info.full_weights and (info.lora_rank, info.target_modules) == (0, [])
            data = batch()
            before = s.forward(data).result(timeout=60)
            s.forward_backward(data, "cross_entropy").result(timeout=60)
            assert s.optim_step(learning_rate=1e-3).result(timeout=60).step == 1
            assert s.forward(data).result(timeout=60) != before
            saved = s.save_state("full").result(timeout=60)
            assert saved.step == 1 and (tmp_path / "full" / "state_full" / "model.safetensors").exists()
    finally:
        served.close()


def test_a_session_whose_worker_went_away_says_how_to_resume(world) -> None:
    """A call that cannot reach the session after its retries (the worker or its node is gone: here
    the endpoint's port refuses connections) names the task and points to resume_training_session."""
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    with TrainingSession(
        world["served"].address, api_key=world["alice_token"], task_id=world["task"], retries=1, timeout=5
    ) as s:
        s._stub = training_pb2_grpc.TrainingServiceStub(grpc.insecure_channel(dead))
        with pytest.raises(UnavailableError) as err:
            s.optim_step(learning_rate=1e-2).result(timeout=60)
    text = str(err.value)
    assert text.startswith("UNAVAILABLE: training session " + world["task"])
    assert "after 2 tries" in text and f"RLClient.resume_training_session('{world['task']}')" in text


def test_tinker_losses_and_adam_defaults_over_grpc(world) -> None:
    """Tinker's loss_fn_config keys reach the loss by field name; a bad one is INVALID_ARGUMENT
    naming it, and changes nothing; Tinker's AdamParams defaults are accepted."""
    with TrainingSession(world["served"].address, api_key=world["alice_token"]) as s:
        data = [
            Datum(d.input_tokens, d.target_tokens, (), d.advantages, d.sampling_logprobs, [1.0] * len(d.input_tokens))
            for d in batch(2)
        ]
        logp = s.forward(data).result(timeout=60)
        out = s.forward_backward(data, "dro", loss_fn_config={"beta": 0.5}).result(timeout=60)
        for d, lp, got in zip(data, logp, out.losses):
            lp, q, a = (torch.tensor(x) for x in (lp, d.sampling_logprobs, d.advantages))
            assert got == pytest.approx(float(-(lp * a - 0.25 * (lp - q) ** 2).sum()), rel=1e-5)
        assert set(out.metrics) == {"loss:sum", "tokens:sum", "importance_ratio:mean"}
        config = {"clip_low_threshold": 0.7, "clip_high_threshold": 1.5}
        for loss_fn in ("ppo", "cispo", "gspo"):
            out = s.forward_backward(data, loss_fn, loss_fn_config=config).result(timeout=60)
            assert {"loss:sum", "clip_fraction:mean"} <= set(out.metrics)
        before = s.get_info()
        with pytest.raises(InvalidArgumentError, match="loss_fn_config.beta: not read by ppo"):
            s.forward_backward(data, "ppo", loss_fn_config={"beta": 0.1}).result(timeout=60)
        with pytest.raises(InvalidArgumentError, match="loss_fn_config.beta: dro needs it"):
            s.forward_backward(data, "dro").result(timeout=60)
        with pytest.raises(InvalidArgumentError, match=r"datums\[0\].loss_fn_input_spans: stable_reinforce needs"):
            s.forward_backward(data, "stable_reinforce").result(timeout=60)
        with pytest.raises(InvalidArgumentError, match="loss_fn_config.clip_epsilon: expected one of"):
            s.forward_backward(data, "ppo", loss_fn_config={"clip_epsilon": 0.2}).result(timeout=60)
        after = s.get_info()  # the refusals used up their numbers and changed nothing
        assert after.next_sequence > before.next_sequence and after.accumulated_calls == before.accumulated_calls
        step = s.optim_step(1e-3, beta2=0.95, eps=1e-12, max_grad_norm=0.0).result(timeout=60)
        assert step.step == before.step + 1


def test_sample_snapshot_samples_a_sampler_save_in_one_call_without_a_sequence_number(world) -> None:
    """Over gRPC with the owner's endpoint token: prompts sampled from a sampler save after later
    optimizer steps equal Sample at the save's step, the call uses no sequence number, and bad
    calls are refused with the field named."""
    with TrainingSession(world["served"].address, api_key=world["alice_token"]) as s:
        s.forward_backward(batch(2), "importance_sampling").result(timeout=60)
        s.optim_step(learning_rate=1e-2).result(timeout=60)
        saved = s.save_weights_for_sampler("snap").result(timeout=60)
        prompts = [[31, 40, 52, 67], [90, 91]]
        at_save = [s.sample(p, n=2, max_tokens=5, seed=i, top_k=20).result(timeout=60) for i, p in enumerate(prompts)]
        greedy = s.sample(prompts[0], max_tokens=5, temperature=0.0, prompt_logprobs=True).result(timeout=60)
        s.forward_backward(batch(2), "importance_sampling").result(timeout=60)
        s.optim_step(learning_rate=1e-2).result(timeout=60)
        before = s.get_info()

        stub = training_pb2_grpc.TrainingServiceStub(s._channel)
        md = s._metadata()
        request = training_pb2.SampleSnapshotRequest(
            sampler="snap",
            prompts=[
                training_pb2.SnapshotPrompt(tokens=training_pb2.TokenPrompt(tokens=p), num_samples=2, seed=i)
                for i, p in enumerate(prompts)
            ],
            params=training_pb2.SamplingParams(max_tokens=5, top_k=20, return_logprobs=True, prompt_logprobs=True),
        )
        out = stub.SampleSnapshot(request, metadata=md, timeout=60)
        assert out.step == saved.step == before.step - 1
        assert [[list(x.tokens) for x in r.samples] for r in out.results] == [
            [x.tokens for x in a.samples] for a in at_save
        ]
        assert all(len(x.sampling_logprobs) == len(x.tokens) for r in out.results for x in r.samples)
        assert math.isnan(out.results[0].prompt_logprobs[0])
        assert list(out.results[0].prompt_logprobs[1:]) == pytest.approx(greedy.prompt_logprobs[1:], abs=1e-5)
        assert s.get_info().next_sequence == before.next_sequence  # no sequence number used

        def refused(req, code, message):
            with pytest.raises(grpc.RpcError) as err:
                stub.SampleSnapshot(req, metadata=md, timeout=60)
            assert err.value.code() == code and message in err.value.details(), err.value.details()

        bad = training_pb2.SampleSnapshotRequest()
        bad.CopyFrom(request)
        bad.params.top_k = -5
        refused(bad, grpc.StatusCode.INVALID_ARGUMENT, "params.top_k: expected a number >= 1, or 0 or -1")
        bad.params.top_k, bad.params.temperature = 0, -1.0
        refused(bad, grpc.StatusCode.INVALID_ARGUMENT, "params.temperature: expected a number >= 0")
        bad.params.temperature = 1.0
        bad.prompts[1].tokens.tokens.append(10**8)
        refused(bad, grpc.StatusCode.INVALID_ARGUMENT, "prompts[1].prompt.tokens[2]: expected a token id in [0, ")
        refused(
            training_pb2.SampleSnapshotRequest(prompts=request.prompts),
            grpc.StatusCode.INVALID_ARGUMENT,
            "weights: expected a sampler save's name (sampler) or base_model: true",
        )
        unknown = training_pb2.SampleSnapshotRequest(sampler="other", prompts=request.prompts)
        refused(unknown, grpc.StatusCode.NOT_FOUND, "sampler 'other': no sampler save of that name")
        base = stub.SampleSnapshot(
            training_pb2.SampleSnapshotRequest(base_model=True, prompts=request.prompts[:1]), metadata=md, timeout=60
        )
        assert base.step == 0 and len(base.results[0].samples) == 2
    with grpc.insecure_channel(world["served"].address) as channel, pytest.raises(grpc.RpcError) as err:
        training_pb2_grpc.TrainingServiceStub(channel).SampleSnapshot(
            request, metadata=[("authorization", f"Bearer {world['bob_token']}")], timeout=60
        )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_call_whose_caller_goes_away_runs_once_and_keeps_its_answer(world, monkeypatch) -> None:
    """A gateway killed during a call cancels its RPC; the call goes on, and the retry of its
    sequence number gets its answer instead of applying the batch a second time."""
    servicer = world["served"].servicer
    session = servicer.session
    started, release = threading.Event(), threading.Event()
    real = session.forward_backward
    runs = []

    def gated(*args, **kwargs):
        runs.append(1)
        started.set()
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(session, "forward_backward", gated)
    scheduler = SchedulerConnection(world["target"], timeout=30, api_key=world["alice"])
    tokens = EndpointTokens(scheduler, world["task"])
    with scheduler, TrainingSession(world["served"].address, tokens=tokens, task_id=world["task"]) as s:
        sequence = s.get_info().next_sequence
        stub = training_pb2_grpc.TrainingServiceStub(s._channel)

        def messages():
            header = training_pb2.BatchHeader(sequence=sequence, loss_fn=training_pb2.LOSS_FN_IMPORTANCE_SAMPLING)
            return client_training.batch_messages(header, batch(), training_pb2.ForwardBackwardRequest)

        first = stub.ForwardBackward.future(messages(), metadata=s._metadata())
        assert started.wait(60)
        first.cancel()
        wait_for(lambda: servicer.seq.in_flight == 0, what="the server to see the call cancelled")
        release.set()
        retried = stub.ForwardBackward(messages(), metadata=s._metadata(), timeout=60)
        assert retried.accumulated_calls == 1 and len(runs) == 1
        stub.OptimStep(
            training_pb2.OptimStepRequest(sequence=sequence + 1, adam=training_pb2.AdamParams(learning_rate=1e-3)),
            metadata=s._metadata(),
            timeout=60,
        )
