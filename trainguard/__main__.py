"""``python -m trainguard``: the command line (same as the ``trainguard`` console script)."""

import sys

from trainguard.cli import main

sys.exit(main())
