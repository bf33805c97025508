"""Task specs as typed, validated values — the contract shared by client, scheduler and trainer.

Torch-free on purpose: the scheduler validates a spec at submit and the client can validate it
before sending, with the same code. Every refusal is a :class:`SpecError` that names the field
path (``spec.hyperparameters.learning_rate``) and what was expected; the scheduler maps it to
gRPC ``INVALID_ARGUMENT``.

Layout: :mod:`._parse` (strict dict -> dataclass), :mod:`.registry` (environments and workloads
plug in here), one module per family of configs (:mod:`.envs`, :mod:`.grpo`, ...), and
:mod:`.task` (the whole spec). A new workload or environment adds a module that registers itself
and one import line below.
"""

from __future__ import annotations

from opentinker_common.spec._parse import (
    SpecError,
    check_text,
    control_character_problem,
    did_you_mean,
    is_control_character,
    jsonable,
    plain,
    num,
    parse_dataclass,
    short_repr,
)
from opentinker_common.spec.registry import WORKLOAD_TYPES, implemented_workloads

# Config families: each module registers its environments and workloads on import.
from opentinker_common.spec.envs import TEXT_ENVIRONMENTS, ArithmeticEnvConfig
from opentinker_common.spec.grpo import GRPOConfig
from opentinker_common.spec.gym import GymEnvConfig
from opentinker_common.spec.ppo import PPOConfig
from opentinker_common.spec.multiagent import MULTIAGENT_ENVIRONMENTS, MultiAgentEnvConfig, MultiAgentPPOConfig
from opentinker_common.spec.client_env import ClientEnvConfig
from opentinker_common.spec.lm_game import LMGameGRPOConfig
from opentinker_common.spec.grpo import FullGRPOConfig
from opentinker_common.spec.sft import ChatDatasetConfig, DatasetError, SFTConfig
from opentinker_common.spec.inference import InferenceConfig
from opentinker_common.spec.session import LoraSessionConfig
from opentinker_common.spec.prompts import PromptsEnvConfig, RewardConfig

from opentinker_common.spec.task import (
    TaskSpecModel,
    env_kind,
    spec_from_proto,
    task_uses_model,
    validate_env_config,
    validate_hyperparameters,
)

__all__ = [
    "SpecError",
    "short_repr",
    "WORKLOAD_TYPES",
    "TEXT_ENVIRONMENTS",
    "ArithmeticEnvConfig",
    "PromptsEnvConfig",
    "RewardConfig",
    "GRPOConfig",
    "GymEnvConfig",
    "InferenceConfig",
    "LoraSessionConfig",
    "PPOConfig",
    "MULTIAGENT_ENVIRONMENTS",
    "MultiAgentEnvConfig",
    "MultiAgentPPOConfig",
    "ClientEnvConfig",
    "LMGameGRPOConfig",
    "FullGRPOConfig",
    "ChatDatasetConfig",
    "DatasetError",
    "SFTConfig",
    "TaskSpecModel",
    "check_text",
    "control_character_problem",
    "did_you_mean",
    "env_kind",
    "is_control_character",
    "implemented_workloads",
    "jsonable",
    "plain",
    "num",
    "parse_dataclass",
    "spec_from_proto",
    "task_uses_model",
    "validate_env_config",
    "validate_hyperparameters",
]
