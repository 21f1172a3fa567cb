"""`python -m hwsync.cli ...`: the `hwsync` command without its console script."""

import sys

from hwsync.cli import main

sys.exit(main())
