"""The bench side of the launcher: driving a launched engine over HTTP as its clients do, and the arms
that `strata bench` compares in process.

`http_driver` (one checked client), `load_test` (`strata loadtest`), `http_workloads` (`strata bench
--url`), `stats` (percentiles) and `arms` (the arms as ``--set`` overrides). Standard library only.
"""
