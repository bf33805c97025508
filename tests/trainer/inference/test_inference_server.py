"""Many adapters on one base model through the real gRPC service: isolation under concurrent
requests, eval-mode determinism, the LRU bound, refused adapters, bad input, disconnects."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from opentinker_client import FailedPreconditionError, InvalidArgumentError, NotFoundError, ResourceExhaustedError
from opentinker_client.inference import InferenceClient
from opentinker_trainer.inference.adapters import AdapterRefused, validate_adapter

from tests.support.inference import ServerThread, greedy_generate, load_tiny, make_adapter, tiny_runtime

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {f"task-a{i}": make_adapter(tiny_model_dir, root / f"a{i}", seed=i) for i in range(4)}


@pytest.fixture
def server(tiny_model_dir, adapters, request):
    kw = getattr(request, "param", {})
    s = ServerThread(tiny_runtime(tiny_model_dir, adapters, **kw))
    yield s
    s.close()


def _greedy(client: InferenceClient, adapter, n_tokens: int = 12) -> tuple[int, ...]:
    return (
        client.generate(PROMPT, adapter=adapter, temperature=0, max_tokens=n_tokens, ignore_eos=True)
        .samples[0]
        .token_ids
    )


def _peft_reference(base_dir: Path, adapter_dir: Path, n_tokens: int = 12) -> tuple[int, ...]:
    from peft import PeftModel

    tok, base = load_tiny(base_dir)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    ids = torch.tensor([tok(PROMPT)["input_ids"]])
    out = greedy_generate(model, ids, n_tokens, tok.eos_token_id)
    return tuple(out[0, ids.shape[1] :].tolist())


def test_concurrent_requests_for_different_adapters_never_see_each_others(server, adapters, tiny_model_dir) -> None:
    client = InferenceClient(server.address)
    names = [None, *adapters]
    alone = {name: _greedy(client, name) for name in names}
    assert len(set(alone.values())) == len(names)  # every adapter really changes the answer
    assert alone["task-a1"] == _peft_reference(tiny_model_dir, adapters["task-a1"])  # the adapter, applied as PEFT does
    order = names * 3  # 15 requests at once, decoding in one batch (the default max_concurrent is 16)
    with ThreadPoolExecutor(max_workers=len(order)) as pool:
        got = list(pool.map(lambda name: _greedy(client, name), order))
    for name, tokens in zip(order, got):
        assert tokens == alone[name], f"request for {name} got another adapter's answer"

    # Streams interleave token by token; each still only sees its own adapter.
    def stream(name):
        return tuple(
            t
            for c in client.generate_stream(PROMPT, adapter=name, temperature=0, max_tokens=12, ignore_eos=True)
            for t in c.token_ids
        )

    with ThreadPoolExecutor(max_workers=len(order)) as pool:
        got = list(pool.map(stream, order))
    assert got == [alone[name] for name in order]


def test_every_module_is_in_eval_mode_and_greedy_is_deterministic(server, adapters) -> None:
    client = InferenceClient(server.address)
    registry = server.runtime.registry
    for name in adapters:  # the adapters were saved with lora_dropout=0.1
        first = _greedy(client, name, 20)
        assert registry.modules_in_eval()
        assert _greedy(client, name, 20) == first
    seeded = client.generate(PROMPT, adapter="task-a2", temperature=1.0, seed=9, max_tokens=10).samples[0].token_ids
    assert (
        client.generate(PROMPT, adapter="task-a2", temperature=1.0, seed=9, max_tokens=10).samples[0].token_ids
        == seeded
    )


@pytest.mark.parametrize("server", [{"max_resident_adapters": 2}], indirect=True)
def test_least_recently_used_adapter_is_unloaded_first(server) -> None:
    client = InferenceClient(server.address)
    a0 = _greedy(client, "task-a0")
    _greedy(client, "task-a1")
    _greedy(client, "task-a0")  # a0 is now the most recently used
    _greedy(client, "task-a2")  # evicts a1
    assert [a.name for a in client.list_adapters()] == ["task-a2", "task-a0"]
    assert _greedy(client, "task-a1") == _greedy(client, "task-a1")
    assert [a.name for a in client.list_adapters()] == ["task-a1", "task-a2"]
    assert _greedy(client, "task-a0") == a0  # reloaded, same answer
    infos = client.list_adapters()
    assert all(a.size_bytes > 0 and a.in_use == 0 and a.path for a in infos)
    assert server.runtime.registry.evictions >= 3


def test_refused_adapters_list_their_keys_and_are_never_served_as_the_base(
    server, adapters, tiny_model_dir, tmp_path
) -> None:
    src = adapters["task-a0"]
    tensors = load_file(src / "adapter_model.safetensors")
    config = (src / "adapter_config.json").read_text()

    def adapter(name: str, tensors: dict) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(config)
        save_file(tensors, str(d / "adapter_model.safetensors"))
        return d

    no_lora = adapter("no-lora", {"some.weight": torch.zeros(2, 2)})
    wrong_keys = adapter("wrong-keys", {k.replace("layers.0.", "layers.7."): v for k, v in tensors.items()})
    wrong_shape = adapter(
        "wrong-shape", {k: (torch.zeros(v.shape[0], 3) if "lora_A" in k else v) for k, v in tensors.items()}
    )
    _, base = load_tiny(tiny_model_dir)
    with pytest.raises(AdapterRefused, match=r"no LoRA tensors .*some\.weight"):
        validate_adapter(no_lora, base)
    with pytest.raises(
        AdapterRefused, match=r"modules the base model does not have: .*layers\.7\.self_attn\.q_proj\.lora_A"
    ):
        validate_adapter(wrong_keys, base)
    with pytest.raises(AdapterRefused, match=r"shapes differ: .*lora_A\.weight \[4, 3\] \(expected \[r, 64\]\)"):
        validate_adapter(wrong_shape, base)
    with pytest.raises(AdapterRefused, match="no adapter_model.safetensors"):
        validate_adapter(tmp_path, base)
    # Through the service: FAILED_PRECONDITION, and nothing is loaded.
    table = {"task-bad1": no_lora, "task-bad2": wrong_keys}
    resolve = server.runtime.registry.resolve
    server.runtime.registry.resolve = lambda name: table[name] if name in table else resolve(name)
    client = InferenceClient(server.address)
    for name in table:
        with pytest.raises(FailedPreconditionError, match="LoRA"):
            client.generate(PROMPT, adapter=name, max_tokens=3)
    assert client.list_adapters() == []


def test_bad_requests_get_the_right_status_and_name_the_field(server, tiny_model_dir) -> None:
    client = InferenceClient(server.address)
    with pytest.raises(NotFoundError, match="task-nope"):
        client.generate(PROMPT, adapter="task-nope")
    with pytest.raises(NotFoundError, match="is not served here"):
        InferenceClient(server.address, model="/other/model").generate(PROMPT)
    with pytest.raises(
        InvalidArgumentError,
        match=r"the prompt has \d+ tokens and max_tokens is 600, \d+ in all, beyond the model's context of 512 tokens",
    ):
        client.generate(PROMPT, max_tokens=600)
    with pytest.raises(InvalidArgumentError, match=r"sampling.temperature: expected a number in \[0, 10\]"):
        client.generate(PROMPT, temperature=-1)
    with pytest.raises(InvalidArgumentError, match=r"sampling.top_p"):
        client.generate(PROMPT, top_p=1.5)
    with pytest.raises(InvalidArgumentError, match=r"sampling.n"):
        client.generate(PROMPT, n=65)
    with pytest.raises(InvalidArgumentError, match=r"messages\[0\].role"):
        client.generate(messages=[{"role": "robot", "content": "hi"}])
    with pytest.raises(InvalidArgumentError, match="prompt"):
        client.generate()
    with pytest.raises(InvalidArgumentError, match="prompt"):
        client.generate(PROMPT, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(NotFoundError):
        next(iter(client.generate_stream(PROMPT, adapter="task-nope")))
    assert server.runtime.running == 0


@pytest.mark.parametrize("server", [{"max_concurrent": 1, "max_queued": 0}], indirect=True)
def test_a_client_that_goes_away_mid_stream_stops_generation_and_frees_its_slot(server) -> None:
    client = InferenceClient(server.address)
    stream = client.generate_stream(PROMPT, adapter="task-a0", temperature=0, max_tokens=400, ignore_eos=True)
    for _ in range(3):
        next(stream)
    assert server.runtime.running == 1
    with pytest.raises(ResourceExhaustedError, match=r"queue is full: 0 requests waiting \(max_queued_requests 0\)"):
        client.generate(PROMPT, max_tokens=2)
    stream.close()  # cancels the call, like a client that disconnects
    deadline = time.monotonic() + 10
    while server.runtime.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.runtime.running == 0
    steps = server.runtime.steps
    time.sleep(0.3)
    assert server.runtime.steps == steps < 400  # nothing keeps generating for the departed client
    assert server.runtime.registry.list()[0].in_use == 0
    assert len(client.generate(PROMPT, max_tokens=2, ignore_eos=True).samples[0].token_ids) == 2  # the slot is free


def test_chat_messages_use_the_chat_template(server, tiny_model_dir) -> None:
    tok, _ = load_tiny(tiny_model_dir)
    client = InferenceClient(server.address)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    out = client.generate(messages=messages, temperature=0, max_tokens=4)
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt_tokens == len(tok(rendered, add_special_tokens=False)["input_ids"])
    assert out.model == str(tiny_model_dir) and out.adapter is None
