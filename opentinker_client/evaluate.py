"""Evaluate a served model on a text environment: the mean reward over ``episodes`` problems.

Before and after training, in one command (``opentinker eval TASK_ID`` does the same)::

    llm = client.serve(task_id)
    before = evaluate(llm, adapter=None, episodes=64)   # the base model
    after = evaluate(llm, episodes=64)                   # the trained adapter
    print(before.mean_reward, "->", after.mean_reward)

Each episode is one problem of the environment (drawn from its own seeded RNG, so every model
sees the same problems), asked as the chat turn the trainer renders, answered with greedy
decoding by default, and scored with the environment's reward function. Calls go through the
given client, so its API key and TLS settings apply (``RLClient.serve`` passes the RLClient's on).
Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from opentinker_client.errors import InvalidArgumentError, from_spec_error
from opentinker_common.spec import SpecError, validate_env_config

__all__ = ["EvalResult", "evaluate"]

_DEFAULT = object()


#: Most episodes one evaluate() call runs (each is one generation request).
MAX_EPISODES = 10_000


@dataclass(frozen=True)
class EvalResult:
    """Rewards of one evaluation.

    Attributes:
        mean_reward: mean over episodes (the arithmetic task: the fraction answered right).
        stderr: standard error of that mean.
        rewards, prompts, replies: per episode.
        adapter: the adapter evaluated (None: the base model).
    """

    env_id: str
    episodes: int
    mean_reward: float
    stderr: float
    adapter: str | None
    rewards: tuple[float, ...]
    prompts: tuple[str, ...]
    replies: tuple[str, ...]


def evaluate(
    client: Any,
    *,
    env: str | Mapping[str, Any] = "arithmetic",
    episodes: int = 32,
    adapter: Any = _DEFAULT,
    seed: int = 1234,
    temperature: float = 0.0,
    max_tokens: int = 16,
) -> EvalResult:
    """Run ``episodes`` episodes of ``env`` against ``client`` (an
    :class:`~opentinker_client.inference.InferenceClient`).

    Args:
        env: an ``env_id`` or an env config mapping (``Environment(...).to_dict()``); text
            environments only (``arithmetic``).
        adapter: adapter to evaluate; ``None`` is the base model; omitted: the client's default.
        seed: seeds the problem draw when the env config has no seed of its own.
        temperature: 0 (default) is greedy decoding.

    Raises:
        InvalidArgumentError: unknown or non-text environment, episodes outside [1, MAX_EPISODES].
        OpenTinkerError subclasses: from the server (see ``InferenceClient.generate``), e.g.
            UnauthenticatedError / PermissionDeniedError when the client's API key may not use
            the server, NotFoundError for an adapter of a task the key cannot see.
    """
    from opentinker_common.arithmetic import ArithmeticEnv, reward  # torch-free: problems and reward only

    if isinstance(episodes, bool) or not isinstance(episodes, int) or not 1 <= episodes <= MAX_EPISODES:
        raise InvalidArgumentError(
            f"episodes: expected an integer in [1, {MAX_EPISODES}], got {episodes!r}", field="episodes"
        )
    data = {"env_id": env} if isinstance(env, str) else dict(env)
    try:
        config = validate_env_config(data, path="env")
    except SpecError as err:
        raise from_spec_error(err) from None
    if config.env_id != "arithmetic":
        raise InvalidArgumentError(
            f"env.env_id: expected a text environment this helper can score (arithmetic), got {config.env_id!r}",
            field="env.env_id",
        )
    problems = ArithmeticEnv(config, tokenizer=None, seed=seed).sample(episodes)
    kwargs = {} if adapter is _DEFAULT else {"adapter": adapter}
    rewards, prompts, replies = [], [], []
    for problem in problems:
        messages = ([{"role": "system", "content": config.system_prompt}] if config.system_prompt else []) + [
            {"role": "user", "content": problem.question}
        ]
        out = client.generate(messages=messages, temperature=temperature, max_tokens=max_tokens, seed=seed, **kwargs)
        prompts.append(problem.question)
        replies.append(out.text)
        rewards.append(reward(out.text, problem))
    mean = sum(rewards) / len(rewards)
    var = sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1) if len(rewards) > 1 else 0.0
    used = client.adapter if adapter is _DEFAULT else adapter
    return EvalResult(
        config.env_id,
        episodes,
        mean,
        math.sqrt(var / len(rewards)),
        used,
        tuple(rewards),
        tuple(prompts),
        tuple(replies),
    )
