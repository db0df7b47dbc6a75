"""Multi-needle retrieval (the paper's Table 2 task, small): N "key -> value" needles hidden at
controlled depths in corpus text, R of them queried at the end; loss and accuracy on the
answers only. A DIFF V1 model and its twin, from scratch, CPU-sized."""


from diffjax import ModelConfig
from diffjax.data import DataConfig
from diffjax.train import ExperimentConfig, RunConfig, TrainConfig


def get_config():
    return ExperimentConfig(
        run=RunConfig(name="needle"),
        model=ModelConfig(d_model=128, num_layers=4, num_heads=2, attention="diff_v1",
                          max_seq_len=512),
        data=DataConfig(source="needle", seq_len=512, num_needles=4, num_queries=2),
        train=TrainConfig(steps=600, batch_size=8, lr=2e-3, warmup_steps=50, schedule="cosine",
                          min_lr_ratio=0.1, b2=0.95, weight_decay=0.1, eval_every=100,
                          eval_batches=8, checkpoint_every=200),
        compare=True,
    )
