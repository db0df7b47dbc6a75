"""The default comparison (what `python train.py` runs): a small DIFF V1 model and its
standard-attention twin on the built-in corpus (the Python standard library's own sources),
byte-level, sized to finish in about five minutes on 2 CPU cores."""

from diffjax.train import default_config


def get_config():
    return default_config()
