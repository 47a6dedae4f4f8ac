"""The NumPy reference of every kernel, in one place.

Each kernel the runtime runs on a GPU has its contract written here plainly in NumPy:

* `ops`: the array path's ops (RMSNorm in the input dtype, SwiGLU's gate, RoPE) and the counter-based random
  weights. These are also the CPU path itself: on a virtual CPU device the model runs them.
* `kernels`: the CUDA decode and prefill launchers of `strata_runtime.cuda.ops`, same names and signatures,
  writing their outputs in place.
* `flash`: the fused prefill attention of `strata_runtime.cuda.flash`, and the argument contract both share.
* `routing`: the router bias of `strata_runtime.cuda.routing` (calibrated routing's intended experts), the
  rules it follows and the argument contract both share.

The gpu tests compare each kernel with its reference; nothing here imports CuPy.
"""
