"""The Textual app behind `strata tui`: a profile list, a TOML editor and a live plan view.

This is the only part of strata_cfg that imports textual; `strata_cfg.tui.app.StrataApp` is the app.
"""
