"""grpo_update: the GRPO optimisation of one step, shared by the text and game trainers.

One test per rule of its docstring (batches without signal, missing rewards, the reported KL,
the reference model), and equality with the loop the text trainer ran before it was shared.
The policy is a real (tiny) torch module: an embedding and a linear head over a 7-token
vocabulary, scoring fixed completions given fixed contexts.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch

from opentinker_trainer.rl.grpo import (
    ADAPTER_OFF,
    GRPOBatch,
    group_advantages,
    grpo_update,
    headline_metrics,
    kl_k3,
    masked_mean,
    masked_sum,
    pg_loss,
    rewards_tensor,
    token_logprobs,
)

VOCAB, T = 7, 5
nan = float("nan")


class TinyPolicy(torch.nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(context)))  # [B, T, V]


@dataclass
class Config:
    ppo_epochs: int = 1
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    max_grad_norm: float = 1.0
    scale_rewards: bool = True
    loss_aggregation: str = "token_mean"
    max_new_tokens: int = T


def make_rows(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(context [n, T], completion [n, T], mask [n, T])`` with varied completion lengths."""
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(0, VOCAB, (n, T), generator=g)
    completion = torch.randint(0, VOCAB, (n, T), generator=g)
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    return context, completion, mask


def logprobs_of(context: torch.Tensor, completion: torch.Tensor):
    return lambda module, sl: token_logprobs(module(context[sl]), completion[sl])


def chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def previous_loop(model, optimizer, params, rewards, mask, parts, logprobs, cfg, ref_logp) -> dict[str, float]:
    """The text trainer's own GRPO loop as it was before grpo_update (grpo_text.train_step)."""
    adv, zero_std = group_advantages(rewards, scale=cfg.scale_rewards)
    adv = adv.flatten()
    valid = ~torch.isnan(rewards.flatten())
    mask = mask & valid.unsqueeze(1)
    n_tokens = mask.sum().clamp(min=1).float()
    with torch.no_grad():
        old_logp = torch.cat([logprobs(model, sl) for sl in parts]) if cfg.ppo_epochs > 1 else None
    sums = {"loss/policy": 0.0, "loss/kl": 0.0, "grpo/clipfrac": 0.0, "grpo/approx_kl": 0.0}
    grad_norm = 0.0
    sampling_logp = old_logp
    for _epoch in range(cfg.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        epoch_logp = []
        for sl in parts:
            logp = logprobs(model, sl)
            epoch_logp.append(logp.detach())
            old = old_logp[sl] if old_logp is not None else logp.detach()
            m = mask[sl]
            policy_loss, stats = pg_loss(logp, old, adv[sl], m, cfg.clip_eps, normalizer=n_tokens)
            kl_loss = masked_sum(kl_k3(logp, ref_logp[sl]), m) / n_tokens if ref_logp is not None else torch.zeros(())
            loss = policy_loss + cfg.kl_coef * kl_loss if cfg.kl_coef > 0 else policy_loss
            loss.backward()
            weight = (m.sum() / n_tokens).item()
            sums["loss/policy"] += policy_loss.item()
            sums["loss/kl"] += kl_loss.item()
            sums["grpo/clipfrac"] += stats["clipfrac"].item() * weight
            sums["grpo/approx_kl"] += stats["approx_kl"].item() * weight
        if sampling_logp is None:
            sampling_logp = torch.cat(epoch_logp)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    avg = {k: v / cfg.ppo_epochs for k, v in sums.items()}
    kl_ref = masked_mean(kl_k3(sampling_logp, ref_logp), mask).item() if ref_logp is not None else math.nan
    return {
        **avg,
        "loss/total": avg["loss/policy"] + cfg.kl_coef * avg["loss/kl"],
        "kl": kl_ref,
        "grpo/zero_std_frac": zero_std.float().mean().item(),
        "optim/grad_norm": grad_norm,
    }


# --- equality with the loop it replaced ---------------------------------------------------------


@pytest.mark.parametrize(
    "cfg, chunk",
    [
        (Config(), 6),
        (Config(kl_coef=0.1, ppo_epochs=3), 2),
        (Config(kl_coef=0.0, ppo_epochs=2, scale_rewards=False), 4),
    ],
)
def test_matches_the_previous_text_loop_step_for_step(cfg, chunk):
    context, completion, mask = make_rows(6)
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.0, nan, 1.0]])
    logprobs = logprobs_of(context, completion)
    new, old = TinyPolicy(), TinyPolicy()
    reference = TinyPolicy().requires_grad_(False)
    opt_new = torch.optim.AdamW(trainable(new), lr=0.05)
    opt_old = torch.optim.AdamW(trainable(old), lr=0.05)
    for step in range(3):
        with torch.no_grad():
            ref_logp = logprobs(reference, slice(0, 6))
        want = previous_loop(old, opt_old, trainable(old), rewards, mask, chunks(6, chunk), logprobs, cfg, ref_logp)
        batch = GRPOBatch(rewards=rewards, mask=mask, chunks=chunks(6, chunk))
        got = grpo_update(new, opt_new, batch, logprobs, cfg, reference=reference)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), (step, key)
        for p_new, p_old in zip(new.parameters(), old.parameters()):
            assert torch.allclose(p_new, p_old, rtol=1e-6, atol=1e-7), step


def test_rows_of_one_sample_share_its_advantage_like_one_row_each():
    """Game layout: an episode's turns are rows with the episode's advantage (sample_of_row)."""
    context, completion, mask = make_rows(5)
    rewards = torch.tensor([[1.0, 0.0]])
    per_turn = GRPOBatch(rewards=rewards, mask=mask, chunks=chunks(5, 2), sample_of_row=torch.tensor([0, 0, 1, 1, 1]))
    model = TinyPolicy()
    out = grpo_update(
        model, torch.optim.AdamW(model.parameters(), lr=0.05), per_turn, logprobs_of(context, completion), Config()
    )
    adv = torch.tensor([0.5, 0.5, -0.5, -0.5, -0.5]) / (math.sqrt(0.5) + 1e-6)  # sample std of [1, 0]
    with torch.no_grad():
        logp = token_logprobs(TinyPolicy()(context), completion)
    want, _ = pg_loss(logp, logp, adv, mask)
    assert out["loss/policy"] == pytest.approx(want.item(), rel=1e-5)
    assert out["grpo/tokens"] == float(mask.sum())
    assert out["train/tokens"] == float(mask.sum())  # what usage counts as tokens trained


# --- rule: a batch without signal ---------------------------------------------------------------


def test_a_batch_without_signal_still_takes_its_optimizer_step():
    context, completion, mask = make_rows(4)
    logprobs = logprobs_of(context, completion)
    model = TinyPolicy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.0)
    signal = GRPOBatch(rewards=torch.tensor([[1.0, 0.0], [0.0, 1.0]]), mask=mask, chunks=chunks(4, 4))
    first = grpo_update(model, optimizer, signal, logprobs, Config())
    assert first["grpo/no_signal"] == 0.0 and first["optim/grad_norm"] > 0

    before = copy.deepcopy(model.state_dict())
    steps = optimizer.state[model.head.weight]["step"].item()
    flat = GRPOBatch(rewards=torch.tensor([[1.0, 1.0], [0.0, 0.0]]), mask=mask, chunks=chunks(4, 4))
    out = grpo_update(model, optimizer, flat, logprobs, Config())
    assert out["grpo/no_signal"] == 1.0 and out["grpo/zero_std_frac"] == 1.0
    assert out["loss/policy"] == 0.0 and out["optim/grad_norm"] == 0.0
    # The step is taken: AdamW's moments from the first batch still move the weights.
    assert optimizer.state[model.head.weight]["step"].item() == steps + 1
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


# --- rule: missing rewards ----------------------------------------------------------------------


def test_none_rewards_become_nan_and_do_not_crash():
    rewards = rewards_tensor([1.0, None, 0.0, 2, None, 1.0], 2, 3)
    assert rewards.dtype == torch.float32 and rewards.shape == (2, 3)
    assert torch.isnan(rewards).tolist() == [[False, True, False], [False, True, False]]


@pytest.mark.parametrize("missing", [nan, None])
def test_missing_rewards_are_left_out_of_loss_normaliser_and_kl(missing):
    context, completion, mask = make_rows(6)
    logprobs = logprobs_of(context, completion)
    reference = TinyPolicy(seed=3).requires_grad_(False)
    cfg = Config(kl_coef=0.5)
    model = TinyPolicy()
    out = grpo_update(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        GRPOBatch(rewards=rewards_tensor([1.0, missing, 0.0, 0.0, 1.0, 1.0], 2, 3), mask=mask, chunks=chunks(6, 6)),
        logprobs,
        cfg,
        reference=reference,
    )
    # The same samples without the missing one (row 1): same loss, KL, reported numbers and update.
    keep = torch.tensor([0, 2, 3, 4, 5])
    kept_logprobs = logprobs_of(context[keep], completion[keep])
    alone = TinyPolicy()
    want = grpo_update(
        alone,
        torch.optim.SGD(alone.parameters(), lr=0.1),
        GRPOBatch(
            rewards=torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
            mask=mask[keep],
            chunks=chunks(5, 5),
            sample_of_row=torch.tensor([0, 1, 2, 3, 3]),
        ),
        kept_logprobs,
        cfg,
        reference=reference,
    )
    # (The groups differ, [1, _, 0] against [1, 0] and [0, 1]: compare what does not depend on them.)
    assert out["grpo/missing_rewards"] == 1.0 and want["grpo/missing_rewards"] == 0.0
    assert out["grpo/tokens"] == float(mask[keep].sum())
    assert out["train/tokens"] == float(mask[keep].sum())  # rows without a reward are not trained on
    assert out["reward/mean"] == pytest.approx(3.0 / 5.0) and math.isfinite(out["reward/std"])
    assert out["kl"] == pytest.approx(want["kl"], abs=1e-7)
    assert out["loss/kl"] == pytest.approx(want["loss/kl"], rel=1e-6)


def test_a_missing_reward_changes_nothing_of_the_update_but_its_own_rows():
    """A NaN sample's rows are out of the loss: the update equals the one with them cut out."""
    context, completion, mask = make_rows(4)
    cfg = Config(kl_coef=0.2)
    reference = TinyPolicy(seed=5).requires_grad_(False)
    with_gap = TinyPolicy()
    grpo_update(
        with_gap,
        torch.optim.SGD(with_gap.parameters(), lr=0.1),
        GRPOBatch(rewards=torch.tensor([[1.0, 0.0, nan, 1.0]]), mask=mask, chunks=chunks(4, 3)),
        logprobs_of(context, completion),
        cfg,
        reference=reference,
    )
    keep = torch.tensor([0, 1, 3])
    cut = TinyPolicy()
    grpo_update(
        cut,
        torch.optim.SGD(cut.parameters(), lr=0.1),
        GRPOBatch(rewards=torch.tensor([[1.0, 0.0, 1.0]]), mask=mask[keep], chunks=chunks(3, 3)),
        logprobs_of(context[keep], completion[keep]),
        cfg,
        reference=reference,
    )
    for a, b in zip(with_gap.parameters(), cut.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_all_rewards_missing_reports_nan_rewards_and_no_update():
    context, completion, mask = make_rows(2)
    model = TinyPolicy()
    before = copy.deepcopy(model.state_dict())
    out = grpo_update(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        GRPOBatch(rewards=rewards_tensor([None, None], 1, 2), mask=mask, chunks=chunks(2, 2)),
        logprobs_of(context, completion),
        Config(),
    )
    assert math.isnan(out["reward/mean"]) and out["grpo/tokens"] == 0.0 and out["loss/policy"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --- rule: the reported KL and the reference ----------------------------------------------------


def test_kl_reported_is_k3_from_the_sampling_policy_to_the_reference():
    context, completion, mask = make_rows(4)
    logprobs = logprobs_of(context, completion)
    reference = TinyPolicy(seed=7).requires_grad_(False)
    model = TinyPolicy()
    with torch.no_grad():
        sampling = logprobs(model, slice(0, 4))
        ref = logprobs(reference, slice(0, 4))
    batch = GRPOBatch(rewards=torch.tensor([[1.0, 0.0, 0.0, 1.0]]), mask=mask, chunks=chunks(4, 3))
    out = grpo_update(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.05),
        batch,
        logprobs,
        Config(ppo_epochs=2),
        reference=reference,
    )
    want = masked_mean(kl_k3(sampling, ref), mask).item()
    assert want > 0 and out["kl"] == pytest.approx(want, rel=1e-6) and out["grpo/kl_ref"] == out["kl"]
    assert out["loss/kl"] > 0  # the penalty is measured even with kl_coef 0 ...
    assert out["loss/total"] == out["loss/policy"]  # ... and not optimised


def test_without_a_reference_kl_is_nan_and_the_penalty_zero():
    context, completion, mask = make_rows(2)
    model = TinyPolicy()
    batch = GRPOBatch(rewards=torch.tensor([[1.0, 0.0]]), mask=mask, chunks=chunks(2, 2))
    out = grpo_update(model, torch.optim.AdamW(model.parameters()), batch, logprobs_of(context, completion), Config())
    assert math.isnan(out["kl"]) and out["loss/kl"] == 0.0
    with pytest.raises(ValueError, match="reference"):
        grpo_update(
            model, torch.optim.AdamW(model.parameters()), batch, logprobs_of(context, completion), Config(kl_coef=0.1)
        )


def test_a_frozen_reference_model_anchors_full_weight_training():
    context, completion, mask = make_rows(4)
    logprobs = logprobs_of(context, completion)
    model = TinyPolicy()
    reference = copy.deepcopy(model).requires_grad_(False).eval()
    frozen = copy.deepcopy(reference.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    batch = GRPOBatch(rewards=torch.tensor([[1.0, 0.0], [0.0, 1.0]]), mask=mask, chunks=chunks(4, 2))
    kls = [
        grpo_update(model, optimizer, batch, logprobs, Config(kl_coef=0.5), reference=reference)["kl"] for _ in range(3)
    ]
    assert kls[0] == pytest.approx(0.0, abs=1e-7)  # the policy starts at the reference
    assert kls[2] > kls[1] > 0  # and moves away from it, which the penalty measures
    assert all(torch.equal(frozen[k], v) for k, v in reference.state_dict().items())
    assert reference.head.weight.grad is None


def test_adapter_off_reference_is_the_base_model_under_a_lora_adapter():
    from peft import LoraConfig, get_peft_model

    context, completion, mask = make_rows(4)
    logprobs = logprobs_of(context, completion)
    model = get_peft_model(TinyPolicy(), LoraConfig(r=2, lora_alpha=4, target_modules=["head"]))
    base = TinyPolicy()  # the same seed: the weights under the adapter
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    batch = GRPOBatch(rewards=torch.tensor([[1.0, 0.0], [0.0, 1.0]]), mask=mask, chunks=chunks(4, 4))
    first = grpo_update(model, optimizer, batch, logprobs, Config(kl_coef=0.1), reference=ADAPTER_OFF)
    second = grpo_update(model, optimizer, batch, logprobs, Config(kl_coef=0.1), reference=ADAPTER_OFF)
    assert first["kl"] == pytest.approx(0.0, abs=1e-7) and second["kl"] > 0
    with torch.no_grad():
        sampling = logprobs(model, slice(0, 4))
        model.eval()
        with model.disable_adapter():
            off = logprobs(model, slice(0, 4))
    assert torch.allclose(off, logprobs(base, slice(0, 4)).detach(), atol=1e-6)
    assert not torch.allclose(sampling, off, atol=1e-4)
    with pytest.raises(ValueError, match="reference"):
        grpo_update(model, optimizer, batch, logprobs, Config(kl_coef=0.1), reference="base")


def test_headline_metrics_are_the_update_metrics_under_their_short_names():
    context, completion, mask = make_rows(4)
    model = TinyPolicy()
    batch = GRPOBatch(rewards=torch.tensor([[1.0, 0.0], [1.0, 1.0]]), mask=mask, chunks=chunks(4, 4))
    out = grpo_update(model, torch.optim.AdamW(model.parameters()), batch, logprobs_of(context, completion), Config())
    assert headline_metrics(out) == {
        "loss": out["loss/total"],
        "reward": out["reward/mean"],
        "reward_std": out["reward/std"],
        "zero_std_frac": out["grpo/zero_std_frac"],
    }
    assert list(headline_metrics(out)) == ["loss", "reward", "reward_std", "zero_std_frac"]


def test_lora_dropout_leaves_the_first_minibatch_ratio_exactly_one(tiny_model_dir, monkeypatch):
    """With ``lora_dropout > 0`` and several epochs, the old log-probs and the first epoch's
    new ones come from the same (dropout-free) function of the same weights: ratio exactly 1."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import opentinker_trainer.rl.grpo as grpo

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    for name, p in model.named_parameters():  # a non-zero adapter, so that dropout on its input shows
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 1000, (4, 12), generator=g)
    mask = torch.zeros(4, 11, dtype=torch.bool)
    mask[:, 5:] = True

    def logprobs(module, sl):
        logits = module(input_ids=ids[sl]).logits[:, :-1]
        return token_logprobs(logits, ids[sl, 1:])

    seen = []
    real_pg_loss = grpo.pg_loss

    def recording_pg_loss(*args, **kwargs):
        loss, stats = real_pg_loss(*args, **kwargs)
        seen.append({k: v.item() for k, v in stats.items()})
        return loss, stats

    monkeypatch.setattr(grpo, "pg_loss", recording_pg_loss)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = GRPOBatch(rewards=torch.tensor([[1.0, 0.0], [0.0, 1.0]]), mask=mask, chunks=chunks(4, 2))
    grpo_update(model, optimizer, batch, logprobs, Config(ppo_epochs=2), reference=ADAPTER_OFF)
    assert len(seen) == 4  # 2 epochs x 2 minibatches
    assert seen[0] == {"ratio_mean": 1.0, "approx_kl": 0.0, "clipfrac": 0.0}
    assert seen[1] == {"ratio_mean": 1.0, "approx_kl": 0.0, "clipfrac": 0.0}  # the step comes after both
    assert seen[2]["approx_kl"] > 0  # the second epoch sees the step
    assert model.training  # left in train mode, as before
    assert all(m.training for m in model.modules())
