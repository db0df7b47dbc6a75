"""The paper's 830M DIFF V1 model and its twin (d_model 1536, 24 layers; DIFF: 8 heads of
2 x 96, twin: 16 heads of 96; SwiGLU 4096), bf16 compute, float32 parameters, scanned layers.

The paper's scaling-study shape (its appendix: 830M = hidden 1536, 24 layers, 8 heads) and its
Table 10 recipe for 830M-2.8B: AdamW betas (0.9, 0.98), weight decay 0.05, 375 warmup steps,
lr 1.5e-4, linear decay, no dropout; sequences of 2048 tokens, batch 128 (0.25M tokens a step,
10B tokens in 40K steps: our reading of the paper's setup). Untied embeddings, vocab 50304
(GPT-2's padded): 830M parameters, as the paper counts them (tied would be 757M). Data:
pre-tokenized token files at data.path, as configs/diff_125m.py.

Sized for a v5e-8 (8 chips of 16 GiB) with FSDP over the 8 chips (mesh.fsdp=-1). As the paper
trains it (no rematerialization, the whole batch at once) the step needs 92 GiB per chip there
(the TPU compiler's count; the twin 77 GiB); ``python -m diffjax.plan`` found the cheapest
setting that fits, remat "dots" with 4 microbatches of 32 sequences (13.4 GiB per chip for the
DIFF model), which this config sets (2026-12-02, jax 0.10.2; docs/scaling.md has the table):

    python -m diffjax.plan --config configs/diff_830m.py plan.target=v5e-8
    python train.py --config configs/diff_830m.py data.path='/data/tokens/train_*.bin'

On a larger target (h100-8, v5p-8) plan it again with model.remat=none
train.grad_accum_steps=1: it names what fits there.
"""

import dataclasses
import os

from diffjax.infra.sharding import MeshConfig
from diffjax.train import load_config


def get_config():
    base = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "diff_125m.py"))
    return dataclasses.replace(
        base,
        run=dataclasses.replace(base.run, name="diff-830m"),
        model=base.model.replace(
            d_model=1536,
            num_layers=24,
            num_heads=8,
            max_seq_len=4096,
            tie_embeddings=False,
            scan_layers=True,
            remat="dots",  # the planner's choice for v5e-8 (see the docstring)
            attention_impl="auto",
            dtype="bfloat16",
            param_dtype="float32",
        ),
        data=base.data.replace(seq_len=2048),
        train=dataclasses.replace(
            base.train,
            steps=40000,
            batch_size=128,
            grad_accum_steps=4,  # 4 microbatches of 32 (the planner's choice for v5e-8)
            lr=1.5e-4,
            warmup_steps=375,
            b1=0.9,
            b2=0.98,
            weight_decay=0.05,
            eval_every=1000,
        ),
        mesh=MeshConfig(fsdp=-1),
    )
