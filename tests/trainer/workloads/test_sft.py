"""sft: which tokens are trained on, data split and order, the loss, and whole runs on a tiny
random Llama (LoRA and full weights): metrics, checkpoints, exact resume, bad data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from opentinker_trainer.context import UserError, WorkerContext
from opentinker_trainer.workloads import sft
from opentinker_trainer.workloads.sft_data import (
    IGNORE_INDEX,
    Encoded,
    assistant_char_spans,
    assistant_label_mask,
    batch_indices,
    collate,
    encode_chat,
    read_chat_jsonl,
    split_indices,
)

from tests.support.datasets import arithmetic_chat_jsonl
from tests.support.workers import reports, worker_ctx

CONVERSATION = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "It is 8."},
]


# ------------------------------------------------------------------------------ label mask


def test_assistant_label_mask_is_a_pure_offset_rule() -> None:
    # text:  "U: hi\nA: yo!\n" with the assistant span covering "yo!" (9..12)
    offsets = [(0, 2), (2, 5), (5, 6), (6, 9), (9, 11), (11, 12), (12, 13), (13, 13)]
    assert assistant_label_mask(offsets, [(9, 12)]) == [False, False, False, False, True, True, False, False]
    assert assistant_label_mask(offsets, []) == [False] * 8
    # A token that starts inside a span is trained on even if it runs past its end.
    assert assistant_label_mask([(8, 10), (10, 14)], [(9, 12)]) == [False, True]


def test_exactly_the_assistant_replies_and_their_end_of_turn_tokens_are_trained_on(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    enc = encode_chat(tok, CONVERSATION, max_seq_len=512)
    assert (
        enc.input_ids
        == tok(tok.apply_chat_template(CONVERSATION, tokenize=False), add_special_tokens=False)["input_ids"]
    )
    trained = [i for i, label in enumerate(enc.labels) if label != IGNORE_INDEX]
    assert all(enc.labels[i] == enc.input_ids[i] for i in trained)
    # Two contiguous runs: "5<|im_end|>" and "It is 8.<|im_end|>"; nothing of the system or user
    # turns, the role headers or the newlines between turns.
    runs, run = [], [trained[0]]
    for i in trained[1:]:
        if i == run[-1] + 1:
            run.append(i)
        else:
            runs.append(run)
            run = [i]
    runs.append(run)
    assert [tok.decode([enc.input_ids[i] for i in r]) for r in runs] == ["5<|im_end|>", "It is 8.<|im_end|>"]
    before = tok.decode(enc.input_ids[: runs[0][0]])
    assert before.endswith("What is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")  # the prompt, header included, is not
    assert tok.decode([enc.input_ids[runs[0][-1] + 1]]) == "\n"  # the newline after <|im_end|> is not trained on
    assert enc.trained_tokens == len(trained)

    short = encode_chat(tok, CONVERSATION, max_seq_len=runs[0][0] + 1)  # cut inside the first reply
    assert len(short.input_ids) == runs[0][0] + 1 and short.trained_tokens == 1


def test_a_template_that_is_not_incremental_is_refused() -> None:
    def render(msgs, gen):  # puts a turn counter up front: earlier renders are not prefixes
        return f"{len(msgs)}|" + "".join(m["content"] for m in msgs) + ("A:" if gen else "")

    with pytest.raises(UserError, match="does not render a conversation incrementally"):
        assistant_char_spans(render, CONVERSATION[1:3])


def test_collate_pads_right_with_ignored_labels() -> None:
    batch = [Encoded([1, 2, 3], [IGNORE_INDEX, 2, 3]), Encoded([4], [IGNORE_INDEX])]
    ids, attn, labels = collate(batch, pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert attn.tolist() == [[True, True, True], [True, False, False]]
    assert labels.tolist() == [[IGNORE_INDEX, 2, 3], [IGNORE_INDEX] * 3]


# ------------------------------------------------------------------------------ split, order, loss


def test_split_and_batch_order_are_seeded_and_cover_every_example() -> None:
    train, held = split_indices(10, 0.2, seed=1)
    assert len(held) == 2 and sorted(train + held) == list(range(10))
    assert split_indices(10, 0.2, seed=1) == (train, held) and split_indices(10, 0.2, seed=2) != (train, held)
    assert split_indices(1, 0.5, seed=0) == ([0], [])  # one example: nothing held out
    assert split_indices(3, 0.01, seed=0)[1] != []  # a positive fraction holds out at least one
    assert split_indices(5, 0.0, seed=0) == ([0, 1, 2, 3, 4], [])
    # Epochs of 7 examples read in batches of 3: each epoch is a permutation, continuing across steps.
    seq = [i for step in range(1, 15) for i in batch_indices(step, 3, 7, seed=0)]
    for e in range(6):
        assert sorted(seq[7 * e : 7 * e + 7]) == list(range(7))
    assert seq[:7] != seq[7:14]  # a fresh order each epoch
    assert batch_indices(5, 3, 7, seed=0) == seq[12:15]  # a step's batch depends only on the step


def test_token_nll_matches_a_hand_computed_cross_entropy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5)
    labels = torch.tensor([[IGNORE_INDEX, 1, IGNORE_INDEX, 3], [IGNORE_INDEX, IGNORE_INDEX, 2, IGNORE_INDEX]])
    nll, correct, count = sft.token_nll(logits, labels)
    logp = torch.log_softmax(logits, -1)
    want = -(logp[0, 0, 1] + logp[0, 2, 3] + logp[1, 1, 2])
    assert torch.allclose(nll, want) and count.item() == 3
    hits = int(logits[0, 0].argmax() == 1) + int(logits[0, 2].argmax() == 3) + int(logits[1, 1].argmax() == 2)
    assert correct.item() == hits


def test_lr_schedules() -> None:
    assert [sft.lr_at(s, 10, 1.0, 2, "constant") for s in (1, 2, 3, 10)] == [0.5, 1.0, 1.0, 1.0]
    assert [sft.lr_at(s, 10, 1.0, 2, "linear") for s in (1, 2, 3)] == [0.5, 1.0, 1.0]


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("total, warmup", [(10, 0), (10, 2), (3, 1), (1, 0)])
def test_decay_follows_transformers_schedulers_and_the_last_step_still_learns(schedule, total, warmup) -> None:
    """After warmup, optimizer step s uses transformers' factor at s - 1 (its scheduler steps after
    the optimizer), so the last step's rate is above 0."""
    from torch.optim import SGD
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    make = get_linear_schedule_with_warmup if schedule == "linear" else get_cosine_schedule_with_warmup
    param = torch.nn.Parameter(torch.zeros(1))
    opt = SGD([param], lr=1.0)
    sched = make(opt, num_warmup_steps=warmup, num_training_steps=total)
    theirs = []
    for _ in range(total):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ours = [sft.lr_at(s, total, 1.0, warmup, schedule) for s in range(1, total + 1)]
    assert ours[warmup:] == pytest.approx(theirs[warmup:])
    assert ours[-1] > 0


# ------------------------------------------------------------------------------ reading data


def test_read_names_the_bad_line_and_refuses_empty_files(tmp_path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"messages": CONVERSATION}) + "\n\n" + '{"messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(UserError, match=rf"dataset {f}:3: expected at least one assistant message"):
        read_chat_jsonl(f)
    f.write_text("\n \n")
    with pytest.raises(UserError, match="expected at least one example"):
        read_chat_jsonl(f)
    f.write_text('{"messages": [}\n')  # JSON syntax: the column too
    with pytest.raises(UserError, match=rf"dataset {f}:1:15: expected"):
        read_chat_jsonl(f)
    with pytest.raises(UserError, match="cannot be read on this trainer node"):
        read_chat_jsonl(tmp_path / "missing.jsonl")
    f.write_text(json.dumps({"messages": CONVERSATION}) + "\r\n" + json.dumps({"messages": CONVERSATION[1:3]}))
    assert [len(m) for m in read_chat_jsonl(f)] == [5, 2]


def test_read_names_every_bad_line_up_to_max_bad_lines(tmp_path) -> None:
    good, no_reply = json.dumps({"messages": CONVERSATION}), '{"messages": [{"role": "user", "content": "x"}]}'
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join([good, "{oops", good, no_reply, "[1]"]) + "\n")
    with pytest.raises(UserError) as err:
        read_chat_jsonl(f)
    assert str(err.value).startswith(f"dataset {f}: 3 bad lines: {f}:2:2: expected")
    assert [part.split(": ")[0] for part in str(err.value).split("; ")[1:]] == [f"{f}:4", f"{f}:5"]
    from opentinker_common.spec.sft import MAX_BAD_LINES

    f.write_text("\n".join(["{oops"] * (MAX_BAD_LINES + 5)) + "\n")  # stops reading after the first N
    with pytest.raises(UserError) as err:
        read_chat_jsonl(f)
    assert f"the first {MAX_BAD_LINES} bad lines (it has more)" in str(err.value)
    assert str(err.value).count("expected") == MAX_BAD_LINES


# ------------------------------------------------------------------------------ whole runs


class StopAfter(WorkerContext):
    """A context whose stop is requested once step ``stop_at`` is reported (like a drain)."""

    stop_at: int = 0

    def emit_metric(self, step, values) -> None:
        super().emit_metric(step, values)
        if step == self.stop_at:
            self.request_stop()


def make_ctx(
    model, tmp_path: Path, name: str, data: Path, resume_from=None, cls=WorkerContext, env=None, **hp
) -> WorkerContext:
    return worker_ctx(
        tmp_path,
        name,
        workload_type="sft",
        model=model,
        env_config={"env_id": "chat_jsonl", "path": str(data), "eval_fraction": 0.25, **(env or {})},
        hyperparameters={"batch_size": 4, "micro_batch_size": 2, "learning_rate": 1e-2, "lora_rank": 4, **hp},
        resume_from=resume_from,
        cls=cls,
    )


def test_lora_sft_reports_metrics_and_writes_peft_checkpoints(tiny_model_dir, tmp_path) -> None:
    data = arithmetic_chat_jsonl(tmp_path / "d.jsonl")
    ctx = make_ctx(tiny_model_dir, tmp_path, "lora", data, steps=0, epochs=2, checkpoint_every=3, eval_every=2)
    sft.run(ctx)
    metrics = reports(ctx, "metric")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # 2 epochs x ceil(18 / 4)
    for m in metrics:
        v = m["values"]
        assert {
            "loss",
            "reward",
            "loss/train",
            "train/token_accuracy",
            "perf/tokens_per_s",
            "optim/lr",
            "train/tokens",
        } <= set(v)
        assert v["loss"] == v["loss/train"] and v["reward"] == v["train/token_accuracy"] and 0 <= v["reward"] <= 1
        assert ("loss/eval" in v) == (m["step"] % 2 == 0)
    assert "loss/eval_start" in metrics[0]["values"]
    assert metrics[-1]["values"]["train/epoch"] == pytest.approx(40 / 18)
    assert metrics[-1]["values"]["loss/eval"] < metrics[0]["values"]["loss/eval_start"]  # it learns
    ckpts = reports(ctx, "checkpoint")
    assert [(c["step"], c["final"], c["format"]) for c in ckpts] == [
        (3, False, "peft_lora"),
        (6, False, "peft_lora"),
        (9, False, "peft_lora"),
        (10, True, "peft_lora"),
    ]
    final = Path(ckpts[-1]["path"])
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt"} <= {p.name for p in final.iterdir()}

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), final)
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_full_weight_sft_resumes_exactly_and_saves_a_transformers_folder(tiny_model_dir, tmp_path) -> None:
    data = arithmetic_chat_jsonl(tmp_path / "d.jsonl")
    hp = {"steps": 4, "lora": False, "learning_rate": 1e-3, "lr_schedule": "cosine", "warmup_steps": 1}
    straight = make_ctx(tiny_model_dir, tmp_path, "straight", data, **hp)
    sft.run(straight)

    first = make_ctx(tiny_model_dir, tmp_path, "split", data, cls=StopAfter, **hp)
    first.stop_at = 2
    sft.run(first)
    assert [c["step"] for c in reports(first, "checkpoint")] == [2] and not first.completed
    resumed = make_ctx(tiny_model_dir, tmp_path, "split", data, resume_from=tmp_path / "split" / "step_2", **hp)
    sft.run(resumed)
    assert [m["step"] for m in reports(resumed, "metric")] == [3, 4]
    assert "loss/eval_start" not in reports(resumed, "metric")[0]["values"]

    def losses(ctx):
        return [(m["step"], round(m["values"]["loss"], 5), m["values"]["optim/lr"]) for m in reports(ctx, "metric")]

    assert losses(first) + losses(resumed) == losses(straight)
    final = reports(resumed, "checkpoint")[-1]
    assert final["format"] == "hf_full" and final["final"]

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(final["path"])
    model = AutoModelForCausalLM.from_pretrained(path)  # a standalone folder: weights, config, tokenizer
    AutoTokenizer.from_pretrained(path)
    a = load_file(path / "model.safetensors")
    b = load_file(tmp_path / "straight" / "step_4" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    changed = [n for (n, p), (_, q) in zip(model.named_parameters(), base.named_parameters()) if not torch.equal(p, q)]
    assert len(changed) == len(list(base.parameters()))  # every weight moved


def test_bad_dataset_line_fails_the_task_naming_the_line(tiny_model_dir, tmp_path) -> None:
    data = arithmetic_chat_jsonl(tmp_path / "d.jsonl", n=3)
    with open(data, "a") as fh:
        fh.write('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]}\n')
    with pytest.raises(UserError, match=r"d\.jsonl:4: expected messages\[1\]\.content to be a string"):
        sft.run(make_ctx(tiny_model_dir, tmp_path, "bad", data, steps=1))
    assert not (tmp_path / "bad").exists()  # nothing written


def test_sft_on_a_one_example_dataset_trains_without_eval(tiny_model_dir, tmp_path) -> None:
    data = arithmetic_chat_jsonl(tmp_path / "d.jsonl", n=1)
    ctx = make_ctx(tiny_model_dir, tmp_path, "one", data, steps=2, batch_size=3)
    sft.run(ctx)
    metrics = reports(ctx, "metric")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(not any(k.startswith(("loss/eval", "eval/")) for k in m["values"]) for m in metrics)
    assert all(math.isfinite(m["values"]["loss"]) for m in metrics)
