"""The default comparison (what `python train.py` runs): a small DIFF V1 model (d_model 128, 4
layers, 2 heads) and its standard-attention twin on the built-in corpus (the Python standard
library's own sources), byte-level, each from two paired init seeds (0 and 1) so the report can
give an interval on the difference; 200 steps per model and seed. Results: docs/results.md."""

from diffjax.compare import default_comparison


def get_config():
    return default_comparison()
