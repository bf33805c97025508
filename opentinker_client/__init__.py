"""OpenTinker client: submit reinforcement-learning tasks to an OpenTinker scheduler and follow them.

::

    from opentinker_client import RLClient, Environment

    env = Environment(action_space=4, observation_space=100)
    with RLClient(scheduler_url="http://scheduler-host:8888") as client:
        task_id = client.submit_task(env_config=env.to_dict(), workload_type="lora_finetune", gpu_count=1)
        for event in client.watch(task_id):
            print(event)

Torch-free: installing and importing the client does not pull in torch.
"""

from opentinker_client.client import RLClient
from opentinker_client.config import TaskConfig, load_task_config, parse_task_config
from opentinker_client.convert import DeviceInfo, DeviceTelemetry, NodeInfo, TaskEvent, TaskInfo
from opentinker_client.environment import Environment
from opentinker_client.env_server import EnvironmentServer
from opentinker_client.evaluate import EvalResult, evaluate
from opentinker_client.inference import CheckpointInfo, Generation, InferenceClient, StreamChunk
from opentinker_client.errors import (
    AlreadyExistsError,
    ConfigError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    OpenTinkerError,
    PermissionDeniedError,
    ResourceExhaustedError,
    TaskFailedError,
    UnauthenticatedError,
    UnavailableError,
)
from opentinker_client.url import parse_scheduler_url
from opentinker_client.keys import ApiKeyInfo, KeyAdmin

__all__ = [
    "RLClient",
    "Environment",
    "EnvironmentServer",
    "TaskConfig",
    "load_task_config",
    "parse_task_config",
    "TaskInfo",
    "TaskEvent",
    "NodeInfo",
    "DeviceInfo",
    "DeviceTelemetry",
    "parse_scheduler_url",
    "OpenTinkerError",
    "InvalidArgumentError",
    "ConfigError",
    "NotFoundError",
    "FailedPreconditionError",
    "AlreadyExistsError",
    "UnauthenticatedError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnavailableError",
    "DeadlineExceededError",
    "TaskFailedError",
    "InferenceClient",
    "Generation",
    "StreamChunk",
    "CheckpointInfo",
    "EvalResult",
    "evaluate",
    "KeyAdmin",
    "ApiKeyInfo",
]
