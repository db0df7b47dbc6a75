"""``python -m diffjax.compare [--config configs/NAME.py] [--resume] [key=value ...]``: the same
as ``python train.py``."""

from diffjax.compare.cli import exit_process, main

if __name__ == "__main__":
    exit_process(main())
