"""`python -m tensorbend VERB`: the command line (cli.main)."""

import sys

from tensorbend.cli import main

sys.exit(main())
