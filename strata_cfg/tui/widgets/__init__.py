"""The app's widgets, one module per screen area: profile list, editor, plan view, status line, engine
indicator."""
