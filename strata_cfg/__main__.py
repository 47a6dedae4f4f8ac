"""`python -m strata_cfg` is the `strata` command."""

import sys

from .cli import main

sys.exit(main())
