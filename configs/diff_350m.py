"""A ~350M-parameter DIFF V1 model and its twin (GPT-3-medium shape: d_model 1024, 24 layers;
DIFF: 8 heads of 2 x 64, twin: 16 heads of 64), for GPU/TPU hosts.

The recipe of diff_125m.py (the paper's Table 10: AdamW betas (0.9, 0.98), weight decay 0.05,
375 warmup steps, linear decay, no dropout; pre-tokenized token files at data.path, vocab 50304,
tied embeddings) at this size: lr 3e-4 (GPT-3's value at this size; the paper's 1.5e-4 is for
830M-2.8B), 40000 steps, evaluation every 1000.

    python train.py --config configs/diff_350m.py data.path='/data/tokens/train_*.bin'

A step toward the paper's scale (its claims are for 830M+ parameters); nothing has been
measured at this size yet (docs/results.md lists what has).
"""

import dataclasses
import os

from diffjax.train import load_config


def get_config():
    base = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "diff_125m.py"))
    return dataclasses.replace(
        base,
        run=dataclasses.replace(base.run, name="diff-350m"),
        model=base.model.replace(d_model=1024, num_layers=24, num_heads=8),
        train=dataclasses.replace(base.train, steps=40000, lr=3e-4, eval_every=1000),
    )
