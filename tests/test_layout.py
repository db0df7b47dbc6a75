"""The package's layout: every import of diffjax sits at the top of its module (none inside a
function), and the import contracts of pyproject.toml (``[tool.importlinter]``: the experiment
layer above the library, the library's own layers, the kernels on their own) hold."""

from __future__ import annotations

import ast
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "diffjax"


def _imports_diffjax(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "diffjax"
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "diffjax" for alias in node.names)
    return False


def deferred_imports(path: pathlib.Path) -> list[int]:
    """The lines of ``path`` where an import of diffjax (absolute or relative) sits inside a
    function or method."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            lines.update(n.lineno for n in ast.walk(fn) if _imports_diffjax(n))
    return sorted(lines)


def test_deferred_imports_are_found(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(
        "import os\nfrom . import a\n\ndef f():\n    from .b import c\n    import json\n\n"
        "class K:\n    def m(self):\n        import diffjax.nn.model\n"
    )
    assert deferred_imports(path) == [5, 10]


def test_no_diffjax_import_inside_a_function():
    """An import of diffjax inside a function hides a dependency from the import contracts
    and from the reader (and usually a cycle or an import-time cost that should be fixed
    where it arises)."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in deferred_imports(path)
    ]
    assert not offenders, "imports of diffjax inside a function:\n" + "\n".join(offenders)


def test_the_kernels_contract_names_every_other_module():
    """The forbidden contract of the kernels lists diffjax's modules one by one: a new module
    must join the list (and the layers contract, whose ``exhaustive`` makes lint-imports say
    so)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (kernels,) = [c for c in config["contracts"] if c.get("source_modules") == ["diffjax.kernels"]]
    modules = {
        f"diffjax.{p.stem if p.is_file() else p.name}"
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    }
    assert set(kernels["forbidden_modules"]) == modules - {"diffjax.kernels"}


def test_import_contracts_hold():
    """``lint-imports`` (import-linter, in the ``test`` extra; CI runs it too)."""
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.skip("lint-imports is not installed (pip install -e '.[test]' installs it)")
    proc = subprocess.run(
        [exe, "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_importing_the_command_line_starts_no_jax_backend():
    """Every diffjax import sits at the top of its module, so ``import diffjax.compare`` imports
    the whole package: none of it may start a JAX backend at import, since train.py starts
    ``jax.distributed`` after its imports and before any device is touched."""
    code = (
        "import diffjax.compare, diffjax.sample\n"
        "try:\n"
        "    from jax._src.xla_bridge import backends_are_initialized\n"
        "except ImportError:\n"
        "    print('unknown')\n"
        "else:\n"
        "    print(backends_are_initialized())"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if proc.stdout.strip() == "unknown":
        pytest.skip("this jax has no jax._src.xla_bridge.backends_are_initialized")
    assert proc.stdout.strip() == "False"


# the distribution that provides each third-party module diffjax imports, where the names differ
_DISTRIBUTIONS = {
    "google": "google-cloud-storage",
    "tensorboardX": "tensorboardX",
    "lm_eval": "lm-eval",
    "orbax": "orbax-checkpoint",
    "nvidia": "nvidia-cuda-nvcc",
    "jaxlib": "jax",  # jax depends on the matching jaxlib
}


def test_every_third_party_import_is_declared():
    """Each module the package imports (at the top or inside a function) comes from a
    dependency of pyproject.toml or of one of its named extras (e.g. ``readers``: pyarrow and
    datasets for prepare's optional inputs)."""
    import re

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {}
    for extra, reqs in [("", project["dependencies"]), *project["optional-dependencies"].items()]:
        for req in reqs:
            name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0).lower().replace("_", "-")
            declared.setdefault(name, extra or "dependencies")
    missing = {}
    for path in (ROOT / "diffjax").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names}:
                if top in sys.stdlib_module_names or top == "diffjax":
                    continue
                dist = _DISTRIBUTIONS.get(top, top).lower().replace("_", "-")
                if dist not in declared:
                    missing.setdefault(dist, str(path.relative_to(ROOT)))
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
