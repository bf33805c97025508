"""The training primitives' domain logic on a tiny random Llama, with no channel: each loss
against its reference (the built-in SFT step, REINFORCE, rl/ppo.py's pg_loss), sampler and
trainer log-probabilities, exact resume from a saved state, and bad input refused with the
session unchanged."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from opentinker_trainer.rl import ppo as rl_ppo
from opentinker_trainer.training.datums import Datum
from opentinker_trainer.training.errors import BadRequest, NotReady, OutOfOrder, OverLimit, StateNotFound
from opentinker_trainer.training.sequencing import Sequencer
from opentinker_trainer.training.session import AdamParams, SampleParams
from opentinker_trainer.workloads import sft
from opentinker_trainer.workloads.lora_session import open_session
from opentinker_trainer.workloads.sft_data import IGNORE_INDEX, batch_indices

from tests.support.datasets import arithmetic_chat_jsonl
from tests.support.workers import worker_ctx

HP = {"lora_rank": 4, "lora_alpha": 8.0, "seed": 3}


def new_session(model, tmp_path, name="s", **hp):
    ctx = worker_ctx(
        tmp_path, name, workload_type="lora_session", model=model, env_config={}, hyperparameters={**HP, **hp}
    )
    return open_session(ctx)[0]


def adapter(session) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in session.model.named_parameters() if p.requires_grad}


def grads(session) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in session.params]


def same(a: dict, b: dict, atol=1e-6) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol, rtol=1e-5) for k in a)


def datums(n=3, length=7, *, advantages=None, sampling=None):
    out = []
    for i in range(n):
        toks = [(17 * i + 5 * t + 11) % 400 + 20 for t in range(length + 1)]
        adv = advantages[i] if advantages is not None else 0.5 - i * 0.4
        out.append(
            Datum(
                input_tokens=toks[:-1],
                target_tokens=toks[1:],
                advantages=[float(adv)] * length,
                sampling_logprobs=list(sampling[i]) if sampling is not None else [-3.0] * length,
            )
        )
    return out


@pytest.fixture(scope="module")
def tmp_module(tmp_path_factory):
    return tmp_path_factory.mktemp("sessions")


def test_cross_entropy_step_gives_the_adapter_of_the_builtin_sft_step(tiny_model_dir, tmp_module) -> None:
    data = arithmetic_chat_jsonl(tmp_module / "d.jsonl", n=8)
    hp = {"batch_size": 4, "micro_batch_size": 0, "learning_rate": 1e-2, "steps": 1, "weight_decay": 0.1}
    ctx = worker_ctx(
        tmp_module,
        "sft",
        workload_type="sft",
        model=tiny_model_dir,
        env_config={"env_id": "chat_jsonl", "path": str(data), "eval_fraction": 0.0},
        hyperparameters={**hp, **HP, "max_grad_norm": 0.05},
    )
    trainer = sft._SFTTrainer(ctx)
    batch = [trainer.encoded(trainer.train_idx[k]) for k in batch_indices(1, 4, len(trainer.train_idx), 0)]
    session = new_session(tiny_model_dir, tmp_module, "ce")
    initial = adapter(session)
    assert same(initial, {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad})
    trainer.step = 1
    trainer.train_step()

    n_tokens = sum(e.trained_tokens for e in batch)
    batch_datums = [
        Datum(
            input_tokens=e.input_ids[:-1],
            target_tokens=[t if t != IGNORE_INDEX else 0 for t in e.labels[1:]],
            weights=[(1.0 / n_tokens) if t != IGNORE_INDEX else 0.0 for t in e.labels[1:]],
        )
        for e in batch
    ]
    # Two calls accumulate into one step, as one call would.
    first = session.forward_backward(batch_datums[:1], "cross_entropy")
    rest = session.forward_backward(batch_datums[1:], "cross_entropy")
    assert rest.accumulated_calls == 2 and first.loss > 0
    step, norm = session.optim_step(AdamParams(learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.05))
    assert step == 1 and norm > 0.05  # the clip acted
    sft_adapter = {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert same(adapter(session), sft_adapter, atol=1e-6)
    assert not same(adapter(session), initial)


@pytest.fixture(scope="module")
def session(tiny_model_dir, tmp_module):
    return new_session(tiny_model_dir, tmp_module, "shared")


def reference_grads(session, batch, loss_of_logp) -> list[torch.Tensor]:
    """Gradients of ``sum_i loss_of_logp(i, logp_i)`` by a plain forward of each datum."""
    saved = grads(session)
    for p in session.params:
        p.grad = None
    session.model.eval()
    total = 0
    for i, d in enumerate(batch):
        ids = torch.tensor([list(d.input_tokens)])
        logits = session.model(input_ids=ids).logits[0].float()
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(list(d.target_tokens))[:, None])[:, 0]
        total = total + loss_of_logp(i, logp)
    total.backward()
    out = grads(session)
    for p, g in zip(session.params, saved):
        p.grad = g
    return out


def test_importance_sampling_at_ratio_one_is_reinforce(session) -> None:
    base = datums()
    logp = session.forward(base)
    batch = datums(sampling=logp)  # the sampler is the current policy: ratio 1
    session.optimizer.zero_grad(set_to_none=True)
    session.accumulated_calls = 0
    out = session.forward_backward(batch, "importance_sampling")
    assert out.metrics["importance_ratio:mean"] == pytest.approx(1.0, abs=1e-5)
    want = reference_grads(session, batch, lambda i, lp: -(torch.tensor(batch[i].advantages) * lp).sum())
    assert all(torch.allclose(g, w, atol=1e-6, rtol=1e-4) for g, w in zip(grads(session), want))
    session.optimizer.zero_grad(set_to_none=True)
    session.accumulated_calls = 0


def test_ppo_loss_is_pg_loss_and_clipped_tokens_get_no_gradient(session) -> None:
    logp = session.forward(datums())
    # Ratios of e^{+-0.5}: outside 1 +- 0.2, on both sides.
    shifted = [[lp + (0.5 if t % 2 else -0.5) for t, lp in enumerate(row)] for row in logp]
    batch = datums(sampling=shifted, advantages=[1.0, -1.0, 2.0])
    session.optimizer.zero_grad(set_to_none=True)
    session.accumulated_calls = 0
    out = session.forward_backward(batch, "ppo", loss_fn_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    for i, d in enumerate(batch):
        ratio = torch.exp(torch.tensor(logp[i]) - torch.tensor(d.sampling_logprobs))
        want = rl_ppo.pg_loss(torch.tensor(d.advantages), ratio, 0.2) * len(d)
        assert out.losses[i] == pytest.approx(float(want), rel=1e-5)
    assert out.metrics["clip_fraction:mean"] == 1.0

    # The unclipped branch per token: where A r < A clip(r) it counts, else its gradient is 0.
    def surrogate(i, lp):
        d = batch[i]
        a = torch.tensor(d.advantages)
        r = torch.exp(lp - torch.tensor(d.sampling_logprobs))
        keep = (-a * r.detach()) >= (-a * r.detach().clamp(0.8, 1.2))
        return torch.where(keep, -a * r, torch.zeros_like(r)).sum()

    want = reference_grads(session, batch, surrogate)
    assert all(torch.allclose(g, w, atol=1e-6, rtol=1e-4) for g, w in zip(grads(session), want))
    session.optimizer.zero_grad(set_to_none=True)
    session.accumulated_calls = 0


def test_with_lora_dropout_forward_backward_scores_the_policy_that_sampled(tiny_model_dir, tmp_path) -> None:
    """Dropout is off in every pass, so on the session's own log-probs the ratio is exactly 1 and
    ppo clips nothing before an update."""
    s = new_session(tiny_model_dir, tmp_path, "dropout", lora_dropout=0.5)
    with torch.no_grad():  # lora_B is 0 at init, where dropout on the adapter's input changes nothing
        for p in s.params:
            p.add_(0.05 * torch.randn_like(p))
    logp = s.forward(datums())
    out = s.forward_backward(
        datums(sampling=logp), "ppo", loss_fn_config={"clip_low_threshold": 0.99, "clip_high_threshold": 1.01}
    )
    assert out.metrics["importance_ratio:mean"] == pytest.approx(1.0, abs=1e-5)
    assert out.metrics["clip_fraction:mean"] == 0.0


def test_sampled_logprobs_equal_forward_logprobs_at_temperature_one(session) -> None:
    prompt = [25, 300, 41, 7, 99]
    params = SampleParams(max_tokens=6, return_logprobs=True)
    out = session.sample(prompt, n=3, seed=5, params=params)
    assert out.prompt_tokens == prompt and len(out.samples) == 3
    again = session.sample(prompt, n=3, seed=5, params=params)
    assert [s.tokens for s in again.samples] == [s.tokens for s in out.samples]  # seeded
    batch = []
    for s in out.samples:
        assert len(s.logprobs) == len(s.tokens) > 0
        seq = prompt + s.tokens
        batch.append(Datum(input_tokens=seq[:-1], target_tokens=seq[1:]))
    forward = session.forward(batch)
    for s, lp in zip(out.samples, forward):
        got = lp[len(prompt) - 1 :]
        assert max(abs(a - b) for a, b in zip(got, s.logprobs)) < 1e-4
        assert max(abs(a - b) for a, b in zip(s.sampling_logprobs, s.logprobs)) < 1e-6  # no warper


@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (1.3, 0.8)])
def test_sampling_logprobs_are_those_of_the_distribution_that_sampled(session, temperature, top_p) -> None:
    """``logprobs`` stay the model's at temperature 1; ``sampling_logprobs`` are under
    softmax(logits / temperature) cut to the top_p nucleus, from a forward of the same tokens."""
    from opentinker_trainer.inference.sampling import warp

    prompt = [25, 300, 41, 7, 99]
    params = SampleParams(max_tokens=6, temperature=temperature, top_p=top_p, return_logprobs=True)
    out = session.sample(prompt, n=4, seed=2, params=params)
    for s in out.samples:
        ids = torch.tensor([prompt + s.tokens])
        with torch.no_grad():
            logits = session.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        target = torch.tensor(s.tokens)[:, None]
        raw = torch.log_softmax(logits, -1).gather(-1, target)[:, 0]
        warped = torch.log_softmax(warp(logits, temperature=temperature, top_k=0, top_p=top_p), -1)
        want = warped.gather(-1, target)[:, 0]
        assert torch.allclose(torch.tensor(s.logprobs), raw, atol=1e-4)
        assert torch.allclose(torch.tensor(s.sampling_logprobs), want, atol=1e-4)
        assert not torch.allclose(want, raw, atol=1e-3)


def test_load_state_with_optimizer_then_a_step_equals_the_uninterrupted_run(tiny_model_dir, tmp_path) -> None:
    batch = datums()
    adam = AdamParams(learning_rate=5e-3)
    run = new_session(tiny_model_dir, tmp_path, "run")
    for _ in range(2):
        run.forward_backward(batch, "importance_sampling")
        run.optim_step(adam)
    saved = run.save_state("two", next_sequence=7)
    assert (saved.folder / "adapter_model.safetensors").exists() and saved.step == 2
    at_two = adapter(run)
    run.forward_backward(batch, "importance_sampling")
    run.optim_step(adam)
    uninterrupted = adapter(run)

    # Another session (a new attempt) adopts the saved state, then takes the same third step.
    ctx = worker_ctx(
        tmp_path,
        "resumed",
        workload_type="lora_session",
        model=tiny_model_dir,
        env_config={},
        hyperparameters=HP,
        resume_from=saved.folder,
    )
    resumed, next_sequence = open_session(ctx)
    assert next_sequence == 7 and resumed.step == 2 and resumed.resumed_from == "two"
    assert same(adapter(resumed), at_two, atol=0)
    resumed.forward_backward(batch, "importance_sampling")
    resumed.optim_step(adam)
    assert same(adapter(resumed), uninterrupted, atol=1e-7)

    # In the same session: load the state back and step again; without the optimizer it differs.
    run.load_state("two", with_optimizer=True)
    assert run.step == 2 and same(adapter(run), at_two, atol=0)
    run.forward_backward(batch, "importance_sampling")
    run.optim_step(adam)
    assert same(adapter(run), uninterrupted, atol=1e-7)
    run.load_state("two", with_optimizer=False)
    run.forward_backward(batch, "importance_sampling")
    run.optim_step(adam)
    assert not same(adapter(run), uninterrupted, atol=1e-7)
    with pytest.raises(StateNotFound, match="'three'.*saved: two"):
        run.load_state("three", with_optimizer=True)
    with pytest.raises(BadRequest, match="name: expected 1 to 64"):
        run.save_state("../x", next_sequence=0)


def test_bad_input_is_refused_naming_the_datum_and_leaves_the_session_unchanged(session) -> None:
    session.optimizer.zero_grad(set_to_none=True)
    session.accumulated_calls = 0
    session.forward_backward(datums(), "cross_entropy")  # something accumulated already
    before_grads, before_weights, before_calls = grads(session), adapter(session), session.accumulated_calls
    good = datums()
    cases = [
        ([], "cross_entropy", "datums: expected at least one datum, got an empty batch"),
        (
            [good[0], Datum(good[1].input_tokens, good[1].target_tokens[:-1])],
            "cross_entropy",
            r"datums\[1\].target_tokens: expected 7 values \(one per input token\), got 6",
        ),
        (
            [good[0], Datum(good[1].input_tokens, good[1].target_tokens, advantages=[1.0] * 7)],
            "importance_sampling",
            r"datums\[1\].sampling_logprobs: expected 7 values",
        ),
        (
            [
                good[0],
                good[1],
                Datum(good[2].input_tokens, good[2].target_tokens, (), [0.0] * 6 + [math.nan], [0.0] * 7),
            ],
            "ppo",
            r"datums\[2\].advantages\[6\]: expected a finite number, got nan",
        ),
        ([Datum([5, 10**7], [1, 2])], "cross_entropy", r"datums\[0\].input_tokens\[1\]: expected a token id in \[0, "),
        # The loss overflows only once computed (a ratio of e^200): refused after the forward pass.
        (
            datums(sampling=[[-200.0] * 7] * 3),
            "importance_sampling",
            r"datums\[0\]: the importance_sampling loss is not finite",
        ),
        (good, "mse", "loss_fn: expected one of cross_entropy, importance_sampling, ppo"),
    ]
    for batch, loss_fn, message in cases:
        with pytest.raises(BadRequest, match=message):
            session.forward_backward(batch, loss_fn)
        assert session.accumulated_calls == before_calls
        assert all(torch.equal(a, b) for a, b in zip(grads(session), before_grads))
    with pytest.raises(BadRequest, match=r"loss_fn_config.clip_high_threshold: expected a ratio >= 1, got 0.9"):
        session.forward_backward(good, "ppo", loss_fn_config={"clip_high_threshold": 0.9})
    with pytest.raises(OverLimit, match=r"at most 1024 per call \(max_datums_per_call\), got 1025"):
        session.forward_backward(datums(1) * 1025, "cross_entropy")
    with pytest.raises(BadRequest, match="adam.learning_rate: expected a finite number > 0, got nan"):
        session.optim_step(AdamParams(learning_rate=math.nan))
    with pytest.raises(BadRequest, match=r"adam.beta2: expected a number in \[0, 1\)"):
        session.optim_step(AdamParams(learning_rate=1e-3, beta2=1.0))
    assert all(torch.equal(a, b) for a, b in zip(grads(session), before_grads))
    assert same(adapter(session), before_weights, atol=0)
    session.optim_step(AdamParams(learning_rate=1e-3))
    with pytest.raises(NotReady, match="no gradient accumulated"):
        session.optim_step(AdamParams(learning_rate=1e-3))


def test_sequence_numbers_order_calls_and_answer_retries_and_refusals_from_the_cache() -> None:
    async def scenario():
        seq = Sequencer(0, keep=2, max_in_flight=1, max_held=0)  # a call ahead is refused, not held
        ran: list[int] = []

        def call(n):
            async def go():
                ran.append(n)
                return f"r{n}"

            return go

        assert await seq.run(0, call(0)) == "r0"
        assert await seq.run(0, call(0)) == "r0" and ran == [0]  # a retry runs nothing
        with pytest.raises(OutOfOrder, match="sequence 2: expected 1") as err:
            await seq.run(2, call(2))
        assert err.value.expected == 1 and seq.next == 1

        async def fails():
            raise BadRequest("bad")

        with pytest.raises(BadRequest):
            await seq.run(1, fails)
        assert seq.next == 2  # a refused call uses up its number, as on Tinker
        with pytest.raises(BadRequest, match="bad"):
            await seq.run(1, call(1))  # its retry gets the refusal and runs nothing
        assert await seq.run(2, call(2)) == "r2"
        assert await seq.run(3, call(3)) == "r3"
        with pytest.raises(OutOfOrder, match="call 1 was applied and its response is no longer kept"):
            await seq.run(1, call(1))
        seq.admit()
        with pytest.raises(OverLimit, match=r"at most 1 per session \(max_in_flight_calls\), 1 already are"):
            seq.admit()
        seq.release()
        assert ran == [0, 2, 3]

    asyncio.run(scenario())


def test_a_call_ahead_is_held_and_runs_in_its_turn_even_when_its_caller_went_away() -> None:
    async def scenario():
        seq = Sequencer(0, keep=8, max_held=2, max_held_bytes=100, hold_s=60)
        ran: list[int] = []
        acknowledged: list[int] = []

        def call(n):
            async def go():
                ran.append(n)
                return f"r{n}"

            return go

        def ack(n):
            async def held():
                acknowledged.append(n)

            return held

        second = asyncio.create_task(seq.run(2, call(2), size=10, held=ack(2)))
        first = asyncio.create_task(seq.run(1, call(1), size=10, held=ack(1)))
        while len(acknowledged) < 2:
            await asyncio.sleep(0)
        assert sorted(acknowledged) == [1, 2] and ran == [] and seq.held_bytes == 20
        second.cancel()  # its caller went away: the held call stays
        with pytest.raises(OutOfOrder, match=r"holds 2 calls of 20 bytes .* at most 2 calls of 100 bytes"):
            await seq.run(3, call(3))
        # A retry of a held call is held with it and gets the same answer; its own body is not run.
        retry = asyncio.create_task(seq.run(2, call(-2), held=ack(2)))
        assert await seq.run(0, call(0)) == "r0"
        assert await first == "r1" and await retry == "r2"
        assert ran == [0, 1, 2] and seq.next == 3 and seq.held_bytes == 0
        assert await seq.run(2, call(2)) == "r2"  # kept, though its first caller went away

        # Beyond the bytes held, refused at once; held past hold_s, refused and not used up.
        with pytest.raises(OutOfOrder, match="at most 2 calls of 100 bytes"):
            await seq.run(5, call(5), size=101)
        seq.hold_s = 0.05
        with pytest.raises(OutOfOrder, match=r"sequence 4: expected 3 \(held 0.05 s, and call 3 did not arrive\)"):
            await seq.run(4, call(4), size=10)
        assert seq.held_bytes == 0 and seq.next == 3 and ran == [0, 1, 2]

    asyncio.run(scenario())


def test_a_number_held_or_kept_for_one_call_refuses_another_call_and_answers_its_retry() -> None:
    async def scenario():
        seq = Sequencer(0, keep=8, max_held=4, hold_s=60)

        def call(answer):
            async def go():
                return answer

            return go

        # Call 1 (prompt A) is held while call 0 never came; its client gave both up and reuses 0 and 1.
        held = asyncio.create_task(seq.run(1, call("samples of A"), what=("Sample", b"A")))
        while not seq.ahead(1) or 1 not in seq._held:
            await asyncio.sleep(0)
        assert await seq.run(0, call("step"), what=None) == "step"
        assert await held == "samples of A"
        with pytest.raises(OutOfOrder, match=r"sequence 1: expected 2 \(call 1 is another call, held or applied"):
            await seq.run(1, call("samples of B"), what=("Sample", b"B"))
        with pytest.raises(OutOfOrder, match="call 1 is another call"):
            await seq.run(1, call("an optimizer step"), what=None)
        assert await seq.run(1, call("not run"), what=("Sample", b"A")) == "samples of A"  # a retry
        assert seq.next == 2

    asyncio.run(scenario())


def test_a_client_sends_ahead_no_more_sample_calls_than_a_session_keeps_answers_for() -> None:
    """A sample call sent again after the calls behind it were answered finds its own answer."""
    import inspect

    from opentinker_client.training import PIPELINED_SAMPLES

    assert PIPELINED_SAMPLES <= inspect.signature(Sequencer).parameters["keep"].default


def test_messages_a_chat_template_refuses_are_a_bad_request(session) -> None:
    template = session.tokenizer.chat_template
    session.tokenizer.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    try:
        with pytest.raises(BadRequest, match="messages: the model's chat template refused them: roles must alternate"):
            session.prompt_tokens(None, [("user", "a"), ("user", "b")])
    finally:
        session.tokenizer.chat_template = template


def test_the_workload_serves_until_idle_then_ends(tiny_model_dir, tmp_path) -> None:
    import threading

    from opentinker_client.training import TrainingSession
    from opentinker_trainer.workloads import lora_session

    from tests.support.waiting import wait_for
    from tests.support.workers import reports

    ctx = worker_ctx(
        tmp_path,
        "idle",
        workload_type="lora_session",
        model=tiny_model_dir,
        env_config={},
        hyperparameters={**HP, "idle_timeout_s": 0.5},
    )
    runner = threading.Thread(target=lora_session.run, args=(ctx,))
    runner.start()
    endpoint = wait_for(lambda: (reports(ctx, "endpoint") or [None])[0], timeout=120)["address"]
    with TrainingSession(endpoint, api_key="") as client:  # a call; then nothing for idle_timeout_s
        assert client.get_info().lora_rank == 4
    runner.join(300)  # returns on its own: idle
    assert not runner.is_alive() and not ctx.should_stop()


def test_datums_sharing_an_unscored_prompt_run_it_once_with_the_same_gradient(session) -> None:
    long, short = [31, 200, 77, 5, 140, 9], [90, 91, 92]  # two groups: the short prompt runs left-padded
    completions = [(long, [50, 61, 72]), (long, [50, 88]), (long, [301, 12, 13, 14]), (long, [45])]
    completions += [(short, [7, 8]), (short, [17, 18, 19])]
    batch = []
    for k, (prompt, c) in enumerate(completions):
        seq = prompt + c
        n = len(seq) - 1
        adv = [0.0] * (len(prompt) - 1) + [0.7 - 0.5 * k] * len(c)
        batch.append(Datum(seq[:-1], seq[1:], (), adv, [-2.0] * n))
    batch.append(datums(1)[0])  # a datum of its own prompt runs flat beside them
    assert len(session._shared_logprobs(batch, list(range(len(batch))), "importance_sampling")) == 6
    session.optimizer.zero_grad(set_to_none=True)
    session.accumulated_calls = 0
    out = session.forward_backward(batch, "importance_sampling")
    flat = session.forward(batch)
    assert all(max(abs(a - b) for a, b in zip(x, y)) < 1e-4 for x, y in zip(out.logprobs, flat))

    def loss(i, lp):
        d = batch[i]
        return -(torch.exp(lp - torch.tensor(d.sampling_logprobs)) * torch.tensor(d.advantages)).sum()

    want = reference_grads(session, batch, loss)
    assert all(torch.allclose(g, w, atol=1e-6, rtol=1e-4) for g, w in zip(grads(session), want))
    session.optimizer.zero_grad(set_to_none=True)
    session.accumulated_calls = 0


def test_a_full_weight_session_trains_saves_and_resumes_every_weight(tiny_model_dir, tmp_path) -> None:
    """``lora: false``: no adapter, every weight trains; a state is an ``hf_full`` folder that
    loads on its own with ``from_pretrained``; resuming from it then one step equals the
    uninterrupted run; a LoRA state is refused by a full session and the other way round."""
    from transformers import AutoModelForCausalLM

    batch = datums()
    adam = AdamParams(learning_rate=5e-3)
    run = new_session(tiny_model_dir, tmp_path, "full", lora=False)
    assert run.full and not hasattr(run.model, "peft_config")
    assert len(run.params) == len(list(run.model.parameters()))
    before = adapter(run)
    run.forward_backward(batch, "cross_entropy")
    run.optim_step(adam)
    moved = adapter(run)
    assert moved.keys() == before.keys() and all(not torch.equal(before[k], moved[k]) for k in moved)
    saved = run.save_state("one", next_sequence=3)
    files = {f.name for f in saved.folder.iterdir()}
    assert {"config.json", "model.safetensors", "trainer_state.pt", "tokenizer_config.json"} <= files
    assert "adapter_config.json" not in files
    loaded = AutoModelForCausalLM.from_pretrained(saved.folder)
    assert same({n: p.detach() for n, p in loaded.named_parameters()}, moved, atol=0)
    run.forward_backward(batch, "cross_entropy")
    run.optim_step(adam)
    uninterrupted = adapter(run)
    info = run.info()
    assert info["full"] and info["lora"] == {}

    ctx = worker_ctx(
        tmp_path, "full-resumed", workload_type="lora_session", model=tiny_model_dir, env_config={},
        hyperparameters={**HP, "lora": False}, resume_from=saved.folder,
    )  # fmt: skip
    resumed, next_sequence = open_session(ctx)
    assert (next_sequence, resumed.step, resumed.resumed_from) == (3, 1, "one")
    assert same(adapter(resumed), moved, atol=0)
    resumed.forward_backward(batch, "cross_entropy")
    resumed.optim_step(adam)
    assert same(adapter(resumed), uninterrupted, atol=1e-7)
    run.load_state("one", with_optimizer=True)  # in the same session: back to step 1
    assert run.step == 1 and same(adapter(run), moved, atol=0)

    lora = new_session(tiny_model_dir, tmp_path, "lora-one")
    lora.forward_backward(batch, "cross_entropy")
    lora.optim_step(adam)
    lora_state = lora.save_state("lora", next_sequence=2)
    run.states["lora"] = lora_state
    lora.states["one"] = saved
    kept = adapter(run)
    with pytest.raises(NotReady, match="holds a LoRA adapter and this session trains all weights"):
        run.load_state("lora", with_optimizer=True)
    with pytest.raises(NotReady, match="holds full weights and this session trains a LoRA adapter"):
        lora.load_state("one", with_optimizer=True)
    assert same(adapter(run), kept, atol=0)  # refused: unchanged


def test_each_optimizer_step_reports_its_loss_tokens_and_gradient_norm(tiny_model_dir, tmp_path) -> None:
    """The session task's curve and usage: one metric point per optimizer step, summing the
    step's forward_backward calls and the completions sampled since the step before."""
    from tests.support.workers import reports

    ctx = worker_ctx(
        tmp_path, "metrics", workload_type="lora_session", model=tiny_model_dir, env_config={}, hyperparameters=HP
    )
    s = open_session(ctx)[0]
    batch = datums(n=2, length=5)
    first = s.forward_backward(batch, "importance_sampling")
    second = s.forward_backward(batch[:1], "cross_entropy")
    sampled = s.sample([20, 21, 22], n=2, seed=1, params=SampleParams(max_tokens=3))
    step, norm = s.optim_step(AdamParams(learning_rate=1e-3))
    (point,) = reports(ctx, "metric")
    assert point["step"] == step == 1
    values = point["values"]
    assert values["loss"] == pytest.approx(first.loss + second.loss, rel=1e-6)
    assert values["train/tokens"] == 15  # 2 x 5 + 1 x 5 target tokens
    assert values["tokens_generated"] == sum(len(x.tokens) for x in sampled.samples) > 0
    assert values["grad_norm"] == pytest.approx(norm) and values["learning_rate"] == 1e-3
    assert values["forward_backward_calls"] == 2
    s.forward_backward(batch, "cross_entropy")
    s.optim_step(AdamParams(learning_rate=1e-3))
    second_point = reports(ctx, "metric")[1]
    assert second_point["step"] == 2 and second_point["values"]["tokens_generated"] == 0  # counted once


def test_a_state_name_is_saved_once_per_attempt_as_stored_states_are_immutable(tiny_model_dir, tmp_path) -> None:
    from opentinker_common.artifacts import LocalArtifactStore
    from opentinker_trainer.worker_artifacts import CheckpointPublisher

    ctx = worker_ctx(
        tmp_path, "once", workload_type="lora_session", model=tiny_model_dir, env_config={}, hyperparameters=HP
    )
    store = LocalArtifactStore(tmp_path / "store")
    ctx.publisher = CheckpointPublisher(store, ctx.task_id, ctx.attempt)
    run, _ = open_session(ctx)
    first = run.save_state("x", next_sequence=1)
    assert first.artifact_key == f"tasks/{ctx.task_id}/a1/state_x"
    run.forward_backward(datums(), "importance_sampling")
    run.optim_step(AdamParams(learning_rate=5e-3))
    with pytest.raises(BadRequest, match="'x' was saved already in this attempt, and saved states are immutable"):
        run.save_state("x", next_sequence=2)
    assert store.manifest(first.artifact_key).meta["step"] == "0"  # the stored state is the first one
    assert run.save_state("y", next_sequence=2).artifact_key.endswith("/state_y")
