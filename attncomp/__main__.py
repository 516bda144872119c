import sys

from attncomp.cli import main

sys.exit(main())
