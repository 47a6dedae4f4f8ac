"""The launch step: a resolved plan started as an engine process and kept running."""
