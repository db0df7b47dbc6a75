"""The paper's 3B DIFF V1 model and its twin (d_model 3072, 28 layers; DIFF: 12 heads of
2 x 128, twin: 24 heads of 128; SwiGLU 8192), 4K context, bf16 compute, float32 parameters,
scanned layers.

The paper's 3B shape (hidden 3072, 28 layers, 12 heads, FFN 8192, trained on 1T tokens at 4096
tokens a sequence) and its Table 10 recipe for it: AdamW betas (0.9, 0.95), lr 3.2e-4, 1000
warmup steps, weight decay 0.1, linear decay, no dropout. Batch: 1024 sequences of 4096 (4M
tokens a step, StableLM-3B-4E1T's, whose setup the paper's 3B follows: our reading). Untied
embeddings, vocab 50304 (GPT-2's padded): 3.48B parameters. Data: pre-tokenized token files at
data.path, as configs/diff_125m.py.

Sized for an h100-8 (8 x 80 GiB, of which JAX's allocator takes 60 GiB by default) with FSDP
over the 8 GPUs (mesh.fsdp=-1): one step of 1024 sequences of 4096 tokens cannot hold its
activations at once. ``python -m diffjax.plan`` found that remat "dots" with 32 microbatches of
32 sequences (4 per GPU) fits, 39.9 GiB per GPU for either model; 16 microbatches need 71.1
GiB (they fit only with XLA_CLIENT_MEM_FRACTION=.95 on the machine), 8 need 135 GiB; with remat
"full" at most 232 sequences fit at once (docs/scaling.md's table). This config sets remat
"dots" and 32 microbatches (2026-12-03, jax 0.10.2):

    python -m diffjax.plan --config configs/diff_3b.py plan.target=h100-8
    python train.py --config configs/diff_3b.py data.path='/data/tokens/train_*.bin'

On another target plan it again (the search starts from these settings; pass
model.remat=none train.grad_accum_steps=1 to search from the paper's).
"""

import dataclasses
import os

from diffjax.infra.sharding import MeshConfig
from diffjax.train import load_config


def get_config():
    base = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "diff_125m.py"))
    return dataclasses.replace(
        base,
        run=dataclasses.replace(base.run, name="diff-3b"),
        model=base.model.replace(
            d_model=3072,
            num_layers=28,
            num_heads=12,
            max_seq_len=4096,
            tie_embeddings=False,
            scan_layers=True,
            remat="dots",  # the planner's choice for h100-8 (see the docstring)
            attention_impl="auto",
            dtype="bfloat16",
            param_dtype="float32",
        ),
        data=base.data.replace(seq_len=4096),
        train=dataclasses.replace(
            base.train,
            steps=250000,
            batch_size=1024,
            grad_accum_steps=32,  # 32 microbatches of 32 (the planner's choice for h100-8)
            lr=3.2e-4,
            warmup_steps=1000,
            b1=0.9,
            b2=0.95,
            weight_decay=0.1,
            eval_every=1000,
        ),
        mesh=MeshConfig(fsdp=-1),
    )
