"""Multi-needle retrieval (the paper's Table 2 task), CPU-sized: DIFF V1 (2 heads) and its twin
(4 heads), d_model 64, 2 layers, init std 0.04 for both, from scratch, the same batches in the
same order.

Task: 4 needles "<k><v>" (a one-letter key right before a one-digit value, nothing around them;
keys and values distinct within an example) at random depths in 128 bytes of stdlib text (88
bytes of it haystack: the key letters also occur there, followed by other bytes), then 16
queries "<k><v>" drawn with replacement, so none follows by elimination (but repeats can be
copied: below). The loss and `val_query_accuracy` count the value digits only. Chance
per query (diffjax.data.synthetic.query_chance): uniform 1/9 = 0.111; "no retrieval" 1/4 (copy
the value of a random needle). About 0.9% of the validation queries are ambiguous (the haystack
holds the key letter before another digit). `model.max_seq_len` is 256, twice the trained
length, so `python -m diffjax.evaluate` also measures retrieval and loss by position beyond it.

What the accuracy counts: 12 of the 16 queries (75%) repeat a key asked earlier in the example,
and their answer can be copied from right after that earlier query, without reading the
needles (diffjax.data.query_kinds). Only query 0 must come from the needles:
`val_first_query_accuracy` (no-retrieval level 0.25) is the retrieval measure, and report.md's
seed count uses it.

Measured (2026-12-02, JAX 0.10.2, 2 CPU cores, about 8 min per model and seed on free cores,
batch 128 x 1500 steps: the same examples as the previous batch 64 x 3000 in less time;
docs/retrieval.md): first-query accuracy DIFF 0.293, 0.297, 0.347 (seeds 0-2), its twin 0.951,
0.266, 0.428 (seed 2 left the no-retrieval level at step 1000, still rising); seed count
(above 0.625) DIFF 0 of 3, twin 1 of 3. DIFF's all-query accuracy (0.636, 0.814, 0.822) is
mostly copying: it rises from about 0.3 at query 0 to about 0.9 by query 4
(benchmarks/query_split.py). The twin's accuracy is flat over the query indices. So with bare
needles the twin learns the lookup in some seeds and DIFF mostly learns to copy earlier queries.
With separators around each needle ("\\n$k7\\n", an earlier version of this config) it was the
other way round: DIFF reached 0.34-0.47 on the first query (seeds 0-2, 2000 steps, still
rising) and the twin stayed at 0.25 in every run. The paper's sentences ("The magic number for <k> is
<vv>.", the default of `data.needle_template`) were learned by neither model in any pilot. No
setting measured has both models reading the needles."""


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
        train=TrainConfig(steps=1500, batch_size=128, lr=3e-3, warmup_steps=100, schedule="cosine",
                          min_lr_ratio=0.1, b2=0.95, weight_decay=0.0, eval_every=250,
                          eval_batches=8, checkpoint_every=500),
        compare=True,
    )
