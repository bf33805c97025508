"""Simulated hosts on one machine: each a network namespace with its own address on a shared
bridge, its own host name, and a private disk (an empty tmpfs over ``/srv`` in its own mount
namespace), the others' names in its ``/etc/hosts``. Root only.

Every namespace name starts with :attr:`Hosts.prefix` (``otc<pid>-``). :meth:`Hosts.close`
kills every process in them and deletes them; a watchdog process does the same if the test
process dies without closing (SIGKILL included), and a new run deletes what a dead run left.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.support.waiting import wait_for

SUBNET = "10.77.0"


def netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _cleanup_script(namespaces: list[str]) -> str:
    """Shell that kills every process of ``namespaces`` and deletes them (hub last)."""
    lines = []
    for ns in namespaces:
        q = shlex.quote(ns)
        lines.append(f"for p in $(ip netns pids {q} 2>/dev/null); do kill -9 $p; done")
    for ns in namespaces:
        lines.append(f"ip netns del {shlex.quote(ns)} 2>/dev/null")
    return "\n".join(lines) + "\ntrue"


def delete_dead_runs() -> list[str]:
    """Delete the namespaces of runs whose test process is gone; their names."""
    dead = []
    for ns in netns_list():
        m = re.match(r"otc(\d+)-", ns)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            dead.append(ns)
    if dead:
        subprocess.run(["sh", "-c", _cleanup_script(dead)], check=False)
    return dead


@dataclass
class Host:
    name: str
    address: str
    ns: str
    veth: str
    keeper: subprocess.Popen | None = None


class Hosts:
    """Hosts ``names`` on one bridge, addresses ``10.77.0.10`` on; :meth:`start` makes them."""

    def __init__(self, tmp: Path, names: list[str]) -> None:
        self.tmp = tmp
        self.prefix = f"otc{os.getpid()}-"
        self.hub = self.prefix + "hub"
        self.hosts = {
            name: Host(name, f"{SUBNET}.{10 + i}", self.prefix + name, f"v{i}") for i, name in enumerate(names)
        }
        self.hosts_file = tmp / "etc-hosts"
        self._watchdog: subprocess.Popen | None = None
        self._spawned: list[subprocess.Popen] = []

    # ------------------------------------------------------------------ network and hosts

    def start(self) -> None:
        delete_dead_runs()
        self.hosts_file.write_text(
            "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts.values())
        )
        self._ip("netns", "add", self.hub)
        # Whatever happens to this process, the namespaces and their processes go with it.
        self._watchdog = subprocess.Popen(
            ["sh", "-c", f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 1; done\n" + self._cleanup()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.hub, "link", "set", "br0", "up")
        for h in self.hosts.values():
            self._ip("netns", "add", h.ns)
            self._ip("-n", self.hub, "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            self._ip("-n", self.hub, "link", "set", h.veth, "master", "br0", "up")
            self._ip("-n", h.ns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            self._ip("-n", h.ns, "link", "set", "eth0", "up")
            self._ip("-n", h.ns, "link", "set", "lo", "up")
            self.boot(h.name)

    def boot(self, name: str) -> None:
        """Start host ``name``'s keeper: the process whose mount and UTS namespaces hold its
        host name, its /etc/hosts and an empty private disk at /srv (a fresh one after a kill)."""
        h = self.hosts[name]
        setup = (
            f"hostname {h.name} && mount -t tmpfs -o size=4g tmpfs /srv && "
            f"mount --bind {shlex.quote(str(self.hosts_file))} /etc/hosts && echo up && exec sleep infinity"
        )
        h.keeper = subprocess.Popen(
            ["ip", "netns", "exec", h.ns, "unshare", "-m", "-u", "--propagation", "private", "sh", "-c", setup],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        line = h.keeper.stdout.readline()
        if line.strip() != b"up":
            raise RuntimeError(f"host {name} did not start: {line!r} {h.keeper.stdout.read()!r}")

    def kill(self, name: str) -> None:
        """Power host ``name`` off: SIGKILL to every process in it; its disk is gone."""
        h = self.hosts[name]
        for pid in netns_pids(h.ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_for(lambda: not netns_pids(h.ns), timeout=30, what=f"every process of host {name} gone")
        if h.keeper is not None:
            h.keeper.wait(timeout=10)
            h.keeper.stdout.close()

    def cut(self, name: str) -> None:
        """Cut host ``name`` off the network (both directions); :meth:`heal` joins it again."""
        self._ip("-n", self.hub, "link", "set", self.hosts[name].veth, "down")

    def heal(self, name: str) -> None:
        self._ip("-n", self.hub, "link", "set", self.hosts[name].veth, "up")

    # ------------------------------------------------------------------ commands on a host

    def argv(self, name: str, script: str) -> list[str]:
        """``bash -ec script`` on host ``name``, in the repository checkout."""
        h = self.hosts[name]
        root = Path(__file__).resolve().parents[2]
        env = {
            "PATH": f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
            "HOME": "/srv",
            "LANG": "C.UTF-8",
            "OPENTINKER_LOG_FORMAT": "json",
            "OMP_NUM_THREADS": "1",
        }
        return [
            "nsenter",
            "-t",
            str(h.keeper.pid),
            "-m",
            "-n",
            "-u",
            "env",
            "-i",
            *(f"{k}={v}" for k, v in env.items()),
            "bash",
            "-ec",
            f"cd {shlex.quote(str(root))}\n{script}",
        ]

    def run(self, name: str, script: str, *, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run ``script`` on host ``name`` to its end; its output. Fails on a non-zero exit."""
        r = subprocess.run(self.argv(name, script), capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise AssertionError(
                f"on {name}: exit {r.returncode}\n{script}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
            )
        return r

    def spawn(self, name: str, script: str, log: Path, **kw) -> subprocess.Popen:
        """Start ``script`` on host ``name`` in its own process group, output to ``log``."""
        with open(log, "ab") as out:
            p = subprocess.Popen(
                self.argv(name, script), stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kw
            )
        self._spawned.append(p)
        return p

    # ------------------------------------------------------------------ teardown

    def _cleanup(self) -> str:
        return _cleanup_script([h.ns for h in self.hosts.values()] + [self.hub])

    def leftovers(self) -> tuple[list[str], list[int]]:
        """Namespaces of this run still there, and processes this run started still alive."""
        alive = [p.pid for p in self._spawned if p.poll() is None]
        alive += [h.keeper.pid for h in self.hosts.values() if h.keeper is not None and h.keeper.poll() is None]
        return [ns for ns in netns_list() if ns.startswith(self.prefix)], alive

    def close(self) -> None:
        subprocess.run(["sh", "-c", self._cleanup()], check=False)
        for p in self._spawned + [h.keeper for h in self.hosts.values() if h.keeper is not None]:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
            if p.stdout is not None:
                p.stdout.close()
        if self._watchdog is not None:
            self._watchdog.kill()
            self._watchdog.wait(timeout=10)

    def _ip(self, *args: str) -> None:
        r = subprocess.run(["ip", *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
