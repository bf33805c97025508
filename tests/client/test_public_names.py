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


def test_every_exported_name_resolves_and_every_exception_class_is_exported() -> None:
    from opentinker_client import errors, types

    for name in opentinker_client.__all__:
        assert getattr(opentinker_client, name) is not None, name
    assert len(set(opentinker_client.__all__)) == len(opentinker_client.__all__)
    for name in errors.EXCEPTIONS:
        cls = getattr(opentinker_client, name)
        assert name in opentinker_client.__all__ and cls is getattr(errors, name)
        assert issubclass(cls, opentinker_client.OpenTinkerError)
    for name in ("TaskInfo", "TaskEvent", "NodeInfo", "DeviceInfo", "DeviceTelemetry", "Generation", "StreamChunk"):
        assert getattr(opentinker_client, name) is getattr(types, name)
    assert opentinker_client.CheckpointInfo is types.CheckpointInfo
