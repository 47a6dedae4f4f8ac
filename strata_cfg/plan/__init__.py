"""The plan step: a profile file (or text) made into a `LaunchPlan` by the steps before it, in order:
`strata_cfg.profile` (load), `strata_cfg.facts` (gather) and `strata_cfg.resolve` (the pure resolver).

The plan's model is `strata_cfg.schema.plan`; its file, ``plan.json``, is `strata_cfg.schema.plan_file`.
"""
