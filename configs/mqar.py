"""Multi-query associative recall (MQAR), CPU-sized: DIFF V1 (2 heads) and its twin (4 heads),
d_model 64, 2 layers, from scratch, the same batches in the same order.

Task: 8 (key, value) byte pairs (keys distinct, from 16 key ids; values from 16 value ids, they
may repeat), then 16 queries drawn *with replacement* from the 8 pairs (`query_replacement`:
16 answers to learn from per example, and no answer follows by elimination); the loss and
`val_query_accuracy` count the queried values only. Chance per query
(diffjax.data.synthetic.query_chance): uniform 1/16 = 0.062; "no retrieval" 0.180 (copy the
value of a random pair: the best a model does without the key -> value link).

Measured (2026-12-01, 2 free CPU cores, `python train.py --config configs/mqar.py
train.num_seeds=2`, 20 min 23 s wall for the four runs, about 5 min per model and seed;
docs/retrieval.md): final validation query accuracy DIFF 0.657 and 0.923 (seeds 0, 1), twin
0.263 and 0.263. DIFF leaves the no-retrieval plateau at about step 1000-1500 in both seeds;
the twin stays on it (0.26 from step 2000 on). So this setting meets half of issue 10's goal:
DIFF retrieves, its twin does not within this budget (nor with lr 1e-3 or 1e-2, d_model 128,
3 layers, 2 heads, 4 pairs or 8000 steps in single-seed pilots); two seeds, so how sure the gap
is: see the report's interval."""

from diffjax import ModelConfig
from diffjax.data import DataConfig
from diffjax.train import ExperimentConfig, RunConfig, TrainConfig


def get_config():
    return ExperimentConfig(
        run=RunConfig(name="mqar"),
        model=ModelConfig(d_model=64, num_layers=2, num_heads=2, attention="diff_v1",
                          max_seq_len=48),
        data=DataConfig(source="mqar", seq_len=48, num_pairs=8, num_queries=16,
                        query_replacement=True, mqar_num_keys=16, mqar_num_values=16),
        train=TrainConfig(steps=4000, batch_size=64, lr=3e-3, warmup_steps=100, schedule="cosine",
                          min_lr_ratio=0.1, b2=0.95, weight_decay=0.0, eval_every=250,
                          eval_batches=8, checkpoint_every=1000),
        compare=True,
    )
