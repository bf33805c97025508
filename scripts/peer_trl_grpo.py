"""The TRL peer of ``scripts/bench_grpo_trl.py``: TRL's ``GRPOTrainer`` with a PEFT LoRA adapter on
the arithmetic problems, measured the way the bench measures OpenTinker, printed as one JSON line.

Runs in its own interpreter, a venv with TRL (``make bench-grpo-trl`` makes ``.cache/peer-venv``):

    .cache/peer-venv/bin/python scripts/peer_trl_grpo.py --config '{"model": ..., "steps": 12, ...}'

``--config`` (JSON): the bench's settings (``SETTINGS`` in ``scripts/bench_grpo_trl.py``) plus
``seed`` and ``problems``, a list of ``[a, b]``, ``prompts_per_step`` per step in step order. Only
``opentinker_common.arithmetic`` is imported from OpenTinker (standard library only): the
instruction, :class:`Problem` and :func:`reward`, so both sides ask and score alike.

Measured: the time of each optimizer step's end (``on_step_end``), seconds since the trainer was
built, and the step's mean reward as TRL logs it (``logging_steps`` 1).

Output: ``{"steps": [{"step", "end_s", "reward"}], "build_s", "versions", "gradient_checkpointing",
"dtype"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentinker_common.arithmetic import DEFAULT_INSTRUCTION, Problem, reward  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the settings as JSON")
    cfg = json.loads(parser.parse_args().config)

    import peft
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.set_num_threads(1)
    problems = [Problem(a, b, DEFAULT_INSTRUCTION.format(a=a, b=b)) for a, b in cfg["problems"]]
    # Conversational prompts: TRL renders them with the chat template, as the arithmetic env does.
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": p.question}], "answer": p.answer} for p in problems]
    )

    def arithmetic_reward(completions, answer, **_):
        return [reward(c[0]["content"], int(ans)) for c, ans in zip(completions, answer)]

    batch = cfg["prompts_per_step"] * cfg["group_size"]
    args = trl.GRPOConfig(
        output_dir=cfg["output_dir"],
        max_steps=cfg["steps"],
        per_device_train_batch_size=batch,  # completions per optimizer step
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=cfg["group_size"],
        num_iterations=cfg["ppo_epochs"],
        max_completion_length=cfg["max_new_tokens"],
        temperature=cfg["temperature"],
        top_p=1.0,
        top_k=0,
        learning_rate=cfg["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=cfg["weight_decay"],
        max_grad_norm=cfg["max_grad_norm"],
        beta=cfg["kl_coef"],
        epsilon=cfg["clip_eps"],
        scale_rewards="group",
        loss_type="dapo",  # per-token losses over the batch's tokens: OpenTinker's token_mean
        shuffle_dataset=False,  # the problems in the order OpenTinker's env draws them
        seed=cfg["seed"],
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    lora = peft.LoraConfig(
        r=cfg["lora_rank"],
        lora_alpha=cfg["lora_alpha"],
        lora_dropout=cfg["lora_dropout"],
        target_modules=list(cfg["target_modules"]),
        task_type="CAUSAL_LM",
    )

    steps: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            steps.append({"step": state.global_step, "end_s": time.perf_counter() - t0, "reward": None})
            print(f"trl step {state.global_step} at {steps[-1]['end_s']:.1f} s", file=sys.stderr, flush=True)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs and steps and steps[-1]["step"] == state.global_step:
                steps[-1]["reward"] = float(logs["reward"])

    t0 = time.perf_counter()
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=arithmetic_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[Clock()],
    )
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.train()
    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    versions["torch"] = torch.__version__
    # What the comparison relies on: no activation checkpointing, float32 weights.
    checks = {
        "gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False)),
        "dtype": str(next(trainer.model.parameters()).dtype),
    }
    print(json.dumps({"steps": steps, "build_s": build_s, "versions": versions, **checks}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
