"""`python -m legato ...`: the `legato` command."""

import sys

from legato.cli import main

sys.exit(main())
