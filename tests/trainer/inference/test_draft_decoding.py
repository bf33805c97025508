"""Greedy requests decode with prompt-lookup drafts on the real SmolLM2: the service streams
exactly plain greedy decoding's tokens (one forward pass per token), with and without a LoRA
adapter, alone and two at once, and where max_tokens, EOS or a stop string ends the
sample inside a run of kept draft tokens; while a repetitive text takes far fewer passes."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from opentinker_client.inference import InferenceClient

from tests.support.inference import ServerThread, make_adapter

#: Greedy decoding falls into a loop on this text.
DAYS = "Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday, Monday,"
#: The answer copies the prompt's sentence, then ends with EOS, which follows it in the prompt.
COPY = [
    {
        "role": "user",
        "content": "Copy this text exactly: The quick brown fox jumps over the lazy dog while the cat sat on "
        "the mat and the bird sang in the old tree.",
    }
]
CHAT = [{"role": "user", "content": "Explain how a bicycle stays upright."}]
TOKENS = 32


@pytest.fixture(scope="module")
def served(real_model_dir: Path, tmp_path_factory):
    """The service on the real model, plain weights (the reference's). Yields the server, a
    client, the tokenizer, and ``plain(prompt ids, adapter or None) -> TOKENS greedy tokens``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opentinker_trainer.inference.runtime import ModelRuntime, RuntimeConfig

    adapter = make_adapter(real_model_dir, tmp_path_factory.mktemp("draft") / "a", seed=3, scale=0.1)
    tok = AutoTokenizer.from_pretrained(real_model_dir)
    runtime = ModelRuntime(
        model_name="smol",
        tokenizer=tok,
        model=AutoModelForCausalLM.from_pretrained(real_model_dir),
        stop_token_ids=[tok.eos_token_id],
        resolve={"task-a": adapter}.__getitem__,
        config=RuntimeConfig(packed_weights=False),
    )
    base = AutoModelForCausalLM.from_pretrained(real_model_dir).eval()
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(real_model_dir), adapter).eval()

    def plain(ids: list[int], name: str | None) -> list[int]:
        return _plain_greedy(tuned if name else base, ids, TOKENS)

    server = ServerThread(runtime)
    client = InferenceClient(server.address, timeout=600)
    yield server, client, tok, plain
    client.close()
    server.close()


@torch.inference_mode()
def _plain_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy decoding without drafts: one forward pass per token, nothing stops it."""
    from transformers import DynamicCache

    cache, out, x = DynamicCache(), [], torch.tensor([ids])
    for _ in range(n):
        logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits
        out.append(int(logits[0, -1].argmax()))
        x = torch.tensor([[out[-1]]])
    return out


def _prompt_ids(tok, case: dict) -> list[int]:
    if "messages" in case:
        text = tok.apply_chat_template(case["messages"], tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(case["prompt"])["input_ids"]


def _stream(client: InferenceClient, case: dict) -> tuple[list[int], str, str, list]:
    """Tokens, text, finish reason and the chunks of one greedy stream."""
    case = dict(case)
    chunks = list(client.generate_stream(case.pop("prompt", None), temperature=0.0, **case))
    tokens = [t for c in chunks for t in c.token_ids]
    finish = [c.finish_reason for c in chunks if c.finish_reason]
    return tokens, "".join(c.text for c in chunks), finish[0], chunks


@pytest.mark.parametrize(
    "case",
    [
        dict(prompt=DAYS, max_tokens=TOKENS, ignore_eos=True),
        dict(messages=COPY, max_tokens=TOKENS),
        dict(messages=CHAT, max_tokens=TOKENS),
        dict(messages=COPY, max_tokens=TOKENS, adapter="task-a"),
    ],
    ids=["loop", "copy", "chat", "copy-adapter"],
)
def test_greedy_output_is_plain_greedy_decoding_token_for_token(served, case) -> None:
    server, client, tok, plain = served
    ref = plain(_prompt_ids(tok, case), case.get("adapter"))
    if not case.get("ignore_eos"):  # EOS ends it
        ref = ref[: ref.index(tok.eos_token_id) + 1] if tok.eos_token_id in ref else ref
    steps = server.runtime.decode_steps
    tokens, text, _, _ = _stream(client, case)
    assert tokens == ref
    assert text == tok.decode(ref, skip_special_tokens=True)
    if case.get("messages") is not CHAT and not case.get("adapter"):
        assert server.runtime.decode_steps - steps < len(ref) / 2  # the text repeats: drafts were kept


def test_two_greedy_requests_at_once_get_plain_greedy_decoding(served) -> None:
    server, client, tok, plain = served
    cases = [dict(prompt=DAYS, max_tokens=TOKENS, ignore_eos=True), dict(messages=COPY, max_tokens=20, ignore_eos=True)]
    refs = [plain(_prompt_ids(tok, c), None)[: c["max_tokens"]] for c in cases]
    start = threading.Barrier(2)

    def together(case):
        start.wait()
        return _stream(client, case)[0]

    rows, kept = server.runtime.max_batch_rows_seen, server.runtime.kept_draft_tokens
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(together, cases))
    assert got == refs
    assert server.runtime.max_batch_rows_seen == max(rows, 2)
    assert server.runtime.kept_draft_tokens > kept


def test_max_tokens_eos_and_a_stop_string_end_the_sample_inside_a_run_of_kept_drafts(served) -> None:
    server, client, tok, plain = served
    ref = plain(_prompt_ids(tok, dict(messages=COPY)), None)
    text_of = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    for max_tokens in (9, 14):
        tokens, text, finish, chunks = _stream(client, dict(messages=COPY, max_tokens=max_tokens, ignore_eos=True))
        assert (tokens, text, finish) == (ref[:max_tokens], text_of(ref[:max_tokens]), "length")
        assert len(chunks[-2].token_ids) > 1  # the last step kept draft tokens
    # EOS, which follows the sentence in the prompt, ends the sample.
    tokens, text, finish, chunks = _stream(client, dict(messages=COPY, max_tokens=TOKENS))
    end = ref.index(tok.eos_token_id) + 1
    assert (tokens, text, finish) == (ref[:end], text_of(ref[:end]), "stop")
    assert len(chunks[-2].token_ids) > 1
    # A stop string: the sample ends with the token that completes it; the text stops before it.
    stop = " lazy dog"
    end = next(i for i in range(1, len(ref) + 1) if stop in text_of(ref[:i]))
    chosen = server.runtime.decode_tokens
    tokens, text, finish, chunks = _stream(client, dict(messages=COPY, max_tokens=TOKENS, ignore_eos=True, stop=[stop]))
    assert (tokens, text, finish) == (ref[:end], text_of(ref[:end]).split(stop)[0], "stop")
    # The step that reached it had chosen more tokens, past the stop string: they were dropped.
    assert server.runtime.decode_tokens - chosen > len(tokens) - 1
