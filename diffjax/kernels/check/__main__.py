"""``python -m diffjax.kernels.check``: see :mod:`diffjax.kernels.check`."""

import sys

from . import main

sys.exit(main())
