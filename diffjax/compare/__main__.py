"""``python -m diffjax.compare [--config configs/NAME.py] [--resume] [key=value ...]``: the same
as ``python train.py``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
