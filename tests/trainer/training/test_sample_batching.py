"""Sample calls that wait together decode in one continuous batch: a real session server on
loopback with keys checked against a real scheduler, a tiny Llama, the real client and raw stubs.
The model's forward passes are counted (and held back when a test needs a call to wait), so a
batch shows as fewer passes; each call still samples what it samples alone with the same seed,
and a sample queued after an optimizer step samples the new weights."""

from __future__ import annotations

import threading

import grpc
import pytest

from opentinker.training.v1 import training_pb2, training_pb2_grpc
from opentinker_client import RLClient, TrainingSession
from opentinker_client.training import Datum
from opentinker_trainer.workloads.lora_session import open_session

from tests.support.security import AUTH_LOCAL_MODELS, LoopbackScheduler
from tests.support.waiting import wait_for
from tests.support.workers import worker_ctx
from tests.trainer.training.test_training_server import Served

PROMPTS = [[25, 300, 41, 7, 99], [60, 61], [400, 12, 13, 90, 91, 92, 93, 8], [33, 34, 35]]
MAX_TOKENS = 6


class Passes:
    """Counts the session model's forward passes; with :meth:`hold` armed, the next pass waits
    until :meth:`release`."""

    def __init__(self, model) -> None:
        self.count = 0
        self.entered = threading.Event()
        self._armed = False
        self._go = threading.Event()
        self._handle = model.register_forward_pre_hook(self._pass)

    def _pass(self, _module, _args) -> None:
        self.count += 1
        if self._armed:
            self._armed = False
            self.entered.set()
            self._go.wait(120)

    def hold(self) -> None:
        self._go.clear()
        self.entered.clear()
        self._armed = True

    def release(self) -> None:
        self._armed = False
        self._go.set()

    def remove(self) -> None:
        self.release()
        self._handle.remove()


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("batching")
    sched = LoopbackScheduler(tmp / "state", AUTH_LOCAL_MODELS)
    try:
        with RLClient(sched.target, api_key=sched.admin_key) as root:
            _, alice = root.keys.create("alice", "user")
        with RLClient(sched.target, api_key=alice) as c:
            task = c.submit_task(workload_type="lora_session", model="/models/m")
            token = c.endpoint_token(task).token
        ctx = worker_ctx(
            tmp,
            "session",
            workload_type="lora_session",
            model=tiny_model_dir,
            env_config={},
            hyperparameters={"lora_rank": 4, "seed": 5},
            task_id=task,
        )
        session = open_session(ctx)[0]
        served = Served(session, sched.target, task)
        passes = Passes(session.model)
        try:
            yield {"served": served, "token": token, "passes": passes}
        finally:
            passes.remove()
            served.close()
    finally:
        sched.close()


def request(sequence: int, prompt: list[int], seed: int) -> training_pb2.SampleRequest:
    req = training_pb2.SampleRequest(
        sequence=sequence,
        n=3,
        params=training_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, return_logprobs=True),
        seed=seed,
    )
    req.tokens.tokens.extend(prompt)
    return req


def samples(out) -> list[tuple[list[int], list[float]]]:
    return [(list(s.tokens), [round(x, 4) for x in s.sampling_logprobs]) for s in out.samples]


def test_held_sample_calls_decode_in_one_batch_and_each_samples_as_alone(world) -> None:
    passes = world["passes"]
    with TrainingSession(world["served"].address, api_key=world["token"]) as s:
        stub = training_pb2_grpc.TrainingServiceStub(s._channel)
        md = s._metadata()
        first = s.get_info().next_sequence
        alone, alone_passes = [], []
        for i, prompt in enumerate(PROMPTS):  # one at a time: each its own batch
            before = passes.count
            alone.append(stub.Sample(request(first + i, prompt, seed=i), metadata=md))
            alone_passes.append(passes.count - before)
        assert all(p == MAX_TOKENS for p in alone_passes)  # a prefill, then a pass per further token

        # Calls 1..3 held ahead of call 0; call 0 then runs with all of them in one batch.
        base = first + len(PROMPTS)
        before = passes.count
        ahead = [request(base + i, PROMPTS[i], seed=i) for i in range(1, 4)]
        held = [stub.Sample.future(r, metadata=md) for r in ahead]
        seq = world["served"].servicer.seq
        wait_for(lambda: seq.held_bytes == sum(r.ByteSize() for r in ahead), 60, "calls 1..3 held")
        together = [stub.Sample(request(base, PROMPTS[0], seed=0), metadata=md)] + [c.result(60) for c in held]
        assert passes.count - before == max(alone_passes)  # one prefill and one pass per token, for all four
        assert [r.sequence for r in together] == [base + i for i in range(4)]
        assert [samples(r) for r in together] == [samples(r) for r in alone]
        assert s.get_info().next_sequence == base + 4


def test_the_client_sends_queued_samples_ahead_and_a_sample_after_a_step_sees_the_new_weights(world) -> None:
    passes = world["passes"]
    with TrainingSession(world["served"].address, api_key=world["token"]) as s:
        at_start = [s.sample(p, n=3, max_tokens=MAX_TOKENS, seed=i).result(60) for i, p in enumerate(PROMPTS[:2])]
        toks = PROMPTS[2] + [50, 51, 52, 53]
        data = [Datum.from_sequence(toks, prompt_length=len(PROMPTS[2]), advantage=1.0)]

        servicer = world["served"].servicer
        calls = servicer.calls
        passes.hold()  # the first sample's first pass waits: the calls queued behind it must reach the server
        try:
            a, b = (s.sample(p, n=3, max_tokens=MAX_TOKENS, seed=i) for i, p in enumerate(PROMPTS[:2]))
            fb = s.forward_backward(data, "cross_entropy")
            step = s.optim_step(learning_rate=0.5)
            c, d = (s.sample(p, n=3, max_tokens=MAX_TOKENS, seed=i) for i, p in enumerate(PROMPTS[:2]))
            assert passes.entered.wait(60)
            wait_for(lambda: servicer.calls >= calls + 2, 60, "the second sample call sent while the first runs")
        finally:
            passes.release()
        a, b, c, d = (f.result(60) for f in (a, b, c, d))
        assert [samples(a), samples(b)] == [samples(r) for r in at_start]
        assert fb.result(60).accumulated_calls == 1 and step.result(60).step == a.step + 1
        assert c.step == d.step == a.step + 1 and b.step == a.step
        assert [r.sequence for r in (a, b, c, d)] == [a.sequence, a.sequence + 1, a.sequence + 4, a.sequence + 5]
        again = [s.sample(p, n=3, max_tokens=MAX_TOKENS, seed=i).result(60) for i, p in enumerate(PROMPTS[:2])]
        assert [samples(c), samples(d)] == [samples(r) for r in again]  # the weights after the step
        assert samples(c) != samples(a)


def test_a_refused_sample_call_in_a_batch_gets_its_refusal_and_the_others_their_samples(world) -> None:
    with TrainingSession(world["served"].address, api_key=world["token"]) as s:
        stub = training_pb2_grpc.TrainingServiceStub(s._channel)
        md = s._metadata()
        base = s.get_info().next_sequence
        bad = request(base + 1, [10**7], seed=1)  # a token id outside the vocabulary
        ahead = [bad, request(base + 2, PROMPTS[1], seed=1)]
        held = [stub.Sample.future(r, metadata=md) for r in ahead]
        seq = world["served"].servicer.seq
        wait_for(lambda: seq.held_bytes == sum(r.ByteSize() for r in ahead), 60, "calls 1 and 2 held")
        first = stub.Sample(request(base, PROMPTS[0], seed=0), metadata=md)
        with pytest.raises(grpc.RpcError) as err:
            held[0].result(60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt.tokens[0]: expected a token id in [0," in err.value.details()
        assert len(first.samples) == len(held[1].result(60).samples) == 3
        assert s.get_info().next_sequence == base + 3  # the refusal used up its number


def test_a_sample_call_that_cannot_be_sent_uses_no_number(world) -> None:
    with TrainingSession(world["served"].address, api_key=world["token"]) as s:
        base = s.get_info().next_sequence
        with pytest.raises(ValueError):
            s.sample(PROMPTS[0], max_tokens="many").result(60)  # refused before it is sent
        out = s.sample(PROMPTS[0], n=1, max_tokens=MAX_TOKENS, seed=0).result(60)
        assert out.sequence == base and s.get_info().next_sequence == base + 1
