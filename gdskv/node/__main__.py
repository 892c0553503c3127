"""``python -m gdskv.node``: the same as ``gdskv-node``."""

import sys

from gdskv.node.cli import main

sys.exit(main())
