"""A real PostgreSQL server on loopback for tests: ``initdb`` into a temporary folder, ``postgres``
on a free port of 127.0.0.1, stopped (and its folder removed) at the end of the session.

PostgreSQL refuses to run as root: as root the server runs as the ``postgres`` user (``runuser``),
in a folder that user owns; otherwise as the current user. Without the binaries
(``pg_config --bindir``, or ``/usr/lib/postgresql/*/bin``) :func:`find_bindir` returns None and the
fixtures skip, saying so; ``make test`` installs them first (the Makefile's ``test-deps``).

Each test gets its own schema (:meth:`PostgresServer.new_schema`), so tests never see each
other's rows and no database has to be created per test.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from tests.support.procs import free_port

#: Server settings for tests: no fsync (the OS still holds every committed page, so a killed
#: server loses nothing; only a power cut would), small shared memory, loopback only.
_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "full_page_writes": "off",
    "shared_buffers": "32MB",
    "max_connections": "200",
    "log_min_messages": "warning",
}


def find_bindir() -> Path | None:
    """The folder of ``initdb``, ``pg_ctl`` and ``postgres``, or None when PostgreSQL is absent."""
    exe = shutil.which("pg_config")
    if exe:
        try:
            out = subprocess.run([exe, "--bindir"], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out and (Path(out) / "initdb").exists() and (Path(out) / "postgres").exists():
            return Path(out)
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(d) / "initdb").exists():
            return Path(d)
    return None


def _children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(Path(stat).parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class PostgresServer:
    """One PostgreSQL cluster in a temporary folder, on ``127.0.0.1:port``.

    Args:
        bindir: from :func:`find_bindir`.

    Attributes:
        port: the TCP port it listens on.
        user: the database superuser (``postgres``), no password (trust on loopback).
    """

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.port = free_port()
        self.user = "postgres"
        self.root = Path(tempfile.mkdtemp(prefix="opentinker-pg-"))
        self.data = self.root / "data"
        self.sockets = self.root / "sock"
        self.sockets.mkdir()
        self.log = self.root / "server.log"
        self._as_root = os.geteuid() == 0
        if self._as_root:
            shutil.chown(self.root, "postgres", "postgres")
            shutil.chown(self.sockets, "postgres", "postgres")
        self._schemas = 0
        self._run(
            [
                str(bindir / "initdb"),
                "-D",
                str(self.data),
                "--username",
                self.user,
                "--auth",
                "trust",
                "--locale",
                "C",
                "--encoding",
                "UTF8",
                "--no-sync",
            ]
        )
        self.start()

    def _run(self, argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
        if self._as_root:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr or out.stdout}")
        return out

    def _options(self) -> str:
        sets = " ".join(f"-c {k}={v}" for k, v in _SETTINGS.items())
        return f"-p {self.port} -k {self.sockets} {sets}"

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        self._run(
            [
                str(self.bindir / "pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(self.log),
                "-o",
                self._options(),
                "-w",
                "start",
            ]
        )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``mode``: smart, fast or immediate, as ``pg_ctl stop -m``)."""
        self._run([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"], check=False)

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def pid(self) -> int:
        """The postmaster's pid."""
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def kill9(self) -> None:
        """``kill -9`` of the postmaster and of its backends (by pid); returns once all are gone."""
        pid = self.pid()
        family = [pid, *_children(pid)]
        for p in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in family):
            time.sleep(0.05)
        # Until its parent reaps it, the dead postmaster's pid still exists (a zombie), and a new
        # postmaster takes the lock file for a live one: wait a little for the reaping, then
        # remove the lock file of the (certainly dead) old server.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.05)
        (self.data / "postmaster.pid").unlink(missing_ok=True)

    def dsn(self, dbname: str = "postgres") -> str:
        """A libpq connection string for ``dbname`` over TCP loopback."""
        return f"host=127.0.0.1 port={self.port} user={self.user} dbname={dbname}"

    def new_schema(self, prefix: str = "t") -> str:
        """A fresh, empty schema's name (made here)."""
        self._schemas += 1
        name = f"{prefix}_{os.getpid()}_{self._schemas}"
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{name}"')
        return name

    def close(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
