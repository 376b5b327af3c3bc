"""`python -m pagoda_daemon.topology`: the same as `pagoda topology`."""

import sys

from pagoda_daemon.topology.cli import main

sys.exit(main())
