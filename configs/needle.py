"""Multi-needle retrieval (the paper's Table 2 task), CPU-sized: DIFF V1 (2 heads) and its twin
(4 heads), d_model 64, 2 layers, init std 0.04 and lr 3e-3 for both, from scratch, the same
batches in the same order; batch 128 x 1500 steps, minutes per model and seed on 2 CPU cores.

Task: 4 needles "<K><v>" (a key character right before a one-digit value, nothing around them;
keys and values distinct within an example) at random depths in 128 bytes of stdlib text (88
bytes of it haystack), then 16 queries "<K><v>" drawn with replacement, so none follows by
elimination. The keys are the characters "JQZXYKVW", which are rare in the text, so, as with
the paper's keys, the needle is the one place the key points to, and the other three needles
are the distractors (lowercase letters also occur in the text; set
`data.needle.key_letters=abcdefghijklmnopqrstuvwxyz` to try them). The loss and
`val_query_accuracy` count the value digits only. Chance per query
(diffjax.data.synthetic.query_chance): uniform 1/9 = 0.111; "no retrieval" 1/4 (the value of a
random needle). `model.max_seq_len` is 256, twice the trained length, so
`python -m diffjax.evaluate` also measures retrieval and loss by position beyond it.

What the accuracy counts: 12 of the 16 queries (75%) repeat a key asked earlier in the example,
and their answer can be copied from right after that earlier query without reading the needles
(diffjax.data.query_kinds). Only query 0 must come from the needles: `val_first_query_accuracy`
(no-retrieval level 0.25) is the retrieval measure, and report.md's seed count uses it.

Results (5 paired seeds): docs/results.md; how this setting was found: docs/retrieval.md.

    python train.py --config configs/needle.py compare.seeds=5
"""

from diffjax import ModelConfig
from diffjax.data import DataConfig, NeedleData
from diffjax.compare import Comparison
from diffjax.train import RunConfig, TrainConfig


def get_config():
    return Comparison(
        run=RunConfig(name="needle"),
        model=ModelConfig(
            d_model=64,
            num_layers=2,
            num_heads=2,
            attention="diff_v1",
            max_seq_len=256,
            init_std=0.04,
        ),
        data=DataConfig(
            source="needle",
            seq_len=128,
            needle=NeedleData(
                num_needles=4,
                num_queries=16,
                query_replacement=True,
                key_len=1,
                value_len=1,
                key_letters="JQZXYKVW",
                template="{key}{value}",
                query_template="{key}{value}",
            ),
        ),
        train=TrainConfig(
            steps=1500,
            batch_size=128,
            lr=3e-3,
            warmup_steps=100,
            schedule="cosine",
            min_lr_ratio=0.1,
            b2=0.95,
            weight_decay=0.0,
            eval_every=250,
            eval_batches=8,
            checkpoint_every=500,
        ),
    )
