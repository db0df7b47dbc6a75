"""``python -m diffjax.plan``: the real train step compiled for a TPU slice and a GPU node that
are not here, its memory against the target's HBM, and the refusals.

Every plan that compiles runs in a child process of ``$DIFFJAX_COMPILE_PYTHON`` (a venv holding
the ``compile`` extra: the CUDA PJRT plugin, ptxas and libtpu; ``.ci/run`` makes it), as
tests/test_compile_kernels.py does; without it those tests are skipped, saying so. A tiny model
(1 layer, width 64) keeps each compile to seconds. The refusals run in this process: they come
before any compiler is asked for.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess

import pytest

from diffjax import plan as planner

ROOT = pathlib.Path(__file__).resolve().parent.parent
# one xdist worker runs every test that starts the compile venv's jax (libtpu lets one process
# at a time hold its lock file)
pytestmark = pytest.mark.xdist_group("compile")
PYTHON = os.environ.get("DIFFJAX_COMPILE_PYTHON")
needs_compilers = pytest.mark.skipif(
    not PYTHON,
    reason="DIFFJAX_COMPILE_PYTHON is unset: the planner needs the compile extra's venv "
    "(python -m venv --system-site-packages V && V/bin/pip install -e '.[compile]'; .ci/run "
    "makes one)",
)

# a tiny DIFF V1 model (2 DIFF heads of 2 x 16) and its twin (4 heads), FSDP over the 8 devices,
# 16 sequences of 256: activations dominate its memory, so accumulation and remat show
TINY = [
    "model.d_model=64",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.max_seq_len=256",
    "model.vocab_size=256",
    "data.seq_len=256",
    "train.batch_size=16",
    "mesh.fsdp=-1",
]


def plan(*args: str, python: str | None = None, timeout: int = 240):
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        TF_CPP_MIN_LOG_LEVEL="3",
        # the compilers' own optimisation levels, not the suite's level 0 (tests/conftest.py)
        XLA_FLAGS=" ".join(
            f for f in os.environ.get("XLA_FLAGS", "").split() if "optimization_level" not in f
        ),
    )
    for var in planner.GPU_MEM_FRACTION_VARS:  # JAX's default GPU budget: 75% of the memory
        env.pop(var, None)
    return subprocess.run(
        [python or PYTHON, "-m", "diffjax.plan", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def h100_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "h100.json"
    proc = plan("plan.target=h100-8", f"plan.json={out}", *TINY)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def _check_both_models(proc, target: str):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert f"target {target}" in out
    for label in ("[diff] diff_v1", "[standard] standard"):
        assert label in out, out
    assert out.count("FITS (") == 2, out
    assert out.count("Pallas (") == 2, out  # the kernels, not the XLA path, were compiled
    assert "tokens/s at MFU 0.4" in out or "FLOPs/step, formula         n/a" in out
    assert f"plan: every model fits on {target}" in out


@needs_compilers
def test_tiny_plan_on_a_tpu_slice(tmp_path):
    """...and plan.dump writes each model's compiled step and its memory breakdown."""
    dump = tmp_path / "dump"
    proc = plan("plan.target=v5e-8", f"plan.dump={dump}", *TINY)
    _check_both_models(proc, "v5e-8")
    for label in ("diff", "standard"):
        assert f"[{label}] the compiled step: {dump / label}.hlo.txt" in proc.stdout
        assert "HloModule" in (dump / f"{label}.hlo.txt").read_text()
        memory = json.loads((dump / f"{label}.memory.json").read_text())
        assert "temp_size" in memory and memory["params"] > 0 and memory["argument_size"] > 0


@needs_compilers
def test_tiny_plan_on_a_gpu_node(h100_plan):
    proc, rec = h100_plan
    _check_both_models(proc, "h100-8")
    diff, std = rec["models"]
    assert (diff["label"], std["label"]) == ("diff", "standard")
    assert "budget per GPU: 60 GiB, the 75% of its memory JAX's allocator takes" in proc.stdout
    for m in (diff, std):
        assert m["hbm_bytes"] == 60 * 1024**3  # 0.75 x 80 GiB
        assert m["fits"] and m["kernel_calls"] > 0
        assert 0 < m["params_bytes"] and 2 * m["params_bytes"] <= m["opt_bytes"] + 64
        assert m["total_bytes"] >= m["params_bytes"] + m["opt_bytes"] + m["temp_bytes"]


@needs_compilers
def test_a_context_axis_compiles_as_a_ring_for_a_gpu_node(tmp_path):
    """mesh.context=4 on an h100-8 (data=2): the DIFF step compiles with the sequence split,
    the ring's K/V hops in the program (its collective-permutes) and its blocks on the fused
    kernels, in the zigzag order the loop lays its batches in (the planner traces the loop's
    own batch: positions and token_index). Triton for the H100: five blocks (the local one, and
    the two halves a remote block can be, inside the ring's loop and at its last step), each
    with its forward, dK/dV and dQ kernels. In the contiguous order a remote block is whole or
    hidden: three blocks."""
    out = tmp_path / "context.json"
    args = ["plan.target=h100-8", "plan.model=diff", "plan.search=none", f"plan.json={out}"]
    ctx = ["mesh.fsdp=1", "mesh.data=2", "mesh.context=4", "train.batch_size=2"]
    ctx += ["model.scan_layers=true"]  # the ring inside the scan over layers (Shardy's split)
    proc = plan(*args, *TINY, *ctx)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mesh data=2 fsdp=1 context=4 tensor=1" in proc.stdout
    (m,) = json.loads(out.read_text())["models"]
    assert m["fits"] and m["permutes"] >= 2 and m["kernel_calls"] == 15, m
    assert f"{m['permutes']} collective-permutes in the program" in proc.stdout
    contiguous = tmp_path / "contiguous.json"
    args[-1] = f"plan.json={contiguous}"
    proc = plan(*args, *TINY, *ctx, "mesh.context_order=contiguous")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(contiguous.read_text())["models"][0]["kernel_calls"] == 9


@needs_compilers
@pytest.mark.parametrize(
    "target,impl,calls",
    [
        # documents apart: V1 as four cuDNN calls (the packed layout takes V in halves), each
        # with its backward; the twin one call and its backward
        ("h100-8", "cudnn", {"diff": "cuDNN (8 cuDNN attention", "standard": "cuDNN (2 cuDNN"}),
        # V1 as two Splash calls sharing V (forward, dQ and dK/dV kernels each); the twin one
        ("v5e-8", "splash", {"diff": "Splash (6 Splash kernel", "standard": "Splash (3 Splash"}),
    ],
)
def test_the_vendors_attention_is_in_the_compiled_step_of_its_target(tmp_path, target, impl, calls):
    """The loop's train step compiled for an H100 node with model.attention_impl=cudnn holds
    cuDNN's attention custom calls (jax traces them for the target's GPU and cuDNN 9.12,
    compile-only); for a v5e slice with splash, the Splash kernels."""
    dump = tmp_path / "dump"
    tiny = [a for a in TINY if not a.startswith("train.batch_size")] + ["train.batch_size=8"]
    proc = plan(
        f"plan.target={target}", "plan.search=none", f"plan.dump={dump}", *tiny,
        "model.dtype=bfloat16", f"model.attention_impl={impl}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for label, line in calls.items():
        assert line in proc.stdout, proc.stdout
        text = (dump / f"{label}.hlo.txt").read_text()
        marker = "__cudnn$fmhaSoftmax" if impl == "cudnn" else "splash_mha_fwd"
        assert marker in text


@needs_compilers
def test_no_fit_names_a_setting_that_fits(h100_plan, tmp_path):
    _, rec = h100_plan
    diff = rec["models"][0]
    # between what the step needs as configured and what it needs with 2 microbatches
    hbm = (diff["total_bytes"] - 0.3 * diff["temp_bytes"]) / 1024**3
    out = tmp_path / "nofit.json"
    proc = plan(
        "plan.target=h100-8",
        "plan.model=diff",
        "plan.search=accum",  # one try, 2 microbatches (plan.search=all would try remat=dots first)
        f"plan.hbm_gib={hbm:.6f}",
        f"plan.json={out}",
        *TINY,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DOES NOT FIT (over by" in proc.stdout
    (m,) = json.loads(out.read_text())["models"]
    assert not m["fits"] and m["fix"], proc.stdout
    assert m["tried"][-1]["fits"] and m["tried"][-1]["total_bytes"] <= hbm * 1024**3
    fix = " ".join(m["fix"])
    assert fix == "train.grad_accum_steps=2"
    assert fix == "train.grad_accum_steps=2"
    assert f"FIX [diff]: pass {fix}" in proc.stdout
    assert f"plan: [diff] does not fit on h100-8; fits with: {fix}" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan.target=v9x-8"], "unknown target 'v9x-8'. Fix: use one of v5e-8, v6e-8, v5p-8"),
        # 2 DIFF heads cannot be split 8 ways: refused, naming the tensor sizes that work
        (
            ["plan.target=v5e-8", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=8"],
            "mesh.tensor=8 does not divide the model.num_heads=2 DIFF heads (pairs)",
        ),
        # v5p-8 is 4 chips: a mesh of 8 does not cover it
        (["plan.target=v5p-8", "mesh.data=1", "mesh.fsdp=8"], "v5p-8 has 4 devices"),
        (["plan.target=h100-8", "train.batch_size=12"], "Fix: use a batch size that is a multiple"),
    ],
)
def test_bad_input_is_refused_before_compiling(args, message, capsys):
    """Refused by the checks, before any compiler is asked: in this process, which has none."""
    assert planner.main([*TINY, *args]) == 2
    err = capsys.readouterr()
    assert message in err.err, err.err
    assert "Fix:" in err.err
    assert "FITS" not in err.out


def test_a_missing_compiler_is_named_with_the_extra_to_install(capsys):
    """This interpreter (the test environment) has no libtpu: the plan says which extra."""
    if importlib.util.find_spec("libtpu") is not None:
        pytest.skip("libtpu is installed in this interpreter")
    assert planner.main(["plan.target=v5e-8", *TINY]) == 2
    err = capsys.readouterr().err
    assert "libtpu is not installed" in err
    assert "pip install -e '.[compile]'" in err


def test_a_gpu_budget_is_the_part_of_its_memory_jax_takes(monkeypatch, capsys):
    """JAX's GPU allocator takes 75% of each GPU unless XLA_CLIENT_MEM_FRACTION (or the older
    XLA_PYTHON_CLIENT_MEM_FRACTION) says otherwise; a TPU's budget is its HBM."""
    h100, v5e = planner.TARGETS["h100-8"], planner.TARGETS["v5e-8"]
    assert h100.budget_gib({}) == 60 and v5e.budget_gib({}) == 16
    assert h100.budget_gib({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".95"}) == pytest.approx(76)
    assert h100.budget_gib({"XLA_CLIENT_MEM_FRACTION": "0.5"}) == 40
    assert v5e.budget_gib({"XLA_CLIENT_MEM_FRACTION": "0.5"}) == 16
    for bad in ("1.5", "0", "most"):
        with pytest.raises(planner.PlanError, match="must be a fraction in"):
            h100.budget_gib({"XLA_CLIENT_MEM_FRACTION": bad})
    # refused before any compiler is asked for (this process has none)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "95")
    assert planner.main(["plan.target=h100-8", *TINY]) == 2
    err = capsys.readouterr().err
    assert "XLA_CLIENT_MEM_FRACTION='95': must be a fraction in (0, 1]" in err and "Fix:" in err


def test_the_planner_lowers_the_program_train_py_runs():
    """Given this machine's CPU as its target, the planner lowers the very program the training
    loop compiles for the same config (the loop's own jitted step: no second copy)."""
    import jax
    from flax import nnx

    from diffjax.infra import sharding
    from diffjax.infra.runtime import Runtime
    from diffjax.train import setup as setup_lib
    from diffjax.train import step as step_lib
    from diffjax.compare import load_comparison
    from diffjax.train.config import apply_overrides

    overrides = ["model.d_model=32", "model.num_layers=2", "model.num_heads=1", "data.seq_len=16"]
    overrides += ["model.max_seq_len=32", "train.batch_size=4", "data.max_files=8"]
    exp = apply_overrides(load_comparison(None), overrides)
    devices = jax.devices()[:1]
    kind = devices[0].device_kind
    target = planner.Target("this CPU", "cpu", 1, 1.0, kind, 1.0, "cpu")
    mesh = sharding.make_mesh(exp.mesh, devices)
    for model_cfg in exp.models.values():
        _, lowered, _ = planner.lower_train_step(exp, model_cfg, devices, target)
        runtime = Runtime.of(model_cfg, exp.mesh, mesh)
        with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.current_rules()):
            setup = setup_lib.model_setup(model_cfg, exp.train, runtime)
            state, rest = setup.fresh_state()
            rows = next(setup_lib.process_stream(exp, "train", mesh))
            batch = step_lib.model_inputs(rows, runtime, exp.train.batch_size)
            train, _ = setup_lib.jit_steps(setup, rest, {k: v.sharding for k, v in batch.items()})
            ours = train.lower(state, batch).as_text()
        assert lowered.as_text() == ours
