"""The HTTP bench: driving a launched engine as its clients do (`strata loadtest`, `strata bench --url`)."""
