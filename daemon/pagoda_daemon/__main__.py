import sys

from pagoda_daemon.cli import main

sys.exit(main())
