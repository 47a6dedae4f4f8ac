"""Engine-process commands, one module each (see strata_runtime.__main__)."""
