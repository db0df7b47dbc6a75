"""The kernels' self-check (``diffjax.kernels.check``): in interpret mode every case passes;
planted errors (a wrong softmax scale, a dropped lambda, a causal mask off by one) fail it and
stop ``train.py`` before any training step; the cache skips what passed and checks again on a
jax upgrade; a config's check covers its own head and value widths."""

from __future__ import annotations

import json
import os

import jax
import pytest
from flax import nnx

import diffjax
from diffjax import ops
from diffjax.compare import cli
from diffjax.kernels import check, gpu

from tiny import tiny_run

F32_V1 = check.Case("v1", 64, 128, "float32")
F32_V2 = check.Case("v2", 64, 64, "float32")
F32_STD = check.Case("standard", 64, 64, "float32")


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    """Every test starts with an empty cache of its own (file and in-process memo)."""
    monkeypatch.setenv("DIFFJAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(check, "_PASSED", set())
    jax.clear_caches()  # planted errors must be traced anew, not found in a jit cache
    yield
    jax.clear_caches()


def _plant(monkeypatch, error: str) -> None:
    real_diff = gpu.differential_flash_attention
    if error == "scale":  # 1/sqrt(2d): V1's value width in place of the q/k width

        def wrong(q1, k1, q2, k2, v, lam, **kw):
            return real_diff(
                q1, k1, q2, k2, v, lam, **{**kw, "sm_scale": (2 * q1.shape[-1]) ** -0.5}
            )

        monkeypatch.setattr(gpu, "differential_flash_attention", wrong)
    elif error == "lambda":  # the second map dropped

        def wrong(q1, k1, q2, k2, v, lam, **kw):
            return real_diff(q1, k1, q2, k2, v, 0 * lam, **kw)

        monkeypatch.setattr(gpu, "differential_flash_attention", wrong)
    elif error == "causal":  # every query also sees the next key
        monkeypatch.setattr(gpu._Config, "offset", property(lambda c: c.kv_len - c.q_len + 1))
    else:
        raise AssertionError(error)


@pytest.mark.exhaustive  # by default: the command's 3 cases and the planted errors below
def test_every_standard_case_passes_interpreted():
    report = check.run_check(interpret=True)
    assert report.passed, "\n".join(report.lines())
    assert {(c.kind, c.head_dim, c.dtype) for c in (r.case for r in report.results)} == {
        (k, d, dt) for k in check.KINDS for d in (64, 128) for dt in ("float32", "bfloat16")
    }
    v1 = [r.case for r in report.results if r.case.kind == "v1"]
    assert all(c.v_head_dim == 2 * c.head_dim for c in v1)  # V1's value is 2d wide
    lines = report.lines()
    assert lines[0].startswith("kernel check on cpu, interpreted gpu kernel, jax ")
    assert (
        lines[-1]
        == f"PASS: {len(report.results)} of {len(report.results)} cases agree with the reference"
    )


def test_the_command_passes_and_prints_a_line_per_case(capsys):
    assert check.main(["check.interpret=true", "check.head_dim=64", "check.dtype=float32"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("kernel check on cpu") and jax.__version__ in out[0]
    assert [line.split()[:2] for line in out[1:4]] == [
        ["ok", "v1"],
        ["ok", "v2"],
        ["ok", "standard"],
    ]
    assert out[-1].startswith("PASS: 3 of 3")


@pytest.mark.parametrize("error", ["scale", "lambda", "causal"])
def test_a_planted_error_fails_the_check(monkeypatch, capsys, error):
    _plant(monkeypatch, error)
    code = check.main(
        ["check.interpret=true", "check.head_dim=64", "check.dtype=float32", "check.kind=v1,v2"]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL v1 d=64 dv=128 float32" in out and "FAIL v2 d=64 dv=64 float32" in out
    assert out.splitlines()[-1].startswith("FAIL: 0 of 2")
    if error == "causal":  # the standard kernel shares the mask
        report = check.run_check([F32_STD], interpret=True)
        assert not report.passed


def test_train_py_stops_before_training_on_a_failed_check(monkeypatch, tmp_path, capsys):
    _plant(monkeypatch, "lambda")
    run_dir = tmp_path / "run"
    code = cli.main(
        [
            f"run.dir={run_dir}",
            *tiny_run(
                "compare.twins=",
                "model.d_model=64",  # V1, one head: d = 32, V 64 wide
                "data.seq_len=32",
                "train.steps=3",
                "train.kernel_check=interpret",
            ),
        ]
    )
    err = capsys.readouterr()
    text = err.out + err.err
    assert code != 0
    assert "FAIL v1 d=32 dv=64 float32" in text  # the run's own widths
    assert "model.attention_impl=xla" in text and "python -m diffjax.kernels.check" in text
    metrics = list(run_dir.rglob("metrics.jsonl"))
    assert not any(p.read_text().strip() for p in metrics)  # no training step was taken
    assert not list(run_dir.rglob("checkpoints/*/"))


def test_passes_are_cached_and_a_jax_upgrade_checks_again(monkeypatch):
    calls = []
    real = check.check_case

    def counted(case, **kw):
        calls.append(case.name)
        return real(case, **kw)

    monkeypatch.setattr(check, "check_case", counted)
    assert check.ensure_checked([F32_V2], interpret=True) is not None
    assert calls == [F32_V2.name]
    with open(check.cache_path()) as f:
        keys = list(json.load(f))
    assert len(keys) == 1 and "jax " in keys[0] and F32_V2.name in keys[0]
    monkeypatch.setattr(check, "_PASSED", set())  # a new process: read from the file
    assert check.ensure_checked([F32_V2], interpret=True) is None
    assert calls == [F32_V2.name]
    monkeypatch.setattr(check, "versions", lambda: "jax 99.0, jaxlib 99.0")  # an upgrade
    assert check.ensure_checked([F32_V2], interpret=True) is not None
    assert calls == [F32_V2.name, F32_V2.name]


def test_failures_are_not_cached(monkeypatch):
    _plant(monkeypatch, "lambda")
    with pytest.raises(check.KernelCheckError, match="v2 d=64 dv=64 float32"):
        check.ensure_checked([F32_V2], interpret=True)
    assert not os.path.exists(check.cache_path()) or not json.load(open(check.cache_path()))


@pytest.mark.parametrize(
    "config,want",
    [
        (dict(attention="diff_v1", d_model=192, num_heads=2), ("v1", 48, 96)),
        (dict(attention="diff_v2", d_model=96, num_heads=2, head_dim=40), ("v2", 40, 40)),
        (
            dict(attention="standard", d_model=96, num_heads=3, dtype="bfloat16"),
            ("standard", 32, 32),
        ),
    ],
)
def test_a_configs_check_covers_its_own_widths(monkeypatch, config, want):
    seen = []
    monkeypatch.setattr(
        check,
        "run_check",
        lambda cases, **kw: seen.extend(cases) or check.CheckReport("x", "y", ()),
    )
    cfg = diffjax.ModelConfig(**config)
    assert ops.check_kernels(cfg) is None  # on CPU the model runs the XLA path: nothing to check
    ops.check_kernels(cfg, interpret=True)
    dtypes = {"float32", cfg.dtype}
    assert {(c.kind, c.head_dim, c.v_head_dim) for c in seen} == {want}
    assert {c.dtype for c in seen} == dtypes


def test_explicit_pallas_on_cpu_checks_the_interpreted_kernels(monkeypatch):
    """On CPU the model runs the kernels interpreted, so an explicit ``attention_impl="pallas"``
    (``generate``, ``train.py``) checks them interpreted rather than compiling them for a CPU."""
    seen = []
    monkeypatch.setattr(
        check, "run_check", lambda cases, **kw: seen.append(kw) or check.CheckReport("x", "y", ())
    )
    monkeypatch.setattr(check, "_PASSED", set())
    monkeypatch.setattr(check, "cache_path", lambda: "/nonexistent/diffjax-kernel-check.json")
    monkeypatch.setattr(check, "_record", lambda path, passed: None)
    cfg = diffjax.ModelConfig(d_model=64, num_heads=1, num_layers=1, attention_impl="pallas")
    ops.check_kernels(cfg)
    assert [kw["interpret"] for kw in seen] == [True]


def test_a_failed_check_is_a_config_error_that_names_the_fix(monkeypatch):
    _plant(monkeypatch, "scale")
    cfg = diffjax.ModelConfig(attention="diff_v1", d_model=128, num_heads=1, num_layers=1)
    with pytest.raises(diffjax.ConfigError) as e:
        ops.check_kernels(cfg, interpret=True)
    msg = str(e.value)
    assert msg.startswith("ModelConfig.attention_impl: the attention kernels disagree")
    assert "FAIL v1 d=64 dv=128 float32" in msg and "Fix: set model.attention_impl=xla" in msg


def test_generate_checks_the_kernels_of_its_model(monkeypatch):
    """``diffjax.generate`` asks for the check of its model's config (a no-op on CPU, where the
    model runs the XLA path; on a GPU/TPU the kernels' check, once)."""
    seen = []
    monkeypatch.setattr(ops, "check_kernels", lambda config, **kw: seen.append(config))
    cfg = diffjax.ModelConfig(d_model=32, num_layers=1, num_heads=1, max_seq_len=16)
    model = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(0))
    diffjax.generate(model, jax.numpy.array([[1, 2, 3]]), 2)
    assert seen == [cfg]
