"""``make install`` places the converted model in the Hugging Face hub cache, so the Tinker SDK's
``get_tokenizer()`` loads it offline (``scripts/prepare_model.py`` ``place_in_hub_cache``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from scripts.prepare_model import place_in_hub_cache


def _model(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_the_model_is_linked_once_and_placed_again_when_its_clone_is_gone(tmp_path) -> None:
    cache = tmp_path / "hub"
    first = _model(tmp_path / "clone-1")
    assert place_in_hub_cache(first, cache, "org/model")
    snapshot = cache / "models--org--model" / "snapshots" / "local"
    assert (snapshot / "tokenizer.json").resolve() == first / "tokenizer.json"
    assert not place_in_hub_cache(first, cache, "org/model")  # already there: nothing changes

    second = tmp_path / "clone-2"
    shutil.copytree(first, second)
    shutil.rmtree(first)  # the first clone is deleted: its links dangle
    assert place_in_hub_cache(second, cache, "org/model")
    assert (snapshot / "tokenizer.json").resolve() == second / "tokenizer.json"


def test_a_model_the_cache_holds_from_the_hub_is_left_alone(tmp_path) -> None:
    cache = tmp_path / "hub"
    repo = cache / "models--org--model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    assert not place_in_hub_cache(_model(tmp_path / "clone"), cache, "org/model")
    assert not (repo / "snapshots" / "local").exists()
