"""``python -m gdskv.master``: the same as ``gdskv-master``."""

import sys

from gdskv.master.server import main

sys.exit(main())
