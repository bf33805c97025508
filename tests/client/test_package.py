import subprocess
import sys

import opentinker_client


def test_public_surface():
    for name in (
        "RLClient",
        "Environment",
        "TaskConfig",
        "load_task_config",
        "TaskInfo",
        "TaskEvent",
        "OpenTinkerError",
        "InvalidArgumentError",
        "NotFoundError",
        "FailedPreconditionError",
        "AlreadyExistsError",
        "UnauthenticatedError",
        "PermissionDeniedError",
        "ResourceExhaustedError",
        "UnavailableError",
        "DeadlineExceededError",
        "TaskFailedError",
        "ConfigError",
    ):
        assert name in opentinker_client.__all__
        assert hasattr(opentinker_client, name)


def test_import_pulls_in_neither_torch_nor_rich():
    code = "import opentinker_client, sys; assert 'torch' not in sys.modules, 'torch'; assert 'rich' not in sys.modules, 'rich'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
