"""``python -m pagekv``: the same command line as the ``pagekv`` console script."""

import sys

from pagekv.store.cli import main

sys.exit(main())
