"""The profile step: TOML files -> one validated `Profile`, every key with the file and line that wrote it.

Reading and the line index, the ``extends`` chain, ``--set`` overrides and validation into problems that
speak TOML. Nothing here gathers facts or resolves; the next step is `strata_cfg.facts`.
"""
