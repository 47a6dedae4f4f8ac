"""The facts step: everything the resolver takes as given, gathered (with I/O) before it runs.

`machine` (the GPUs, from the profile or nvidia-smi), `model` (a synthetic preset or a model directory),
`checkpoint` (what safetensors headers say) and `gather` (both, with every problem reported together).
"""
