"""A scaling ladder for 2 CPU cores (``python -m diffjax.sweep --config configs/scaling_cpu.py``):
DIFF V1 and its twin at four sizes from about 54K to 3.2M non-embedding parameters, each on the
same 245,760 tokens (120 steps of 16 x 128), from two paired init seeds, on the built-in corpus
(the default config's data and recipe: byte-level stdlib sources, lr 2e-3, cosine to 0.1).

| size (d_model x layers, DIFF heads) | non-embedding parameters, DIFF / twin |
|---|---:|
| 64 x 1, 1 head | 53,632 / 53,440 |
| 128 x 1, 2 heads | 213,568 / 213,376 |
| 192 x 2, 2 heads | 886,272 / 885,696 |
| 256 x 4, 2 heads | 3,215,104 / 3,213,568 |

Time: about 20 minutes on 2 otherwise idle CPU cores, an estimate (nothing of it has been run
in full yet): the default comparison's pace (about 0.45 ms a step per thousand parameters at
batch 16 x 128) over the 4 sizes x 2 models x 2 seeds, plus compilation and evaluation. On a
machine shared with other jobs it takes longer: there 256 x 4 took 2.6 s a step, 64 x 1 0.12 s,
and each size spent about a minute compiling and loading data (a 16-step smoke run of all four
sizes with one seed, ``sweep.tokens=2048 train.batch_size=4 data.seq_len=32``, took 5 minutes). Tiny next to the paper's 830M-13B (configs/scaling_paper.py): a short run at
small sizes says how the two compare there, not at the paper's scale.
"""

import dataclasses

from diffjax.sweep import Ladder
from diffjax.compare import CompareConfig, default_comparison

SWEEP = Ladder(
    sizes=[(64, 1, 1), (128, 1, 2), (192, 2, 2), (256, 4, 2)],
    budget="fixed",
    tokens=120 * 16 * 128,
    evals=8,
)


def get_config():
    base = default_comparison()
    return dataclasses.replace(
        base,
        run=dataclasses.replace(base.run, name="scaling-cpu"),
        train=dataclasses.replace(
            base.train,
            eval_batches=4,
            checkpoint_every=60,
            tensorboard=False,
        ),
        compare=CompareConfig(seeds=2, quick_eval=False, throughput_rounds=0),
    )
