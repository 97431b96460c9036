"""`python -m benchmarks`: see benchmarks.cli."""

import sys

from .cli import main

sys.exit(main())
