"""A TCP forwarder on loopback that a test can cut: a network split between one process and a
server (PostgreSQL), without root or iptables.

``pause()`` stops moving bytes both ways and holds new connections unanswered (what a silent
network does: nothing is refused, nothing arrives); ``resume()`` moves them again;
``unread_bytes()`` says how much is waiting meanwhile. ``refuse()`` ends every connection and
closes new ones at once (a server that is gone) until ``resume()``. ``close()`` ends everything.
Runs in one daemon thread (selectors).
"""

from __future__ import annotations

import fcntl
import selectors
import socket
import struct
import termios
import threading

from tests.support.procs import free_port


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``(target_host, target_port)``."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._peer: dict[socket.socket, socket.socket] = {}
        self._paused = threading.Event()
        self._refusing = threading.Event()
        self._stop = threading.Event()
        self._held: list[socket.socket] = []  # accepted while paused, not yet connected on
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """Stop forwarding (both ways); new connections are accepted and left unanswered."""
        self._paused.set()

    def refuse(self) -> None:
        """End every connection and close each new one at once (a store that is gone: every
        request fails fast) until :meth:`resume`."""
        self._refusing.set()

    def resume(self) -> None:
        self._refusing.clear()
        self._paused.clear()

    def unread_bytes(self) -> int:
        """Bytes waiting in the proxy's sockets, not yet moved (while paused: what the peers sent
        into the silent network, e.g. the body of an upload that cannot arrive)."""
        total = 0
        for _ in range(5):  # the forwarding thread may change the sockets meanwhile
            try:
                socks = [*self._peer, *self._held]
                break
            except RuntimeError:
                continue
        else:
            return 0
        for sock in socks:
            try:
                total += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
            except (OSError, ValueError):
                pass
        return total

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in [self._listener, *self._peer, *self._held]:
            try:
                s.close()
            except OSError:
                pass

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        upstream.setblocking(False)
        client.setblocking(False)
        self._peer[client], self._peer[upstream] = upstream, client
        self._sel.register(client, selectors.EVENT_READ, None)
        self._sel.register(upstream, selectors.EVENT_READ, None)

    def _drop(self, s: socket.socket) -> None:
        other = self._peer.pop(s, None)
        for x in (s, other):
            if x is None:
                continue
            self._peer.pop(x, None)
            try:
                self._sel.unregister(x)
            except (KeyError, ValueError):
                pass
            x.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._refusing.is_set():
                for sock in [*self._peer, *self._held]:
                    self._drop(sock)
                self._held.clear()
                try:
                    self._listener.accept()[0].close()
                except (BlockingIOError, OSError):
                    pass
                self._stop.wait(0.02)
                continue
            if self._paused.is_set():
                # Accept (so the peer's connect succeeds, as through a silent network), move nothing.
                try:
                    client, _ = self._listener.accept()
                    self._held.append(client)
                except (BlockingIOError, OSError):
                    pass
                self._stop.wait(0.05)
                continue
            while self._held:
                self._connect(self._held.pop(0))
            for key, _ in self._sel.select(timeout=0.05):
                s = key.fileobj
                if s is self._listener:
                    try:
                        client, _ = self._listener.accept()
                    except (BlockingIOError, OSError):
                        continue
                    self._connect(client)
                    continue
                if self._paused.is_set():
                    break
                try:
                    data = s.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._drop(s)
                    continue
                other = self._peer.get(s)
                if other is None:
                    continue
                try:
                    other.setblocking(True)
                    other.sendall(data)
                    other.setblocking(False)
                except OSError:
                    self._drop(s)
