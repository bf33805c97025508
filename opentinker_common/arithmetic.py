"""The built-in ``arithmetic`` text environment: "What is a + b?".

A seeded :class:`random.Random` draws problems; each operand first draws its number of digits
uniformly from ``min_digits..max_digits`` and then a value uniformly among the numbers with that
many digits (1 digit means 0..9, d > 1 digits means 10**(d-1)..10**d - 1). The prompt is the
tokenizer's chat template with the generation prompt added; a tokenizer without a chat template
(a base model) gets a plain ``Question: ...\\nAnswer:`` prompt instead.

Reward (:func:`reward`): 1.0 when the LAST number in the reply is an integer equal to the sum,
else 0.0. Parsing rules, chosen to judge the answer a person would read:

* ``-7`` and ``−7`` (Unicode minus) are negative; a minus sign right after a digit is an operator,
  so in ``"9-2"`` the last number is ``2``.
* Thousands separators are accepted when they group by exactly three digits: ``"1,234"`` is
  1234, ``"1,234,567"`` is 1234567; any other comma separates numbers (``"3,4"`` ends with 4).
* A decimal is a number: ``"7.0"`` counts as 7 (integral), ``"7.5"`` is not an integer, so it
  scores 0 even though it contains the digit group 5. A trailing full stop (``"7."``) is
  punctuation.
* No number at all (or no reply) scores 0.0. Digits are ASCII ``0-9`` only.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a type only: the verifiers (which the spec imports) read numbers with last_number
    from opentinker_common.spec import ArithmeticEnvConfig

__all__ = ["ArithmeticEnv", "Problem", "last_number", "reward"]

DEFAULT_INSTRUCTION = "What is {a} + {b}? Answer with just the number."

_NUMBER = re.compile(
    r"(?<![0-9])(?<![0-9]\.)"  # not inside a number, nor the fraction of one
    r"(?P<sign>(?<![0-9])[-\u2212])?"  # a minus right after a digit is an operator
    r"(?P<int>[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)"
    r"(?P<frac>\.[0-9]+)?"
)


@dataclass(frozen=True)
class Problem:
    """One problem: its operands, its answer and the question as asked."""

    a: int
    b: int
    question: str

    @property
    def answer(self) -> int:
        return self.a + self.b


def last_number(text: str | None) -> Decimal | None:
    """The last number in ``text`` by the rules in the module docstring, or None."""
    if not text:
        return None
    match = None
    for match in _NUMBER.finditer(text):
        pass
    if match is None:
        return None
    sign = "-" if match.group("sign") else ""
    return Decimal(sign + match.group("int").replace(",", "") + (match.group("frac") or ""))


def reward(reply: str | None, problem: Problem | int) -> float:
    """1.0 when the last number in ``reply`` is an integer equal to the answer, else 0.0."""
    answer = problem.answer if isinstance(problem, Problem) else int(problem)
    value = last_number(reply)
    if value is None or value != value.to_integral_value():
        return 0.0
    return 1.0 if int(value) == answer else 0.0


class ArithmeticEnv:
    """Problem source and scorer for ``env_id: arithmetic``.

    Args:
        config: the validated env config (digits, seed, optional system prompt).
        tokenizer: a transformers tokenizer; its chat template renders prompts.
        seed: used when ``config.seed`` is None (the task's hyper-parameter seed).
    """

    def __init__(self, config: ArithmeticEnvConfig, tokenizer: Any = None, seed: int = 0) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.rng = random.Random(config.seed if config.seed is not None else seed)

    # --- problems -----------------------------------------------------------------------------
    def _operand(self) -> int:
        digits = self.rng.randint(self.config.min_digits, self.config.max_digits)
        lo = 0 if digits == 1 else 10 ** (digits - 1)
        return self.rng.randint(lo, 10**digits - 1)

    def sample(self, n: int) -> list[Problem]:
        """Draw ``n`` problems from the environment's RNG."""
        problems = []
        for _ in range(n):
            a, b = self._operand(), self._operand()
            problems.append(Problem(a, b, DEFAULT_INSTRUCTION.format(a=a, b=b)))
        return problems

    # --- prompts ------------------------------------------------------------------------------
    def render(self, problem: Problem) -> str:
        """The prompt text for ``problem``, ready for the model to continue."""
        tok = self.tokenizer
        if tok is not None and getattr(tok, "chat_template", None):
            messages = []
            if self.config.system_prompt:
                messages.append({"role": "system", "content": self.config.system_prompt})
            messages.append({"role": "user", "content": problem.question})
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        system = f"{self.config.system_prompt}\n\n" if self.config.system_prompt else ""
        return f"{system}Question: {problem.question}\nAnswer:"

    def encode(self, problem: Problem) -> list[int]:
        """Token ids of :meth:`render` (no extra special tokens: the template has them)."""
        return list(self.tokenizer(self.render(problem), add_special_tokens=False)["input_ids"])

    def score(self, reply: str | None, problem: Problem) -> float:
        return reward(reply, problem)

    def score_batch(self, replies: list[str], problems: list[Problem]) -> list[float]:
        """:meth:`score` of each reply (``problems[i]`` is the problem of ``replies[i]``)."""
        return [self.score(r, p) for r, p in zip(replies, problems)]

    # --- resume ---------------------------------------------------------------------------------
    def get_state(self) -> Any:
        return self.rng.getstate()

    def set_state(self, state: Any) -> None:
        self.rng.setstate(_as_tuple(state))


def _as_tuple(value: Any) -> Any:
    """``random.setstate`` wants tuples; a state round-tripped through a file may hold lists."""
    if isinstance(value, list):
        return tuple(_as_tuple(v) for v in value)
    if isinstance(value, tuple):
        return tuple(_as_tuple(v) for v in value)
    return value
