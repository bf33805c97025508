#!/usr/bin/env python3
"""CPU cost of one decode step and one prefill of the served model, with and without oneDNN-packed
weights (:mod:`opentinker_trainer.inference.packed`): two models in one process, alternated.

The model is SmolLM2-135M-Instruct with 8 random LoRA adapters (rank 16 on q/k/v/o) run grouped by
adapter (:mod:`opentinker_trainer.inference.lora_rows`), as the server runs them. For each row
count, a 42-token prompt is prefilled and ``--steps`` decode steps run on its key/value cache; the
figure is the median step. Rows: ``base`` all on the base model, ``mixed`` the base and the
adapters in turn (one row: an adapter). Also the prefill of one 42-token prompt, and the 211 ``Linear`` layers alone.

Usage: PYTHONPATH=$PWD:$PWD/protos OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_decode_step.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / ".cache/models/SmolLM2-135M-Instruct"))
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of plain and packed")
    args = parser.parse_args()

    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from opentinker_trainer.inference.lora_rows import RowLoRA
    from opentinker_trainer.inference.packed import pack_linears

    torch.manual_seed(0)
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench-step-"))
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(args.model),
        LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    names = [f"a{i}" for i in range(8)]
    for name in names:
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if "lora_B" in pname:
                    p.normal_(0, 0.01)
        peft_model.save_pretrained(tmp / name)
    del peft_model
    prompt = torch.randint(100, 1000, (1, 42))

    def build(pack: bool) -> list:
        """The cases on a model of its own, its Linear weights packed or plain."""
        base = AutoModelForCausalLM.from_pretrained(args.model).eval()
        if pack:
            pack_linears(base)
        linears = [m for m in base.modules() if isinstance(m, torch.nn.Linear)]
        model = PeftModel.from_pretrained(base, tmp / names[0], adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(tmp / name, adapter_name=name)
        model.eval()
        model.base_model.disable_adapter_layers()
        lora = RowLoRA(model, names)

        def decode(rows: list) -> float:
            b = len(rows)
            lora.set_rows(rows)
            with torch.inference_mode():
                out = base(input_ids=prompt.expand(b, -1), use_cache=True, logits_to_keep=1)
                cache, mask, times = out.past_key_values, torch.ones((b, 42), dtype=torch.long), []
                for _ in range(args.steps):
                    mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long)], dim=1)
                    lora.set_rows(rows)
                    t0 = time.perf_counter()
                    out = base(
                        input_ids=torch.full((b, 1), 7),
                        attention_mask=mask,
                        position_ids=mask.sum(1, keepdim=True) - 1,
                        past_key_values=cache,
                        use_cache=True,
                    )
                    times.append(time.perf_counter() - t0)
                    cache = out.past_key_values
            return 1000 * statistics.median(times)

        def prefill() -> float:
            lora.set_rows([names[0]])
            with torch.inference_mode():
                t0 = time.perf_counter()
                base(input_ids=prompt, use_cache=True, logits_to_keep=1)
                return 1000 * (time.perf_counter() - t0)

        def linears_only(b: int) -> float:
            xs = {m.in_features: torch.randn(b, m.in_features) for m in linears}
            with torch.inference_mode():
                t0 = time.perf_counter()
                for m in linears:
                    m(xs[m.in_features])
                return 1000 * (time.perf_counter() - t0)

        cases = []
        for b in (int(x) for x in args.rows.split(",")):
            cases.append((f"{b} rows base", lambda b=b: decode([None] * b)))
            mixed = ([None, *names] * b)[:b] if b > 1 else names[:1]  # the base and adapters in turn
            cases.append((f"{b} rows mixed", lambda mixed=mixed: decode(mixed)))
            cases.append((f"{b} rows, Linear layers only", lambda b=b: linears_only(b)))
        cases.append(("prefill 42 tokens, one adapter", prefill))
        cases.append(("42 rows, Linear layers only", lambda: linears_only(42)))
        return cases

    both = {False: build(False), True: build(True)}
    cases = both[False]
    got: dict[tuple[str, bool], list[float]] = {}
    for r in range(args.rounds):
        for on in (False, True) if r % 2 == 0 else (True, False):
            for label, fn in both[on]:
                got.setdefault((label, on), []).append(fn())
    print(f"ms, median of {args.rounds} rounds (range); plain MKL -> oneDNN packed")
    for label, _ in cases:
        plain, fast = got[(label, False)], got[(label, True)]
        print(
            f"{label}: {statistics.median(plain):.1f} ({min(plain):.0f}-{max(plain):.0f}) -> "
            f"{statistics.median(fast):.1f} ({min(fast):.0f}-{max(fast):.0f}), "
            f"{statistics.median(plain) / statistics.median(fast):.2f}x",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
