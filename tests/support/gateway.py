"""A Tinker API gateway process (``python -m opentinker_gateway``) on loopback, for the tests of
the unmodified ``tinker`` SDK against a real scheduler and trainer."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from tests.support.procs import Proc, free_port
from tests.support.waiting import wait_for

__all__ = ["Gateway", "MODEL_NAME"]

#: The Tinker model name tests train; the gateway maps it to the test's model folder.
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


class Gateway:
    """``python -m opentinker_gateway`` for scheduler ``scheduler`` (``host:port``), serving
    :data:`MODEL_NAME` from ``model_dir``; ``extra`` are more flags. Ready once /healthz answers."""

    def __init__(self, tmp: Path, scheduler: str, model_dir: Path, *extra: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc = Proc(
            [
                "-m",
                "opentinker_gateway",
                "--scheduler",
                scheduler,
                "--port",
                str(self.port),
                "--model",
                f"{MODEL_NAME}={model_dir}",
                *extra,
            ],
            tmp / f"gateway-{self.port}.log",
        )
        wait_for(self._healthy, what=f"the gateway on port {self.port} answers /healthz")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        if self.proc.popen.poll() is not None:
            raise RuntimeError(f"gateway exited: {self.proc.log_text()}")
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/healthz", timeout=2) as resp:
                return json.loads(resp.read()) == {"status": "ok"}
        except OSError:
            return False

    def close(self) -> None:
        self.proc.close()
