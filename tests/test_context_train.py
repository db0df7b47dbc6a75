"""Training with the sequence split over a ``context`` mesh axis (8 CPU devices): the same
losses as without it, resumable across context sizes, bad settings refused before compute."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from diffjax import context
from diffjax.compare.cli import main
from diffjax.train.metrics import read_metrics

# A tiny experiment (tests/test_train.py's), 20 steps; DIFF V1 beside its twin.
TINY = [
    "model.d_model=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.max_seq_len=32",
    "data.seq_len=16",
    "data.max_files=12",
    "train.batch_size=8",
    "train.eval_batches=2",
    "train.warmup_steps=2",
    "train.progress=false",
    "train.num_seeds=1",
    "train.quick_eval=false",
    "train.throughput_rounds=0",
    "train.tensorboard=false",
    "train.steps=20",
    "train.eval_every=10",
    "train.checkpoint_every=10",
]
RTOL = 1e-5  # float32 sums in another order across devices


def _losses(run, label="diff"):
    return np.array(
        [r["loss"] for r in read_metrics(str(run / label / "seed_0" / "metrics.jsonl"))]
    )


def _val(run, label="diff"):
    return [
        r["val_loss"]
        for r in read_metrics(str(run / label / "seed_0" / "metrics.jsonl"))
        if "val_loss" in r
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run without a context axis (8 devices data-parallel)."""
    run = tmp_path_factory.mktemp("context_1") / "run"
    assert main([f"run.dir={run}", *TINY]) == 0
    return run


@pytest.mark.parametrize(
    "mesh",
    [
        ["mesh.context=4"],  # data takes the other 2 devices; ring, zigzag
        [
            "mesh.data=1",
            "mesh.context=8",
            "mesh.context_order=contiguous",
            "model.context_attention=allgather",
        ],
    ],
    ids=["data2-context4-ring-zigzag", "context8-allgather-contiguous"],
)
def test_training_with_a_context_axis_gives_the_same_losses(reference, tmp_path, mesh, monkeypatch):
    calls = {}
    for name in ("context_differential_attention", "context_dot_product_attention"):
        real = getattr(context, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1  # at trace time
            return _real(*a, **k)

        monkeypatch.setattr(context, name, counted)
    run = tmp_path / "run"
    assert main([f"run.dir={run}", *TINY, *mesh]) == 0
    # both models attended through the sequence-parallel path (traced at least once each)
    assert calls.get("context_differential_attention") and calls.get(
        "context_dot_product_attention"
    )
    for label in ("diff", "standard"):
        np.testing.assert_allclose(
            _losses(run, label), _losses(reference, label), rtol=RTOL, err_msg=label
        )
        np.testing.assert_allclose(
            _val(run, label), _val(reference, label), rtol=RTOL, err_msg=label
        )


def test_a_checkpoint_saved_with_one_context_size_resumes_with_another(reference, tmp_path, capsys):
    run = tmp_path / "run"
    args = [f"run.dir={run}", *TINY, "compare=false"]
    assert main([*args, "mesh.context=4"]) == 0
    shutil.rmtree(run / "diff" / "seed_0" / "checkpoints" / "20")
    capsys.readouterr()
    assert main([*args, "mesh.context=2"]) == 0
    assert "resuming from the checkpoint at step 10" in capsys.readouterr().out
    np.testing.assert_allclose(_losses(run), _losses(reference), rtol=RTOL)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["mesh.context=4", "data.seq_len=12"], "data.seq_len"),
        (["mesh.context=3"], "context=3"),
        (["mesh.context_order=spiral"], "mesh.context_order"),
        (["model.context_attention=tree"], "context_attention"),
    ],
)
def test_bad_context_settings_are_refused_before_compute(tmp_path, capsys, extra, message):
    run = tmp_path / "run"
    assert main([f"run.dir={run}", *TINY, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Fix" in err
    assert not (run / "diff").exists()
