"""The paper's 1.4B DIFF V1 model and its twin (d_model 2048, 24 layers; DIFF: 8 heads of
2 x 128, twin: 16 heads of 128; SwiGLU 5504), bf16 compute, float32 parameters, scanned layers.

The paper's scaling-study shape (its appendix: 1.4B = hidden 2048, 24 layers, 8 heads) and its
Table 10 recipe for 830M-2.8B: AdamW betas (0.9, 0.98), weight decay 0.05, 375 warmup steps,
lr 1.5e-4, linear decay, no dropout; sequences of 2048 tokens, batch 128 (0.25M tokens a step,
10B tokens in 40K steps: our reading of the paper's setup). Untied embeddings, vocab 50304
(GPT-2's padded): 1.42B parameters, as the paper counts them (tied would be 1.32B). Data:
pre-tokenized token files at data.path, as configs/diff_125m.py.

Sized for an h100-8 (8 x 80 GiB) or a v5p-8 (4 x 95 GiB) with FSDP over every device
(mesh.fsdp=-1). As the paper trains it (no rematerialization) the step needs 114 GiB per GPU
on an h100-8 (the twin 99 GiB); ``python -m diffjax.plan`` found remat "dots" enough there
(43.4 GiB per GPU for either model, within the 60 GiB JAX's allocator takes by default). On a v5p-8 (4 chips, so twice the rows per chip) remat
"dots" with the whole batch at once needs 104.4 GiB per chip, and the planner named 2
microbatches (57.8 GiB); this config sets both, so it fits either target (2026-12-02, jax
0.10.2; docs/scaling.md has the table):

    python -m diffjax.plan --config configs/diff_1_4b.py plan.target=v5p-8
    python train.py --config configs/diff_1_4b.py data.path='/data/tokens/train_*.bin'

On an h100-8, ``train.grad_accum_steps=1`` also fits (one pass per step: a little faster). On a
v5e-8 plan it again (it will need more accumulation, as diff_830m.py does).
"""

import dataclasses
import os

from diffjax.infra.sharding import MeshConfig
from diffjax.train import load_config


def get_config():
    base = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "diff_125m.py"))
    return dataclasses.replace(
        base,
        run=dataclasses.replace(base.run, name="diff-1.4b"),
        model=base.model.replace(
            d_model=2048,
            num_layers=24,
            num_heads=8,
            max_seq_len=4096,
            tie_embeddings=False,
            scan_layers=True,
            remat="dots",  # the planner's choice for h100-8 (see the docstring)
            attention_impl="auto",
            dtype="bfloat16",
            param_dtype="float32",
        ),
        data=base.data.replace(seq_len=2048),
        train=dataclasses.replace(
            base.train,
            steps=40000,
            batch_size=128,
            grad_accum_steps=2,  # the planner's choice for v5p-8 (see the docstring)
            lr=1.5e-4,
            warmup_steps=375,
            b1=0.9,
            b2=0.98,
            weight_decay=0.05,
            eval_every=1000,
        ),
        mesh=MeshConfig(fsdp=-1),
    )
