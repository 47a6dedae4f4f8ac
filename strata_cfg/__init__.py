"""strata-cfg: hardware profiles, a pure launch-plan resolver, and the `strata` command.

Importing this package stays cheap: no numpy, no cupy, no textual.
"""

__version__ = "0.1.0"
