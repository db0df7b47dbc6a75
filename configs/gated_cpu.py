"""DIFF against the strongest rival at the table, on 2 CPU cores: the default comparison's DIFF V1
model (d_model 128, 4 layers, 2 DIFF heads; the built-in stdlib corpus, byte-level, 200 steps of
16 x 128 tokens) beside two twins on the same batches in the same order from the same init
seeds (0, 1, 2):

- ``standard``: its standard-attention twin (4 heads of width 32, the same projections);
- ``gated``: that twin with gated attention's output gate (Qiu et al. 2025; ``model.gate``),
  elementwise (``compare.twin_gate``): sigmoid(x W_gate) times each head's output before
  out_proj. The gate adds a d_model x d_model kernel per layer (65,536 parameters here), so the
  gated twin is matched to the twin in everything but the gate, not in parameters.

The quick evaluation adds the attention sinks and massive activations of all three models.
DIFF V2 against its own two twins is the same command with ``model.attention=diff_v2
run.name=gated-cpu-v2``. DIFF with the gate itself (``model.gate=elementwise``) trains against
its twin, which the gate makes the gated twin (``compare.twins=standard``; the same gated twin,
run for run, as above). Results: docs/results.md.

    python train.py --config configs/gated_cpu.py
    python train.py --config configs/gated_cpu.py model.attention=diff_v2 run.name=gated-cpu-v2
    python train.py --config configs/gated_cpu.py model.gate=elementwise compare.twins=standard \
        run.name=gated-cpu-diffgate          # and model.attention=diff_v2 run.name=gated-cpu-v2-diffgate
"""

from diffjax.compare import default_comparison
from diffjax.train import apply_overrides


def get_config():
    return apply_overrides(
        default_comparison(),
        ["run.name=gated-cpu", "compare.twins=standard,gated", "compare.seeds=3"],
    )
