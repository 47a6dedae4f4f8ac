"""The launch step: a resolved plan started as an engine process and kept running.

`run_dir` (the folder of one launch), `preflight` (refusals before anything starts, the engine's address),
`summary` (what is said before and after), `engine_process` (the runtime's command line and process),
`health` (waiting until it serves), `options` and `supervisor` (restarts, stops, detached supervisors).
Nothing here imports strata_runtime, numpy or cupy.
"""
