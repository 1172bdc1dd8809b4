"""A small TCP key-value store for rendezvous, in the manner of torch's TCPStore.

Rank 0 serves it at MASTER_ADDR:MASTER_PORT; every rank sets keys and blocks on `get` until a key
is set. The wire is length-prefixed binary (never pickle). Any object with the same `set(key,
value)` and blocking `get(key)` methods (a torch.distributed Store, say) can stand in for it.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

from overcast.errors import OvercastError

_REQUEST = struct.Struct("<BHI")
_REPLY = struct.Struct("<BI")
_SET, _GET = 1, 2
_OK, _TIMEOUT, _BAD, _CLOSED = 0, 1, 2, 3
_MAX_VALUE = 1 << 20


class StoreError(OvercastError):
    """The rendezvous store could not be reached or did not answer in time."""


def read_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes from a blocking socket, by `deadline` (time.monotonic()) if given, else within
    the socket's own timeout; ConnectionError if the peer closes first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the connection closed")
        got += k
    return bytes(buf)


def connect_until(host: str, port: int, deadline: float) -> socket.socket:
    """Connect, retrying while the other side is not listening yet, until `deadline`
    (time.monotonic()); then the last OSError is raised."""
    while True:
        try:
            return socket.create_connection(
                (host, port), timeout=max(0.1, deadline - time.monotonic())
            )
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)  # a retry interval, not synchronisation


class StoreServer:
    """Serves the store from a daemon thread, a thread per connection, until `close()`."""

    def __init__(self, host: str, port: int):
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._conns: set[socket.socket] = set()  # served now; under _cond
        accepting = threading.Thread(target=self._accept, name="overcast-store", daemon=True)
        self._threads = [accepting]  # the accepting one and the serving ones; under _cond
        accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # close() shut it
                return
            serving = threading.Thread(
                target=self._serve, args=(conn,), name="overcast-store-conn", daemon=True
            )
            with self._cond:
                if self._closed:  # accepted as close() began
                    conn.close()
                    return
                self._conns.add(conn)
                self._threads = [t for t in self._threads if t.is_alive()] + [serving]
                serving.start()  # under the lock: close() joins only threads started

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                self._answer(conn)
            finally:
                with self._cond:
                    self._conns.discard(conn)

    def _answer(self, conn: socket.socket) -> None:
        """Requests on `conn` until it closes, sends a bad one, or close() shuts it."""
        try:
            while True:
                op, klen, vlen = _REQUEST.unpack(read_exact(conn, _REQUEST.size))
                if vlen > _MAX_VALUE:
                    conn.sendall(_REPLY.pack(_BAD, 0))
                    return
                key = read_exact(conn, klen).decode()
                value = read_exact(conn, vlen)
                if op == _SET:
                    with self._cond:
                        self._data[key] = value
                        self._cond.notify_all()
                    conn.sendall(_REPLY.pack(_OK, 0))
                elif op == _GET:
                    wait = struct.unpack("<d", value)[0] if vlen == 8 else 0.0
                    with self._cond:
                        # wait_for calls the predicate before the loop moves `key` on
                        found = self._cond.wait_for(
                            lambda: key in self._data or self._closed,  # noqa: B023
                            timeout=wait,
                        )
                        found = found and key in self._data
                        reply = self._data[key] if found else b""
                        status = _OK if found else _CLOSED if self._closed else _TIMEOUT
                    conn.sendall(_REPLY.pack(status, len(reply)) + reply)
                else:
                    conn.sendall(_REPLY.pack(_BAD, 0))
                    return
        except (ConnectionError, OSError, struct.error, UnicodeDecodeError):
            return

    def close(self) -> None:
        """Stop listening and serving, and wait for its threads. A thread blocked in accept()
        or recv() is not woken by the socket's close() on Linux, and would go on serving the
        port: shutdown() wakes it."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            conns, threads = list(self._conns), list(self._threads)
        for sock in (self._listener, *conns):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # not connected (any more)
                pass
        self._listener.close()
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()


class StoreClient:
    """A connection to a StoreServer; retries the connect until `timeout` (rank 0 may be late)."""

    def __init__(self, host: str, port: int, timeout: float = 60.0):
        self.timeout = timeout
        try:
            self._sock = connect_until(host, port, time.monotonic() + timeout)
        except OSError as err:
            raise StoreError(
                f"cannot reach the rendezvous store at {host}:{port} within {timeout:.0f} s: {err}"
            ) from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()
        self.address = (host, port)

    def _call(self, op: int, key: str, value: bytes) -> bytes:
        k = key.encode()
        with self._lock:
            self._sock.settimeout(self.timeout + 5)
            try:
                self._sock.sendall(_REQUEST.pack(op, len(k), len(value)) + k + value)
                status, vlen = _REPLY.unpack(read_exact(self._sock, _REPLY.size))
                reply = read_exact(self._sock, vlen)
            except OSError as err:  # ConnectionError and timeouts among them
                raise StoreError(
                    f"the store at {self.address[0]}:{self.address[1]} did not answer the "
                    f"request for {key!r}: {err or type(err).__name__}"
                ) from None
        if status == _CLOSED:
            raise StoreError(
                f"the store at {self.address[0]}:{self.address[1]} closed while the request "
                f"for {key!r} waited"
            )
        if status == _TIMEOUT:
            raise StoreError(
                f"rendezvous key {key!r} was not set within {self.timeout:.0f} s "
                f"(is every rank running?)"
            )
        if status != _OK:
            raise StoreError(f"store at {self.address} refused the request for {key!r}")
        return reply

    def set(self, key: str, value: bytes) -> None:
        self._call(_SET, key, bytes(value))

    def get(self, key: str) -> bytes:
        return self._call(_GET, key, struct.pack("<d", self.timeout))

    def close(self) -> None:
        self._sock.close()


def forget(store, keys: list[str]) -> None:
    """Delete `keys` from a torch.distributed store: what a communicator's ranks said there to
    meet, once all have read it, so that a job making many communicators does not grow its
    store. Stores that cannot delete (this module's own, FileStore's) keep them."""
    delete = getattr(store, "delete_key", None)
    if delete is None:
        return
    for key in keys:
        try:
            delete(key)
        except (RuntimeError, NotImplementedError):  # its host gone; or it deletes nothing
            pass
