"""The facts step: everything the resolver takes as given, gathered (with I/O) before it runs."""
