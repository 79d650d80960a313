"""A TCP proxy that can cut a connection, for the fault tests and `specq bench-chaos`.

    proxy = Proxy("127.0.0.1", 5432).start()     # listens on proxy.port
    proxy.cut()       # drop every connection; new ones are accepted, then closed at once
    proxy.hang()      # new connections are accepted and never answered (an unresponsive peer)
    proxy.stall()     # hold every byte, both ways, on every connection, until restore
    proxy.restore()   # forward again (what a stall held goes on its way)

A worker pointed at the proxy sees what a network cut, a restarted server or a hung one
looks like, while the real server goes on serving everyone else. A stall is the path that
acknowledges and then holds the data (a congested link, a paused middlebox): no socket
option of the client notices it, and every call through it waits for the restore.
"""

from __future__ import annotations

import socket
import threading


class Proxy:
    def __init__(self, host: str, port: int, listen: str = "127.0.0.1") -> None:
        self.target = (host, port)
        self._server = socket.create_server((listen, 0))
        self.port = self._server.getsockname()[1]
        self.mode = "up"  # up | cut | hang | stall
        self._flowing = threading.Event()  # clear while stalled
        self._flowing.set()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._closed = False

    def start(self) -> Proxy:
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()
        return self

    def cut(self) -> None:
        with self._lock:
            self.mode = "cut"
            conns, self._conns = self._conns, []
        self._flowing.set()  # what a stall held meets the closed sockets and ends
        for c in conns:
            _close(c)

    def hang(self) -> None:
        self.cut()
        self.mode = "hang"

    def stall(self) -> None:
        self.mode = "stall"
        self._flowing.clear()

    def restore(self) -> None:
        self.mode = "up"
        self._flowing.set()

    def close(self) -> None:
        self._closed = True
        self.cut()
        _close(self._server)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if self.mode == "cut":
                _close(client)
                continue
            if self.mode == "hang":
                with self._lock:
                    self._conns.append(client)  # held open, never answered, until cut
                continue
            with self._lock:
                self._conns.append(client)
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        self._flowing.wait()  # a connection made during a stall waits for the restore
        if self.mode in ("cut", "hang") or self._closed:
            _close(client)
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
            upstream.settimeout(None)
        except OSError:
            _close(client)
            return
        with self._lock:
            self._conns.append(upstream)
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self._flowing.wait()  # held while stalled
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
