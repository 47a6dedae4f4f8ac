"""The CUDA path: a stage's layers, the head and the MTP head run by hand-written kernels.

`layers` holds a run of layers as the kernels read them (`LayerStack`) and one layer's kernel sequence;
`decode` replays windows of up to 8 rows through a stack as CUDA graphs; `prefill` runs long prompt chunks
through the same stack on cuBLAS; `head` and `mtp` are the last stage's head and the MTP head. `ops`
launches the kernels of ``kernels.cu``, `flash` the fused prefill attention of ``flash.cu``, `routing` the
router bias of calibrated routing (``routing.cu``), `blas` the cuBLAS products, and `compile` compiles kernel
sources on demand. Importing this package imports no CuPy.
"""
