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

Pointing the clients at an emulator: ``STORAGE_EMULATOR_HOST`` (the Google client libraries and
gcsfs) and ``TENSORSTORE_GCS_HTTP_URL`` (tensorstore, the checkpoints); when only the first is
set, the second is set to it. On Google Cloud the application default
credentials are used (a VM's service account, ``gcloud auth application-default login``, or
``GOOGLE_APPLICATION_CREDENTIALS``).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
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
        _use_emulator()
    return p if isinstance(p, epath.Path) else epath.Path(p)


def _use_emulator() -> None:
    """With ``STORAGE_EMULATOR_HOST`` set: tensorstore to the same server (unless
    ``TENSORSTORE_GCS_HTTP_URL`` says otherwise) and gcsfs without credentials (an emulator
    checks none; looking for them costs seconds per process)."""
    host = os.environ.get(EMULATOR_VAR)
    if not host:
        return
    os.environ.setdefault(TENSORSTORE_VAR, host if "://" in host else f"http://{host}")
    import fsspec.config

    for protocol in ("gs", "gcs"):
        fsspec.config.conf.setdefault(protocol, {}).setdefault("token", "anon")


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


def exists(p: PathLike) -> bool:
    return path(p).exists()


def isdir(p: PathLike) -> bool:
    return path(p).is_dir()


def read_bytes(p: PathLike) -> bytes:
    return path(p).read_bytes()


def read_text(p: PathLike) -> str:
    return path(p).read_text()


def read_json(p: PathLike) -> Any:
    return json.loads(read_text(p))


def write_bytes(p: PathLike, data: bytes) -> None:
    """Write ``data`` whole or not at all: a bucket's object appears when its upload completes;
    a local file is written under a temporary name and renamed."""
    if is_remote(p):
        path(p).write_bytes(data)
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
    with path(p).open("rb") as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 16 << 20)
    return out


def upload(local: str, p: PathLike) -> None:
    """The local file ``local`` copied to ``p`` whole."""
    if not is_remote(p):
        shutil.copyfile(local, os.fspath(p))
        return
    with open(local, "rb") as src, path(p).open("wb") as dst:
        shutil.copyfileobj(src, dst, 16 << 20)


# ------------------------------------------------------------------------ objects in a bucket
def filesystem():
    """The fsspec filesystem of ``gs://`` (gcsfs; one per process, thread-safe: its requests run
    on its own event loop)."""
    import fsspec

    _use_emulator()
    return fsspec.filesystem("gs")


def read_ranges(urls: list[str], starts: list[int], stops: list[int]) -> list[bytes]:
    """Bytes ``[starts[i], stops[i])`` of the object ``urls[i]``, for every ``i``, as concurrent
    ranged reads (HTTP ``Range`` requests, all in flight at once)."""
    if not urls:
        return []
    return filesystem().cat_ranges(list(urls), list(starts), list(stops), on_error="raise")


def object_sizes(prefix: PathLike) -> dict[str, int]:
    """The objects directly under the prefix ``prefix`` (a bucket's "folder"): name -> bytes, in
    one listing."""
    fs = filesystem()
    try:
        listed = fs.ls(_text(prefix), detail=True, refresh=True)
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
        info = filesystem().info(_text(p), refresh=True)
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
            filesystem().rm_file(_text(p))
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
    try:
        list(client.list_blobs(bucket, prefix=prefix + "/" if prefix else None, max_results=1))
        if write:
            probe = client.bucket(bucket).blob(
                f"{prefix}/.diffjax-write-check-{uuid.uuid4().hex}".lstrip("/")
            )
            probe.upload_from_string(b"", if_generation_match=0)
            probe.delete()
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
    except (api.GoogleAPICallError, OSError) as e:
        raise StorageError(
            f"{what}={shown!r}: Google Cloud Storage could not be reached "
            f"({type(e).__name__}: {str(e)[:200]}). Fix: check the network and the bucket name"
            + (
                f" ({EMULATOR_VAR}={os.environ[EMULATOR_VAR]})"
                if os.environ.get(EMULATOR_VAR)
                else ""
            )
            + "."
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
        if src.exists():
            download(src, os.path.dirname(self.local_path(name)) or self.local)
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
