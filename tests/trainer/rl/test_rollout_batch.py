"""Rollouts of several LoRA adapters in shared forward passes (a model host's tenants): every
request's rows are the tokens ``generate`` samples for it alone from the same RNG state, and its
generator ends where ``generate`` leaves the global one; a request whose draw fails fails alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opentinker_trainer.rl.rollout import left_pad
from opentinker_trainer.rl.rollout_batch import RolloutRequest, generate_alone, generate_batched, unbatchable
from tests.support.models import tiny_lora_model

#: A stop set of many frequent-enough ids: the tiny random model then ends rows at different
#: steps (rarely on its one EOS), so rows that finish early and requests that end first are covered.
STOPS = list(range(0, 6000))


def _model(tiny_model_dir: Path, ranks=(4, 8, 4)):
    """The tiny model with one LoRA adapter per rank (``a0``, ``a1`` ...), B matrices random."""
    return tiny_lora_model(tiny_model_dir, [(f"a{i}", r, ["q_proj", "v_proj"]) for i, r in enumerate(ranks)])


def _requests(tok) -> list[RolloutRequest]:
    """Four tenants' rollouts: different prompts, group sizes, lengths, temperatures, seeds and
    adapters (two share ``a0``)."""
    specs = [
        ("a0", ["What is 2 + 3?", "Name a colour."], 2, 7, 1.0, 11),
        ("a1", ["Count to five:"], 3, 9, 0.7, 12),
        ("a2", ["Hello", "Tell me a long joke, please", "x"], 1, 4, 1.3, 13),
        ("a0", ["Why is the sky blue?"], 2, 5, 1.0, 14),
    ]
    out = []
    for adapter, prompts, k, max_new, temp, seed in specs:
        ids, mask = left_pad([tok(p)["input_ids"] for p in prompts], tok.pad_token_id)
        out.append(
            RolloutRequest(
                adapter=adapter,
                prompt_ids=ids,
                prompt_mask=mask,
                max_new_tokens=max_new,
                stop_token_ids=STOPS,
                pad_token_id=tok.pad_token_id,
                rng_state=torch.Generator().manual_seed(seed).get_state(),
                temperature=temp,
                group_size=k,
            )
        )
    return out


def _alone(model, req: RolloutRequest):
    model.set_adapter(req.adapter)
    return generate_alone(model, req)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-lora", "peft-adapter-names"])
def test_batched_rows_are_what_generate_samples_for_each_request_alone(tiny_model_dir: Path, grouped: bool) -> None:
    from peft.tuners.lora import LoraLayer

    tok, model = _model(tiny_model_dir)
    reqs = _requests(tok)
    global_before = torch.get_rng_state()
    got = generate_batched(model, reqs, grouped=grouped)
    assert torch.equal(torch.get_rng_state(), global_before)  # draws came from each request's own generator
    assert model.active_adapter == "a0" and not model.training
    assert not any(m.disable_adapters for m in model.modules() if isinstance(m, LoraLayer))  # layers on again
    lengths = set()
    for req, batched in zip(reqs, got):
        alone = _alone(model, req)
        assert batched.error is None and alone.error is None
        a, b = alone.rollout, batched.rollout
        for field in (
            "prompt_ids",
            "prompt_mask",
            "completion_ids",
            "completion_mask",
            "completion_lengths",
            "truncated",
        ):
            assert torch.equal(getattr(a, field), getattr(b, field)), (req.adapter, field)
            assert not getattr(b, field).is_inference()  # usable in the update's autograd
        assert torch.equal(batched.rng_state, alone.rng_state)  # the stream continues where generate leaves it
        lengths.update(b.completion_lengths.tolist())
    assert len(lengths) > 2  # rows ended at different steps: the ragged case was exercised
    model.set_adapter("a0")


def test_one_request_runs_generate_itself_with_its_own_adapter_whichever_is_active(tiny_model_dir: Path) -> None:
    """A rollout run of one tenant (nobody to batch with) is ``generate`` exactly, on that
    tenant's adapter even when another's is active (the last holder's), in eval mode even when
    another's update left the model training; the active adapter and mode are left as found."""
    tok, model = _model(tiny_model_dir)
    req = _requests(tok)[1]  # adapter a1
    model.set_adapter("a1")
    want = generate_alone(model, req)
    model.set_adapter("a2")
    model.train()
    (got,) = generate_batched(model, [req])
    assert torch.equal(got.rollout.completion_ids, want.rollout.completion_ids)
    assert torch.equal(got.rng_state, want.rng_state)
    assert model.active_adapter == "a2" and model.training
    model.eval()


def test_a_request_whose_draw_fails_fails_alone(tiny_model_dir: Path) -> None:
    """A tenant whose adapter diverged (NaN weights) gets the sampler's error; the other requests
    of the same passes get what they get without it."""
    tok, model = _model(tiny_model_dir)
    reqs = _requests(tok)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".a1." in name and "lora_B" in name:
                p.fill_(float("nan"))
    got = generate_batched(model, reqs)
    assert isinstance(got[1].error, RuntimeError) and got[1].rollout is None
    for i in (0, 2, 3):
        alone = _alone(model, reqs[i])
        assert got[i].error is None
        assert torch.equal(got[i].rollout.completion_ids, alone.rollout.completion_ids)
        assert torch.equal(got[i].rng_state, alone.rng_state)


def test_a_generation_config_that_adds_a_processor_is_not_batched(tiny_model_dir: Path) -> None:
    _, model = _model(tiny_model_dir, ranks=(4,))
    assert unbatchable(model) is None
    model.generation_config.suppress_tokens = [5]
    assert unbatchable(model) == "generation_config.suppress_tokens = [5]"
    model.generation_config.suppress_tokens = None
    model.generation_config.min_length = 3
    assert "min_length" in unbatchable(model)
