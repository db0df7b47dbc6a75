"""The README's Python examples run as written (the PyTorch one needs torch, and the ones that
read checkpoints at ``path/to/...`` need those files: both are skipped; tests/test_hf.py runs
that API)."""

import pathlib
import re

import jax.numpy as jnp

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    runnable = [b for b in blocks if "torch_module" not in b and "path/to/" not in b]
    assert len(runnable) >= 2
    namespace = {"tokens": jnp.zeros((1, 16), jnp.int32)}  # the README's placeholder input
    for i, block in enumerate(runnable):
        exec(compile(block, f"README.md[python {i}]", "exec"), namespace)
    assert namespace["y"].shape == (2, 64, 1024)
    assert namespace["logits"].shape == (1, 16, namespace["cfg"].vocab_size)


def test_readme_starts_with_the_two_commands():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    assert "python train.py" in first_block
    ci = (README.parent / ".ci" / "run").read_text()
    test_cmd = next(l.split("#")[0].strip() for l in first_block.splitlines() if "pytest" in l)
    assert test_cmd in ci, "the README's test command must be exactly what .ci/run runs"
