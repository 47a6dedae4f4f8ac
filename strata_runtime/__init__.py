"""strata_runtime: a CuPy Mixture-of-Experts inference engine that executes a strata launch plan.

With no GPU it runs the same code on NumPy over virtual CPU devices, which is also the reference path.
"""

__version__ = "0.1.0"
