import sys

from diffjax.retrofit.cli import main

sys.exit(main())
