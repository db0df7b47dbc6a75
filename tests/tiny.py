"""The tiny run the end-to-end tests start from: ``train.py`` overrides for a model and data
small enough for CI (seconds per model on a CPU), with nothing the test does not ask for (no
progress bar, TensorBoard, throughput rounds, quick evaluation or extra seeds).

    main([f"run.dir={tmp_path}", *tiny_run("train.steps=4", "compare.twins=")])

:func:`tiny_run` changes settings by key (``"model.num_heads=2"`` replaces the base's), adds
new ones after, and leaves the keys in ``drop`` at the config's defaults.
"""

from __future__ import annotations

TINY_RUN = (
    "model.d_model=32",
    "model.num_layers=1",
    "model.num_heads=1",
    "model.max_seq_len=32",
    "data.seq_len=16",
    "data.max_files=12",
    "train.batch_size=8",
    "train.eval_batches=1",
    "train.warmup_steps=2",
    "train.progress=false",
    "train.tensorboard=false",
    "compare.seeds=1",
    "compare.quick_eval=false",
    "compare.throughput_rounds=0",
)


# the model's settings, for a run whose model comes from elsewhere (train.init_from, a retrofit)
MODEL_KEYS = tuple(s.split("=")[0] for s in TINY_RUN if s.startswith("model."))


def tiny_run(*settings: str, drop: tuple[str, ...] = ()) -> list[str]:
    """:data:`TINY_RUN` with ``settings`` (``"key=value"``) replacing the base setting of the
    same key or added after it, and the keys of ``drop`` removed (the config's defaults)."""
    merged = dict(s.split("=", 1) for s in TINY_RUN)
    for key in drop:
        del merged[key]  # a KeyError names a key the base does not set
    for setting in settings:
        key, value = setting.split("=", 1)
        merged[key] = value
    return [f"{k}={v}" for k, v in merged.items()]
