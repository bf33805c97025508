"""The built-in arithmetic environment: problems, prompts, reward parsing."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from opentinker_common.spec import ArithmeticEnvConfig
from opentinker_common.arithmetic import ArithmeticEnv, Problem, last_number, reward


@pytest.fixture(scope="module")
def tokenizer(real_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


P = Problem(3, 4, "What is 3 + 4?")


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("7", 1.0),
        ("The answer is 7.", 1.0),
        ("3 + 4 = 7", 1.0),
        ("7\n\nbecause 3 plus 4 is seven", 0.0),  # the LAST number is 4
        ("It is 7, not 8", 0.0),
        ("8", 0.0),
        ("17", 0.0),
        ("7.0", 1.0),
        ("7.5", 0.0),  # not an integer, even though it contains 5 and 7
        ("0.7", 0.0),
        ("", 0.0),
        (None, 0.0),
        ("seven", 0.0),
        ("3 + 4 =", 0.0),  # the last number is 4
        ("**7**", 1.0),
        ("x=7;", 1.0),
    ],
)
def test_reward_uses_the_last_number(reply, expected):
    assert reward(reply, P) == expected


@pytest.mark.parametrize(
    "text, value",
    [
        ("-5", Decimal(-5)),
        ("\u22125", Decimal(-5)),  # Unicode minus
        ("9-2", Decimal(2)),  # a minus after a digit is an operator
        ("x = -12", Decimal(-12)),
        ("1,234", Decimal(1234)),
        ("total: 1,234,567 apples", Decimal(1234567)),
        ("3,4", Decimal(4)),  # not a thousands group: two numbers
        ("12,34", Decimal(34)),
        ("1,234.5", Decimal("1234.5")),
        ("no digits", None),
    ],
)
def test_last_number_parsing(text, value):
    assert last_number(text) == value


def test_reward_handles_negatives_and_thousands():
    assert reward("The sum is -3", Problem(-5, 2, "")) == 1.0
    assert reward("1,234", Problem(1000, 234, "")) == 1.0
    assert reward("1234", Problem(1000, 234, "")) == 1.0
    assert reward("1,23,4", Problem(1000, 234, "")) == 0.0


@given(st.integers(0, 10**9), st.integers(0, 10**9), st.sampled_from(["{}", "The answer is {}.", "a + b = {}", "{:,}"]))
def test_reward_of_a_correct_answer_in_any_format(a, b, template):
    assert reward(template.format(a + b), Problem(a, b, "")) == 1.0
    assert reward(template.format(a + b + 1), Problem(a, b, "")) == 0.0


def test_problems_are_seeded_and_respect_digit_bounds():
    config = ArithmeticEnvConfig(min_digits=2, max_digits=3, seed=7)
    a = ArithmeticEnv(config).sample(200)
    b = ArithmeticEnv(config).sample(200)
    assert a == b
    assert ArithmeticEnv(ArithmeticEnvConfig(min_digits=2, max_digits=3, seed=8)).sample(200) != a
    operands = [x for p in a for x in (p.a, p.b)]
    assert all(10 <= x <= 999 for x in operands)
    assert any(x < 100 for x in operands) and any(x >= 100 for x in operands)
    one_digit = ArithmeticEnv(ArithmeticEnvConfig(), seed=3).sample(300)
    assert {x for p in one_digit for x in (p.a, p.b)} == set(range(10))
    assert all(p.answer == p.a + p.b and f"{p.a} + {p.b}" in p.question for p in a)


def test_env_seed_falls_back_to_the_task_seed_and_state_round_trips():
    env = ArithmeticEnv(ArithmeticEnvConfig(max_digits=4), seed=5)
    assert env.sample(5) == ArithmeticEnv(ArithmeticEnvConfig(max_digits=4), seed=5).sample(5)
    state = env.get_state()
    after = env.sample(5)
    other = ArithmeticEnv(ArithmeticEnvConfig(max_digits=4), seed=99)
    other.set_state([list(x) if isinstance(x, tuple) else x for x in state])  # as a file may give it back
    assert other.sample(5) == after


def test_prompt_uses_the_chat_template(tokenizer):
    env = ArithmeticEnv(ArithmeticEnvConfig(seed=1), tokenizer)
    problem = env.sample(1)[0]
    text = env.render(problem)
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": problem.question}], tokenize=False, add_generation_prompt=True
    )
    assert text == expected
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert f"What is {problem.a} + {problem.b}?" in text
    ids = env.encode(problem)
    assert tokenizer.decode(ids) == text  # no extra special tokens added


def test_system_prompt_and_plain_fallback(tokenizer):
    env = ArithmeticEnv(ArithmeticEnvConfig(seed=1, system_prompt="You add numbers."), tokenizer)
    text = env.render(env.sample(1)[0])
    assert text.startswith("<|im_start|>system\nYou add numbers.<|im_end|>")
    assert "SmolLM" not in text
    plain = ArithmeticEnv(ArithmeticEnvConfig(seed=1), tokenizer=None)
    p = plain.sample(1)[0]
    assert plain.render(p) == f"Question: {p.question}\nAnswer:"
