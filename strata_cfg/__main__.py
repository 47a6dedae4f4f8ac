"""`python -m strata_cfg` is the `strata` command."""

from .cli import entry

entry()
