"""``python -m pagoda_operator``: run the operator."""

import sys

from pagoda_operator.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
