"""``python -m diffjax.retrofit SOURCE OUT [section.field=value ...]``: convert a pretrained
standard-attention model into DIFF V2 (or V1) and write it as a diffjax model folder.

SOURCE: a diffjax model folder of a standard model (a train.py run's ``standard/seed_0``, its
best step) or a Hugging Face Llama directory. OUT: a new folder holding ``checkpoints/0``, which
``train.py train.init_from=OUT`` (its ramp settings come along), ``python -m
diffjax.evaluate``, ``diffjax.generate`` and ``python -m diffjax.sample`` take as any other
model folder. The negative map's weight w starts at 0 (``retrofit.warmup_steps=0``: at 1) and
is saved with the parameters. The step-0 gap (the converted model's logits against the
source's on fixed random tokens) is printed and kept in the checkpoint's metadata.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
from flax import nnx

from diffjax import cli
from diffjax.infra import storage
from diffjax.config import ATTENTION_KINDS, ConfigError
from diffjax.data import DataConfig
from diffjax.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    committed_steps,
    load_pretrained,
    pretrained_source,
)

from diffjax.interop.conversion import (
    LAMBDA_PROJ,
    RAMPS,
    SECONDS,
    RetrofitConfig,
    logit_gap,
    retrofit_config,
    retrofit_model,
)

PROG = "python -m diffjax.retrofit"
EXIT_BAD_INPUT = 2


@dataclasses.dataclass(frozen=True)
class Target:
    """The DIFF model the source becomes."""

    attention: str = "diff_v2"  # the DIFF kind: diff_v2 starts exactly at the source
    lambda_init: float | None = None  # DIFF V1's lambda_init (None: 0.8 - 0.6 exp(-0.3 depth))
    diff_norm: bool = True  # DIFF V1's per-head RMSNorm (off: no DiffLlama export)
    seed: int = 0  # the fresh init of what is not copied (random second queries, lambda)

    def __post_init__(self):
        cli.check_fields(self)
        if self.attention not in ("diff_v1", "diff_v2"):
            cli.fail(
                "Target",
                "attention",
                f"{self.attention!r} is not a DIFF kind",
                "use 'diff_v2' (starts exactly at the source) or 'diff_v1'",
            )


SECTIONS = (
    cli.Section("model", Target(), {"attention": ATTENTION_KINDS[1:]}),
    cli.Section(
        "retrofit",
        RetrofitConfig(),
        {"ramp": RAMPS, "second": SECONDS, "lambda_proj": LAMBDA_PROJ},
    ),
)


def source_data(source: str) -> dict:
    """The data config of the run a diffjax source was trained in (its ``config.json``, in the
    model folder or up to two levels above: ``RUN/<label>/seed_<s>``); else the default data,
    with the source's ``tokenizer.json`` when it has one."""
    folder = storage.absolute(source)
    for parent in (folder, folder.parent, folder.parent.parent):
        path = storage.join(str(parent), "config.json")
        if storage.exists(path):
            saved = storage.read_json(path)
            if isinstance(saved.get("data"), dict):
                return saved["data"]
    data = DataConfig()
    if storage.exists(storage.join(str(folder), "tokenizer.json")):
        data = data.replace(tokenizer=str(folder))
    return dataclasses.asdict(data)


def retrofit_checkpoint(
    source: str, out: str, target: Target | None = None, rcfg: RetrofitConfig | None = None
) -> dict:
    """Convert ``source`` and write ``out`` (see the module); returns the step-0 gap
    (:func:`diffjax.retrofit.logit_gap`). Refuses, before any compute, a source that is not a
    standard model, a target it cannot become, and an ``out`` that holds checkpoints."""
    target, rcfg = target or Target(), rcfg or RetrofitConfig()
    storage.check_access(out, what="OUT", write=True)
    if committed_steps(storage.join(out, "checkpoints")):
        raise CheckpointError(
            f"{out} already holds checkpoints; nothing is overwritten. Fix: pass a new folder."
        )
    if target.attention == "diff_v2" and (target.lambda_init is not None or not target.diff_norm):
        raise ConfigError(
            "model.lambda_init and model.diff_norm are DIFF V1 settings. Fix: leave them unset "
            "for model.attention=diff_v2, or set model.attention=diff_v1."
        )
    if target.attention == "diff_v1" and rcfg.lambda_proj != "default":
        raise ConfigError(
            "retrofit.lambda_proj is a DIFF V2 setting. Fix: leave it at 'default' for "
            "model.attention=diff_v1."
        )
    _, config, _ = pretrained_source(source)
    retrofit_config(  # its checks, before any weight is read
        config, target.attention, lambda_init=target.lambda_init, diff_norm=target.diff_norm
    )
    model_src = load_pretrained(source)
    model = retrofit_model(
        model_src,
        target.attention,
        rcfg,
        lambda_init=target.lambda_init,
        diff_norm=target.diff_norm,
        seed=target.seed,
    )
    vocab, length = model.config.vocab_size, min(64, model.config.max_seq_len)
    tokens = np.random.default_rng(0).integers(0, vocab, size=(2, length))
    gap = logit_gap(model_src, model, tokens)
    params = nnx.state(model, nnx.Param)
    meta = {
        "model": model.config.to_dict(),
        "label": "diff",
        "retrofit": dataclasses.asdict(rcfg),
        "source": str(source),
        "step0": gap,
    }
    storage.makedirs(out)
    storage.write_json(  # what python -m diffjax.evaluate OUT reads: the data it evaluates on
        storage.join(out, "config.json"),
        {
            "model": model.config.to_dict(),
            "data": source_data(source),
            "retrofit": dataclasses.asdict(rcfg),
            "compare": False,
            "source": str(source),
        },
    )
    ckpt = Checkpointer(storage.join(out, "checkpoints"), async_save=False)
    try:
        ckpt.save(0, {"step": np.zeros((), np.int32), "params": params}, {}, meta)
        ckpt.wait()
    finally:
        ckpt.close()
    return gap


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(
        PROG,
        "Convert a pretrained standard-attention model (a diffjax model folder or a Hugging "
        "Face Llama directory) into DIFF V2 or DIFF V1, its negative map's weight w ramped in "
        "from 0 as it trains, and write it as a diffjax model folder.",
        SECTIONS,
        example=f"{PROG} runs/base/standard/seed_0 runs/base-diff model.attention=diff_v2 "
        "retrofit.warmup_steps=500",
        epilog="Train it on with: python train.py compare.twins= train.init_from=OUT ...",
    )
    p.add_argument("source", help="a standard model: diffjax model folder or Hugging Face dir")
    p.add_argument("out", help="a new folder for the DIFF model")
    try:
        args, settings = cli.parse(p, argv, SECTIONS)
        target, rcfg = settings["model"], settings["retrofit"]
        gap = retrofit_checkpoint(args.source, args.out, target, rcfg)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    kind = {"diff_v1": "DIFF V1", "diff_v2": "DIFF V2"}[target.attention]
    print(f"{kind} written to {args.out} (w = {0.0 if rcfg.warmup_steps else 1.0:g})")
    print(
        f"step 0 against the source: largest logit difference {gap['max_abs']:.3g} "
        f"({gap['max_rel']:.2e} of the largest logit); loss on random tokens "
        f"{gap['retrofit_loss']:.4f} vs {gap['source_loss']:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
