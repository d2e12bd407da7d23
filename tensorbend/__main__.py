import sys

from tensorbend.cli import main

sys.exit(main())
