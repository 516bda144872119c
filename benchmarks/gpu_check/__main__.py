"""``python -m benchmarks.gpu_check``: the command, and the workers it starts (``--worker``)."""

import sys

from benchmarks.gpu_check.cli import main

sys.exit(main())
