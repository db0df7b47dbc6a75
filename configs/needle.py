"""Multi-needle retrieval (the paper's Table 2 task), CPU-sized: DIFF V1 (2 heads) and its twin
(4 heads), d_model 64, 2 layers, init std 0.04 for both, from scratch, the same batches in the
same order.

Task: 4 needles "<k><v>" (a one-letter key right before a one-digit value, nothing around them;
keys and values distinct within an example) at random depths in 128 bytes of stdlib text (88
bytes of it haystack: the key letters also occur there, followed by other bytes), then 16
queries "<k><v>" drawn with replacement, so every query needs the key-value link and none
follows by elimination. The loss and `val_query_accuracy` count the value digits only. Chance
per query (diffjax.data.synthetic.query_chance): uniform 1/9 = 0.111; "no retrieval" 1/4 (copy
the value of a random needle). About 0.9% of the validation queries are ambiguous (the haystack
holds the key letter before another digit). `model.max_seq_len` is 256, twice the trained
length, so `python -m diffjax.evaluate` also measures retrieval and loss by position beyond it.

Why this format: which model learns the lookup at this scale depends on how many of the
context's tokens are keys and values (docs/retrieval.md, "Needle format"). With separators
around each needle ("\\n$k7\\n", the previous version of this config) DIFF learned it in 3 of 3
seeds and its twin in none of 2 seeds and 12 pilots, even with no haystack at all; with bare
needles the twin learns it (first, and to a higher accuracy) and DIFF learns it later. The
paper's sentences ("The magic number for <k> is <vv>.", the default of `data.needle_template`)
were learned by neither model in any pilot.

Measured (2026-12-02, JAX 0.10.2, 2 CPU cores, about 10.5 min per model and seed on free cores;
docs/retrieval.md): final validation query accuracy DIFF 0.770, 0.819, 0.249 (seeds 0-2;
above the no-retrieval level from step 1750 and 1000 in seeds 0-1, still rising at 3000), twin
0.950, 0.250, 0.247 (seed 0 from step 750; seeds 1-2 never left the no-retrieval level).
Escape is all or nothing per seed for both models: DIFF 2 of 3, twin 1 of 3."""


from diffjax import ModelConfig
from diffjax.data import DataConfig
from diffjax.train import ExperimentConfig, RunConfig, TrainConfig


def get_config():
    return ExperimentConfig(
        run=RunConfig(name="needle"),
        model=ModelConfig(d_model=64, num_layers=2, num_heads=2, attention="diff_v1",
                          max_seq_len=256, init_std=0.04),
        data=DataConfig(source="needle", seq_len=128, num_needles=4, num_queries=16,
                        query_replacement=True, key_len=1, value_len=1,
                        needle_template="{key}{value}", query_template="{key}{value}"),
        train=TrainConfig(steps=3000, batch_size=64, lr=3e-3, warmup_steps=100, schedule="cosine",
                          min_lr_ratio=0.1, b2=0.95, weight_decay=0.0, eval_every=250,
                          eval_batches=8, checkpoint_every=500),
        compare=True,
    )
