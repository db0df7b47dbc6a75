#!/usr/bin/env python
"""Train a Differential Transformer and its standard-attention twin, and compare them.

python train.py                                   # the default comparison (~5 min on 2 CPU cores)
python train.py --config configs/needle.py train.steps=200 model.num_layers=4
python train.py --help                            # every config key with its default

The same as ``python -m diffjax.compare`` (:func:`diffjax.compare.main`).
"""

from diffjax.compare import exit_process, main

if __name__ == "__main__":
    exit_process(main())
