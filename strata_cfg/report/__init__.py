"""The report: a plan or a refusal in words, for the CLI commands and the TUI alike.

`plan_text` (what `strata plan` prints), `explain` (one key's value, source and rules), `diff` (what changes
between two plans), `problems` (a refused profile, as text or JSON), `engine_args` (the equivalent engine
command line) and `table` (aligned columns).
"""
