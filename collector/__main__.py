"""``python -m collector ...``: the ``stepmem`` command without its console script."""

import sys

from collector.cli import main

sys.exit(main())
