"""The OpenAI-compatible HTTP endpoint, driven by the real ``openai`` Python client on loopback:
models list, completions and chat completions (streamed over server-sent events and not), n,
stop, max_tokens, logprobs, the same answers as the gRPC service, errors in OpenAI's shape."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from pathlib import Path

import pytest

from opentinker_client.inference import InferenceClient

from tests.support.inference import ServerThread, make_adapter, tiny_runtime
from tests.support.waiting import wait_for

openai = pytest.importorskip("openai")

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory):
    from opentinker_trainer.inference.openai_http import start_openai_server

    root = tmp_path_factory.mktemp("openai-adapters")
    adapters = {"task-o1": make_adapter(tiny_model_dir, root / "o1", seed=31)}
    grpc_server = ServerThread(tiny_runtime(tiny_model_dir, adapters))
    http = grpc_server.call(start_openai_server(grpc_server.runtime, host="127.0.0.1", port=0))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http.port}/v1", api_key="unused", max_retries=0)
    yield grpc_server, client, str(tiny_model_dir)
    client.close()
    grpc_server.call(http.stop())
    grpc_server.close()


def test_models_list_the_base_by_its_name_and_served_adapters_each_an_id_model_accepts(served) -> None:
    grpc_server, client, base = served
    InferenceClient(grpc_server.address).generate(PROMPT, adapter="task-o1", max_tokens=1)  # load it
    models = client.models.list().data
    assert [m.id for m in models] == [Path(base).name, "task-o1"]  # a folder by its name, not its path
    assert models[1].parent == Path(base).name
    for m in models:
        assert client.completions.create(model=m.id, prompt=PROMPT, max_tokens=1).model == m.id
    assert client.completions.create(model=base, prompt=PROMPT, max_tokens=1).model == base  # as spec.model says


def test_models_list_every_adapter_served_also_after_it_was_evicted(tiny_model_dir: Path, tmp_path: Path) -> None:
    from opentinker_trainer.inference.openai_http import start_openai_server

    adapters = {
        name: make_adapter(tiny_model_dir, tmp_path / name, seed=seed)
        for name, seed in (("task-e1", 41), ("task-e2", 42))
    }
    grpc_server = ServerThread(tiny_runtime(tiny_model_dir, adapters, max_resident_adapters=1))
    http = grpc_server.call(start_openai_server(grpc_server.runtime, host="127.0.0.1", port=0))
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{http.port}/v1", api_key="unused", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == [tiny_model_dir.name]
            grpc = InferenceClient(grpc_server.address)
            for name in ("task-e1", "task-e2"):  # one slot: the second evicts the first
                grpc.generate(PROMPT, adapter=name, max_tokens=1)
            assert [a.name for a in grpc.list_adapters()] == ["task-e2"]
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model="task-none", prompt=PROMPT, max_tokens=1)
            models = client.models.list().data
            assert [m.id for m in models] == [tiny_model_dir.name, "task-e1", "task-e2"]  # what model accepts
            assert client.completions.create(model="task-e1", prompt=PROMPT, max_tokens=1).model == "task-e1"
    finally:
        grpc_server.call(http.stop())
        grpc_server.close()


@contextlib.contextmanager
def _endpoint(runtime):
    """``(gRPC server, openai client)`` of ``runtime`` served on loopback."""
    from opentinker_trainer.inference.openai_http import start_openai_server

    grpc_server = ServerThread(runtime)
    http = grpc_server.call(start_openai_server(runtime, host="127.0.0.1", port=0))
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{http.port}/v1", api_key="unused", max_retries=0) as client:
            yield grpc_server, client
    finally:
        grpc_server.call(http.stop())
        grpc_server.close()


def test_models_list_the_most_recently_served_adapters_only(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from opentinker_trainer.inference import runtime as runtime_module

    monkeypatch.setattr(runtime_module, "MAX_SERVED_ADAPTERS", 2)
    adapters = {f"task-l{i}": make_adapter(tiny_model_dir, tmp_path / f"l{i}", seed=50 + i) for i in range(3)}
    with _endpoint(tiny_runtime(tiny_model_dir, adapters)) as (grpc_server, client):
        grpc = InferenceClient(grpc_server.address)
        for name in ("task-l0", "task-l1", "task-l0", "task-l2"):  # task-l1 is the least recently served
            grpc.generate(PROMPT, adapter=name, max_tokens=1)
        assert [m.id for m in client.models.list().data] == [tiny_model_dir.name, "task-l0", "task-l2"]
        assert client.completions.create(model="task-l1", prompt=PROMPT, max_tokens=1).model == "task-l1"
        assert [m.id for m in client.models.list().data] == [tiny_model_dir.name, "task-l2", "task-l1"]


def test_an_adapter_whose_checkpoint_is_gone_is_forgotten_when_used_or_listed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    table = {f"task-g{i}": make_adapter(tiny_model_dir, tmp_path / f"g{i}", seed=60 + i) for i in range(3)}
    runtime = tiny_runtime(tiny_model_dir, max_resident_adapters=1)

    def resolve(name: str) -> Path:
        from opentinker_trainer.inference.adapters import AdapterNotFound

        if name not in table:
            raise AdapterNotFound(f"adapter {name!r}: task has no checkpoint (its artifacts were deleted)")
        return table[name]

    runtime.registry.resolve = resolve
    with _endpoint(runtime) as (grpc_server, client):
        grpc = InferenceClient(grpc_server.address)
        for name in table:  # one slot: only the last stays resident
            grpc.generate(PROMPT, adapter=name, max_tokens=1)
        del table["task-g0"], table["task-g1"]  # their checkpoints are deleted
        with pytest.raises(openai.NotFoundError, match="deleted"):
            client.completions.create(model="task-g0", prompt=PROMPT, max_tokens=1)
        assert list(runtime.served_adapters) == ["task-g1", "task-g2"]  # forgotten when used
        assert [m.id for m in client.models.list().data] == [tiny_model_dir.name, "task-g2"]
        assert list(runtime.served_adapters) == ["task-g2"]  # forgotten when listed


class _PinnedLater:
    """A resolver whose ``current`` pins ``task-b`` to ``task-b@1`` once ``go`` is set."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.asked = threading.Event()
        self.go = threading.Event()

    def __call__(self, name: str) -> Path:
        return self.path

    def current(self, name: str) -> str:
        if name != "task-b":
            return name
        self.asked.set()
        self.go.wait(60)
        return "task-b@1"


def test_a_request_refused_as_busy_after_its_adapter_is_ready_is_not_listed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    runtime = tiny_runtime(tiny_model_dir, max_concurrent=1, max_queued=0)
    versions = runtime.registry.resolve = _PinnedLater(make_adapter(tiny_model_dir, tmp_path / "b1", seed=71))
    with _endpoint(runtime) as (grpc_server, client), concurrent.futures.ThreadPoolExecutor(1) as pool:
        grpc = InferenceClient(grpc_server.address)
        grpc.generate(PROMPT, adapter="task-b@1", max_tokens=1)  # resident from now on
        refused = pool.submit(client.completions.create, model="task-b", prompt=PROMPT, max_tokens=1)
        wait_for(versions.asked.is_set, what="the request naming task-b asks for its version")
        stream = grpc.generate_stream(PROMPT, temperature=0, max_tokens=400, ignore_eos=True)
        next(stream)  # the one slot is taken while task-b's request waits for its version
        versions.go.set()
        with pytest.raises(openai.RateLimitError, match="queue is full"):
            refused.result(60)
        stream.close()
        assert list(runtime.served_adapters) == ["task-b@1"]
        assert [m.id for m in client.models.list().data] == [tiny_model_dir.name, "task-b@1"]


def test_openai_client_streams_a_chat_completion_from_an_adapter_as_grpc_answers(served) -> None:
    grpc_server, client, _ = served
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    expected = InferenceClient(grpc_server.address).generate(
        messages=messages, adapter="task-o1", temperature=0, max_tokens=12, n=2
    )
    stream = client.chat.completions.create(
        model="task-o1",
        messages=messages,
        temperature=0,
        max_tokens=12,
        n=2,
        stream=True,
        logprobs=True,
        stream_options={"include_usage": True},
    )
    texts, finish, logprobs, usage = ["", ""], [None, None], [[], []], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
            if choice.logprobs and choice.logprobs.content:
                logprobs[choice.index] += [t.logprob for t in choice.logprobs.content]
    for i in range(2):
        assert texts[i] == expected.samples[i].text
        assert finish[i] == expected.samples[i].finish_reason
        assert logprobs[i] == pytest.approx(list(expected.samples[i].logprobs), abs=1e-5)
    assert (usage.prompt_tokens, usage.completion_tokens) == (expected.prompt_tokens, expected.completion_tokens)
    # Not streamed: the same answer in one response.
    whole = client.chat.completions.create(model="task-o1", messages=messages, temperature=0, max_tokens=12)
    assert whole.choices[0].message.content == expected.samples[0].text and whole.model == "task-o1"


def test_completions_with_stop_seed_top_p_and_logprobs(served) -> None:
    grpc_server, client, base = served
    grpc = InferenceClient(grpc_server.address)
    ref = grpc.generate(PROMPT, temperature=0.8, top_p=0.9, seed=4, max_tokens=10, ignore_eos=True)
    text = ref.samples[0].text
    out = client.completions.create(
        model=base, prompt=PROMPT, temperature=0.8, top_p=0.9, seed=4, max_tokens=10, logprobs=0
    )
    assert out.choices[0].text == text or out.choices[0].finish_reason == "stop"
    assert out.choices[0].logprobs.token_logprobs == pytest.approx(
        list(ref.samples[0].logprobs[: len(out.choices[0].logprobs.token_logprobs)]), abs=1e-5
    )
    word = text.split()[1] if len(text.split()) > 1 else text[-2:]
    cut = client.completions.create(
        model=base, prompt=PROMPT, temperature=0.8, top_p=0.9, seed=4, max_tokens=10, stop=[word]
    )
    assert cut.choices[0].text == text[: text.find(word)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=base, prompt=PROMPT, temperature=0, max_tokens=6, stream=True)
        if c.choices
    )
    assert streamed == client.completions.create(model=base, prompt=PROMPT, temperature=0, max_tokens=6).choices[0].text


def test_errors_come_in_the_openai_shape(served) -> None:
    _, client, base = served
    with pytest.raises(openai.NotFoundError, match="task-nope"):
        client.chat.completions.create(model="task-nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match=r"sampling.temperature: expected a number in \[0, 10\]"):
        client.completions.create(model=base, prompt=PROMPT, temperature=11)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].role"):
        client.chat.completions.create(model=base, messages=[{"role": "robot", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="beyond the model's context of 512 tokens"):
        client.completions.create(model=base, prompt=PROMPT, max_tokens=600)
