"""Learning-rate sensitivity on 2 CPU cores (``python -m diffjax.sweep.lr_sensitivity --config
configs/lr_sensitivity_cpu.py``): DIFF V1, DIFF V2, their twin and their gated twin (the twin
with gated attention's elementwise output gate, Qiu et al. 2025) trained at 10 learning rates,
log-spaced half a decade apart from 1e-4 (20x below the default's 2e-3) to 3 (past divergence), each from two paired init seeds, on the built-in corpus. Measured the way
Wortsman et al. 2023 measure small-scale instability: each model's learning-rate sensitivity
(``sweep.md``), with the largest attention logit and output logit of every run
(``train.diagnostics``) and the updates skipped as spikes (``train.skip_spikes=5``: only steps
five times the running median, or not finite; the safety net a long run would use, the same for
every model).

The models (d_model 64, 2 layers, 500 steps of 16 x 128 tokens, the default recipe otherwise:
AdamW, warmup 20, cosine to 0.1, clipping at 1):

| arm | model | heads x width | its twin |
|---|---|---|---|
| v1 | DIFF V1 | 1 x (2 x 32) | standard, 2 x 32, and the gated twin (both trained in this arm) |
| v2 | DIFF V2 | 2 x 32 | the same two: V2 gets twice V1's heads so that its twins are V1's |

Both DIFF models are paired with both twins (seeds paired: the same init seed and data order).
Time: about 40 minutes on 2 otherwise idle cores (without the gated twin it took 27). Results:
docs/results.md.
"""

from diffjax.sweep import Ladder
from diffjax.compare import default_comparison
from diffjax.train import apply_overrides

SENSITIVITY = Ladder(
    field="train.lr",
    values=[1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0],
    tokens=500 * 16 * 128,
    evals=5,
    arms={
        "v1": ["model.attention=diff_v1", "model.num_heads=1", "compare.twins=standard,gated"],
        "v2": ["model.attention=diff_v2", "model.num_heads=2", "compare.twins="],
    },
)


def get_config():
    return apply_overrides(
        default_comparison(),
        [
            "run.name=lr-sensitivity-cpu",
            "model.d_model=64",
            "model.num_layers=2",
            "compare.seeds=2",
            "train.eval_batches=4",
            "train.checkpoint_every=250",
            "compare.quick_eval=false",
            "compare.throughput_rounds=0",
            "train.tensorboard=false",
            "train.diagnostics=true",
            "train.skip_spikes=5",
            "train.spike_window=32",
        ],
    )
