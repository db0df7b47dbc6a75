"""Multi-needle retrieval (the paper's Table 2 task), CPU-sized: DIFF V1 (2 heads) and its twin
(4 heads), d_model 64, 2 layers, init std 0.04 for both, from scratch, the same batches in the
same order.

Task: 4 needles "\\n$<k><v>\\n" (a one-letter key right before a one-digit value; keys and values
distinct within an example) in 128 bytes of stdlib text, then 16 queries "\\n$<k><v>" drawn with
replacement, so every query needs the key-value link and none follows by elimination. The loss
and `val_query_accuracy` count the value digits only. Chance per query
(diffjax.data.synthetic.query_chance): uniform 1/9 = 0.111; "no retrieval" 1/4 (copy the value
of a random needle: the best a model does without matching the key). `model.max_seq_len` is
256, twice the trained length, so `python -m diffjax.evaluate` also measures retrieval and loss
by position beyond it.

Why not the paper's sentences: with "The magic number for <k> is <vv>." (the default
`data.needle_template`) no 2-layer d64 model left the no-retrieval level in any pilot (up to
4000 steps, inits 0.02-0.072, lr 3e-3 and 1e-2, batch 16-32; docs/retrieval.md). With the key
right before the value, the lookup is the one MQAR needs (a previous-token head, then a match);
in text the key is a few bytes from the value and the two offsets must be learned exactly.

Measured (2026-12-01, JAX 0.10.2, 2 CPU cores, about 7 min per model and seed; docs/retrieval.md):
final validation query accuracy DIFF 0.854, 0.479, 0.698 (seeds 0-2; above the no-retrieval
level from step 750, 1500, 750, still rising at 2000), twin 0.254, 0.252 (seeds 0-1: at the
no-retrieval level, as in 12 twin pilots with other inits, lr, batch sizes and contexts). The
issue-10 goal "both models well above chance" is met by DIFF only."""


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
                        needle_template="\n${key}{value}\n", query_template="\n${key}{value}"),
        train=TrainConfig(steps=2000, batch_size=64, lr=3e-3, warmup_steps=100, schedule="cosine",
                          min_lr_ratio=0.1, b2=0.95, weight_decay=0.0, eval_every=250,
                          eval_batches=8, checkpoint_every=500),
        compare=True,
    )
