"""OpenTinker: the generated gRPC stubs (``opentinker.<area>.v1``), and the seed's import.

``from opentinker import RLClient, Environment`` (the deployment guide's spelling) works: the
client names are loaded lazily from :mod:`opentinker_client` on first use, so importing the
stubs alone never loads the client.
"""

from __future__ import annotations

_CLIENT_NAMES = {"RLClient", "Environment", "TaskConfig", "load_task_config", "OpenTinkerError"}


def __getattr__(name: str):
    if name in _CLIENT_NAMES:
        import opentinker_client

        return getattr(opentinker_client, name)
    raise AttributeError(f"module 'opentinker' has no attribute {name!r}")
