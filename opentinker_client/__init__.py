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

import os as _os
import sys as _sys


def _is_the_cli() -> bool:
    """This process is the ``opentinker`` command (its console script or ``python -m opentinker_client``)."""
    argv0 = (getattr(_sys, "argv", None) or [""])[0]
    orig = list(getattr(_sys, "orig_argv", ()))
    return _os.path.basename(argv0) in ("opentinker", "opentinker.exe") or any(
        a == "-m" and b == "opentinker_client" for a, b in zip(orig, orig[1:])
    )


# The CLI prints an error as one `error: ...` line; gRPC's own log lines (`I1130 ... Handshake
# failed ...` on a TLS error) would come with it. GRPC_VERBOSITY is read when grpc is first
# imported (by the imports below), so it is set here, for the CLI only: library users keep
# gRPC's default and their own setting wins everywhere (setdefault).
if _is_the_cli():
    _os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

# A process holding a client may fork: gymnasium's AsyncVectorEnv and torch's DataLoader workers
# start with fork on Linux. gRPC's default there runs its core's fork handlers without its
# Python layer's, and children crashed or broke their pipes in about half the forks. Off, gRPC
# does nothing at a fork: the children, which never use gRPC, run safely beside the parent's
# live channels, streams and servers (a hosted environment). Read when grpc is first imported,
# so it is set here, before the imports below; a value set by the user wins (setdefault).
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from opentinker_client import errors as _errors
from opentinker_client.client import RLClient
from opentinker_client.config import TaskConfig, load_task_config, parse_task_config
from opentinker_client.environment import Environment
from opentinker_client.errors import (  # "X as X": re-exported; __all__ takes them from errors.EXCEPTIONS
    AlreadyExistsError as AlreadyExistsError,
    ConfigError as ConfigError,
    DeadlineExceededError as DeadlineExceededError,
    FailedPreconditionError as FailedPreconditionError,
    InvalidArgumentError as InvalidArgumentError,
    NotFoundError as NotFoundError,
    OpenTinkerError as OpenTinkerError,
    OutOfOrderError as OutOfOrderError,
    OverloadedError as OverloadedError,
    PermissionDeniedError as PermissionDeniedError,
    ResourceExhaustedError as ResourceExhaustedError,
    TaskFailedError as TaskFailedError,
    UnauthenticatedError as UnauthenticatedError,
    UnavailableError as UnavailableError,
)
from opentinker_client.endpoint_tokens import EndpointToken, EndpointTokens
from opentinker_client.evaluate import EvalResult, evaluate
from opentinker_client.hosting.server import EnvironmentServer
from opentinker_client.inference import InferenceClient
from opentinker_client.keys import ApiKeyInfo, KeyAdmin
from opentinker_client.training import Datum, TrainingSession
from opentinker_client.types import (
    ActResult,
    CheckpointInfo,
    DeviceInfo,
    DeviceTelemetry,
    HostTelemetry,
    Generation,
    ModelHostInfo,
    NodeInfo,
    StreamChunk,
    TaskEvent,
    TaskInfo,
)
from opentinker_common.net.url import parse_scheduler_url

__all__ = [
    "RLClient",
    "Environment",
    "EnvironmentServer",
    "TaskConfig",
    "load_task_config",
    "parse_task_config",
    "TaskInfo",
    "TaskEvent",
    "ModelHostInfo",
    "NodeInfo",
    "DeviceInfo",
    "DeviceTelemetry",
    "HostTelemetry",
    "parse_scheduler_url",
    *_errors.EXCEPTIONS,  # OpenTinkerError and every subclass
    "InferenceClient",
    "EndpointToken",
    "EndpointTokens",
    "Generation",
    "StreamChunk",
    "ActResult",
    "CheckpointInfo",
    "EvalResult",
    "evaluate",
    "KeyAdmin",
    "ApiKeyInfo",
    "TrainingSession",
    "Datum",
]
