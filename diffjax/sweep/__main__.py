"""``python -m diffjax.sweep --config FILE [--report-only] [key=value ...]``: scaling curves of
DIFF and its twin over the config file's ladder (:mod:`diffjax.sweep.cli`)."""

import sys

from diffjax.sweep.cli import main

if __name__ == "__main__":
    sys.exit(main())
