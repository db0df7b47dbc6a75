"""The Python examples of the README and docs/api.md run as written, each on its own in a fresh
interpreter, as a reader pastes one (the PyTorch one needs torch, and the ones that read checkpoints at
``path/to/...`` need those files: both are skipped; tests/test_hf.py runs that API)."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).parent.parent / "README.md"
ROOT = README.parent
PAGES = (README, ROOT / "docs" / "api.md")  # the pages whose examples a reader pastes

# printed after a block: the shapes of the names the assertions read, as JSON on the last line
REPORT = """
import json as _json
_names = {k: v for k, v in dict(globals()).items() if not k.startswith("_")}
print(_json.dumps({k: list(v.shape) for k, v in _names.items()
                   if isinstance(getattr(v, "shape", None), tuple)}
                  | {"vocab_size": getattr(_names.get("cfg"), "vocab_size", None)}))
"""


def runnable_blocks() -> list[str]:
    blocks = [b for p in PAGES for b in re.findall(r"```python\n(.*?)```", p.read_text(), re.S)]
    return [b for b in blocks if "torch_module" not in b and "path/to/" not in b]


def run_block(block: str) -> dict:
    """Run ``block`` in a fresh ``python`` (from the repository root, nothing else defined);
    the shapes of the arrays it leaves (and ``cfg.vocab_size``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    flags = os.environ.get("XLA_FLAGS", "").split()  # the suite's, without a device count
    env["XLA_FLAGS"] = " ".join(f for f in flags if "device_count" not in f)
    p = subprocess.run(
        [sys.executable, "-c", block + REPORT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, f"README block failed on its own:\n{block}\n{p.stderr[-3000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_readme_has_runnable_examples():
    assert len(runnable_blocks()) >= 4


@pytest.mark.parametrize("index", range(len(runnable_blocks())))
def test_readme_example_runs_on_its_own(index):
    block = runnable_blocks()[index]
    shapes = run_block(block)
    if re.search(r"^y = ", block, re.M):  # the attention layers
        assert shapes["y"] == [2, 64, 1024]
    if re.search(r"^logits = ", block, re.M):  # the language model
        assert shapes["logits"] == [*shapes["tokens"], shapes["vocab_size"]]
        assert shapes["tokens"][0] == 1 and shapes["tokens"][1] > 1
    if re.search(r"^greedy = ", block, re.M):  # generation
        assert shapes["greedy"] == [1, 4 + 16]
    if re.search(r"^out = differential_flash_attention", block, re.M):  # the kernel
        assert shapes["out"] == [1, 128, 4, 128]


def test_readme_examples_cover_the_layers_and_the_model():
    """The two assertions on ``y`` and ``logits`` above are reached: some block defines each."""
    blocks = runnable_blocks()
    assert any(re.search(r"^y = ", b, re.M) for b in blocks)
    assert any(re.search(r"^logits = ", b, re.M) for b in blocks)


def test_readme_starts_with_the_two_commands():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    assert "python train.py" in first_block
    ci = (README.parent / ".ci" / "run").read_text()
    test_cmd = next(l.split("#")[0].strip() for l in first_block.splitlines() if "pytest" in l)
    assert test_cmd in ci, "the README's test command must be exactly what .ci/run runs"
