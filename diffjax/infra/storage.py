"""Where a run's files live: a local path or a ``gs://`` URL, one path type for both.

Every path a user gives (a run directory, ``train.init_from``, an export, an evaluated run) goes
through :func:`path`, which returns an :class:`etils.epath.Path`: the type Orbax itself takes, so
a checkpoint directory, a report and a model export are the same object whether they sit on
local disk or in a bucket. A local path behaves as with ``os``; a ``gs://`` URL is reached
through gcsfs (fsspec), and Orbax writes checkpoints there through tensorstore. Any other scheme
is refused (:class:`StorageError`).

Objects in a bucket are written whole: an upload becomes visible when it completes, never half
written, so :func:`write_bytes` is atomic on both (locally: a temporary name, then a rename).
Objects cannot be appended to: :class:`SyncedDir` keeps a local folder of the files that grow
(``metrics.jsonl``, TensorBoard's event files) and uploads each changed file whole every
``every_s`` seconds and whenever asked (at each checkpoint and at the end).

Pointing the clients at an emulator: ``STORAGE_EMULATOR_HOST`` is all a user sets. From it
diffjax derives the rest (:func:`_configure_clients`): tensorstore (the checkpoints) to the same
server (``TENSORSTORE_GCS_HTTP_URL``, unless set), gcsfs's plain JSON-API filesystem without
credentials (its zonal/hierarchical-bucket support asks a gRPC storage-control service for each
bucket's type, which an emulator does not serve: gcsfs would retry that for a minute on every
call), and no Google metadata-server probe. On Google Cloud the application default
credentials are used (a VM's service account, ``gcloud auth application-default login``, or
``GOOGLE_APPLICATION_CREDENTIALS``), and gcsfs's bucket-type lookup gets
:data:`LOOKUP_TIMEOUT_S` seconds before it falls back to the plain API.

No call into a bucket waits forever: each gcsfs call (read, write, listing) is bounded by
:func:`timeout_s` (``DIFFJAX_STORAGE_TIMEOUT_S``, default 120 s; ``run.storage_timeout_s``), one
request by a connect and a read timeout; gcsfs retries 429, 5xx and dropped connections with
capped exponential backoff and jitter inside that budget. Past it the call fails with a
:class:`StorageError` naming the operation, the path, the cause and the fix. Tensorstore's
requests (checkpoints) get a connect timeout and abort a transfer that stalls
(``TENSORSTORE_CURL_*``, unless set), and retry with its own backoff.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from typing import Any

from etils import epath

from diffjax.config import ConfigError

PathLike = str | os.PathLike
SCHEMES = ("gs",)  # the remote schemes diffjax reads and writes
EMULATOR_VAR, TENSORSTORE_VAR = "STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class StorageError(ConfigError):
    """A path that cannot be used: an unknown scheme, a missing bucket, no credentials or no
    permission. The message names the path, the cause and the fix."""


def scheme(p: PathLike) -> str | None:
    """``"gs"`` for ``gs://bucket/x``; None for a local path."""
    m = _SCHEME.match(_text(p))
    return m.group(1).lower() if m else None


def _text(p: PathLike) -> str:
    return str(p) if isinstance(p, epath.Path) else os.fspath(p)


def path(p: PathLike, *, what: str = "path") -> epath.Path:
    """``p`` as an :class:`epath.Path` (a local path as given, relative or not; a ``gs://``
    URL). ``what`` names the setting in the error for an unknown scheme."""
    s = scheme(p)
    if s is not None and s not in SCHEMES:
        raise StorageError(
            f"{what}={_text(p)!r}: the scheme "
            f"{s}:// is not one diffjax reads or writes. Fix: use a local path or a gs:// URL "
            f"(Google Cloud Storage), e.g. gs://my-bucket/runs/default."
        )
    if s is not None:
        _configure_clients()
    return p if isinstance(p, epath.Path) else epath.Path(p)


TIMEOUT_VAR = "DIFFJAX_STORAGE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0  # one gcsfs call, retries included
CONNECT_TIMEOUT_S = 10.0  # one request's connection
READ_TIMEOUT_S = 30.0  # one request's silence (a stalled server)
LOOKUP_TIMEOUT_S = 10.0  # gcsfs's bucket-type lookup on Google Cloud (then the plain API)
_state: dict[str, Any] = {"timeout_s": None, "configured": None}


def timeout_s() -> float:
    """The budget of one call into a bucket, retries included: :func:`set_timeout`'s, else
    ``DIFFJAX_STORAGE_TIMEOUT_S``, else :data:`DEFAULT_TIMEOUT_S`."""
    if _state["timeout_s"] is not None:
        return _state["timeout_s"]
    raw = os.environ.get(TIMEOUT_VAR)
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise StorageError(
            f"{TIMEOUT_VAR}={raw!r} is not a number of seconds > 0. Fix: e.g. "
            f"{TIMEOUT_VAR}=300, or unset it for {DEFAULT_TIMEOUT_S:.0f} s."
        )
    return value


def set_timeout(seconds: float | None) -> None:
    """Bound every later call into a bucket by ``seconds`` (None: back to the default)."""
    if seconds is not None and not float(seconds) > 0:
        raise StorageError(f"a storage timeout must be > 0 s, not {seconds!r}.")
    _state["timeout_s"] = None if seconds is None else float(seconds)
    _state["configured"] = None


def _configure_clients() -> None:
    """The settings every client needs, derived from the environment once per timeout: the
    emulator's (see the module's docstring) and the timeouts."""
    budget = timeout_s()
    host = os.environ.get(EMULATOR_VAR)
    key = (budget, host)
    if _state["configured"] == key:
        return
    if host:
        os.environ.setdefault(TENSORSTORE_VAR, host if "://" in host else f"http://{host}")
        # before gcsfs is first imported (it reads this then): no storage-control lookups
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        os.environ.setdefault("NO_GCE_CHECK", "True")  # google-auth: no metadata probe
    for var, value in (
        ("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS", CONNECT_TIMEOUT_S),
        ("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", READ_TIMEOUT_S),
        ("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", 1),
    ):
        os.environ.setdefault(var, str(int(value)))
    gcsfs_log = logging.getLogger("gcsfs")
    if gcsfs_log.level == logging.NOTSET:
        # gcsfs logs each exhausted retry with its traceback; the StorageError that follows
        # names the path, the cause and the fix (a level the user set is kept)
        gcsfs_log.setLevel(logging.CRITICAL)
    import aiohttp
    import fsspec
    import fsspec.config

    options = {
        "requests_timeout": aiohttp.ClientTimeout(
            sock_connect=min(CONNECT_TIMEOUT_S, budget), sock_read=min(READ_TIMEOUT_S, budget)
        ),
    }
    if host:
        from gcsfs.core import GCSFileSystem

        # gcsfs was imported before the variable was set (by the user, or another library):
        # its JSON-API filesystem all the same
        for protocol in ("gs", "gcs"):
            fsspec.register_implementation(protocol, GCSFileSystem, clobber=True)
        options["token"] = "anon"  # an emulator checks none; looking for them costs seconds
        options["endpoint_url"] = host if "://" in host else f"http://{host}"
    else:
        options["retry_timeout"] = LOOKUP_TIMEOUT_S  # the bucket-type lookup (a gRPC call)
    token = options.pop("token", None)
    for protocol in ("gs", "gcs"):
        conf = fsspec.config.conf.setdefault(protocol, {})
        conf.pop("endpoint_url", None)  # the emulator of an earlier configuration
        if token is not None:
            conf.setdefault("token", token)  # the user's own fsspec token wins
        conf.update(options)
    _state["configured"] = key


def _use_emulator() -> None:  # the earlier name, for callers outside this module
    _configure_clients()


_TRANSIENT_FIX = (
    "check the network and that the bucket answers{where}; a slow bucket may need a larger "
    "budget ({var}=SECONDS or run.storage_timeout_s, now {budget:.0f} s)"
)


def _failed(op: str, p: PathLike, error: BaseException) -> StorageError:
    """A :class:`StorageError` for a bucket call that failed past its retries or its budget."""
    host = os.environ.get(EMULATOR_VAR)
    where = f" ({EMULATOR_VAR}={host})" if host else ""
    cause = f"{type(error).__name__}: {str(error)[:200]}".rstrip(": ")
    if "Timeout" in type(error).__name__:
        cause = f"no answer within {timeout_s():.0f} s ({cause})"
    fix = _TRANSIENT_FIX.format(where=where, var=TIMEOUT_VAR, budget=timeout_s())
    return StorageError(f"{op} {_text(p)}: {cause}. Fix: {fix}. Nothing was changed by it.")


def _bounded(op: str, p: PathLike, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, a call into the bucket of ``p``: an error that is not the
    answer itself (a missing object, a refused permission) becomes :func:`_failed`'s."""
    try:
        return fn(*args, **kwargs)
    except (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError):
        raise
    except PermissionError:
        raise
    except StorageError:
        raise
    except Exception as e:
        if _is_transport_error(e):
            raise _failed(op, p, e) from e
        raise


@contextlib.contextmanager
def guarded(op: str, p: PathLike):
    """Calls into the bucket of ``p`` that another library makes (Orbax's checkpoint saves,
    through gcsfs and tensorstore): a transport error past that library's own retries becomes
    :func:`_failed`'s :class:`StorageError` (``op`` names what was being done). Local paths and
    any other error pass through unchanged."""
    try:
        yield
    except StorageError:
        raise
    except Exception as e:
        if is_remote(p) and (_is_transport_error(e) or _is_tensorstore_unavailable(e)):
            raise _failed(op, p, e) from e
        raise


# tensorstore's status codes for a server that is gone, stalled or refusing for now
_TENSORSTORE_TRANSIENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED")


def _is_tensorstore_unavailable(e: BaseException) -> bool:
    return isinstance(e, ValueError) and str(e).startswith(_TENSORSTORE_TRANSIENT)


def _is_transport_error(e: BaseException) -> bool:
    import asyncio

    import aiohttp
    from fsspec.exceptions import FSTimeoutError

    if isinstance(e, (FSTimeoutError, asyncio.TimeoutError, TimeoutError, aiohttp.ClientError)):
        return True
    if isinstance(e, (ConnectionError, OSError)):
        return True
    try:
        from gcsfs.retry import HttpError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(e, HttpError) and (e.code in (408, 429) or (e.code or 0) >= 500)


def is_remote(p: PathLike) -> bool:
    return scheme(p) is not None


def absolute(p: PathLike) -> epath.Path:
    """A local path made absolute; a URL as it is."""
    p = path(p)
    return p if is_remote(p) else epath.Path(os.path.abspath(p))


def join(p: PathLike, *parts: str) -> str:
    """``p / parts`` as a string (the form the results and messages keep)."""
    return str(path(p).joinpath(*parts)) if is_remote(p) else os.path.join(p, *parts)


def makedirs(p: PathLike) -> None:
    """A local folder and its parents; nothing for a bucket (objects need no folders, and
    gcsfs would create a missing bucket: :func:`check_access` refuses one first)."""
    if not is_remote(p):
        os.makedirs(p, exist_ok=True)


def _remote(op: str, p: PathLike, method: str, *args):
    """``filesystem().method(*args)`` bounded by :func:`timeout_s` (fsspec cancels the call
    past it), its failure said by :func:`_failed`."""
    fs = filesystem()
    return _bounded(op, p, getattr(fs, method), *args, timeout=timeout_s())


def exists(p: PathLike) -> bool:
    if is_remote(p):
        path(p)
        return _remote("checking", p, "exists", _text(p))
    return os.path.exists(p)


def isdir(p: PathLike) -> bool:
    if is_remote(p):
        path(p)
        return _remote("listing", p, "isdir", _text(p))
    return os.path.isdir(p)


def read_bytes(p: PathLike) -> bytes:
    if is_remote(p):
        path(p)
        return _remote("reading", p, "cat_file", _text(p))
    return path(p).read_bytes()


def read_text(p: PathLike) -> str:
    return read_bytes(p).decode()


def read_json(p: PathLike) -> Any:
    return json.loads(read_text(p))


def write_bytes(p: PathLike, data: bytes) -> None:
    """Write ``data`` whole or not at all: a bucket's object appears when its upload completes;
    a local file is written under a temporary name and renamed."""
    if is_remote(p):
        path(p)
        _remote("writing", p, "pipe_file", _text(p), data)
        return
    p = os.fspath(p)
    parent = os.path.dirname(os.path.abspath(p))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(p)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_text(p: PathLike, text: str) -> None:
    write_bytes(p, text.encode())


def write_json(p: PathLike, obj: Any, **kwargs) -> None:
    write_text(p, json.dumps(obj, **{"indent": 1, **kwargs}))


def save_figure(fig, p: PathLike, **kwargs) -> None:
    """A matplotlib figure as a PNG at ``p`` (rendered in memory, then written whole)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", **kwargs)
    write_bytes(p, buf.getvalue())


def download(p: PathLike, local_dir: str) -> str:
    """The file ``p`` copied into ``local_dir`` (its name kept); a local file is returned as it
    is. For readers that need a real file (memory-mapped safetensors, tokenizers)."""
    if not is_remote(p):
        return os.fspath(p)
    out = os.path.join(local_dir, path(p).name)
    _remote("downloading", p, "get_file", _text(p), out)
    return out


def upload(local: str, p: PathLike) -> None:
    """The local file ``local`` copied to ``p`` whole."""
    if not is_remote(p):
        shutil.copyfile(local, os.fspath(p))
        return
    path(p)
    _remote("uploading", p, "put_file", local, _text(p))


# ------------------------------------------------------------------------ objects in a bucket
def filesystem():
    """The fsspec filesystem of ``gs://`` (gcsfs; one per process, thread-safe: its requests run
    on its own event loop)."""
    import fsspec

    _configure_clients()
    return fsspec.filesystem("gs")


def read_ranges(urls: list[str], starts: list[int], stops: list[int]) -> list[bytes]:
    """Bytes ``[starts[i], stops[i])`` of the object ``urls[i]``, for every ``i``, as concurrent
    ranged reads (HTTP ``Range`` requests, all in flight at once)."""
    if not urls:
        return []
    fs = filesystem()
    return _bounded(
        "reading",
        urls[0] if len(urls) == 1 else f"{urls[0]} (and {len(urls) - 1} more)",
        fs.cat_ranges,
        list(urls),
        list(starts),
        list(stops),
        on_error="raise",
        timeout=timeout_s(),
    )


def object_sizes(prefix: PathLike) -> dict[str, int]:
    """The objects directly under the prefix ``prefix`` (a bucket's "folder"): name -> bytes, in
    one listing."""
    fs = filesystem()
    try:
        listed = _bounded(
            "listing", prefix, fs.ls, _text(prefix), detail=True, refresh=True, timeout=timeout_s()
        )
    except FileNotFoundError:
        return {}
    return {
        e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"])
        for e in listed
        if e.get("type") == "file"
    }


def same_bytes(p: PathLike, data: bytes) -> bool:
    """Whether the file or object ``p`` holds exactly ``data`` (an object is compared by its
    size and MD5 hash, without downloading it)."""
    if not is_remote(p):
        p = os.fspath(p)
        if not os.path.isfile(p) or os.path.getsize(p) != len(data):
            return False
        with open(p, "rb") as fh:
            return fh.read() == data
    try:
        fs = filesystem()
        info = _bounded("checking", p, fs.info, _text(p), refresh=True, timeout=timeout_s())
    except FileNotFoundError:
        return False
    if int(info.get("size", -1)) != len(data):
        return False
    if info.get("md5Hash"):
        digest = base64.b64encode(hashlib.md5(data).digest()).decode()
        return info["md5Hash"] == digest
    return read_bytes(p) == data


def remove(p: PathLike) -> None:
    """Delete the file or object ``p`` (nothing when it is missing)."""
    if is_remote(p):
        try:
            _remote("deleting", p, "rm_file", _text(p))
        except FileNotFoundError:
            pass
    elif os.path.exists(p):
        os.remove(p)


# ------------------------------------------------------------------------ checks before compute
def _bucket(p: PathLike) -> tuple[str, str]:
    rest = _text(p).split("://", 1)[1]
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix.strip("/")


def _gcs_client():
    from google.cloud import storage as gcs

    if os.environ.get(EMULATOR_VAR):
        from google.auth.credentials import AnonymousCredentials

        return gcs.Client(project="diffjax-emulator", credentials=AnonymousCredentials())
    import google.auth

    credentials, project = google.auth.default()
    return gcs.Client(project=project, credentials=credentials)


def _credentials_fix() -> str:
    return (
        "on a Google Cloud VM (TPU or GPU) its service account is used: give it access to the "
        "bucket; elsewhere run `gcloud auth application-default login` or set "
        "GOOGLE_APPLICATION_CREDENTIALS to a service account's key file (or "
        f"{EMULATOR_VAR}=http://HOST:PORT for a GCS emulator)"
    )


def check_access(p: PathLike, *, what: str, write: bool) -> None:
    """Refuse, before any compute, a ``gs://`` path diffjax could not use: an unknown scheme,
    no credentials, a bucket that does not exist, or no permission to list (and with
    ``write``, to create an object: a probe object under ``p`` is written and deleted, so
    nothing already in the bucket is touched). A local path passes (its errors are the
    operating system's)."""
    path(p, what=what)
    if not is_remote(p):
        return
    bucket, prefix = _bucket(p)
    shown = _text(p)
    if not bucket:
        raise StorageError(f"{what}={shown!r} names no bucket. Fix: gs://BUCKET/path.")
    try:
        import google.auth.exceptions
        from google.api_core import exceptions as api
    except ImportError as e:  # pragma: no cover - a dependency of diffjax
        raise StorageError(
            f"{what}={shown!r}: the Google Cloud Storage client is not installed ({e}). "
            f"Fix: pip install google-cloud-storage gcsfs."
        ) from None
    try:
        client = _gcs_client()
    except google.auth.exceptions.DefaultCredentialsError as e:
        raise StorageError(
            f"{what}={shown!r}: no Google Cloud credentials were found ({str(e)[:200]}). "
            f"Fix: {_credentials_fix()}."
        ) from None
    from google.cloud.storage.retry import DEFAULT_RETRY

    # 429, 5xx and dropped connections retried with capped backoff and jitter, within the budget
    bounded = {
        "retry": DEFAULT_RETRY.with_timeout(timeout_s()),
        "timeout": (min(CONNECT_TIMEOUT_S, timeout_s()), min(READ_TIMEOUT_S, timeout_s())),
    }
    try:
        listing = client.list_blobs(
            bucket, prefix=prefix + "/" if prefix else None, max_results=1, **bounded
        )
        list(listing)
        if write:
            probe = client.bucket(bucket).blob(
                f"{prefix}/.diffjax-write-check-{uuid.uuid4().hex}".lstrip("/")
            )
            probe.upload_from_string(
                b"", if_generation_match=0, retry=bounded["retry"], timeout=bounded["timeout"]
            )
            probe.delete(**bounded)
    except (google.auth.exceptions.GoogleAuthError, api.Unauthorized) as e:
        raise StorageError(
            f"{what}={shown!r}: Google Cloud Storage refused the credentials (401 "
            f"unauthenticated: {type(e).__name__}: {str(e)[:200]}). Fix: {_credentials_fix()}."
        ) from None
    except api.NotFound:
        raise StorageError(
            f"{what}={shown!r}: the bucket gs://{bucket} does not exist (or is not visible to "
            f"these credentials). Fix: create it (gcloud storage buckets create gs://{bucket} "
            f"--location=REGION, in the region of the TPUs or GPUs) or correct the name."
        ) from None
    except api.Forbidden as e:
        need = "create and read objects in" if write else "read"
        role = "roles/storage.objectUser" if write else "roles/storage.objectViewer"
        raise StorageError(
            f"{what}={shown!r}: these credentials may not {need} gs://{bucket} (403: "
            f"{str(e)[:200]}). Fix: grant the account {role} on the bucket (gcloud storage "
            f"buckets add-iam-policy-binding gs://{bucket} --member=... --role={role}), or use "
            f"a bucket it can write."
        ) from None
    except (api.GoogleAPIError, OSError) as e:  # RetryError: the budget ran out
        raise StorageError(
            f"{what}={shown!r}: Google Cloud Storage could not be reached "
            f"({type(e).__name__}: {str(e)[:200]}). Fix: check the network and the bucket name"
            + (
                f" ({EMULATOR_VAR}={os.environ[EMULATOR_VAR]})"
                if os.environ.get(EMULATOR_VAR)
                else ""
            )
            + f"; a slow bucket may need a larger budget ({TIMEOUT_VAR}=SECONDS or "
            f"run.storage_timeout_s, now {timeout_s():.0f} s)."
        ) from None


# ------------------------------------------------------------------------ files that grow
class SyncedDir:
    """A local folder standing for the folder ``remote`` (local or a bucket's): files that grow
    by appends are written here, and :meth:`sync` copies each changed one to ``remote`` whole.

    For a local ``remote`` it *is* the folder (nothing to copy). For a bucket, a reader of
    ``remote`` sees each file as of its last upload (an object is replaced whole, never torn);
    a process killed with SIGKILL loses what was written after the last :meth:`sync`.
    ``pull(name)`` starts a file from the copy in ``remote`` (to append to it after a resume,
    on a machine whose local disk holds nothing of the run)."""

    def __init__(self, remote: PathLike, every_s: float = 30.0):
        self.remote, self.every_s = remote, every_s
        self.is_remote = is_remote(remote)
        if self.is_remote:
            self.local = tempfile.mkdtemp(prefix="diffjax-sync-")
        else:
            self.local = os.fspath(remote)
            os.makedirs(self.local, exist_ok=True)
        self._sent: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) uploaded
        self._last = time.monotonic()

    def local_path(self, *parts: str) -> str:
        return os.path.join(self.local, *parts)

    def pull(self, name: str) -> None:
        if not self.is_remote:
            return
        src = path(self.remote) / name
        try:  # no existence check first: a missing object is the download's own answer
            download(src, os.path.dirname(self.local_path(name)) or self.local)
        except FileNotFoundError:
            return
        self._sent[name] = self._stamp(name)

    def _stamp(self, rel: str) -> tuple[int, int]:
        st = os.stat(self.local_path(rel))
        return st.st_size, st.st_mtime_ns

    def due(self) -> bool:
        """``every_s`` seconds have passed since the last :meth:`sync`."""
        return time.monotonic() - self._last >= self.every_s

    def sync(self) -> None:
        """Upload every file changed since its last upload."""
        if not self.is_remote:
            return
        self._last = time.monotonic()
        for root, _, files in os.walk(self.local):
            for name in files:
                rel = os.path.relpath(os.path.join(root, name), self.local)
                stamp = self._stamp(rel)
                if self._sent.get(rel) != stamp:
                    upload(self.local_path(rel), path(self.remote).joinpath(*rel.split(os.sep)))
                    self._sent[rel] = stamp

    def close(self) -> None:
        self.sync()
        if self.is_remote:
            shutil.rmtree(self.local, ignore_errors=True)
