"""The comparison past the crossover on 2 CPU cores (``python -m diffjax.sweep --config
configs/crossover_cpu.py``): DIFF V1, DIFF V2 and their one twin at the default model's size,
trained 15x longer than the default (3000 steps, 6.1M tokens each), from three paired init seeds,
on the built-in corpus. Its report (``sweep.md``, ``curves.png``) gives, per DIFF model, the
paired DIFF − twin validation loss against tokens with a pointwise 95% band over the seeds, the
crossover (the first evaluation after which the band stays below 0) and the final difference
with its interval.

The models (d_model 128, 4 layers, about 0.8M non-embedding parameters; the default recipe
otherwise: AdamW at 2e-3, b2 0.95, weight decay 0.1, clipping at 1, cosine to 0.1 over the
3000 steps after a 100-step warmup):

| arm | model | heads x width | its twin |
|---|---|---|---|
| v1 | DIFF V1 | 2 x (2 x 32) | standard, 4 x 32 (trained in this arm) |
| v2 | DIFF V2 | 4 x 32 | the same standard 4 x 32: V2 gets twice V1's heads so that its twin is V1's |

Every run sees the same batches in the same order (``data.seed``); seed s of each model starts
from init seed s. 30 evaluations per run on the same 16 held-out batches. A checkpoint every 500
steps: a sitting that ends mid-run resumes where it stopped with the same command (finished arms
are skipped). Time and results: docs/results.md.
"""

from diffjax.sweep import Ladder
from diffjax.compare import default_comparison
from diffjax.train import apply_overrides

SWEEP = Ladder(
    tokens=3000 * 16 * 128,
    evals=30,
    arms={
        "v1": ["model.attention=diff_v1", "model.num_heads=2"],
        "v2": ["model.attention=diff_v2", "model.num_heads=4", "compare.twins="],
    },
)


def get_config():
    return apply_overrides(
        default_comparison(),
        [
            "run.name=crossover-cpu",
            "compare.seeds=3",
            "train.warmup_steps=100",
            "train.eval_batches=16",
            "train.checkpoint_every=500",
            "compare.quick_eval=false",
            "compare.throughput_rounds=0",
            "train.tensorboard=false",
        ],
    )
