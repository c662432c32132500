"""`python -m bench.analysis`: see `bench.analysis.cli`."""

import sys

from bench.analysis.cli import main

sys.exit(main())
