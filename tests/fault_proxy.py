"""An HTTP proxy on 127.0.0.1 that injects faults between the storage clients and the GCS
emulator (``gcs_emulator.GcsEmulator``): GCS's transient errors (503, 429), connections reset
in the middle of a request, a slow server and a server that is gone, each on a seeded share of
the requests, so the tests can check what diffjax's storage paths do when the bucket misbehaves.

Point a client at :attr:`FaultProxy.url` (``STORAGE_EMULATOR_HOST``,
``TENSORSTORE_GCS_HTTP_URL``) instead of the emulator's. Every request is read whole (a
``Content-Length`` or chunked body), forwarded to the emulator with :mod:`http.client`, and its
response sent back whole, with a ``Content-Length`` and ``Connection: close`` (one request a
connection). The emulator writes its own address into what it answers (the ``Location`` of a
resumable upload, an object's ``mediaLink``): the proxy writes its own instead, in the response
headers and in JSON bodies (not in object data), so the clients keep going through it.

Standard library only::

    with FaultProxy(gcs_server.url, seed=0) as proxy:
        proxy.set("503", rate=0.3)  # about a third of the requests answer 503
        proxy.down_for(1.0)  # every connection refused for a second
        proxy.down_after("commit_success.txt")  # gone once a checkpoint has committed
"""

from __future__ import annotations

import http.client
import http.server
import json
import random
import re
import socket
import struct
import threading
import time
import urllib.parse

KINDS = (None, "503", "429", "reset", "stall", "down")

# headers of one connection, not of the request: the proxy sets its own
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
    "host",
    "content-length",
}

_REASONS = {503: "backendError", 429: "rateLimitExceeded"}


def error_body(status: int) -> bytes:
    """A GCS JSON API error of ``status``, as GCS words it."""
    message = f"injected by the test proxy: HTTP {status}"
    return json.dumps(
        {
            "error": {
                "code": status,
                "message": message,
                "errors": [{"message": message, "domain": "global", "reason": _REASONS[status]}],
            }
        }
    ).encode()


def reset(sock: socket.socket) -> None:
    """Close ``sock`` abruptly: linger 0, so the peer gets a TCP reset, not an orderly end."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def read_chunked(rfile) -> bytes:
    """A ``Transfer-Encoding: chunked`` body from ``rfile``, decoded (trailers dropped)."""
    parts = []
    while True:
        line = rfile.readline(65537)
        if not line:
            raise ConnectionError("the client closed the connection inside a chunked body")
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                pass
            return b"".join(parts)
        parts.append(rfile.read(size))
        rfile.readline(65537)  # the CRLF after the chunk


def is_object_data(path: str) -> bool:
    """Whether the request ``path`` (with its query) reads an object's bytes (left unchanged)."""
    parsed = urllib.parse.urlsplit(path)
    media = "media" in urllib.parse.parse_qs(parsed.query).get("alt", [])
    return media or parsed.path.startswith("/download/")


class FaultProxy:
    """A proxy to ``upstream_url`` on a free port of 127.0.0.1, serving in a daemon thread
    while entered; :meth:`set` picks the fault. ``requests`` counts the requests (connections
    while down) it saw, ``log`` each request's method and path, ``injected`` the faults it
    injected; the draws of which requests are hit
    come from ``random.Random(seed)``, so a sequence of requests meets the same faults each run.
    """

    def __init__(self, upstream_url: str, *, seed: int = 0):
        parsed = urllib.parse.urlsplit(upstream_url)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(
                f"FaultProxy forwards plain HTTP to host:port, got {upstream_url!r}: "
                "pass the emulator's url, e.g. http://127.0.0.1:PORT"
            )
        self.upstream = (parsed.hostname, parsed.port)
        self._upstream_netloc = parsed.netloc.encode()
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._kind: str | None = None
        self._rate = 0.0
        self._stall_s = 0.0
        self._timer: threading.Timer | None = None
        self._trigger: str | None = None
        self._then_down = False
        self.triggered = threading.Event()  # set when down_after's request has been answered
        self.requests = 0
        self.injected = 0
        # (method, path with its query) of each request read; a multipart upload's gets
        # "&name=OBJECT" from its body
        self.log: list[tuple[str, str]] = []
        self._httpd = _Server(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._netloc = self.url.removeprefix("http://").encode()
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)

    # ------------------------------------------------------------------ control
    def set(self, kind: str | None = None, rate: float = 0.0, stall_s: float = 0.0) -> None:
        """Inject ``kind`` (one of :data:`KINDS`) on a share ``rate`` of the requests from now
        on (``"down"``: on all of them); ``stall_s``: how long a ``"stall"`` waits."""
        if kind not in KINDS:
            raise ValueError(f"fault kind {kind!r} is not one of {KINDS}")
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate={rate} is a share of the requests: give one in [0, 1]")
        if stall_s < 0:
            raise ValueError(f"stall_s={stall_s} is a wait in seconds: give one >= 0")
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._kind, self._rate, self._stall_s = kind, float(rate), float(stall_s)
            self._trigger = None

    def down_for(self, seconds: float) -> None:
        """Refuse every connection now, and pass everything through again after ``seconds``."""
        self.set("down")
        timer = threading.Timer(seconds, self._recover)
        timer.daemon = True
        with self._lock:
            self._timer = timer
        timer.start()

    def down_after(self, substring: str) -> None:
        """Pass everything through until a write (POST, PUT, PATCH; of a resumable upload,
        the one that sends the data) whose path (query included) contains ``substring`` has
        succeeded, then refuse every connection
        (:attr:`triggered` is set then): a server that goes away at a chosen point of a run,
        e.g. right after a checkpoint's commit marker is written."""
        self.set(None)
        self.watch(substring, then_down=True)

    def watch(self, substring: str, *, then_down: bool = False) -> None:
        """Set :attr:`triggered` once a write as in :meth:`down_after` has succeeded (the
        current fault, if any, kept); ``then_down``: refuse every connection from then on."""
        self.triggered.clear()
        with self._lock:
            self._trigger, self._then_down = substring, then_down

    def _answered(self, method: str, path: str, status: int) -> None:
        with self._lock:
            if self._trigger is None or self._trigger not in urllib.parse.unquote(path):
                return
            if method not in ("POST", "PUT", "PATCH") or not 200 <= status < 300:
                return
            if "uploadType=resumable" in path and "upload_id=" not in path:
                return  # a resumable upload begun, its data not yet sent
            self._trigger = None
            if self._then_down:
                self._kind, self._rate, self._stall_s = "down", 1.0, 0.0
        self.triggered.set()

    def _recover(self) -> None:
        with self._lock:
            self._timer = None
            self._kind, self._rate, self._stall_s = None, 0.0, 0.0

    def _draw(self) -> tuple[str | None, float]:
        """Count one request and pick its fault: (kind or None, stall seconds)."""
        with self._lock:
            self.requests += 1
            kind = self._kind
            if kind is None:
                return None, 0.0
            if kind != "down" and not self._rng.random() < self._rate:
                return None, 0.0
            self.injected += 1
            return kind, self._stall_s

    def _is_down(self) -> bool:
        with self._lock:
            return self._kind == "down"

    def _rewrite(self, data: bytes) -> bytes:
        return data.replace(self._upstream_netloc, self._netloc)

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
        self._httpd.shutdown()
        self._httpd.server_close()


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        """A client that gave up on its request (its own timeout) is not the proxy's error."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _handler(proxy: FaultProxy) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # chunked request bodies, Expect: 100-continue

        def handle(self):
            if proxy._is_down():
                proxy._draw()
                self._reset()
                return
            self.close_connection = True
            self.handle_one_request()

        def _reset(self):
            self.rfile.close()  # its reference keeps the socket open otherwise
            reset(self.connection)
            self.close_connection = True

        def _body(self) -> bytes:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                return read_chunked(self.rfile)
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _send(self, status: int, headers: list[tuple[str, str]], body: bytes, length=None):
            self.send_response_only(status)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body) if length is None else length))
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            self.wfile.flush()

        def _proxy(self):
            body = self._body()
            logged = self.path
            if "uploadType=multipart" in logged:  # the object's name is in the body
                named = re.search(rb'"name"\s*:\s*"([^"]+)"', body[:4096])
                logged += f"&name={named.group(1).decode()}" if named else ""
            with proxy._lock:
                proxy.log.append((self.command, logged))
            kind, stall_s = proxy._draw()
            if kind == "down":  # went down while this request was read
                return self._reset()
            if kind == "reset":
                return self._reset()
            if kind in ("503", "429"):
                status = int(kind)
                headers = [("Content-Type", "application/json; charset=UTF-8")]
                return self._send(status, headers, error_body(status))
            if kind == "stall":
                time.sleep(stall_s)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            if body or self.command in ("POST", "PUT", "PATCH"):
                headers["Content-Length"] = str(len(body))
            conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            except OSError as e:
                msg = json.dumps({"error": {"code": 502, "message": f"upstream: {e}"}}).encode()
                return self._send(502, [("Content-Type", "application/json")], msg)
            finally:
                conn.close()
            out = [
                (k, proxy._rewrite(v.encode("latin-1")).decode("latin-1"))
                for k, v in resp.getheaders()
                if k.lower() not in _HOP_BY_HOP
            ]
            length = None
            if self.command == "HEAD":
                length = resp.getheader("Content-Length", "0")
            elif (
                "json" in (resp.getheader("Content-Type") or "")
                and not resp.getheader("Content-Encoding")
                and not is_object_data(self.path)
            ):
                data = proxy._rewrite(data)
            proxy._answered(self.command, self.path, resp.status)  # before the client hears
            self._send(resp.status, out, data, length)

        do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = _proxy

        def log_message(self, *args):
            pass

    return Handler
