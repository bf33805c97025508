"""The ``prompts`` text environment: prompts of a user's JSONL dataset, scored by a verifier.

Torch-free (like :mod:`opentinker_common.arithmetic`): the trainer builds it from the dataset's
lines (:func:`load_lines`), a client can score replies with the same code.

* **Split**: the usable lines are shuffled with ``seed``; the first ``eval_fraction`` of them
  (at least one when there are two or more and the fraction is > 0) are held out for evaluation,
  the rest are the training prompts.
* **Order**: training prompts are drawn epoch by epoch, each epoch a fresh permutation from the
  environment's RNG (seeded with ``seed``); :meth:`PromptsEnv.get_state` /
  :meth:`PromptsEnv.set_state` carry the RNG and the position across a resume.
* **Skipped lines**: a line whose expected value the verifier cannot use (the ``reward.field``
  is missing, or not e.g. a number for ``numeric``) is left out of both splits and counted in
  :attr:`PromptsEnv.skipped` (reported as ``data/skipped_lines``); their numbers are in
  :attr:`PromptsEnv.skipped_lines`.
* **Prompts** are rendered with the tokenizer's chat template (``messages`` as given, or the
  ``prompt`` text as one user message after ``system_prompt``); a tokenizer without a template
  gets ``Question: ...\\nAnswer:``.
* **Reward**: :meth:`PromptsEnv.score_batch` — the built-in verifier with its shaping terms
  (:func:`opentinker_common.verifiers.make_reward`), or the ``scorer`` given (the client's own
  function, called by the trainer): ``(prompts, completions, metadata) -> list[float | None]``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from opentinker_common.spec.prompts import PromptLine, PromptsEnvConfig, expected_value, parse_prompt_line
from opentinker_common.verifiers import Term, make_reward

__all__ = ["PromptProblem", "PromptsEnv", "Scorer", "load_lines"]

#: A batched reward: ``(prompts, completions, metadata) -> one reward (or None: missing) each``.
Scorer = Callable[[Sequence[str], Sequence[str], Sequence[dict]], list]


@dataclass(frozen=True)
class PromptProblem:
    """One prompt of the dataset: its line, and the expected value the verifier compares with."""

    line: PromptLine
    expected: Any

    @property
    def question(self) -> str:
        return self.line.text()


def load_lines(raw_lines: Iterable[str | bytes]) -> list[PromptLine]:
    """Every prompt line of a JSONL dataset (blank lines skipped), checked by
    :func:`~opentinker_common.spec.prompts.parse_prompt_line`.

    Raises:
        DatasetError: the first malformed line (its number), or ``line 0`` for no prompt at all.
    """
    from opentinker_common.spec.sft import DatasetError

    out = []
    for lineno, raw in enumerate(raw_lines, start=1):
        if isinstance(raw, bytes):
            raw = raw.rstrip(b"\r\n")
        line = parse_prompt_line(raw, lineno)
        if line is not None:
            out.append(line)
    if not out:
        raise DatasetError(0, "at least one prompt (one JSON object per line); the dataset is empty")
    return out


class PromptsEnv:
    """Prompt source and scorer for ``env_id: prompts`` (module docstring).

    Args:
        config: the validated env config.
        lines: the dataset's parsed lines (:func:`load_lines`).
        tokenizer: a transformers tokenizer (renders prompts); None when only scoring.
        scorer: the batched reward for ``reward.verifier: client``; None = the built-in verifier.

    Raises:
        ValueError: no line is usable by the verifier (every one was skipped).
    """

    def __init__(
        self,
        config: PromptsEnvConfig,
        lines: Sequence[PromptLine],
        tokenizer: Any = None,
        *,
        scorer: Scorer | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        reward = config.reward
        usable: list[PromptProblem] = []
        self.skipped_lines: list[int] = []
        for line in lines:
            value, why = expected_value(reward, line)
            if why is not None:
                self.skipped_lines.append(line.lineno)
                continue
            usable.append(PromptProblem(line, value))
        if not usable:
            raise ValueError(
                f"no prompt the reward can score: all {len(self.skipped_lines)} lines lack a usable "
                f'"{reward.field}" (reward.field) for verifier {reward.verifier}'
            )
        order = list(range(len(usable)))
        random.Random(config.seed).shuffle(order)
        n_eval = 0
        if config.eval_fraction > 0 and len(usable) >= 2:
            n_eval = min(len(usable) - 1, max(1, round(len(usable) * config.eval_fraction)))
        self.eval_problems = [usable[i] for i in order[:n_eval]][: config.max_eval_prompts]
        self.train_problems = [usable[i] for i in order[n_eval:]]
        self.scorer = scorer
        self._verify = (
            None
            if reward.is_client
            else make_reward(
                reward.verifier,
                reward.options,
                weight=reward.weight,
                terms=[Term(t.kind, t.weight, t.options()) for t in reward.terms],
            )
        )
        self._plain_verify = None if reward.is_client else make_reward(reward.verifier, reward.options)
        self.rng = random.Random(config.seed)
        self._perm: list[int] = []
        self._pos = 0

    @property
    def skipped(self) -> int:
        return len(self.skipped_lines)

    # --- problems -----------------------------------------------------------------------------
    def sample(self, n: int) -> list[PromptProblem]:
        """The next ``n`` training prompts (epoch by epoch, each a fresh permutation)."""
        out = []
        for _ in range(n):
            if self._pos >= len(self._perm):
                self._perm = list(range(len(self.train_problems)))
                self.rng.shuffle(self._perm)
                self._pos = 0
            out.append(self.train_problems[self._perm[self._pos]])
            self._pos += 1
        return out

    # --- prompts ------------------------------------------------------------------------------
    def messages(self, problem: PromptProblem) -> list[dict[str, str]]:
        line = problem.line
        if line.messages is not None:
            return [dict(m) for m in line.messages]
        msgs = []
        if self.config.system_prompt:
            msgs.append({"role": "system", "content": self.config.system_prompt})
        msgs.append({"role": "user", "content": line.prompt})
        return msgs

    def render(self, problem: PromptProblem) -> str:
        """The prompt text for ``problem``, ready for the model to continue."""
        tok = self.tokenizer
        msgs = self.messages(problem)
        if tok is not None and getattr(tok, "chat_template", None):
            return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        text = "\n\n".join(m["content"] for m in msgs[:-1])
        return f"{text + chr(10) * 2 if text else ''}Question: {msgs[-1]['content']}\nAnswer:"

    def encode(self, problem: PromptProblem) -> list[int]:
        """Token ids of :meth:`render` (no extra special tokens: the template has them)."""
        return list(self.tokenizer(self.render(problem), add_special_tokens=False)["input_ids"])

    def too_long(self, max_prompt_tokens: int) -> list[tuple[int, int]]:
        """``(line number, tokens)`` of every prompt (both splits) longer than ``max_prompt_tokens``."""
        out = []
        for p in (*self.train_problems, *self.eval_problems):
            n = len(self.encode(p))
            if n > max_prompt_tokens:
                out.append((p.line.lineno, n))
        return sorted(out)

    # --- rewards --------------------------------------------------------------------------------
    def score(self, reply: str | None, problem: PromptProblem) -> float:
        """The built-in reward of one reply (verifier and shaping terms)."""
        assert self._verify is not None, "a client reward scores through score_batch"
        return self._verify(reply, problem.expected)

    def correct(self, reply: str | None, problem: PromptProblem) -> bool:
        """Whether the verifier alone (no shaping terms) gives the reply full marks."""
        assert self._plain_verify is not None
        return self._plain_verify(reply, problem.expected) >= 1.0

    def score_batch(self, replies: Sequence[str], problems: Sequence[PromptProblem]) -> list[float | None]:
        """One reward per reply (``problems[i]`` is the prompt of ``replies[i]``); None = missing."""
        if self.scorer is None:
            return [self.score(r, p) for r, p in zip(replies, problems)]
        return self.scorer([p.question for p in problems], list(replies), [dict(p.line.metadata) for p in problems])

    # --- resume ---------------------------------------------------------------------------------
    def get_state(self) -> Any:
        return {"rng": self.rng.getstate(), "perm": list(self._perm), "pos": self._pos}

    def set_state(self, state: Any) -> None:
        from opentinker_common.arithmetic import _as_tuple

        if not state:
            return
        self.rng.setstate(_as_tuple(state["rng"]))
        self._perm = [int(i) for i in state["perm"]]
        self._pos = int(state["pos"])
