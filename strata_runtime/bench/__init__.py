"""`strata bench` inside the engine process: the harness and what it measures against.

`harness` runs named workloads over arms (one plan each) and summarises them; `ceilings` is the arithmetic
of the byte roofline and the prompt FLOPs; `step` times one decode step straight from the CUDA kernels;
`vram` reads the memory the engine really holds; `peer` runs transformers on the same weights as an arm;
`host_choice` times the host's token choice (``python -m strata_runtime.bench.host_choice``).
Nothing in the engine imports this package.
"""
