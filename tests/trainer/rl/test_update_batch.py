"""The update passes of several LoRA adapters in one forward and backward (a model host's
tenants): each request's log-probs and the gradient of its own loss on its own adapter are those
of its pass alone, within float tolerance; default-shaped requests share a pass, whose token
budget counts them padded; a request whose loss fails fails alone, and a failed shared pass is
logged, counted and leaves the model as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from opentinker_common.arithmetic import ArithmeticEnv
from opentinker_common.spec import ArithmeticEnvConfig
from opentinker_common.spec.grpo import GRPOConfig
from opentinker_trainer.rl import update_batch
from opentinker_trainer.rl.grpo import pg_loss
from opentinker_trainer.rl.rollout import Rollout, left_pad, right_pad
from opentinker_trainer.rl.update_batch import GradRows, UpdateRequest, run_alone, run_batched
from tests.support.models import tiny_lora_model

#: Adapters: name, rank, target modules (``a2`` misses ``v_proj``: its rows get no update there).
ADAPTERS = (("a0", 4, ["q_proj", "v_proj"]), ("a1", 8, ["q_proj", "v_proj"]), ("a2", 4, ["q_proj", "o_proj"]))


def _model(tiny_model_dir: Path):
    """The tiny model with the :data:`ADAPTERS`, their B matrices random (non-zero gradients on A)."""
    return tiny_lora_model(tiny_model_dir, ADAPTERS)


@pytest.fixture
def no_share_limit(monkeypatch) -> None:
    """Passes bound by ``PASS_TOKENS`` only: requests of different sizes share one pass."""
    monkeypatch.setattr(update_batch, "PASS_SHARE", 100)


def _params(model, adapter: str) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if f".{adapter}." in n]


def _loss_of(advantages: torch.Tensor, mask: torch.Tensor):
    def loss_of(logp: torch.Tensor) -> torch.Tensor:
        return pg_loss(logp, logp.detach(), advantages, mask)[0]

    return loss_of


def _requests(tok, model) -> list[UpdateRequest]:
    """Three tenants' micro-batches: different prompts, group sizes, completion widths and lengths,
    temperatures and adapters (ranks, target modules)."""
    specs = [
        ("a0", ["What is 2 + 3?", "Name a colour."], 2, [[5, 6, 7], [8], [9, 10, 11], [12, 13]], 1.0),
        ("a1", ["Count to five:"], 3, [[20, 21, 22, 23, 24, 25], [26], [27, 28]], 0.7),
        ("a2", ["Hello", "Tell me a long joke, please"], 1, [[30, 31], [32, 33, 34, 35]], 1.3),
    ]
    out = []
    for adapter, prompts, k, completions, temp in specs:
        ids, mask = left_pad([tok(p)["input_ids"] for p in prompts], tok.pad_token_id)
        ids, mask = ids.repeat_interleave(k, dim=0), mask.repeat_interleave(k, dim=0)
        c_ids, c_mask = right_pad(completions, tok.pad_token_id)
        ro = Rollout(ids, mask, c_ids, c_mask, c_mask.sum(1), torch.zeros(len(completions), dtype=torch.bool))
        adv = torch.linspace(-1.0, 1.0, len(completions))
        out.append(
            UpdateRequest(
                adapter=adapter,
                params=_params(model, adapter),
                rollout=ro,
                loss_of=_loss_of(adv, c_mask),
                temperature=temp,
                group_size=k,
            )
        )
    return out


def test_a_batched_pass_gives_each_request_its_own_logprobs_and_gradients(
    tiny_model_dir: Path, monkeypatch, no_share_limit
) -> None:
    tok, model = _model(tiny_model_dir)
    reqs = _requests(tok, model)
    want = [run_alone(model, r) for r in reqs]
    assert model.active_adapter == "a0"
    with monkeypatch.context() as m:  # the shared pass itself, not its fallback, gives the outcomes
        m.setattr(update_batch, "run_alone", lambda *a: pytest.fail("fell back to passes alone"))
        got = run_batched(model, reqs)
    for req, alone, batched in zip(reqs, want, got):
        assert alone.error is None and batched.error is None
        mask = req.rollout.completion_mask
        assert batched.logp.shape == alone.logp.shape and not batched.logp.requires_grad
        assert torch.allclose(batched.logp[mask], alone.logp[mask], atol=1e-5), req.adapter
        assert len(batched.grads) == len(req.params) and all(g is not None for g in batched.grads)
        for g, w in zip(batched.grads, alone.grads):
            assert torch.allclose(g, w, atol=1e-6, rtol=1e-4), req.adapter
        assert any(float(g.abs().max()) > 1e-4 for g in batched.grads)  # gradients that can differ
    # The model is as found: adapter layers on, only the active adapter trainable, no .grad set.
    assert model.active_adapter == "a0" and not model.training
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".a0." in n for n in trainable)
    assert all(p.grad is None for p in model.parameters())


def _record_alone(monkeypatch) -> list[str]:
    """The adapters of the requests that :func:`run_alone` runs, in order."""
    alone: list[str] = []
    solo = update_batch.run_alone
    monkeypatch.setattr(update_batch, "run_alone", lambda m, r: (alone.append(r.adapter), solo(m, r))[1])
    return alone


def _padded(reqs: list[UpdateRequest]) -> int:
    """Token positions of one pass of ``reqs``: each group's prompt once at the widest prompt's
    width, every row at the widest completion's."""
    prompts = sum(len(r.rollout) // r.group_size for r in reqs)
    rows = sum(len(r.rollout) for r in reqs)
    width = max(r.rollout.prompt_ids.shape[1] for r in reqs)
    return prompts * width + rows * max(r.rollout.completion_ids.shape[1] for r in reqs)


def test_requests_beyond_a_pass_token_budget_run_in_further_passes(
    tiny_model_dir: Path, monkeypatch, no_share_limit
) -> None:
    """A pass takes requests in order up to ``PASS_TOKENS`` token positions (its activations'
    bound); the next request starts another pass, here a pass of one: the solo pass."""
    tok, model = _model(tiny_model_dir)
    reqs = _requests(tok, model)
    want = [run_alone(model, r) for r in reqs]
    assert update_batch.pass_tokens(reqs[:1]) == 2 * reqs[0].rollout.prompt_ids.shape[1] + 4 * 3
    assert update_batch.pass_tokens(reqs[:2]) == _padded(reqs[:2])
    monkeypatch.setattr(update_batch, "PASS_TOKENS", _padded(reqs[:2]))
    alone = _record_alone(monkeypatch)
    got = run_batched(model, reqs)
    assert alone == ["a2"]  # a0 and a1 shared one pass
    for alone_pass, batched in zip(want, got):
        assert all(torch.allclose(g, w, atol=1e-6, rtol=1e-4) for g, w in zip(batched.grads, alone_pass.grads))


def test_a_pass_budget_counts_every_request_padded_to_the_widest_prompt_and_completion(
    tiny_model_dir: Path, monkeypatch
) -> None:
    """The pass pads a0's three-token completions to a1's six and every prompt to the widest: a
    budget one short of that padded size, though above the two requests' own sizes summed, does
    not take them together."""
    tok, model = _model(tiny_model_dir)
    reqs = _requests(tok, model)
    own = sum(_padded([r]) for r in reqs[:2])
    assert own < _padded(reqs[:2]) - 1
    monkeypatch.setattr(update_batch, "PASS_TOKENS", _padded(reqs[:2]) - 1)
    alone = _record_alone(monkeypatch)
    got = run_batched(model, reqs)
    assert "a0" in alone and all(o.error is None for o in got), alone  # a0 ran without a1


def test_default_shaped_requests_share_a_pass_under_the_real_budget(tiny_model_dir: Path, monkeypatch) -> None:
    """Two tenants' micro-batches of the default shape (``GRPOConfig()``'s prompts per step,
    group size and ``max_new_tokens``, whole-batch micro-batches, arithmetic prompts in the chat
    template) run as one pass under the real ``PASS_TOKENS``, each with its own gradients."""
    cfg = GRPOConfig()
    tok, model = _model(tiny_model_dir)
    env = ArithmeticEnv(ArithmeticEnvConfig(), tok, seed=3)
    gen = torch.Generator().manual_seed(5)
    reqs = []
    for adapter, _, _ in ADAPTERS[:2]:
        ids, mask = left_pad([env.encode(p) for p in env.sample(cfg.prompts_per_step)], tok.pad_token_id)
        ids, mask = ids.repeat_interleave(cfg.group_size, 0), mask.repeat_interleave(cfg.group_size, 0)
        rows = len(ids)
        c_ids = torch.randint(5, 1000, (rows, cfg.max_new_tokens), generator=gen)
        c_mask = torch.ones_like(c_ids, dtype=torch.bool)
        ro = Rollout(ids, mask, c_ids, c_mask, c_mask.sum(1), torch.zeros(rows, dtype=torch.bool))
        adv = torch.linspace(-1.0, 1.0, rows)
        reqs.append(
            UpdateRequest(adapter, _params(model, adapter), ro, _loss_of(adv, c_mask), cfg.temperature, cfg.group_size)
        )
    assert _padded(reqs) <= update_batch.PASS_TOKENS  # both fit the real budget
    want = [run_alone(model, r) for r in reqs]
    with monkeypatch.context() as m:
        m.setattr(update_batch, "run_alone", lambda *a: pytest.fail("a default-shaped request ran alone"))
        got = run_batched(model, reqs)
    for alone_pass, batched in zip(want, got):
        assert batched.error is None
        assert all(torch.allclose(g, w, atol=1e-6, rtol=1e-4) for g, w in zip(batched.grads, alone_pass.grads))


def test_small_requests_share_passes_of_a_few_times_the_largest(tiny_model_dir: Path) -> None:
    """Eight tenants' small micro-batches (one prompt, two completions of four tokens: the
    multitenant benchmark's) run in two passes of four under the real limits, not in one pass:
    a host holds about four times the activations of one of them, not eight."""
    tok, model = _model(tiny_model_dir)
    env = ArithmeticEnv(ArithmeticEnvConfig(), tok, seed=3)
    gen = torch.Generator().manual_seed(5)
    reqs = []
    for i in range(8):
        adapter = ADAPTERS[i % len(ADAPTERS)][0]
        ids, mask = left_pad([env.encode(p) for p in env.sample(1)], tok.pad_token_id)
        ids, mask = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)
        c_ids = torch.randint(5, 1000, (2, 4), generator=gen)
        c_mask = torch.ones_like(c_ids, dtype=torch.bool)
        ro = Rollout(ids, mask, c_ids, c_mask, c_mask.sum(1), torch.zeros(2, dtype=torch.bool))
        reqs.append(
            UpdateRequest(adapter, _params(model, adapter), ro, _loss_of(torch.tensor([-1.0, 1.0]), c_mask), 1.0, 2)
        )
    largest = max(update_batch.pass_tokens([r]) for r in reqs)
    assert 8 * largest <= update_batch.PASS_TOKENS  # the token limit alone would take all eight
    parts = update_batch.passes(reqs)
    assert [len(p) for p in parts] == [4, 4]
    assert all(update_batch.pass_tokens(p) <= update_batch.PASS_SHARE * largest for p in parts)


def test_a_request_whose_loss_fails_fails_alone_and_the_fallback_is_logged_and_counted(
    tiny_model_dir: Path, monkeypatch, no_share_limit
) -> None:
    tok, model = _model(tiny_model_dir)
    reqs = _requests(tok, model)
    want = [run_alone(model, r) for r in reqs]

    def broken(logp: torch.Tensor) -> torch.Tensor:
        raise ValueError("a bad loss")

    reqs[1].loss_of = broken
    monkeypatch.setattr(update_batch, "_warned", set())
    fell_back: list[BaseException] = []
    with capture_logs() as logs:
        got = run_batched(model, reqs, fallback=fell_back.append)
        run_batched(model, reqs, fallback=fell_back.append)
    assert isinstance(got[1].error, ValueError) and got[1].grads is None
    for i in (0, 2):
        assert got[i].error is None
        assert all(torch.equal(g, w) for g, w in zip(got[i].grads, want[i].grads))  # alone: exactly
    # The shared pass failed twice: counted twice, told once for its exception type.
    assert [type(e) for e in fell_back] == [ValueError, ValueError]
    (warning,) = [e for e in logs if e["event"] == "a batched update pass failed; its requests run alone"]
    assert warning["log_level"] == "warning" and "a bad loss" in warning["error"] and warning["requests"] == 3


def _adapter_layers_on(model) -> bool:
    from peft.tuners.lora import Linear

    return all(not m.disable_adapters for m in model.modules() if isinstance(m, Linear))


def test_a_shared_pass_whose_hooks_fail_to_set_up_leaves_the_adapter_layers_on(
    tiny_model_dir: Path, monkeypatch
) -> None:
    """The shared pass fails while its hooks are made: the requests then run alone with their
    adapters, as they would have without it."""
    tok, model = _model(tiny_model_dir)
    reqs = _requests(tok, model)
    want = [run_alone(model, r) for r in reqs]

    class Broken:
        def __init__(self, *args) -> None:
            raise RuntimeError("no hooks")

    monkeypatch.setattr(update_batch, "GradRows", Broken)
    alone = _record_alone(monkeypatch)
    got = run_batched(model, reqs)
    assert alone == ["a0", "a1", "a2"] and _adapter_layers_on(model)
    for alone_pass, batched in zip(want, got):
        assert batched.error is None and len(batched.grads) == len(alone_pass.grads)
        assert all(g is not None and torch.equal(g, w) for g, w in zip(batched.grads, alone_pass.grads))


def test_a_lora_layer_on_a_batch_the_hooks_do_not_know_fails_the_pass(tiny_model_dir: Path) -> None:
    """A forward on a batch of a row count the hooks were not given: its rows' adapters are
    unknown, so the pass raises rather than run those rows without their LoRA."""
    _, model = _model(tiny_model_dir)
    model.base_model.disable_adapter_layers()
    hooks = GradRows(model, {2: ["a0", "a1"]})
    try:
        ids = torch.full((3, 4), 7)
        with pytest.raises(RuntimeError, match="ran on 3 rows"):
            model.get_base_model()(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        hooks.close()
        model.base_model.enable_adapter_layers()
    assert _adapter_layers_on(model)


def test_add_grads_accumulates_as_backward_does() -> None:
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    update_batch.add_grads([p, q], [torch.tensor([1.0, 2.0]), None])
    update_batch.add_grads([p, q], [torch.tensor([0.5, 0.5]), torch.tensor([3.0, 3.0])])
    assert p.grad.tolist() == [1.5, 2.5] and q.grad.tolist() == [3.0, 3.0]


def test_add_grads_gives_each_parameter_a_gradient_of_its_own() -> None:
    """Gradients that are views of one buffer (a stacked pass's) become tensors of their own:
    a step on one parameter's ``.grad`` changes no other's."""
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    shared = torch.tensor([1.0, 2.0, 3.0, 4.0])
    update_batch.add_grads([p, q], [shared[:2], shared[2:]])
    p.grad.mul_(10.0)
    assert p.grad.tolist() == [10.0, 20.0] and q.grad.tolist() == [3.0, 4.0]
    assert shared.tolist() == [1.0, 2.0, 3.0, 4.0] and p.grad._base is None and q.grad._base is None
