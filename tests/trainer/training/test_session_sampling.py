"""A session's sampling parameters and its sequence-free snapshot sampling, on a tiny random
Llama with the real tokenizer: greedy decoding, top-k, stop tokens and strings, prompt
log-probabilities against a forward pass, samplers that keep their weights after later optimizer
steps, and several prompts in one batch against each prompt alone."""

from __future__ import annotations

import math

import pytest
import torch

from opentinker_trainer.training.datums import Datum
from opentinker_trainer.training.errors import BadRequest, NotReady, OverLimit, StateNotFound
from opentinker_trainer.training.session import AdamParams, SampleParams
from opentinker_trainer.workloads.lora_session import open_session

from tests.support.workers import worker_ctx

HP = {"lora_rank": 4, "lora_alpha": 8.0, "seed": 3}
PROMPT = [25, 300, 41, 7, 99]
GREEDY = SampleParams(max_tokens=8, temperature=0.0, return_logprobs=True, ignore_eos=True)


def new_session(model, tmp_path, name, **kw):
    ctx = worker_ctx(
        tmp_path, name, workload_type="lora_session", model=model, env_config={}, hyperparameters={**HP, **kw}
    )
    return open_session(ctx)[0]


def trained(session, steps: int = 1) -> None:
    """``steps`` optimizer steps on a fixed batch that moves the adapter far enough to change samples."""
    toks = [(7 * t + 11) % 400 + 20 for t in range(13)]
    batch = [Datum(toks[:-1], toks[1:], advantages=[1.0] * 12, sampling_logprobs=[-3.0] * 12)]
    for _ in range(steps):
        session.forward_backward(batch, "importance_sampling")
        session.optim_step(AdamParams(learning_rate=5e-2))


def weights(session) -> list[torch.Tensor]:
    return [p.detach().clone() for p in session.params]


def argmax_decode(session, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens by plain full forwards, one token at a time."""
    seq = list(prompt)
    session.model.eval()
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(session.model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.fixture(scope="module")
def session(tiny_model_dir, tmp_path_factory):
    s = new_session(tiny_model_dir, tmp_path_factory.mktemp("sampling"), "shared")
    trained(s)  # a non-zero adapter: the adapter's weights count in every test below
    return s


def test_temperature_zero_is_the_argmax_and_top_k_one_is_greedy(session) -> None:
    out = session.sample(PROMPT, n=2, params=GREEDY)
    want = argmax_decode(session, PROMPT, 8)
    assert [s.tokens for s in out.samples] == [want, want]
    assert all(s.stop_reason == "length" for s in out.samples)
    assert all(s.sampling_logprobs == [0.0] * 8 for s in out.samples)  # a greedy token is certain
    top1 = session.sample(PROMPT, n=3, seed=4, params=SampleParams(max_tokens=8, top_k=1, ignore_eos=True))
    assert [s.tokens for s in top1.samples] == [want] * 3


def test_a_stop_token_id_ends_a_sample_and_is_kept(session) -> None:
    want = argmax_decode(session, PROMPT, 8)
    stop = want[3]
    end = want.index(stop) + 1
    out = session.sample(PROMPT, params=SampleParams(**{**GREEDY.__dict__, "stop_token_ids": (stop,)}))
    (s,) = out.samples
    assert s.tokens == want[:end] and s.stop_reason == "stop"
    assert len(s.logprobs) == len(s.sampling_logprobs) == end


def test_a_stop_string_ends_a_sample_once_its_text_holds_it(session) -> None:
    want = argmax_decode(session, PROMPT, 8)
    text = session.tokenizer.decode(want[:5])
    stop = text[-3:].strip() or text[-3:]
    end = next(j for j in range(1, 9) if stop in session.tokenizer.decode(want[:j]))
    out = session.sample(PROMPT, params=SampleParams(**{**GREEDY.__dict__, "stop": (stop,)}))
    (s,) = out.samples
    assert s.tokens == want[:end] and s.stop_reason == "stop"


def test_prompt_logprobs_are_a_forward_over_the_prompt(session) -> None:
    params = SampleParams(max_tokens=2, prompt_logprobs=True, topk_prompt_logprobs=3)
    out = session.sample(PROMPT, seed=1, params=params)
    (forward,) = session.forward([Datum(input_tokens=PROMPT[:-1], target_tokens=PROMPT[1:])])
    assert len(out.prompt_logprobs) == len(PROMPT) and math.isnan(out.prompt_logprobs[0])
    assert out.prompt_logprobs[1:] == pytest.approx(forward, abs=1e-5)
    # Top-k: k pairs per position after the first, most likely first, and the most likely token's
    # log-probability is what a forward gives for it.
    topk = out.topk_prompt_logprobs
    assert len(topk) == len(PROMPT) and topk[0] == [] and all(len(pos) == 3 for pos in topk[1:])
    assert all([v for _, v in pos] == sorted((v for _, v in pos), reverse=True) for pos in topk[1:])
    (best,) = session.forward([Datum(input_tokens=PROMPT[:-1], target_tokens=[pos[0][0] for pos in topk[1:]])])
    assert [pos[0][1] for pos in topk[1:]] == pytest.approx(best, abs=1e-5)
    for t in range(1, len(PROMPT)):
        assert out.prompt_logprobs[t] <= topk[t][0][1] + 1e-6
        assert all(v == pytest.approx(out.prompt_logprobs[t], abs=1e-5) for tok, v in topk[t] if tok == PROMPT[t])


@pytest.mark.parametrize("in_memory", [True, False], ids=["frozen-copy", "from-its-folder"])
def test_a_sampler_save_samples_its_weights_after_later_optimizer_steps(tiny_model_dir, tmp_path, in_memory) -> None:
    s = new_session(tiny_model_dir, tmp_path, "snap")
    if not in_memory:
        s.snapshot_bytes = 0  # no copy fits: the save is read back from its folder
    params = SampleParams(max_tokens=6, temperature=0.9, return_logprobs=True, prompt_logprobs=True)
    at_zero = s.sample(PROMPT, n=2, seed=11, params=params)
    trained(s)
    at_one = s.sample(PROMPT, n=2, seed=11, params=params)
    saved = s.save_state("v1", next_sequence=0, kind="sampler_weights")
    assert (saved.step, "v1" in s._frozen) == (1, in_memory)
    trained(s, steps=2)
    toks = [(5 * t + 3) % 300 + 30 for t in range(9)]
    s.forward_backward([Datum(toks[:-1], toks[1:])], "cross_entropy")  # a gradient waiting for its step
    before, grads = weights(s), [p.grad.clone() for p in s.params]
    (snap,), step = s.sample_snapshot([(PROMPT, 2, 11)], params, sampler="v1")
    assert step == 1
    assert [x.tokens for x in snap.samples] == [x.tokens for x in at_one.samples]
    for a, b in zip(snap.samples, at_one.samples):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.sampling_logprobs == pytest.approx(b.sampling_logprobs, abs=1e-5)
    assert snap.prompt_logprobs[1:] == pytest.approx(at_one.prompt_logprobs[1:], abs=1e-5)
    now = s.sample(PROMPT, n=2, seed=11, params=params)
    assert now.prompt_logprobs[1:] != pytest.approx(at_one.prompt_logprobs[1:], abs=1e-3)  # the steps changed them
    assert all(torch.equal(a, b) for a, b in zip(before, weights(s)))  # the session's weights are back
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, s.params)) and s.accumulated_calls == 1
    # The base model: the adapter off, which is what a fresh adapter (lora_B = 0) sampled at step 0.
    (base,), step = s.sample_snapshot([(PROMPT, 2, 11)], params, sampler=None)
    assert step == 0 and [x.tokens for x in base.samples] == [x.tokens for x in at_zero.samples]
    assert base.prompt_logprobs[1:] == pytest.approx(at_zero.prompt_logprobs[1:], abs=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(s)))


def test_prompts_sampled_together_equal_each_prompt_alone(tiny_model_dir, tmp_path) -> None:
    """Each prompt has its own random stream, so in a batch it draws what it draws alone; the
    batched pass pads rows to a common width, which moves its logits by float rounding only."""
    s = new_session(tiny_model_dir, tmp_path, "batch")
    trained(s)
    s.save_state("v", next_sequence=0, kind="sampler_weights")
    jobs = [([25, 300, 41, 7, 99], 3, 1), ([8, 9], 1, 2), ([50, 60, 70, 80, 90, 100, 110, 120], 2, 3), ([44], 2, 4)]
    params = SampleParams(max_tokens=7, temperature=1.0, top_p=0.95, return_logprobs=True, prompt_logprobs=True)
    together, _ = s.sample_snapshot(jobs, params, sampler="v")
    assert [r.prompt_tokens for r in together] == [p for p, _, _ in jobs]
    for job, got in zip(jobs, together):
        (alone,), _ = s.sample_snapshot([job], params, sampler="v")
        assert len(got.samples) == job[1]
        assert [x.tokens for x in got.samples] == [x.tokens for x in alone.samples]
        assert [x.stop_reason for x in got.samples] == [x.stop_reason for x in alone.samples]
        for a, b in zip(got.samples, alone.samples):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            assert a.sampling_logprobs == pytest.approx(b.sampling_logprobs, abs=1e-4)
        assert got.prompt_logprobs[1:] == pytest.approx(alone.prompt_logprobs[1:], abs=1e-4)
    again, _ = s.sample_snapshot(jobs, params, sampler="v")
    assert [[x.tokens for x in r.samples] for r in again] == [[x.tokens for x in r.samples] for r in together]


@pytest.mark.parametrize(
    "params, message",
    [
        (SampleParams(temperature=-0.1), "params.temperature: expected a number >= 0"),
        (SampleParams(top_k=-2), "params.top_k: expected a number >= 1, or 0 or -1"),
        (SampleParams(top_p=0.0), r"params.top_p: expected a number in \(0, 1\]"),
        (SampleParams(max_tokens=5000), "params.max_tokens: expected 1 to 4096"),
        (SampleParams(stop_token_ids=(5, 10**7)), r"params.stop_token_ids\[1\]: expected a token id in \[0, "),
        (SampleParams(topk_prompt_logprobs=21), "params.topk_prompt_logprobs: expected 0 to 20"),
    ],
)
def test_bad_parameters_are_refused_naming_the_field(session, params, message) -> None:
    session.save_state("bad", next_sequence=0, kind="sampler_weights")
    before = weights(session)
    with pytest.raises(BadRequest, match=message):
        session.sample_snapshot([(PROMPT, 1, None)], params, sampler="bad")
    with pytest.raises(BadRequest, match=message.replace("params.", "")):
        session.sample(PROMPT, params=params)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(session)))


def test_bad_snapshot_calls_are_refused(session, tiny_model_dir, tmp_path) -> None:
    ok = SampleParams(max_tokens=2)
    with pytest.raises(BadRequest, match="prompts: expected at least one prompt"):
        session.sample_snapshot([], ok, sampler=None)
    with pytest.raises(BadRequest, match=r"prompts\[1\].num_samples: expected 1 to 64 completions, got 65"):
        session.sample_snapshot([(PROMPT, 1, None), (PROMPT, 65, None)], ok, sampler=None)
    with pytest.raises(StateNotFound, match="sampler 'nope': no sampler save of that name"):
        session.sample_snapshot([(PROMPT, 1, None)], ok, sampler="nope")
    with pytest.raises(OverLimit, match="more than max_tokens_per_call"):
        session.sample_snapshot([(PROMPT, 64, None)] * 20, SampleParams(max_tokens=400), sampler=None)
    full = new_session(tiny_model_dir, tmp_path, "full", lora=False)
    with pytest.raises(NotReady, match="base_model: this session trains every weight"):
        full.sample_snapshot([(PROMPT, 1, None)], ok, sampler=None)


def test_a_call_without_a_sequence_number_runs_between_sequenced_calls_never_during_one() -> None:
    """SampleSnapshot swaps the session's weights for a while, so it waits for the sequenced call
    running (and that call's number stays the session's business: next moves on only with it)."""
    import asyncio

    from opentinker_trainer.training.sequencing import Sequencer

    async def scenario() -> list[str]:
        seq = Sequencer(0)
        events: list[str] = []
        started, release = asyncio.Event(), asyncio.Event()

        async def sequenced():
            events.append("step starts")
            started.set()
            await release.wait()
            events.append("step ends")

        async def snapshot():
            events.append("snapshot")
            return seq.next

        step = asyncio.create_task(seq.run(0, sequenced))
        await started.wait()
        snap = asyncio.create_task(seq.exclusive(snapshot))
        for _ in range(20):  # let the snapshot run if it could
            await asyncio.sleep(0)
        assert not snap.done() and events == ["step starts"]
        release.set()
        await step
        assert await snap == 1
        return events

    assert asyncio.run(scenario()) == ["step starts", "step ends", "snapshot"]
