"""`strata` subcommands, one module each (see `strata_cfg.cli.COMMANDS`)."""
