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
