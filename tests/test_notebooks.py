"""Every notebook's code cells run top to bottom (shell lines skipped, plots off-screen)."""

import json
import pathlib

import matplotlib
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch):
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "show", lambda *a, **k: plt.close("all"))
    nb = json.loads(path.read_text())
    namespace: dict = {}
    for i, cell in enumerate(c for c in nb["cells"] if c["cell_type"] == "code"):
        lines = [l for l in "".join(cell["source"]).splitlines()
                 if not l.lstrip().startswith(("!", "%"))]
        exec(compile("\n".join(lines), f"{path.name}[{i}]", "exec"), namespace)


def test_there_is_a_notebook():
    assert NOTEBOOKS, "notebooks/ should hold at least the quickstart"
