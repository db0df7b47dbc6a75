"""The comparison at ~30M parameters on one GPU (``bash benchmarks/gpu_stage0.sh``, or
``python -m diffjax.sweep --config configs/gpu_stage0.py``): DIFF V1, DIFF V2, a DIFF V2 matched
to the twin's parameters, and their one twin, on the Python standard library's sources with its
tests (byte-level; what any machine with Python has, no download), documents kept apart, from
two paired init seeds. The size and token budget of diff-mlx's Stage 0 (30M parameters, 100M
tokens per model); ``gpu_stage0.sh`` sets the tokens to what one device call holds.

The models (d_model 512, 10 layers, SwiGLU 1408, RMSNorm, rotary; bf16 activations, float32
parameters; vocabulary 259):

| arm | model | heads x width | non-embedding parameters | against |
|---|---|---|---:|---|
| v1 | DIFF V1 | 4 x (2 x 64) | 32,127,232 | the twin (trained in this arm) |
| v1 | twin | 8 x 64 | 32,123,392 | |
| v2 | DIFF V2 | 8 pairs, 16 query heads of 64 | 34,785,792 (+8.3%) | the same twin: V2 gets twice V1's heads |
| v2m | DIFF V2, FFN 1232 | as v2 | 32,082,432 (-0.13%) | the same twin (``twins``) |

Recipe (the same for every model, tuned for none): AdamW at 1e-3, b2 0.95, weight decay 0.1,
clipping at 1, 100 warmup steps then cosine to 0.1; batch 64 x 1024 tokens (65,536 per step).
Every run sees the same batches in the same order (``data.seed``); seed s of each model starts
from init seed s; 20 evaluations per run on the same 8 held-out batches. A checkpoint every 200
steps: a call cut off mid-run resumes where it stopped with the same command (finished arms are
skipped). ``model.attention_impl=auto``: each model its fastest measured path (the report says
which); ``model.attention_impl=pallas`` puts all on one make.
"""

from diffjax.sweep import Ladder
from diffjax.compare import default_comparison
from diffjax.train import apply_overrides

HEADS = {"v1": 4, "v2": 8}
SWEEP = Ladder(
    tokens=100_000_000,  # the target; gpu_stage0.sh sets what fits its time (sweep.tokens=N)
    evals=20,
    arms={
        "v1": ["model.attention=diff_v1", f"model.num_heads={HEADS['v1']}"],
        "v2": ["model.attention=diff_v2", f"model.num_heads={HEADS['v2']}", "compare.twins="],
        "v2m": [
            "model.attention=diff_v2",
            f"model.num_heads={HEADS['v2']}",
            "model.ffn_dim=1232",
            "compare.twins=",
        ],
    },
    twins={"v2m": "v1"},
)


def get_config():
    return apply_overrides(
        default_comparison(),
        [
            "run.name=gpu-stage0",
            "model.d_model=512",
            "model.num_layers=10",
            "model.num_heads=4",
            "model.max_seq_len=1024",
            "model.dtype=bfloat16",
            "data.seq_len=1024",
            "data.stdlib.tests=true",
            "train.batch_size=64",
            "train.lr=1e-3",
            "train.warmup_steps=100",
            "compare.seeds=2",
            "train.eval_batches=8",
            "train.checkpoint_every=200",
            "train.log_every=10",
            "compare.quick_eval=false",
            "compare.throughput_rounds=0",
            "train.tensorboard=false",
        ],
    )
