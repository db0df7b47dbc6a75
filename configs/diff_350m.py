"""A ~350M-parameter DIFF V1 model and its twin (GPT-3-medium shape: d_model 1024, 24 layers;
DIFF: 8 heads of 2 x 64, twin: 16 heads of 64), for GPU/TPU hosts.

The paper's recipe (Table 10): AdamW betas (0.9, 0.98), weight decay 0.05, 375 warmup steps,
linear decay, no dropout; lr 3e-4 (GPT-3's value at this size; the paper's 1.5e-4 is for
830M-2.8B). Data: pre-tokenized token files at data.path; vocab 50304, tied embeddings.

    python train.py --config configs/diff_350m.py data.path='/data/tokens/train_*.bin'
"""

from diffjax import ModelConfig
from diffjax.data import DataConfig
from diffjax.train import ExperimentConfig, RunConfig, TrainConfig


def get_config():
    return ExperimentConfig(
        run=RunConfig(name="diff-350m"),
        model=ModelConfig(vocab_size=50304, d_model=1024, num_layers=24, num_heads=8,
                          attention="diff_v1", max_seq_len=2048, dtype="bfloat16",
                          param_dtype="float32", tie_embeddings=True),
        data=DataConfig(source="tokens", path="data/tokens/*.bin", token_dtype="uint16",
                        seq_len=2048),
        train=TrainConfig(steps=40000, batch_size=256, lr=3e-4, warmup_steps=375,
                          schedule="linear", b1=0.9, b2=0.98, weight_decay=0.05, grad_clip=1.0,
                          eval_every=1000, eval_batches=20, checkpoint_every=1000, log_every=10),
        compare=True,
    )
