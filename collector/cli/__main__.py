"""``python -m collector.cli``: the ``stepmem`` command."""

import sys

from collector.cli import main

sys.exit(main())
