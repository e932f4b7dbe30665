"""A real S3-compatible server on 127.0.0.1 (moto's server mode) and a fault-injecting TCP proxy in front
of it. Nothing here contacts any address but 127.0.0.1: credentials are dummies, the endpoint is set in
the environment (inherited by the ranks' processes), and instance metadata is disabled."""
from __future__ import annotations

import os
import socket
import struct
import threading
import uuid
from typing import Optional, Tuple

import pytest

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
          "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="session")
def moto_endpoint():
    """http://127.0.0.1:PORT of a moto S3 server for the whole session."""
    pytest.importorskip("moto.server")
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in list(S3_ENV) + ["AWS_ENDPOINT_URL_S3"]}
    os.environ.update(S3_ENV)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def make_bucket(endpoint: str) -> str:
    import boto3

    name = f"b-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_url(moto_endpoint, monkeypatch):
    """s3://<fresh bucket>/run/ckpt, with AWS_ENDPOINT_URL_S3 pointing at the server."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)
    return f"s3://{make_bucket(moto_endpoint)}/run/ckpt"


_SLOWDOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: %d\r\n\r\n")
_SLOWDOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                  b"<Message>Please reduce your request rate.</Message></Error>")


class FaultProxy:
    """A TCP proxy on 127.0.0.1 that forwards one HTTP request per connection to ``upstream`` (forcing
    ``Connection: close``) unless a fault is armed:

    - ``slowdown(n)``: the next n requests get 503 SlowDown;
    - ``reset_uploads(n)``: the next n requests with a body over 1 KiB are cut (TCP RST) half-way through
      their body;
    - ``blackhole(True)``: requests are read and never answered (a server that stops answering);
      ``blackhole(True, only=b".tensors/")``: only requests whose request line contains those bytes.
    """

    def __init__(self, upstream: str):
        host, port = upstream.rsplit("//", 1)[1].split(":")
        self.upstream = (host, int(port))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.lock = threading.Lock()
        self.to_slow = self.to_reset = 0
        self.hole = False
        self.hole_only: Optional[bytes] = None
        self.injected = {"slowdown": 0, "reset": 0, "blackholed": 0}
        self.forwarded = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def slowdown(self, n: int) -> None:
        with self.lock:
            self.to_slow = n

    def reset_uploads(self, n: int) -> None:
        with self.lock:
            self.to_reset = n

    def blackhole(self, on: bool, only: Optional[bytes] = None) -> None:
        with self.lock:
            self.hole = on
            self.hole_only = only

    def close(self) -> None:
        self._stop.set()
        self.sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            head, rest = _read_head(conn)
            if head is None:
                return
            length = _content_length(head)
            with self.lock:
                hole = self.hole and (self.hole_only is None or self.hole_only in head.split(b"\r\n", 1)[0])
                fault = ("blackhole" if hole else "slowdown" if self.to_slow > 0
                         else "reset" if self.to_reset > 0 and length > 1024 else None)
                if fault == "slowdown":
                    self.to_slow -= 1
                elif fault == "reset":
                    self.to_reset -= 1
            if fault == "reset":
                _recv_exact(conn, length // 2, rest)
                with self.lock:
                    self.injected["reset"] += 1
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            body = _recv_exact(conn, length, rest)
            if fault == "blackhole":
                with self.lock:
                    self.injected["blackholed"] += 1
                self._stop.wait()
                return
            if fault == "slowdown":
                with self.lock:
                    self.injected["slowdown"] += 1
                conn.sendall(_SLOWDOWN % len(_SLOWDOWN_BODY) + _SLOWDOWN_BODY)
                return
            self._forward(conn, _force_close(head) + body)
        except OSError:
            pass
        finally:
            conn.close()

    def _forward(self, conn: socket.socket, request: bytes) -> None:
        with socket.create_connection(self.upstream) as up:
            up.sendall(request)
            while True:
                data = up.recv(1 << 16)
                if not data:
                    break
                conn.sendall(data)
        with self.lock:
            self.forwarded += 1


def _read_head(conn: socket.socket) -> Tuple[Optional[bytes], bytes]:
    """(request line + headers, the body bytes already received)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return None, b""
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def _recv_exact(conn: socket.socket, n: int, buf: bytes) -> bytes:
    while len(buf) < n:
        data = conn.recv(min(1 << 20, n - len(buf)))
        if not data:
            break
        buf += data
    return buf[:n]


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def _force_close(head: bytes) -> bytes:
    lines = [ln for ln in head.rstrip(b"\r\n").split(b"\r\n") if not ln.lower().startswith(b"connection:")]
    return b"\r\n".join(lines + [b"Connection: close"]) + b"\r\n\r\n"


@pytest.fixture
def fault_proxy(moto_endpoint, monkeypatch):
    """A FaultProxy in front of the moto server, and a fresh bucket behind it: (proxy, s3 url)."""
    proxy = FaultProxy(moto_endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
    yield proxy, f"s3://{make_bucket(moto_endpoint)}/run/ckpt"
    proxy.close()
