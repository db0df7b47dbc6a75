"""Every notebook runs top to bottom in a real Jupyter kernel (nbclient) in the quick size, no
cell errors, and each draws at least one figure; committed notebooks carry no outputs; library
plots leave the caller's matplotlib backend alone (a notebook's inline backend)."""

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

from diffjax.evaluate import plots

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = {
    "quickstart.ipynb",
    "01_noise_floor.ipynb",
    "02_train_evaluate.ipynb",
    "03_kernel.ipynb",
}


def _kernel_env() -> dict[str, str]:
    """The kernel imports this checkout's diffjax, on one CPU device (not the suite's 8), with
    matplotlib's notebook default (no MPLBACKEND), in the quick size."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MPLBACKEND", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS")
    }
    # the suite's compiler flags (tests/conftest.py), without a device count
    flags = os.environ.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "device_count" not in f)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["DIFFJAX_NOTEBOOK_SIZE"] = "quick"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    return env


def test_the_notebooks_are_these():
    assert {p.name for p in NOTEBOOKS} == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_has_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, (
                f"{path.name} cell {i} holds outputs. Fix: clear them before committing "
                f"(jupyter nbconvert --clear-output --inplace {path.name})"
            )
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert "DIFFJAX_NOTEBOOK_SIZE" in first.source and "pip" in first.source, (
        f"{path.name}: its first code cell should be the install + size cell"
    )


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_in_a_kernel_and_draws(path):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    # a cell that raises fails the test here (CellExecutionError names the cell and the error)
    client.execute(env=_kernel_env())
    images = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]
    assert images, f"{path.name} ran but drew no figure (image/png output)"
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.get("output_type") == "error"
    ]
    assert not errors


def test_evaluation_plots_leave_the_matplotlib_backend_alone(tmp_path):
    """The evaluation's PNGs are drawn on an explicit Figure and Agg canvas: a notebook's own
    backend (here "pdf" stands in for inline) is unchanged and pyplot holds no new figure.
    (The training report's plot has the same test in test_train.py.)"""
    import matplotlib
    import numpy as np

    before = matplotlib.get_backend()
    matplotlib.use("pdf")
    try:
        import matplotlib.pyplot as plt

        open_figures = plt.get_fignums()
        plots.lines(
            {"a": (np.arange(4.0), np.arange(4.0))},
            xlabel="x",
            ylabel="y",
            title="t",
            path=str(tmp_path / "l.png"),
        )
        plots.retrieval_heatmaps(
            {"m": ([8, 16], [0.0, 1.0], np.eye(2))}, "r", str(tmp_path / "r.png")
        )
        assert matplotlib.get_backend() == "pdf"
        assert plt.get_fignums() == open_figures
        assert (tmp_path / "l.png").read_bytes()[:4] == b"\x89PNG"
    finally:
        matplotlib.use(before)
