"""The update passes of several LoRA adapters in one forward and backward (a model host's
tenants): each request's log-probs and the gradient of its own loss on its own adapter are those
of its pass alone, within float tolerance; a request whose loss fails fails alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opentinker_trainer.rl import update_batch
from opentinker_trainer.rl.grpo import pg_loss
from opentinker_trainer.rl.rollout import Rollout, left_pad, right_pad
from opentinker_trainer.rl.update_batch import UpdateRequest, run_alone, run_batched

#: Adapters: name, rank, target modules (``a2`` misses ``v_proj``: its rows get no update there).
ADAPTERS = (("a0", 4, ["q_proj", "v_proj"]), ("a1", 8, ["q_proj", "v_proj"]), ("a2", 4, ["q_proj", "o_proj"]))


def _model(tiny_model_dir: Path):
    """The tiny model with the :data:`ADAPTERS`, their B matrices random (non-zero gradients on A)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).requires_grad_(False).eval()
    model = None
    for i, (name, r, targets) in enumerate(ADAPTERS):
        torch.manual_seed(i)
        cfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.1, target_modules=targets)
        if model is None:
            model = get_peft_model(base, cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model.set_adapter("a0")
    return tok, model.eval()


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


def test_a_batched_pass_gives_each_request_its_own_logprobs_and_gradients(tiny_model_dir: Path, monkeypatch) -> None:
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


def test_requests_beyond_a_pass_token_budget_run_in_further_passes(tiny_model_dir: Path, monkeypatch) -> None:
    """A pass takes requests in order up to ``PASS_TOKENS`` token positions (its activations'
    bound); the next request starts another pass, here a pass of one: the solo pass."""
    tok, model = _model(tiny_model_dir)
    reqs = _requests(tok, model)
    want = [run_alone(model, r) for r in reqs]
    sizes = [update_batch._tokens(r) for r in reqs]
    assert sizes[0] == 2 * reqs[0].rollout.prompt_ids.shape[1] + 4 * 3  # two prompts once each, four rows
    monkeypatch.setattr(update_batch, "PASS_TOKENS", sizes[0] + sizes[1])
    alone: list[str] = []
    solo = update_batch.run_alone
    monkeypatch.setattr(update_batch, "run_alone", lambda m, r: (alone.append(r.adapter), solo(m, r))[1])
    got = run_batched(model, reqs)
    assert alone == ["a2"]  # a0 and a1 shared one pass
    for alone_pass, batched in zip(want, got):
        assert all(torch.allclose(g, w, atol=1e-6, rtol=1e-4) for g, w in zip(batched.grads, alone_pass.grads))


def test_a_request_whose_loss_fails_fails_alone(tiny_model_dir: Path) -> None:
    tok, model = _model(tiny_model_dir)
    reqs = _requests(tok, model)
    want = [run_alone(model, r) for r in reqs]

    def broken(logp: torch.Tensor) -> torch.Tensor:
        raise ValueError("a bad loss")

    reqs[1].loss_of = broken
    got = run_batched(model, reqs)
    assert isinstance(got[1].error, ValueError) and got[1].grads is None
    for i in (0, 2):
        assert got[i].error is None
        assert all(torch.equal(g, w) for g, w in zip(got[i].grads, want[i].grads))  # alone: exactly


def test_add_grads_accumulates_as_backward_does() -> None:
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    update_batch.add_grads([p, q], [torch.tensor([1.0, 2.0]), None])
    update_batch.add_grads([p, q], [torch.tensor([0.5, 0.5]), torch.tensor([3.0, 3.0])])
    assert p.grad.tolist() == [1.5, 2.5] and q.grad.tolist() == [3.0, 3.0]
