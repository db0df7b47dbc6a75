"""Multi-query associative recall (MQAR), CPU-sized: DIFF V1 (2 heads) and its twin (4 heads),
d_model 64, 2 layers, from scratch, the same batches in the same order.

Task: 8 (key, value) byte pairs, keys distinct from 16 key ids, values from 16 value ids (they
may repeat), then 4 of the 8 keys queried; the loss and `val_query_accuracy` count the queried
values only. Only half the pairs are queried, so elimination (answering the last query with the
value not yet asked) does not work. Chance per query (diffjax.data.synthetic.query_chance):
uniform 1/16 = 0.0625; "no retrieval" 0.211 (copy the value of a random pair not asked
before; the best a model does without the key -> value link).

Measured (2026-12-01, 2 CPU cores shared with other jobs, load average 12-22, DIFF and twin
trained at the same time in two processes, init seed 0, see docs/retrieval.md): NOT yet
learned. After the 5000 steps (52 min wall per model at that load; 581 and 531 CPU-seconds,
so under 10 min on 2 free cores) both models stay a little above the no-retrieval level and
flat since step 2500: validation query accuracy DIFF 0.284, twin 0.267 (answer loss 1.641 and
1.681 nats). This is the cheapest setting measured so far, kept as the
starting point; it does not meet issue 10's goal (both models well above chance in ~10 min)."""

from diffjax import ModelConfig
from diffjax.data import DataConfig
from diffjax.train import ExperimentConfig, RunConfig, TrainConfig


def get_config():
    return ExperimentConfig(
        run=RunConfig(name="mqar"),
        model=ModelConfig(d_model=64, num_layers=2, num_heads=2, attention="diff_v1",
                          max_seq_len=24),
        data=DataConfig(source="mqar", seq_len=24, num_pairs=8, num_queries=4, mqar_num_keys=16,
                        mqar_num_values=16),
        train=TrainConfig(steps=5000, batch_size=64, lr=3e-3, warmup_steps=100, schedule="cosine",
                          min_lr_ratio=0.1, b2=0.95, weight_decay=0.0, eval_every=250,
                          eval_batches=8, checkpoint_every=1000),
        compare=True,
    )
