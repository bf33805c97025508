"""InferenceClient and evaluate(): local validation, typed errors, the evaluation arithmetic.
(The client against a real server: tests/trainer/test_inference_*.py and tests/integration.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from opentinker_client import InferenceClient, InvalidArgumentError, UnavailableError, evaluate
from opentinker_client.inference import Generation, Sample


class _Answers:
    """Stands in for an InferenceClient: answers each arithmetic question right or with 0."""

    adapter = "task-x"

    def __init__(self, right: bool) -> None:
        self.right = right
        self.calls: list[dict] = []

    def generate(self, *, messages, **kw) -> Generation:
        self.calls.append({"messages": messages, **kw})
        q = messages[-1]["content"]  # "What is a + b? Answer with just the number."
        a, b = q.split("What is ")[1].split("?")[0].split(" + ")
        text = f"The answer is {int(a) + int(b)}." if self.right else "0"
        return Generation((Sample(0, text, (), (), "stop"),), 1, 1, "m", kw.get("adapter", self.adapter))


def test_evaluate_scores_with_the_environment_reward_and_same_problems_each_time() -> None:
    good, bad = _Answers(True), _Answers(False)
    r = evaluate(good, episodes=10)
    assert r.mean_reward == 1.0 and r.stderr == 0.0 and r.episodes == 10 and r.adapter == "task-x"
    r0 = evaluate(bad, episodes=10, adapter=None)
    assert r0.adapter is None and r0.mean_reward == pytest.approx(sum(p.startswith("What is 0 + 0") for p in r0.prompts) / 10)
    assert r.prompts == r0.prompts  # the same problems for every model
    assert good.calls[0]["temperature"] == 0.0 and "adapter" not in good.calls[0]
    assert bad.calls[0]["adapter"] is None
    sys_prompt = evaluate(good, env={"env_id": "arithmetic", "system_prompt": "Be brief.", "max_digits": 2}, episodes=2)
    assert sys_prompt.mean_reward == 1.0 and good.calls[-1]["messages"][0] == {"role": "system", "content": "Be brief."}


def test_evaluate_refuses_bad_arguments_with_the_field() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        evaluate(_Answers(True), episodes=0)
    assert err.value.field == "episodes"
    with pytest.raises(InvalidArgumentError) as err:
        evaluate(_Answers(True), env="CartPole-v1")
    assert err.value.field == "env.env_id"
    with pytest.raises(InvalidArgumentError, match=r"env.max_digits"):
        evaluate(_Answers(True), env={"env_id": "arithmetic", "max_digits": 99})


def test_inference_client_checks_its_arguments_before_calling() -> None:
    with pytest.raises(InvalidArgumentError, match="endpoint"):
        InferenceClient()
    client = InferenceClient("127.0.0.1:1", timeout=2)
    with pytest.raises(InvalidArgumentError, match="exactly one of prompt"):
        client.generate()
    with pytest.raises(InvalidArgumentError, match="exactly one of prompt"):
        client.generate("x", messages=[{"role": "user", "content": "y"}])
    with pytest.raises(InvalidArgumentError, match=r"messages\[0\]"):
        client.generate(messages=["not a mapping"])
    with pytest.raises(UnavailableError):
        client.generate("hello", max_tokens=1)
    with pytest.raises(UnavailableError):
        list(client.generate_stream("hello", max_tokens=1))
    assert client.with_adapter("task-y").adapter == "task-y"
    client.close()


def test_the_inference_client_and_evaluate_pull_in_no_torch() -> None:
    code = (
        "import sys, opentinker_client.inference\n"
        "from opentinker_client.evaluate import evaluate\n"
        "from opentinker_client.inference import Generation, Sample\n"
        "class C:\n"
        "    adapter = None\n"
        "    def generate(self, **kw): return Generation((Sample(0, '1', (), (), 'stop'),), 1, 1, 'm', None)\n"
        "evaluate(C(), episodes=2)\n"
        "assert 'torch' not in sys.modules, 'torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
