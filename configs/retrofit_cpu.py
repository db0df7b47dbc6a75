"""The measurement of a retrofit on 2 CPU cores (``python -m diffjax.retrofit_study
--config configs/retrofit_cpu.py``): a standard model trained on the built-in corpus, then continued three
ways on the same tokens in the same order from the same weights: unconverted, converted to DIFF
V2 (``train.retrofit=true model.attention=diff_v2``: it starts exactly at the source's logits)
and converted to DIFF V1 (its closest start; the step-0 gap is measured). Three sources, from
init seeds 0, 1 and 2, so the report gives intervals over seeds.

The source (``source/seed_<s>``): standard attention, d_model 128, 4 layers, 4 heads x 32 (an
even head count of width d_model / num_heads, so that both conversions apply), 600 steps of
16 x 128 tokens, the default recipe (AdamW at 2e-3, b2 0.95, weight decay 0.1, clipping at 1,
20 warmup steps, cosine to 0.1 x lr).

The continuations (``standard/``, ``v2/``, ``v1/``), each from its seed's source (its best
checkpoint), 400 steps on ``data.seed=1`` (fresh batches in another order than the source's,
the same for the three arms of a seed):

| arm | model | start |
|---|---|---|
| standard | standard, 4 heads x 32 | the source unchanged |
| v2 | DIFF V2, 4 heads x 32 | the source's logits exactly (w = 0) |
| v1 | DIFF V1, 2 heads x (2 x 32) | the source's heads paired |

A new schedule for every arm: lr 1e-3 (half the source's peak) after 20 warmup steps, cosine
to 0.1 x lr; the converted arms ramp the negative map's weight w from 0 to 1 over the first
100 steps (``retrofit.warmup_steps=100``, linear; negative queries start at zero). An
evaluation every 20 steps on the same 8 held-out batches; a checkpoint every 100 steps (a
sitting that ends mid-run resumes where it stopped with the same command, finished runs are
skipped). After each run: the source's validation loss on the continuation's batches (the
level to recover) and retrieval probes (needle, MQAR) of every final model.

Report: ``runs/retrofit-cpu/retrofit.md`` and ``retrofit.png``; its runs table gives each run's
measured time. Time: 5,400 steps in all (1,800 of the sources, 1,200 per arm). Measured with
40-step runs on 2 cores shared with another training run (load about 4): 0.26 s per step for
the standard model and DIFF V1, 0.32 s for DIFF V2 (median step time), plus about 10 s per run
of compiling, evaluating and probing. At the default model's 140 ms per step on 2 free cores
that is an estimated 16 minutes in all (about 30 on cores shared as in the measurement).
Results: docs/results.md.
"""

from diffjax.compare import RetrofitStudy
from diffjax.train import apply_overrides, default_config

RETROFIT = RetrofitStudy(
    source_steps=600,
    continue_steps=400,
    arms={"v2": ["model.attention=diff_v2"], "v1": ["model.attention=diff_v1"]},
    continuation=[
        "train.lr=1e-3",
        "train.warmup_steps=20",
        "train.eval_every=20",
        "retrofit.warmup_steps=100",
    ],
    seeds=3,
)


def get_config():
    return apply_overrides(
        default_config(),
        [
            "run.name=retrofit-cpu",
            "model.attention=standard",
            "model.num_heads=4",
            "train.eval_every=50",
            "train.checkpoint_every=100",
            "train.tensorboard=false",
        ],
    )
