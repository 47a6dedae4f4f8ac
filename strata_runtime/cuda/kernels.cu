// Decode kernels for strata_runtime's CUDA path.
//
// Every kernel computes each row of a window independently, with a fixed reduction order, so a row's
// result does not depend on which other rows share its window (batch invariance: greedy text is the same
// solo, serial, pipelined or with batch MTP). Weights are fp16; the residual stream and every accumulator
// are fp32. Each kernel has a NumPy reference in strata_runtime/reference/kernels.py that the gpu tests
// compare it to.
//
// Dimension letters: R rows of the window, H hidden, N output features, K reduction length, E experts,
// A = R * topk assignments (row, expert), I expert width, D head dim, G query heads per KV head, T context.
//
// This file holds what every kernel shares (PDL, warp reductions, the block counter); the kernels are in the
// files it includes at its end, in this order, and NVRTC compiles the whole as one unit
// (strata_runtime/cuda/compile.py's `source` inlines each include):
//   gemv.cuh          GEMV on CUDA cores (gemv_wide, gemv_any), and through 8-bit weights (gemv_i8)
//   rope.cuh          q/k RMSNorm + NeoX RoPE of one head (rope_head_row), shared by gemv_mma and qk_norm_rope_kv
//   gemv_mma.cuh      GEMV on tensor cores, with the q/k/v projection's fused RoPE (gemv_mma)
//   gemv_split.cuh    GEMV of a short output, the reduction split over a block: a router's logits (gemv_split)
//   norms.cuh         residual add + RMSNorm (add_rmsnorm); q/k norm + RoPE + KV write (qk_norm_rope_kv)
//   attention.cuh     decode attention: attn_split on CUDA cores, attn_tc on tensor cores
//   experts.cuh       the routed experts (moe_gate_up, moe_down, ..._any); silu_mul, add_scaled
//   argmax.cuh        embedding gather, each row's argmax, a request's logit bias and penalties
//   choose.cuh        choosing each row's token on the device (choose_rows, distribution_rows)
//   choose_split.cuh  a row's choice split over slices of the row (choose_split_*, distribution_split_*)
//                     and draws from distributions, a sampled window's acceptance
//   prefill_ops.cuh   the prefill's pieces between cuBLAS products, and the router's top-k (route_topk)

#include <cuda_fp16.h>
#include "tensor_core.cuh"

#define STRATA_INF __int_as_float(0x7f800000)

// Whether v is a NaN, from its bits (a test no compiler option can fold away).
__device__ __forceinline__ bool strata_isnan(float v) { return (__float_as_uint(v) & 0x7fffffffu) > 0x7f800000u; }

// Programmatic dependent launch (sm_90 and later). Launched with the PDL attribute (ops.py, `pdl.py`), a
// decode kernel may start while the kernel before it in the stream is still finishing: each one lets the
// next launch once all its own blocks have started (STRATA_PDL_LAUNCH, first thing), issues nothing before
// STRATA_PDL_WAIT but reads of weights no kernel writes, and waits there until the kernel before it has
// completed and its writes are visible. So the next kernel's weight loads overlap the previous one's tail.
// Each kernel that launches its dependents waits before it ends, so completion stays transitive along the
// stream. Launched without the attribute, both are no-ops.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define STRATA_PDL_LAUNCH() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#define STRATA_PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define STRATA_PDL_LAUNCH()
#define STRATA_PDL_WAIT()
#endif

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ void unpack8(const uint4& p, float* f) {
  const half2* h = reinterpret_cast<const half2*>(&p);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float2 v = __half22float2(h[j]);
    f[2 * j] = v.x;
    f[2 * j + 1] = v.y;
  }
}

// Whether this block completes a group of blocks (attn_split's chunks of a head, gemv_mma's blocks of a head
// with ROPE), counting in a counter per group that is zero between launches.
__device__ __forceinline__ bool last_to_finish(int* __restrict__ counter, int expected, int* flag) {
  // After the barrier one thread counts the block in with an acquire-release add at GPU scope: the release
  // publishes the block's writes (ordered before it by the barrier), and for the block that arrives last the
  // acquire makes every other block's writes visible to the reads after the second barrier (CUTLASS's
  // semaphores use the same pattern). That block resets the counter for the next launch and reads the
  // others' results through L2 (__ldcg). No sequentially consistent fence is needed.
  __syncthreads();
  if (threadIdx.x == 0) {
    int prev;
    asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], 1;" : "=r"(prev) : "l"(counter) : "memory");
    *flag = prev == expected - 1;
    if (*flag) *counter = 0;
  }
  __syncthreads();
  return *flag;
}

#include "gemv.cuh"
#include "rope.cuh"
#include "gemv_mma.cuh"
#include "gemv_split.cuh"
#include "norms.cuh"
#include "attention.cuh"
#include "experts.cuh"
#include "argmax.cuh"
#include "choose.cuh"
#include "choose_split.cuh"
#include "prefill_ops.cuh"
