"""A model host's tenants in this process (threads on one tiny base model): a task's reward curve
and final adapter are those of the same task run alone by the ordinary worker path, whoever its
neighbours are; a neighbour that fails ends alone, and a stopped one checkpoints and frees its
adapter; turns go round-robin, and the rollouts of the tenants waiting run as one batch (each
tenant's rows on its own adapter, its draws from its own RNG stream), as do their update passes,
which leaves every tenant's numbers as they are alone, within float tolerance."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from opentinker.common.v1 import common_pb2
from opentinker.node.v1 import node_pb2
from opentinker_common.arithmetic import ArithmeticEnv
from opentinker_trainer.host import ModelHost, RoundRobin, adapter_name, shareable
from opentinker_trainer.workloads import grpo_text

from tests.support.workers import reports, worker_ctx

HP = {"steps": 4, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4, "seed": 11}


@pytest.fixture
def reply_rewards(monkeypatch):
    """Reward = parity of the reply's characters: mixed within groups, so the adapters move, and a
    function of the sampled text alone, so a tenant sampling anything but what it would sample
    alone shows in its curve."""
    monkeypatch.setattr(ArithmeticEnv, "score", lambda self, reply, problem: float(sum(map(ord, reply)) % 2))


def _assign(task_id: str, model: Path, hp: dict, *, attempt: int = 1) -> node_pb2.AssignTask:
    spec = common_pb2.TaskSpec(workload_type="lora_finetune", model=str(model))
    spec.env_config.update({"env_id": "arithmetic"})
    spec.hyperparameters.update(hp)
    return node_pb2.AssignTask(task_id=task_id, attempt=attempt, spec=spec)


def _lines(out: io.StringIO, task_id: str, kind: str) -> list[dict]:
    return [
        m
        for m in (json.loads(x) for x in out.getvalue().splitlines() if x.strip())
        if m.get("task_id") == task_id and m["type"] == kind
    ]


def _curve(metrics: list[dict]) -> list[tuple]:
    keys = ("reward", "loss", "completion/mean_tokens")
    return [(m["step"], *(m["values"][k] for k in keys)) for m in metrics]


def test_a_tenant_trains_as_it_would_alone(tiny_model_dir: Path, tmp_path: Path, reply_rewards) -> None:
    alone = worker_ctx(
        tmp_path,
        "alone",
        workload_type="lora_finetune",
        model=tiny_model_dir,
        env_config={"env_id": "arithmetic"},
        hyperparameters={**HP, "checkpoint_every": 0},
        task_id="x",
    )
    grpo_text.run(alone)
    expected = _curve(reports(alone, "metric"))
    assert len({r for _, r, _, _ in expected}) > 1 or any(loss != 0 for _, _, loss, _ in expected)

    out = io.StringIO()
    host = ModelHost(str(tiny_model_dir), "cpu", "auto", out)
    neighbours = {
        "n-rank8": {**HP, "seed": 3, "lora_rank": 8, "steps": 5},
        "x": {**HP, "checkpoint_every": 0},
        "n-bad": {**HP, "target_modules": ["no_such_proj"]},  # a user error: ends this tenant only
        "n-stop": {**HP, "seed": 4, "steps": 400, "checkpoint_every": 0},
    }
    for tid, hp in neighbours.items():
        path = tmp_path / f"{tid}.pb"
        path.write_bytes(_assign(tid, tiny_model_dir, hp).SerializeToString())
        host.add(path, tmp_path / "host" / tid)
    # Stop the long one once the others are done with their steps: it checkpoints and leaves.
    threading.Thread(target=lambda: (host.threads[("x", 1)].join(), host.stop("n-stop", 1)), daemon=True).start()
    host.join()

    got = _curve(_lines(out, "x", "metric"))
    assert [c[0] for c in got] == [c[0] for c in expected] == [1, 2, 3, 4]
    assert [v for c in got for v in c[1:]] == pytest.approx([v for c in expected for v in c[1:]], abs=1e-6)
    ours = load_file(tmp_path / "host" / "x" / "step_4" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "alone" / "step_4" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs)  # the PEFT keys of an adapter alone: no tenant name in them
    assert all(torch.allclose(ours[k], theirs[k], atol=1e-6) for k in ours)
    assert (tmp_path / "host/x/step_4/adapter_config.json").read_text() == (
        tmp_path / "alone/step_4/adapter_config.json"
    ).read_text()

    (bad,) = _lines(out, "n-bad", "failed")
    assert not bad["retryable"] and "no_such_proj" in bad["error"]
    assert _lines(out, "n-rank8", "succeeded") and len(_lines(out, "n-rank8", "metric")) == 5
    assert _lines(out, "n-stop", "stopped") and _lines(out, "n-stop", "checkpoint")[-1]["final"] is False
    # Every tenant released its adapter and its turn; the model holds no adapter now.
    released = {m["task_id"] for m in (json.loads(x) for x in out.getvalue().splitlines()) if m["type"] == "released"}
    assert released == set(neighbours) and not host.tenants
    assert list(host.model.peft_config) == []


def _alone(tmp_path: Path, model: Path, task_id: str, hp: dict) -> tuple[list[tuple], dict[str, torch.Tensor]]:
    """A task's curve and final adapter from the ordinary worker path (its own model)."""
    ctx = worker_ctx(
        tmp_path, f"alone-{task_id}", workload_type="lora_finetune", model=model,
        env_config={"env_id": "arithmetic"}, hyperparameters=hp, task_id=task_id,
    )  # fmt: skip
    grpo_text.run(ctx)
    return _curve(reports(ctx, "metric")), load_file(
        tmp_path / f"alone-{task_id}" / f"step_{hp['steps']}" / "adapter_model.safetensors"
    )


def test_batched_rollouts_and_updates_leave_every_tenant_as_it_is_alone_and_a_diverged_one_fails_alone(
    tiny_model_dir: Path, tmp_path: Path, reply_rewards, monkeypatch
) -> None:
    """Four tenants with different seeds, prompts per step, group sizes, lengths, temperatures
    and adapter ranks, their rollouts batched (mixed-adapter rows in one forward) and their
    update passes batched (one forward and backward, each row on its own adapter): each one's
    curve and final adapter are those of the same task alone, within float tolerance. A fifth,
    whose adapter is NaN (a diverged task's checkpoint), fails at its first rollout, alone."""
    from tests.support.inference import make_adapter
    from safetensors.torch import save_file

    from opentinker_trainer.rl import update_batch

    tasks = {
        "x": {**HP, "checkpoint_every": 0},
        "n1": {
            **HP,
            "seed": 3,
            "lora_rank": 8,
            "group_size": 3,
            "prompts_per_step": 1,
            "max_new_tokens": 6,
            "steps": 5,
        },
        "n2": {**HP, "seed": 5, "group_size": 4, "prompts_per_step": 1, "max_new_tokens": 3, "temperature": 0.8},
        "n3": {**HP, "seed": 7, "prompts_per_step": 3, "steps": 3, "lora_alpha": 4},
    }
    expected = {tid: _alone(tmp_path, tiny_model_dir, tid, hp) for tid, hp in tasks.items()}

    nan = make_adapter(tiny_model_dir, tmp_path / "diverged", seed=2)
    weights = load_file(nan / "adapter_model.safetensors")
    save_file({k: torch.full_like(v, float("nan")) for k, v in weights.items()}, nan / "adapter_model.safetensors")

    out = io.StringIO()
    host = ModelHost(str(tiny_model_dir), "cpu", "auto", out)
    assert host.unbatchable is None
    runs: list[list[str]] = []  # the adapters of each rollout run, recorded on the way through
    run_rollouts = host.run_rollouts
    host.run_rollouts = lambda requests: (runs.append([r.adapter for r in requests]), run_rollouts(requests))[1]
    updates: list[int] = []  # the requests of each update run
    run_updates = host.run_updates
    host.run_updates = lambda requests: (updates.append(len(requests)), run_updates(requests))[1]
    alone: list[str] = []  # update passes run alone: a run of one, never a batch's fallback
    solo = update_batch.run_alone
    monkeypatch.setattr(update_batch, "run_alone", lambda model, r: (alone.append(r.adapter), solo(model, r))[1])
    for tid, hp in {**tasks, "n-nan": {**HP, "seed": 9}}.items():
        assign = _assign(tid, tiny_model_dir, hp)
        if tid == "n-nan":
            assign.init_checkpoint.path, assign.init_checkpoint.format = str(nan), "peft_lora"
        path = tmp_path / f"{tid}.pb"
        path.write_bytes(assign.SerializeToString())
        host.add(path, tmp_path / "host" / tid)
    host.join()

    assert host.turns.requests["rollout"] > host.turns.runs["rollout"] == len(runs)
    assert max(map(len, runs)) >= 3, runs  # runs took several tenants' rollouts
    assert host.turns.runs["update"] == len(updates)
    # Whatever the thread timing: a rollout run of three holds two tenants or more that go on to
    # their update (n-nan's rollout fails). The runner queues its update pass at once, behind
    # the others' places in line, and each of them queues its own when its place comes: some
    # update run takes two requests or more, some of them in shared passes under the real
    # PASS_TOKENS and PASS_SHARE (the rest in passes of one, the solo pass), and no batched
    # pass falls back to passes alone.
    assert max(updates) >= 2 and len(alone) < sum(updates), (updates, alone)
    assert host.turns.fallbacks["update"] == 0
    # (Whether n-nan's one rollout shared a run depends on thread timing; a NaN request in a
    # shared run failing alone is tests/trainer/rl/test_rollout_batch.py's.)
    (failed,) = _lines(out, "n-nan", "failed")
    assert "probability tensor contains" in failed["error"] and not _lines(out, "n-nan", "metric")
    for tid, hp in tasks.items():
        curve, adapter = expected[tid]
        got = _curve(_lines(out, tid, "metric"))
        assert [c[0] for c in got] == [c[0] for c in curve] == list(range(1, hp["steps"] + 1)), tid
        assert [v for c in got for v in c[1:]] == pytest.approx([v for c in curve for v in c[1:]], abs=1e-5), tid
        ours = load_file(tmp_path / "host" / tid / f"step_{hp['steps']}" / "adapter_model.safetensors")
        assert sorted(ours) == sorted(adapter), tid
        assert all(torch.allclose(ours[k], adapter[k], atol=1e-5) for k in ours), tid
        assert _lines(out, tid, "succeeded"), tid
    assert not host.tenants and list(host.model.peft_config) == []


def test_on_a_model_that_cannot_batch_each_rollout_runs_alone_in_its_turn(
    tiny_model_dir: Path, tmp_path: Path, reply_rewards
) -> None:
    """A generation config with a logits processor a batch does not apply (``suppress_tokens``):
    every tenant's rollout is ``generate`` alone in its turn, its curve that of the task alone."""
    import shutil

    model = tmp_path / "suppressing"
    shutil.copytree(tiny_model_dir, model)
    config = model / "generation_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "suppress_tokens": [5]}))
    hp = {**HP, "steps": 2, "checkpoint_every": 0}
    expected, _ = _alone(tmp_path, model, "x", hp)
    out = io.StringIO()
    host = ModelHost(str(model), "cpu", "auto", out)
    assert host.unbatchable == "generation_config.suppress_tokens = [5]"
    for tid, seed in (("x", 11), ("y", 12)):
        path = tmp_path / f"{tid}.pb"
        path.write_bytes(_assign(tid, model, {**hp, "seed": seed}).SerializeToString())
        host.add(path, tmp_path / "host" / tid)
    host.join()
    assert host.turns.runs["rollout"] == 0
    got = _curve(_lines(out, "x", "metric"))
    assert [v for c in got for v in c[1:]] == pytest.approx([v for c in expected for v in c[1:]], abs=1e-6)


def test_round_robin_gives_turns_in_the_order_asked() -> None:
    turns = RoundRobin()
    order: list[str] = []
    gate = threading.Event()

    def tenant(name: str, steps: int) -> None:
        for _ in range(steps):
            with turns.turn(name):
                gate.wait()
                order.append(name)

    threads = [threading.Thread(target=tenant, args=(n, 3)) for n in "abc"]
    for t in threads:
        t.start()
        while len(turns._queue) + (turns._holder is not None) < threads.index(t) + 1:
            time.sleep(0.001)  # each asks in turn: a first, then b, then c
    gate.set()
    for t in threads:
        t.join()
    assert order == list("abc" * 3)
    assert turns.turns == 9


def _queued(turns: RoundRobin, n: int) -> None:
    """Wait until ``n`` tenants wait or hold a turn (progress, not time)."""
    while len(turns._queue) + (turns._holder is not None) < n:
        time.sleep(0.001)


def _run_in_line(turns: RoundRobin, gate: threading.Event, tenant, names: str) -> None:
    """Start a ``tenant(name)`` thread per name, each once the one before it waits or holds a
    turn (so they queue in that order), then open ``gate`` and wait for all of them."""
    threads = [threading.Thread(target=tenant, args=(n,)) for n in names]
    for i, t in enumerate(threads):
        t.start()
        _queued(turns, i + 1)
    gate.set()
    for t in threads:
        t.join()


def test_the_rollouts_of_waiting_tenants_run_as_one_and_each_continues_in_its_place() -> None:
    turns = RoundRobin()
    runs: list[list[str]] = []
    got: dict[str, object] = {}
    order: list[str] = []
    gate = threading.Event()

    def run(requests: list) -> list:
        runs.append(list(requests))
        return [f"rolled {r}" for r in requests]

    def tenant(name: str) -> None:
        with turns.turn(name):
            gate.wait()
            got[name] = turns.rollout(name, name, run)
            order.append(name)  # the rest of its step, in its turn again
            assert turns._holder == name

    _run_in_line(turns, gate, tenant, "abc")
    assert runs == [["a", "b", "c"]]  # a's rollout took b's and c's along: one run
    assert got == {n: f"rolled {n}" for n in "abc"} and order == list("abc")
    assert (turns.runs["rollout"], turns.requests["rollout"], turns.turns) == (1, 3, 3)


def test_an_update_pass_takes_along_the_waiting_update_passes_and_no_rollout() -> None:
    turns = RoundRobin()
    runs: list[tuple[str, list[str]]] = []
    gate = threading.Event()

    def runner(kind: str):
        return lambda requests: (runs.append((kind, list(requests))), list(requests))[1]

    def tenant(name: str) -> None:
        with turns.turn(name):
            gate.wait()
            if name == "b":
                assert turns.rollout(name, name, runner("rollout")) == name
            else:
                assert turns.update(name, name, runner("update")) == name
            assert turns._holder == name

    _run_in_line(turns, gate, tenant, "abc")  # queue at the end: a(update), b(rollout), c(update)
    assert runs == [("update", ["a", "c"]), ("rollout", ["b"])]
    assert (turns.runs, turns.requests) == ({"update": 1, "rollout": 1}, {"update": 2, "rollout": 1})


def test_a_rollout_takes_along_only_tenants_ready_for_one_and_ordinary_turns_keep_their_place() -> None:
    turns = RoundRobin()
    runs: list[list[str]] = []
    order: list[str] = []
    a_holds, b_may_ask, c_may_ask = threading.Event(), threading.Event(), threading.Event()

    def run(requests: list) -> list:
        runs.append(list(requests))
        return list(requests)

    def a() -> None:
        with turns.turn("a"):
            a_holds.set()
            b_may_ask.wait()
            _queued(turns, 2)  # b waits for a turn
            turns.rollout("a", "a", run)  # queue: b, a's rollout
            order.append("a")

    def b() -> None:
        a_holds.wait()
        b_may_ask.set()
        with turns.turn("b"):
            _queued(turns, 3)  # a's rollout and s's ordinary turn wait: queue a(rollout), s
            turns.rollout("b", "b", run)  # queue: a(rollout), s, b(rollout)
            order.append("b")

    def s() -> None:  # a serving tenant's ordinary turn, asked for between a's rollout and b's
        while not (len(turns._queue) == 1 and turns._holder == "b"):
            time.sleep(0.001)
        with turns.turn("s"):
            order.append("s")

    def c() -> None:  # busy elsewhere (not asking): nobody waits for it
        c_may_ask.wait()
        with turns.turn("c"):
            turns.rollout("c", "c", run)
            order.append("c")

    threads = [threading.Thread(target=f) for f in (a, b, s, c)]
    for t in threads:
        t.start()
    for t in threads[:3]:
        t.join()
    assert runs == [["a", "b"]]  # b's rollout, behind s, taken along; c was not ready: not waited for
    assert order == ["a", "s", "b"]  # s kept its place before b's continuation
    c_may_ask.set()
    threads[3].join()
    assert runs == [["a", "b"], ["c"]] and order[-1] == "c"


def test_a_failed_rollout_run_reaches_every_tenant_it_took_and_the_turns_go_on() -> None:
    turns = RoundRobin()
    got: dict[str, object] = {}
    gate = threading.Event()

    def run(requests: list) -> list:
        time.sleep(0.3)
        raise MemoryError("out of memory in the shared pass")

    def tenant(name: str) -> None:
        with turns.turn(name):
            gate.wait()
            got[name] = turns.rollout(name, name, run)

    _run_in_line(turns, gate, tenant, "ab")
    assert all(isinstance(got[n], MemoryError) for n in "ab")
    # The run's time is split between the two: each one's turn counts at least its half.
    assert turns._last_s["a"] >= 0.15 and turns._last_s["b"] >= 0.15
    with turns.turn("a"):
        pass  # the model is free again
    with pytest.raises(RuntimeError, match="inside the caller's own turn"):
        turns.rollout("a", "a", lambda r: r)


def test_a_turn_may_last_as_long_as_the_longest_last_turn_of_the_others() -> None:
    turns = RoundRobin()
    assert turns.slice_for("serve") == 0.0  # alone: nothing to be fair to
    with turns.turn("train"):
        time.sleep(0.05)
    with turns.turn("serve"):
        pass
    assert turns.slice_for("serve") >= 0.05
    with turns.turn("serve-2"):
        time.sleep(0.5)
    assert turns.slice_for("serve-2") >= 0.05
    assert turns.slice_for("serve") < 0.5  # another sliced tenant's turns do not lengthen it
    turns.forget("train")  # it left: its turns set no slice any more
    assert turns.slice_for("serve") == 0.0


def test_shareable_is_lora_grpo_on_text_with_one_rank(tiny_model_dir: Path) -> None:
    one = _assign("t", tiny_model_dir, HP)
    assert shareable(one) == (str(tiny_model_dir), (), "auto")
    one.device_indices.extend([0])
    assert shareable(one) == (str(tiny_model_dir), (0,), "auto")
    two = _assign("t", tiny_model_dir, HP)
    two.device_indices.extend([0, 1])
    assert shareable(two) is None  # two ranks
    full = _assign("t", tiny_model_dir, HP)
    full.spec.workload_type = "full_rl"
    assert shareable(full) is None
    init_full = _assign("t", tiny_model_dir, HP)
    init_full.init_checkpoint.format = "hf_full"
    assert shareable(init_full) is None
    assert adapter_name("task.1", 2) == "ttask_1-a2"


def test_shareable_inference_serves_the_base_models_adapters_on_one_device(tiny_model_dir: Path) -> None:
    serve = _assign("s", tiny_model_dir, {})
    serve.spec.workload_type = "inference"
    serve.device_indices.extend([0])
    assert shareable(serve) == (str(tiny_model_dir), (0,), "auto")
    for hp in ({"policies_only": True}, {"checkpoint_task_id": "full-1"}):
        own = _assign("s", tiny_model_dir, hp)
        own.spec.workload_type = "inference"
        assert shareable(own) is None  # no language model, or another task's full weights
    two = _assign("s", tiny_model_dir, {})
    two.spec.workload_type = "inference"
    two.device_indices.extend([0, 1])
    assert shareable(two) is None


def _generate(runtime, adapter: str | None, prompt: str = "2 + 3 =") -> list[int]:
    """Greedy tokens of one request on ``runtime`` (its own event loop)."""
    from opentinker_trainer.inference.engine import SamplingParams

    async def go() -> list[int]:
        req = runtime.prepare(
            model="", adapter=adapter or "", text=prompt, messages=None, params=SamplingParams(0.0, max_tokens=6)
        )
        got: list[int] = []
        async for ev in runtime.run(req):
            got += ev.token_ids
        await runtime.stop_engine()
        return got

    return asyncio.run(go())


@pytest.mark.parametrize("trainers", [1, 2], ids=["one-trainer", "two-trainers-batched"])
def test_a_serving_tenant_shares_the_host_model_in_turns_and_leaves_training_as_alone(
    tiny_model_dir: Path, tmp_path: Path, reply_rewards, trainers: int
) -> None:
    """A serving tenant's runtime on the host's base model (no second load): its answers are a
    model of its own's, every model-thread call runs in its turn (between the training tenant's
    steps) in eval mode, its adapters carry its own names (one named like the training tenant's adapter does
    not touch it) and leave the model with it; the training tenant's curve is the one it has alone.
    With a second training tenant their rollouts run batched between the serving turns, and all
    of that still holds."""
    from opentinker_trainer.host import Tenant
    from opentinker_trainer.inference.runtime import ModelRuntime, SharedModel

    from tests.support.inference import make_adapter, tiny_runtime

    folder = make_adapter(tiny_model_dir, tmp_path / "served", seed=1)
    hp = {**HP, "checkpoint_every": 0}
    alone = worker_ctx(
        tmp_path, "alone", workload_type="lora_finetune", model=tiny_model_dir,
        env_config={"env_id": "arithmetic"}, hyperparameters=hp, task_id="x",
    )  # fmt: skip
    grpo_text.run(alone)
    expected = _curve(reports(alone, "metric"))
    second = {**hp, "seed": 12, "group_size": 3}
    expected_y = _alone(tmp_path, tiny_model_dir, "y", second) if trainers == 2 else None
    own = tiny_runtime(tiny_model_dir, {"tx-a1": folder})
    want = {name: _generate(own, name) for name in ("tx-a1", None)}
    own.close()

    out = io.StringIO()
    host = ModelHost(str(tiny_model_dir), "cpu", "auto", out)
    serving = Tenant(host, "srv", 1)
    in_turn: list[bool] = []
    with serving.turn():
        runtime = ModelRuntime(
            model_name=str(tiny_model_dir), tokenizer=host.tokenizer, model=host.base,
            stop_token_ids=[host.tokenizer.eos_token_id], resolve={"tx-a1": folder}.__getitem__,
            shared=SharedModel(host, serving.serving_prefix, serving.turn, serving.turn_slice),
        )  # fmt: skip
    decode = runtime._decode_step
    runtime._decode_step = lambda: (in_turn.append(host.turns._holder is serving and not host.base.training), decode())[
        1
    ]
    # The serving tenant makes the host's PeftModel (its first adapter), then the trainer joins.
    assert _generate(runtime, "tx-a1") == want["tx-a1"]
    assert list(host.model.peft_config) == ["ssrv-a1-tx-a1~"]
    for tid, task_hp in [("x", hp), ("y", second)][:trainers]:
        path = tmp_path / f"{tid}.pb"
        path.write_bytes(_assign(tid, tiny_model_dir, task_hp).SerializeToString())
        host.add(path, tmp_path / "host" / tid)
    answers = []
    while host.threads:  # requests keep coming while it trains: turns alternate with its steps
        answers.append((_generate(runtime, "tx-a1"), _generate(runtime, None)))
        time.sleep(0.01)
    host.join()

    assert answers and all(a == (want["tx-a1"], want[None]) for a in answers)
    assert in_turn and all(in_turn)
    got = _curve(_lines(out, "x", "metric"))
    assert [v for c in got for v in c[1:]] == pytest.approx([v for c in expected for v in c[1:]], abs=1e-6)
    ours = load_file(tmp_path / "host" / "x" / "step_4" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "alone" / "step_4" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs) and all(torch.allclose(ours[k], theirs[k], atol=1e-6) for k in ours)
    if expected_y is not None:
        assert host.turns.requests["rollout"] > host.turns.runs["rollout"]  # x's and y's rollouts ran together
        got_y = _curve(_lines(out, "y", "metric"))
        assert [v for c in got_y for v in c[1:]] == pytest.approx([v for c in expected_y[0] for v in c[1:]], abs=1e-5)
        y_adapter = load_file(tmp_path / "host" / "y" / "step_4" / "adapter_model.safetensors")
        assert all(torch.allclose(y_adapter[k], expected_y[1][k], atol=1e-5) for k in expected_y[1])
    host.model.train()  # as a training tenant's update leaves it: serving runs in eval mode, then restores it
    assert _generate(runtime, "tx-a1") == want["tx-a1"] and all(in_turn) and host.model.training
    runtime.close()
    runtime.unload_adapters()  # the serving tenant ends: its adapter leaves the host's model
    assert list(host.model.peft_config) == []


def test_a_serving_tenant_serves_a_training_tenants_live_adapter_as_of_its_last_step(
    tiny_model_dir: Path, tmp_path: Path, reply_rewards
) -> None:
    """A request naming a training tenant's task, on its host, gets that tenant's adapter copied
    between two of its steps and named by the last one (``x@<step>``): the same answers as its
    checkpoint at that step, loaded by a server of its own."""
    from opentinker_trainer.host import Tenant
    from opentinker_trainer.inference.adapters import AdapterNotFound
    from opentinker_trainer.inference.runtime import ModelRuntime, SharedModel
    from opentinker_trainer.workloads.serving import _live_copy

    from tests.support.inference import tiny_runtime

    out = io.StringIO()
    host = ModelHost(str(tiny_model_dir), "cpu", "auto", out)
    serving = Tenant(host, "srv", 1)
    with serving.turn():
        runtime = ModelRuntime(
            model_name=str(tiny_model_dir), tokenizer=host.tokenizer, model=host.base,
            stop_token_ids=[host.tokenizer.eos_token_id],
            shared=SharedModel(
                host, serving.serving_prefix, serving.turn, serving.turn_slice,
                live=lambda n: _live_copy(host, runtime, n),
            ),
        )  # fmt: skip
    path = tmp_path / "x.pb"
    path.write_bytes(_assign("x", tiny_model_dir, {**HP, "checkpoint_every": 1}).SerializeToString())
    host.add(path, tmp_path / "host" / "x")
    while host.threads and not _lines(out, "x", "metric"):
        time.sleep(0.01)  # its first step: before it, "x" names no adapter on this host
    seen: dict[str, list[int]] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    while host.threads:
        try:
            tokens = _generate(runtime, "x")
        except AdapterNotFound:  # no resolver here: only once the tenant has left the host
            assert host.live_tenant("x") is None
            break
        version = runtime.registry.list()[0].name  # the one that request used, most recently
        assert seen.setdefault(version, tokens) == tokens  # a version never changes
        marker = "." + runtime.registry.peft_name(version)
        with serving.turn():
            copy = {n.replace(marker, ""): p.detach().clone() for n, p in host.model.named_parameters() if marker in n}
        assert weights.setdefault(version, copy).keys() == copy.keys()
    host.join()
    assert seen and all(v.startswith("x@") for v in seen)
    for version, tokens in seen.items():
        step = int(version.split("@")[1])
        saved = load_file(tmp_path / "host" / "x" / f"step_{step}" / "adapter_model.safetensors")
        assert sorted(saved) == sorted(weights[version])
        assert all(torch.equal(saved[k], weights[version][k]) for k in saved), version  # the step's own adapter
        own = tiny_runtime(tiny_model_dir, {version: tmp_path / "host" / "x" / f"step_{step}"})
        assert _generate(own, version) == tokens, version
        own.close()
    first = load_file(tmp_path / "host" / "x" / "step_1" / "adapter_model.safetensors")
    last = load_file(tmp_path / "host" / "x" / f"step_{HP['steps']}" / "adapter_model.safetensors")
    assert any(not torch.equal(first[k], last[k]) for k in first)  # the adapter moved: a stale copy shows
    runtime.close()
    runtime.unload_adapters()
    assert list(host.model.peft_config) == []


def test_an_adapter_is_loaded_from_a_checkpoint_after_every_other_was_deleted(tiny_model_dir: Path, tmp_path) -> None:
    # A preempted task's next attempt lands on the same host after its first attempt's adapter,
    # the host's last one, was deleted: loading it from the checkpoint must work (PEFT keeps a
    # deleted last adapter's name active, and its load_adapter then raised KeyError).
    from types import SimpleNamespace

    import torch
    from safetensors.torch import load_file

    host = ModelHost(str(tiny_model_dir), "cpu", "auto", io.StringIO())
    cfg = SimpleNamespace(lora_rank=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    host.add_adapter("ta-a1", cfg, None, "fresh")
    host.model.save_pretrained(str(tmp_path / "ck"), selected_adapters=["ta-a1"])
    saved_dir = tmp_path / "ck" / "ta-a1"
    host.delete_adapter("ta-a1")
    assert list(host.model.peft_config) == []
    rng = torch.random.get_rng_state()
    host.add_adapter("ta-a2", cfg, saved_dir, "resume_from")
    assert torch.equal(rng, torch.random.get_rng_state()), "loading drew from the tenant's RNG stream"
    saved = load_file(str(saved_dir / "adapter_model.safetensors"))
    state = host.model.state_dict()
    assert saved and all(torch.equal(v, state[k.replace(".weight", ".ta-a2.weight")]) for k, v in saved.items())
    assert all(p.requires_grad for n, p in host.model.named_parameters() if "ta-a2" in n)


def test_the_agents_host_command_starts_a_host(tiny_model_dir: Path) -> None:
    """The node agent's host command starts a host process that says it is ready and exits when
    its stdin closes."""
    import os
    import subprocess

    from opentinker_trainer.agent import host_command

    cmd = host_command(str(tiny_model_dir), "cpu", "auto")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}:{root / 'protos'}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=root)
    first = json.loads(proc.stdout.readline())
    proc.stdin.close()
    assert first["type"] == "host_ready" and proc.wait(timeout=60) == 0
