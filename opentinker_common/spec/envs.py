"""Built-in text environments for language models (env kind ``text``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from opentinker_common.spec._parse import SpecError, num
from opentinker_common.spec.registry import register_env

__all__ = ["ArithmeticEnvConfig", "TEXT_ENVIRONMENTS"]


@dataclass(frozen=True)
class ArithmeticEnvConfig:
    """The built-in ``arithmetic`` text task: "What is a + b?"; reward 1.0 when the last integer
    in the reply equals the sum, else 0.0. Operands have between ``min_digits`` and ``max_digits``
    decimal digits (1 digit means 0..9)."""

    env_id: str = "arithmetic"
    min_digits: int = num(1, 1, 9)
    max_digits: int = num(1, 1, 9)
    # The seed's Environment(action_space=..., observation_space=...) declares sizes; a text
    # environment takes free text in and out, so they are recorded but not used.
    action_space: int | None = num(None, 1, 1_000_000)
    observation_space: int | None = num(None, 1, 1_000_000)
    seed: int | None = num(None, 0, 2**31 - 1)
    system_prompt: str | None = field(default=None, metadata={"multiline": True})

    def check(self, path: str) -> None:
        if self.min_digits > self.max_digits:
            raise SpecError(f"{path}.max_digits", f"an integer >= min_digits ({self.min_digits})", self.max_digits)


register_env("arithmetic", ArithmeticEnvConfig, kind="text", description='"What is a + b?", reward 1 for the right sum')

#: Built-in text environments for language models.
TEXT_ENVIRONMENTS: tuple[str, ...] = ("arithmetic", "prompts")
