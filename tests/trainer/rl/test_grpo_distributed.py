"""Data-parallel GRPO: one step of two gloo ranks, each on half of the groups, equals one step of
one rank on all of them (LoRA parameters and metrics within float tolerance), for each loss
aggregation, with gradient clipping active, two epochs and the KL term; full-weight GRPO with
the policy and its KL reference sharded over the two ranks with FSDP2 likewise; and the LM game
trainer's update (turns mapped to episodes) likewise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from opentinker_trainer.rl.grpo import ADAPTER_OFF, GRPOBatch, grpo_update
from opentinker_trainer.rl.rollout import sequence_logprobs

from tests.support.distributed import run_ranks

G, K, P, T = 5, 3, 5, 6  # 5 groups: ranks of 3 and 2, unequal micro-batch counts
AGGREGATIONS = ("token_mean", "seq_mean", "dr_grpo")


def cfg(aggregation: str) -> SimpleNamespace:
    return SimpleNamespace(
        ppo_epochs=2,
        clip_eps=0.2,
        kl_coef=0.05,
        max_grad_norm=0.05,  # small enough to clip: the norm must be the global batch's
        scale_rewards=True,
        loss_aggregation=aggregation,
        max_new_tokens=T,
    )


def global_batch(vocab: int) -> dict[str, torch.Tensor]:
    """``G`` groups of ``K`` rows: shared prompts per group, completions of varied lengths, one
    missing reward and one group without signal."""
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, vocab, (G, P), generator=g).repeat_interleave(K, 0)
    completions = torch.randint(3, vocab, (G * K, T), generator=g)
    lengths = torch.randint(1, T + 1, (G * K,), generator=g)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    rewards = torch.rand(G, K, generator=g)
    rewards[1, 2] = float("nan")
    rewards[3] = 0.5  # no signal
    return {"prompts": prompts, "completions": completions, "mask": mask, "rewards": rewards}


def lora_model(model_dir: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    with torch.no_grad():  # a non-zero B, so the adapter changes the logits from the first step
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def step(model_dir: str, groups: range, dp=None) -> dict[str, dict]:
    """One ``grpo_update`` per aggregation on ``groups`` of the global batch, from the same start."""
    out = {}
    for aggregation in AGGREGATIONS:
        model = lora_model(model_dir)
        data = global_batch(model.config.vocab_size)
        rows = slice(groups.start * K, groups.stop * K)
        prompt_mask = torch.ones(G * K, P, dtype=torch.bool)[rows]
        prompts, completions, mask = data["prompts"][rows], data["completions"][rows], data["mask"][rows]

        def logprobs(module, sl, prompts=prompts, completions=completions, mask=mask, pm=prompt_mask):
            return sequence_logprobs(module, prompts[sl], pm[sl], completions[sl], mask[sl], group_size=K)

        n = len(prompts)
        chunks = [slice(i, min(i + K, n)) for i in range(0, n, K)]  # one group per micro-batch
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        batch = GRPOBatch(rewards=data["rewards"][groups.start : groups.stop], mask=mask, chunks=chunks)
        metrics = grpo_update(model, opt, batch, logprobs, cfg(aggregation), reference=ADAPTER_OFF, dp=dp)
        out[aggregation] = {
            "metrics": metrics,
            "params": {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad},
        }
    return out


def ranked_steps(dp, model_dir: str) -> dict[str, dict]:
    """Both equivalence cases on this rank (one spawn of the ranks for the module)."""
    torch.set_num_threads(1)
    return {
        "lora": step(model_dir, dp.shard(G), dp),
        "full": full_weight_step(model_dir, dp.shard(G), dp),
        "checkpoint": optimizer_round_trip(model_dir),
        "game": game_step(model_dir, dp.shard(G), dp),
    }


def game_step(model_dir: str, groups: range, dp=None) -> dict:
    """One ``grpo_update`` as the LM game trainer takes it on ``groups`` of the global batch:
    rows are turns (1 to 3 per episode, each its own prompt), ``sample_of_row`` maps them to
    their episode, whose return every turn's tokens share."""
    model = lora_model(model_dir)
    data = global_batch(model.config.vocab_size)
    turns_of = [1 + (e * 7) % 3 for e in range(G * K)]  # episode e's turns
    rows = [e for e in range(groups.start * K, groups.stop * K) for _ in range(turns_of[e])]
    g = torch.Generator().manual_seed(11)
    all_prompts = torch.randint(3, model.config.vocab_size, (sum(turns_of), P), generator=g)
    first = [sum(turns_of[:e]) for e in range(G * K)]
    index = torch.tensor([first[e] + t for e in range(groups.start * K, groups.stop * K) for t in range(turns_of[e])])
    prompts, completions = all_prompts[index], data["completions"][torch.tensor(rows)]
    mask = data["mask"][torch.tensor(rows)]
    prompt_mask = torch.ones_like(prompts, dtype=torch.bool)

    def logprobs(module, sl):
        return sequence_logprobs(module, prompts[sl], prompt_mask[sl], completions[sl], mask[sl])

    n = len(rows)
    chunks = [slice(i, min(i + 4, n)) for i in range(0, n, 4)]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = GRPOBatch(
        rewards=data["rewards"][groups.start : groups.stop],
        mask=mask,
        chunks=chunks,
        sample_of_row=torch.tensor(rows) - groups.start * K,
    )
    metrics = grpo_update(model, opt, batch, logprobs, cfg("token_mean"), reference=ADAPTER_OFF, dp=dp)
    return {
        "metrics": metrics,
        "params": {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad},
    }


def plain_optimizer_state(model_dir: str) -> dict:
    """One unsharded rank's AdamW ``state_dict()`` after one step on a fixed input."""
    model = full_model(model_dir)
    opt = torch.optim.AdamW(list(model.parameters()), lr=1e-3)
    model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits.square().mean().backward()
    opt.step()
    return opt.state_dict()


def optimizer_round_trip(model_dir: str) -> dict | None:
    """A one-rank checkpoint's optimizer state loaded into a model sharded over the ranks
    (a resume at another world size), then gathered for a checkpoint again (rank 0's; None on
    the others): what a checkpoint of either world size holds."""
    from opentinker_trainer import fsdp

    model = full_model(model_dir)
    fsdp.shard_model(model)
    opt = torch.optim.AdamW(list(model.parameters()), lr=1e-3)
    fsdp.ShardedOptimizerState(model, opt).load_state_dict(plain_optimizer_state(model_dir))
    full = fsdp.FullState(model, opt)  # a collective: every rank gathers, rank 0 keeps it
    return full.state_dict() if torch.distributed.get_rank() == 0 else None


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory) -> list[dict[str, dict]]:
    return run_ranks(ranked_steps, 2, tmp_path_factory.mktemp("ranks"), str(tiny_model_dir))


def test_two_ranks_take_the_step_of_one(tiny_model_dir, two_ranks) -> None:
    torch.set_num_threads(1)
    one = step(str(tiny_model_dir), range(G))
    ranks = [r["lora"] for r in two_ranks]
    for aggregation in AGGREGATIONS:
        ref = one[aggregation]
        for r in ranks:
            got = r[aggregation]
            for k, v in ref["params"].items():
                torch.testing.assert_close(got["params"][k], v, atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
            for k, v in ref["metrics"].items():
                if v == v:  # NaN stays NaN
                    assert got["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-7), (aggregation, k)
        # the step moved the adapter (a test of something)
        start = lora_model(str(tiny_model_dir))
        moved = max((p - dict(start.named_parameters())[k]).abs().max().item() for k, p in ref["params"].items())
        assert moved > 1e-4


def full_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def full_weight_step(model_dir: str, groups: range, dp=None) -> dict:
    """One full-weight ``grpo_update`` (token means, KL to a frozen copy) on ``groups`` of the
    global batch; with ``dp``, the policy and the reference sharded with FSDP2."""
    from opentinker_trainer import fsdp

    model, reference = full_model(model_dir), full_model(model_dir).requires_grad_(False).eval()
    if dp is not None:
        fsdp.shard_model(model)
        fsdp.shard_model(reference)
    data = global_batch(model.config.vocab_size)
    rows = slice(groups.start * K, groups.stop * K)
    prompt_mask = torch.ones(G * K, P, dtype=torch.bool)[rows]
    prompts, completions, mask = data["prompts"][rows], data["completions"][rows], data["mask"][rows]

    def logprobs(module, sl):
        return sequence_logprobs(module, prompts[sl], prompt_mask[sl], completions[sl], mask[sl], group_size=K)

    n = len(prompts)
    chunks = [slice(i, min(i + K, n)) for i in range(0, n, K)]  # ranks of 3 and 2 chunks: dummies
    opt = torch.optim.AdamW(list(model.parameters()), lr=1e-3)
    batch = GRPOBatch(rewards=data["rewards"][groups.start : groups.stop], mask=mask, chunks=chunks)
    metrics = grpo_update(
        model, opt, batch, logprobs, cfg("token_mean"), reference=reference, dp=dp, sharded=dp is not None
    )
    # sharded: each parameter a DTensor, gathered whole on every rank (a tied lm_head once)
    params = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.named_parameters()
    }
    return {"metrics": metrics, "params": params}


def test_two_fsdp_ranks_take_the_full_weight_step_of_one(tiny_model_dir, two_ranks) -> None:
    """Full weights sharded with FSDP2 over two gloo ranks (unequal chunk counts, clipping, two
    epochs, the KL to a sharded frozen copy): the step and metrics of one unsharded rank."""
    torch.set_num_threads(1)
    one = full_weight_step(str(tiny_model_dir), range(G))
    ranks = [r["full"] for r in two_ranks]
    start = dict(full_model(str(tiny_model_dir)).named_parameters())
    moved = max((v - start[k]).abs().max().item() for k, v in one["params"].items())
    assert moved > 1e-4  # the step moved the weights (a test of something)
    for r in ranks:
        assert r["params"].keys() == one["params"].keys()
        for k, v in one["params"].items():
            torch.testing.assert_close(r["params"][k], v, atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
        for k, v in one["metrics"].items():
            if v == v:
                assert r["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-7), k


def test_an_fsdp_checkpoint_holds_one_ranks_optimizer_state_so_any_world_size_resumes(
    tiny_model_dir, two_ranks
) -> None:
    """One rank's optimizer ``state_dict()`` sharded into two ranks and gathered back is the same
    dict (parameters by number): a 1-rank checkpoint resumes on 2 ranks and a 2-rank one on 1."""
    plain = plain_optimizer_state(str(tiny_model_dir))
    gathered = two_ranks[0]["checkpoint"]
    assert gathered["param_groups"][0]["params"] == plain["param_groups"][0]["params"]
    assert gathered["state"].keys() == plain["state"].keys()
    for i, st in plain["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(gathered["state"][i][k], st[k], atol=0, rtol=0)
    assert any(st["exp_avg"].abs().max() > 0 for st in plain["state"].values())


def test_two_ranks_take_the_game_step_of_one(tiny_model_dir, two_ranks) -> None:
    """The LM game's update (turn rows mapped to episodes by ``sample_of_row``, 5 groups of
    episodes of 1 to 3 turns split 3/2 over the ranks): two ranks take one rank's step."""
    torch.set_num_threads(1)
    one = game_step(str(tiny_model_dir), range(G))
    start = dict(lora_model(str(tiny_model_dir)).named_parameters())
    assert max((v - start[k]).abs().max().item() for k, v in one["params"].items()) > 1e-4
    for r in two_ranks:
        got = r["game"]
        for k, v in one["params"].items():
            torch.testing.assert_close(got["params"][k], v, atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
        for k, v in one["metrics"].items():
            if v == v:
                assert got["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-7), k
