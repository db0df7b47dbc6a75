"""A ~125M-parameter DIFF V1 model and its twin (GPT-3-small shape: d_model 768, 12 layers;
DIFF: 6 heads of 2 x 64, twin: 12 heads of 64), for one GPU/TPU host or more.

The paper's recipe (Table 10): AdamW betas (0.9, 0.98), weight decay 0.05, 375 warmup steps,
linear decay, no dropout; lr 6e-4 here (GPT-3's value at this size; the paper's 1.5e-4 is for
830M-2.8B). Data: pre-tokenized token files (e.g. GPT-2 BPE ids as uint16 .bin files) at
data.path; vocab 50304 (GPT-2's 50257 padded to a multiple of 64), tied embeddings.

    python train.py --config configs/diff_125m.py data.path='/data/tokens/train_*.bin'

A step toward the paper's scale (its claims are for 830M+ parameters); nothing has been
measured at this size yet (docs/results.md lists what has).
"""

from diffjax import ModelConfig
from diffjax.data import DataConfig, TokensData
from diffjax.compare import Comparison
from diffjax.train import RunConfig, TrainConfig


def get_config():
    return Comparison(
        run=RunConfig(name="diff-125m"),
        model=ModelConfig(
            vocab_size=50304,
            d_model=768,
            num_layers=12,
            num_heads=6,
            attention="diff_v1",
            max_seq_len=2048,
            dtype="bfloat16",
            param_dtype="float32",
            tie_embeddings=True,
            scan_layers=True,  # one compiled block, scanned: compile time flat in depth
        ),
        data=DataConfig(
            source="tokens",
            path="data/tokens/*.bin",
            tokens=TokensData(dtype="uint16"),
            seq_len=2048,
        ),
        train=TrainConfig(
            steps=20000,
            batch_size=256,
            lr=6e-4,
            warmup_steps=375,
            schedule="linear",
            b1=0.9,
            b2=0.98,
            weight_decay=0.05,
            grad_clip=1.0,
            eval_every=500,
            eval_batches=20,
            checkpoint_every=1000,
            log_every=10,
        ),
    )
