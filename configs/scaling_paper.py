"""The paper's scaling ladder for accelerators (``python -m diffjax.sweep --config
configs/scaling_paper.py data.path='/data/tokens/train_*.bin'``): DIFF V1 and its twin at the
five sizes of its scaling study, 830M, 1.4B, 2.8B, 6.8B and 13.1B parameters, every size on the
same tokens, for the paper's headline (DIFF reaches the Transformer's loss with about 62-65% of
the parameters or training tokens).

What the paper states (../shared/reference/diff-transformer.md): the 62-65% headline and the
recipe of Table 10 for 830M-2.8B (AdamW betas (0.9, 0.98), weight decay 0.05, 375 warmup
steps, linear decay, lr 1.5e-4). What is assumed here:

* the shapes (hidden x layers, DIFF heads): 1536 x 24, 8 (830M) and 2048 x 24, 8 (1.4B) as in
  configs/diff_830m.py and configs/diff_1_4b.py; 2560 x 32, 10 (2.8B), 4096 x 32, 16 (6.8B)
  and 5120 x 40, 20 (13.1B) as we read the paper's appendix, head width 128 from 1.4B up. With
  the vocabulary of 50,304 and untied embeddings they count 0.834B, 1.42B, 2.78B, 6.86B and
  13.1B parameters, which matches the names; the reference does not give them;
* the tokens: 10B per size (40K steps of 128 x 2048), configs/diff_830m.py's reading of the
  paper's setup;
* lr 1.5e-4 at 6.8B and 13.1B too (Table 10 gives it for 830M-2.8B only);
* one init seed (the cost): the report then gives no interval. Add seeds with
  ``compare.seeds=2`` where the budget allows.

Memory: the base is configs/diff_1_4b.py (FSDP over every device, remat "dots", 2
microbatches: sized for an h100-8 or a v5p-8). The larger sizes need more; plan each with
``python -m diffjax.plan --config configs/diff_1_4b.py model.d_model=4096 model.num_layers=32
model.num_heads=16 plan.target=...`` and put what it names in ``size_overrides`` below (e.g.
``"4096x32": ("train.grad_accum_steps=8",)``). The sweep runs in one process; for several
hosts run each size with train.py (docs/sweep.md).
"""

import dataclasses
import os

from diffjax.sweep import Ladder
from diffjax.compare import CompareConfig
from diffjax.train import load_config

SWEEP = Ladder(
    sizes=[(1536, 24, 8), (2048, 24, 8), (2560, 32, 10), (4096, 32, 16), (5120, 40, 20)],
    budget="fixed",
    tokens=40_000 * 128 * 2048,
    evals=40,
    size_overrides={},
)


def get_config():
    base = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "diff_1_4b.py"))
    return dataclasses.replace(
        base,
        run=dataclasses.replace(base.run, name="scaling-paper"),
        compare=CompareConfig(seeds=1, quick_eval=False, throughput_rounds=0),
    )
