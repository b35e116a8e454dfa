"""``python -m psflow``: the ``psflow`` command line."""

import sys

from psflow.cli import main

sys.exit(main())
