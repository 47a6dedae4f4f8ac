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

#include <cuda_fp16.h>
#include "tensor_core.cuh"

#define STRATA_INF __int_as_float(0x7f800000)

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

// ---- GEMV: y[r, n] (+)= sum_k W[n, k] x'[r, k] ---------------------------------------------------------
// x' is x, or with NORM the RMS-normalised x'[r, k] = x[r, k] * nw[k] * inv_rms(x[r]) (the norm is fused:
// each block computes the rows' inverse RMS itself, so no separate normalisation kernel runs).
// One warp per NR consecutive output features; each lane reads 16 bytes of a weight row per step, so a warp
// streams 512 contiguous bytes. K is a multiple of 256 here; gemv_any handles the rest.
template <int R, int K>
__device__ __forceinline__ void block_inv_rms(const float* __restrict__ x, float eps, float* inv) {
  // inv[r] = rsqrt(mean(x[r]^2) + eps) for r < R, computed by the whole block (256 threads) into shared
  // memory. K is a compile-time multiple of 256, so every load of a row is in flight at once.
  __shared__ float part[R][8];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = 8;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float ss = 0.f;
#pragma unroll
    for (int k = threadIdx.x; k < K; k += 256) {
      const float v = x[(size_t)r * K + k];
      ss += v * v;
    }
    ss = warp_sum(ss);
    if (lane == 0) part[r][warp] = ss;
  }
  __syncthreads();
  if (threadIdx.x < R) {
    float t = 0.f;
    for (int w = 0; w < nw; ++w) t += part[threadIdx.x][w];
    inv[threadIdx.x] = rsqrtf(t / K + eps);
  }
  __syncthreads();
}

// x[r, k0 .. k0 + 8) as two float4s, each element times its norm weight nf[.] when NORM. Both gemv_wide
// paths read x through this one helper and sum with dot8, so a row's operations are the same whatever R is:
// results must not depend on which rows share the window (batch invariance).
template <int K, bool NORM>
__device__ __forceinline__ void load_x8(const float* __restrict__ x, int r, int k0, const float* nf, float4& a,
                                        float4& b) {
  const float4* xr = reinterpret_cast<const float4*>(x + (size_t)r * K + k0);
  a = xr[0];
  b = xr[1];
  if (NORM) {
    a.x *= nf[0]; a.y *= nf[1]; a.z *= nf[2]; a.w *= nf[3];
    b.x *= nf[4]; b.y *= nf[5]; b.z *= nf[6]; b.w *= nf[7];
  }
}

// The dot product of 8 weights with x's 8 values, summed left to right.
__device__ __forceinline__ float dot8(const float* wf, const float4& a, const float4& b) {
  return wf[0] * a.x + wf[1] * a.y + wf[2] * a.z + wf[3] * a.w + wf[4] * b.x + wf[5] * b.y + wf[6] * b.z +
         wf[7] * b.w;
}

template <int R, int K, int NR, bool NORM>
__global__ void gemv_wide(const half* __restrict__ W, const float* __restrict__ x, float* __restrict__ y, int N,
                          int accumulate, const half* __restrict__ nw, float eps) {
  STRATA_PDL_LAUNCH();
  __shared__ float inv[R];
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const int n0 = warp * NR;
  constexpr int STEPS = K / 256;
  uint4 pk[NR == 1 ? STEPS : 1];
  if (NR == 1 && n0 < N) {
    // One row per warp: issue every load of the row first, so the whole row is in flight at once (and, under
    // PDL, while the kernel before is finishing).
    const uint4* w = reinterpret_cast<const uint4*>(W + (size_t)n0 * K);
#pragma unroll
    for (int s = 0; s < STEPS; ++s) pk[s] = __ldg(w + s * 32 + lane);
  }
  STRATA_PDL_WAIT();
  if (NORM) block_inv_rms<R, K>(x, eps, inv);
  if (n0 >= N) return;
  float acc[NR][R];
#pragma unroll
  for (int j = 0; j < NR; ++j)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[j][r] = 0.f;
  if (NR == 1) {
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      float wf[8];
      unpack8(pk[s], wf);
      const int k0 = s * 256 + lane * 8;
      float nf[8];
      if (NORM) unpack8(__ldg(reinterpret_cast<const uint4*>(nw + k0)), nf);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float4 a, b;
        load_x8<K, NORM>(x, r, k0, nf, a, b);
        acc[0][r] += dot8(wf, a, b);
      }
    }
  } else {
    // Several rows per warp: each x load is reused NR times, which matters once R > 2.
#pragma unroll 2
    for (int s = 0; s < STEPS; ++s) {
      uint4 pk[NR];
#pragma unroll
      for (int j = 0; j < NR; ++j) {
        const int n = min(n0 + j, N - 1);
        pk[j] = __ldg(reinterpret_cast<const uint4*>(W + (size_t)n * K) + s * 32 + lane);
      }
      const int k0 = s * 256 + lane * 8;
      float nf[8];
      if (NORM) unpack8(__ldg(reinterpret_cast<const uint4*>(nw + k0)), nf);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float4 a, b;
        load_x8<K, NORM>(x, r, k0, nf, a, b);
#pragma unroll
        for (int j = 0; j < NR; ++j) {
          float wf[8];
          unpack8(pk[j], wf);
          acc[j][r] += dot8(wf, a, b);
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < NR; ++j) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v = warp_sum(acc[j][r]);
      if (NORM) v *= inv[r];
      const int n = n0 + j;
      if (lane == 0 && n < N) {
        float* dst = y + (size_t)r * N + n;
        *dst = accumulate ? *dst + v : v;
      }
    }
  }
}

// ---- q/k RMSNorm + NeoX RoPE of one head ---------------------------------------------------------------
// The inverse RMS of one head's D values from the total of its squares (summed warp by warp in order, warp w
// holding rotation pairs 32w .. 32w + 31), and the normalised, rotated pair i at position p. qk_norm_rope_kv
// and gemv_mma's fused form (ROPE) both go through these, so they give the same bits.
__device__ __forceinline__ float head_inv_rms(float total, int D, float eps) { return rsqrtf(total / D + eps); }

__device__ __forceinline__ float2 rope_pair(float a, float b, float inv, const half* __restrict__ nw, int i, int D,
                                            int p, float theta) {
  const int half_d = D >> 1;
  const float na = a * inv * __half2float(nw[i]), nb = b * inv * __half2float(nw[i + half_d]);
  const float inv_freq = powf(theta, -2.f * (float)i / (float)D);
  float s, c;
  sincosf((float)p * inv_freq, &s, &c);
  return make_float2(na * c - nb * s, nb * c + na * s);
}

// gemv_mma's epilogue with ROPE = D (the q/k/v projection, y = qkv [R, (NQ + 2 NKV) D]): what
// qk_norm_rope_kv does, without a kernel of its own. For each head the block's features touch, the last of
// the head's blocks to finish (a counter per head in done, zero between launches) takes the head for every
// row, one warp per row: q normalised and rotated to q_out [R, NQ, D], k likewise and v as it is into the
// cache at (slot[r], kv head, pos[r]) ([S, NKV, T, D] fp16). Not inlined: inlined, its registers pushed the
// projection's loop at 2 to 8 rows past 128 and into spills.
// One row of head h: a[w], b[w] hold pairs i = 32 w + lane (values i and i + D / 2) of the row's y. q is
// normalised and rotated to q_out, k likewise and v as it is into the cache.
template <int D>
__device__ __forceinline__ void rope_head_row(const float* a, const float* b, int r, int h, const half* __restrict__ qn,
                                              const half* __restrict__ kn, const int* __restrict__ pos,
                                              const int* __restrict__ slot, float* __restrict__ q_out,
                                              half* __restrict__ kc, half* __restrict__ vc, int NQ, int NKV, int T,
                                              float theta, float eps) {
  constexpr int HALF = D / 2, PASSES = (HALF + 31) / 32;
  const int lane = threadIdx.x & 31;
  const bool is_q = h < NQ, is_k = !is_q && h < NQ + NKV;
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < PASSES; ++w) total += warp_sum(a[w] * a[w] + b[w] * b[w]);
  const int p = pos[r], kvh = is_q ? 0 : (h - NQ) % NKV;
  const size_t cache = (((size_t)slot[r] * NKV + kvh) * T + p) * D;
  if (is_q || is_k) {
    const float inv = head_inv_rms(total, D, eps);
#pragma unroll
    for (int w = 0; w < PASSES; ++w) {
      const int i = 32 * w + lane;
      if (i >= HALF) break;
      const float2 rot = rope_pair(a[w], b[w], inv, is_q ? qn : kn, i, D, p, theta);
      if (is_q) {
        float* dst = q_out + ((size_t)r * NQ + h) * D;
        dst[i] = rot.x;
        dst[i + HALF] = rot.y;
      } else {
        kc[cache + i] = __float2half(rot.x);
        kc[cache + i + HALF] = __float2half(rot.y);
      }
    }
  } else {
#pragma unroll
    for (int w = 0; w < PASSES; ++w) {
      const int i = 32 * w + lane;
      if (i >= HALF) break;
      vc[cache + i] = __float2half(a[w]);
      vc[cache + i + HALF] = __float2half(b[w]);
    }
  }
}

template <int R, int D, int WARPS>
__device__ __noinline__ void qkv_rope_heads(const float* __restrict__ y, int N, int n0, int F,
                                            const half* __restrict__ qn, const half* __restrict__ kn,
                                            const int* __restrict__ pos, const int* __restrict__ slot,
                                            float* __restrict__ q_out, half* __restrict__ kc, half* __restrict__ vc,
                                            int NQ, int NKV, int T, float theta, float eps, int* __restrict__ done) {
  constexpr int HALF = D / 2, PASSES = (HALF + 31) / 32;
  __shared__ int last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int first = n0 / D, end = (min(n0 + F, N) - 1) / D, blocks = D > F ? D / F : 1;
  for (int h = first; h <= end; ++h) {
    if (!last_to_finish(done + h, blocks, &last)) continue;
    for (int r = warp; r < R; r += WARPS) {
      const float* src = y + (size_t)r * N + (size_t)h * D;
      float a[PASSES], b[PASSES];
#pragma unroll
      for (int w = 0; w < PASSES; ++w) {
        const int i = 32 * w + lane;
        a[w] = i < HALF ? __ldcg(src + i) : 0.f;
        b[w] = i < HALF ? __ldcg(src + i + HALF) : 0.f;
      }
      rope_head_row<D>(a, b, r, h, qn, kn, pos, slot, q_out, kc, vc, NQ, NKV, T, theta, eps);
    }
  }
}

// Thread block clusters (sm_90): this block's rank, a barrier of the cluster's threads (release-acquire, so
// shared memory written before it is visible after it across the cluster), and a float of the shared memory
// of the cluster's block `rank` at the address of `p` in this block's.
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r = 0;
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}

__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ float cluster_load(const float* p, unsigned rank) {
  float v = 0.f;
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  unsigned a = tensor_core::smem_addr(p), remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(a), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#endif
  return v;
}

// ---- GEMV on tensor cores: y[r, n] (+)= sum_k W[n, k] x'[r, k], the window's rows as the n8 side ---------
// mma.sync m16n8k16 (sm_80 and later) with W as the 16-row operand and the window's R <= 8 rows as the 8
// columns, so each weight is read once for all the rows.
// Block of WARPS warps for 16 * MT output features. The reduction is cut into units of 32 * J k-values
// (J = 4 / MT), dealt to the warps round robin; a warp sums its units in order and the block sums its warps
// in order, so a row's result does not depend on R or on which rows share the window.
// x' keeps fp32 precision: each row's 32 k-values of a unit column are scaled by a power of two s (their
// largest |x'| lands in [2^13, 2^14), so nothing overflows fp16) and split into fp16 hi + lo, both
// multiplied in with fp32 accumulation; the column's sum is then multiplied by 1/s and added in fp32. With
// NORM, x' = x * nw and each warp also sums the squares of the x it reads, so the row's inverse RMS, which
// multiplies the result, costs no pass of its own.
// The k order inside an mma is a fixed permutation: lane (g, t) loads 8 contiguous fp16 of a weight row at
// k0 + 8t and feeds them as its logical k {2t, 2t+1, 2t+8, 2t+9} of two mmas; its x values come from the
// same physical k, so each mma sums 16 distinct k of the row.
__device__ __forceinline__ void mma_16816(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ unsigned pack_half2(float a, float b) {
  const half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}

// 2^e as a float, for |e| <= 126.
__device__ __forceinline__ float pow2(int e) { return __int_as_float((127 + e) << 23); }

// With ROPE = D > 0 the output is q/k/v (N = (NQ + 2 NKV) D, not accumulated) and the block ends with
// qkv_rope_heads; with ROPE = 0 the arguments after eps are unused (null).
// STAGE > 0 (ops.QkvForm's staged) holds STAGE units a warp in registers at a time and lands the units after
// the first round in dynamic shared memory, issued with the first round before the wait. PAIR
// (gemv_mma_pair, QkvForm's paired) runs each head's two blocks as a cluster that exchange their halves in
// shared memory. Neither changes a sum or its order: every form gives the same bits.
#define GEMV_MMA_PARAMS                                                                                   \
  const half *__restrict__ W, const float *__restrict__ x, float *__restrict__ y, int N, int accumulate,      \
      const half *__restrict__ nw, float eps, const half *__restrict__ qn, const half *__restrict__ kn,       \
      const int *__restrict__ pos, const int *__restrict__ slot, float *__restrict__ q_out,                  \
      half *__restrict__ kc, half *__restrict__ vc, int NQ, int NKV, int T, float theta, int *__restrict__ done
#define GEMV_MMA_ARGS W, x, y, N, accumulate, nw, eps, qn, kn, pos, slot, q_out, kc, vc, NQ, NKV, T, theta, done
// Each 16-byte piece of a unit a lane holds: MT tiles x J pieces x 2 bands.
#define EACH_PIECE(m, j, band)                                                                            \
  _Pragma("unroll") for (int m = 0; m < MT; ++m) _Pragma("unroll") for (int j = 0; j < J; ++j)              \
      _Pragma("unroll") for (int band = 0; band < 2; ++band)

template <int R, int K, int MT, int WARPS, bool NORM, int ROPE, int STAGE, bool PAIR>
__device__ __forceinline__ void gemv_mma_body(GEMV_MMA_PARAMS) {
  STRATA_PDL_LAUNCH();
  constexpr int J = 4 / MT, UNIT = 32 * J, UNITS = K / UNIT, PER = (UNITS + WARPS - 1) / WARPS, F = 16 * MT;
  // Units in registers at a time: GROUP * MT * J * 2 loads of 16 bytes a lane.
  constexpr int GROUP = STAGE > 0 ? STAGE : 2;
  // The unit loop is unrolled when it is short (a reduction up to 4096, or 2048 with the norm's registers):
  // a longer unrolled loop keeps more than 128 registers live and spills to local memory.
  constexpr int ALL_ROUNDS = (PER + GROUP - 1) / GROUP, ROUNDS = ALL_ROUNDS <= (NORM ? 2 : 4) ? ALL_ROUNDS : 1;
  __shared__ float red[WARPS][F][R + 1];
  __shared__ float squares[WARPS][R];
  __shared__ float mine[PAIR ? R : 1][PAIR ? F : 1];  // with PAIR, this block's outputs
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * F;
  // Lane (g, t) reads weight rows n0 + 16m + g and n0 + 16m + g + 8 of each m-tile m.
  const uint4* rows[MT][2];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int band = 0; band < 2; ++band)
      rows[m][band] = reinterpret_cast<const uint4*>(W + (size_t)min(n0 + 16 * m + 8 * band + g, N - 1) * K);
  float total[MT][4], ss = 0.f;
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c) total[m][c] = 0.f;
  uint4 pw[GROUP][MT][J][2];
  auto load = [&](int i0) {
#pragma unroll
    for (int slot = 0; slot < GROUP; ++slot) {
      const int u = warp + WARPS * (i0 + slot);
      if (i0 + slot < PER && u < UNITS) {
        EACH_PIECE(m, j, band) pw[slot][m][j][band] = __ldg(rows[m][band] + (u * UNIT + 32 * j) / 8 + t);
      }
    }
  };
  // With STAGE, a warp's units after its first GROUP land in dynamic shared memory as
  // [unit - GROUP][m][j][band][warp][lane] uint4 (cp.async, issued before the wait, like the first round's
  // loads): each lane reads back only its own 16 bytes, so no barrier is needed, and every weight of the
  // block is in flight at once.
  extern __shared__ uint4 staged[];
  constexpr int STAGED = STAGE > 0 ? PER - GROUP : 0;
  static_assert(STAGE == 0 || (PER > GROUP && PER % GROUP == 0), "STAGE: whole rounds");
  auto staged_piece = [&](int i, int m, int j, int band) {
    return staged + ((((i * MT + m) * J + j) * 2 + band) * WARPS + warp) * 32 + lane;
  };
  load(0);
  if constexpr (STAGED > 0) {
#pragma unroll
    for (int i = 0; i < STAGED; ++i) {
      const int u = warp + WARPS * (GROUP + i);
      EACH_PIECE(m, j, band)
      tensor_core::cp_async16(tensor_core::smem_addr(staged_piece(i, m, j, band)),
                              rows[m][band] + (min(u, UNITS - 1) * UNIT + 32 * j) / 8 + t, u < UNITS);
    }
    tensor_core::cp_async_commit();
  }
  STRATA_PDL_WAIT();
#pragma unroll ROUNDS
  for (int i0 = 0; i0 < PER; i0 += GROUP) {
    if constexpr (STAGED > 0) {
      if (i0 > 0) {
        tensor_core::cp_async_wait<0>();
#pragma unroll
        for (int slot = 0; slot < GROUP; ++slot)
          EACH_PIECE(m, j, band) pw[slot][m][j][band] = *staged_piece(i0 - GROUP + slot, m, j, band);
      }
    } else if (i0 > 0) {
      load(i0);
    }
#pragma unroll
    for (int slot = 0; slot < GROUP; ++slot) {
      const int u = warp + WARPS * (i0 + slot);
      if (i0 + slot >= PER || u >= UNITS) break;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int k0 = u * UNIT + 32 * j + 8 * t;
        // Lanes past the window's last row read that row again: their columns of the mma are never stored,
        // and without a branch here the compiler keeps every row count's loop in registers.
        const float4* xr = reinterpret_cast<const float4*>(x + (size_t)min(g, R - 1) * K + k0);
        const float4 xa = xr[0], xb = xr[1];
        float v[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
        if (NORM) {
          float nf[8];
          unpack8(__ldg(reinterpret_cast<const uint4*>(nw + k0)), nf);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            ss += v[e] * v[e];
            v[e] *= nf[e];
          }
        }
        // The column's scale: from the largest |x'| of row g over the 32 values its four lanes hold.
        float mx = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) mx = fmaxf(mx, fabsf(v[e]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        int ex = 0;
        frexpf(mx, &ex);  // mx < 2^ex
        ex = mx > 0.f ? min(max(14 - ex, -120), 120) : 0;
        const float s = pow2(ex);
        unsigned bh[4], bl[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float a = v[2 * i] * s, b = v[2 * i + 1] * s;
          const half2 hh = __floats2half2_rn(a, b);
          const float2 back = __half22float2(hh);
          bh[i] = *reinterpret_cast<const unsigned*>(&hh);
          bl[i] = pack_half2(a - back.x, b - back.y);
        }
        // The accumulator's columns are rows 2t and 2t + 1: their scales are held by lanes 8t and 8t + 4.
        const float un0 = pow2(-__shfl_sync(0xffffffffu, ex, 8 * t));
        const float un1 = pow2(-__shfl_sync(0xffffffffu, ex, 8 * t + 4));
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          const uint4 lo8 = pw[slot][m][j][0], hi8 = pw[slot][m][j][1];
          float d[4] = {0.f, 0.f, 0.f, 0.f};
          // physical k0 + {0..3}: first mma; k0 + {4..7}: second.
          mma_16816(d, lo8.x, hi8.x, lo8.y, hi8.y, bh[0], bh[1]);
          mma_16816(d, lo8.x, hi8.x, lo8.y, hi8.y, bl[0], bl[1]);
          mma_16816(d, lo8.z, hi8.z, lo8.w, hi8.w, bh[2], bh[3]);
          mma_16816(d, lo8.z, hi8.z, lo8.w, hi8.w, bl[2], bl[3]);
          total[m][0] += d[0] * un0;
          total[m][1] += d[1] * un1;
          total[m][2] += d[2] * un0;
          total[m][3] += d[3] * un1;
        }
      }
    }
  }
  // total[m]: (feature 16m + g, rows 2t, 2t + 1), (feature 16m + g + 8, rows 2t, 2t + 1).
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int f = 16 * m + g + 8 * (c >> 1), r = 2 * t + (c & 1);
      if (r < R) red[warp][f][r] = total[m][c];
    }
  if (NORM) {
    ss += __shfl_xor_sync(0xffffffffu, ss, 1);
    ss += __shfl_xor_sync(0xffffffffu, ss, 2);
    if (t == 0 && g < R) squares[warp][g] = ss;
  }
  __syncthreads();
  for (int o = threadIdx.x; o < F * R; o += WARPS * 32) {
    const int f = o / R, r = o % R, n = n0 + f;
    if (n >= N) continue;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) v += red[w][f][r];
    if (NORM) {
      float sq = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) sq += squares[w][r];
      v *= rsqrtf(sq / K + eps);
    }
    float* dst = y + (size_t)r * N + n;
    *dst = accumulate ? *dst + v : v;
    if constexpr (PAIR) mine[r][f] = v;
  }
  static_assert(ROPE == 0 || ROPE % F == 0 || F % ROPE == 0, "a head's features must fill whole blocks");
  static_assert(!PAIR || ROPE == 2 * F, "PAIR: a cluster of two blocks holds one head");
  if constexpr (PAIR) {
    // The two blocks of a head exchange their halves through the cluster's shared memory: the block of
    // the head's first F features holds each rotation pair's first value, its peer the second.
    constexpr int HALF = ROPE / 2, PASSES = (HALF + 31) / 32;
    cluster_sync();
    const unsigned me = cluster_rank(), first = n0 % ROPE == 0 ? me : me ^ 1u;
    const int h = n0 / ROPE;
    for (int r = 2 * warp + (int)(me == first ? 0 : 1); r < R; r += 2 * WARPS) {
      float a[PASSES], b[PASSES];
#pragma unroll
      for (int w = 0; w < PASSES; ++w) {
        const int i = 32 * w + lane;
        a[w] = i < HALF ? cluster_load(&mine[r][i], first) : 0.f;
        b[w] = i < HALF ? cluster_load(&mine[r][i], first ^ 1u) : 0.f;
      }
      rope_head_row<ROPE>(a, b, r, h, qn, kn, pos, slot, q_out, kc, vc, NQ, NKV, T, theta, eps);
    }
    cluster_sync();  // a block's shared memory stays until its peer has read it
  } else if constexpr (ROPE > 0) {
    qkv_rope_heads<R, ROPE, WARPS>(y, N, n0, F, qn, kn, pos, slot, q_out, kc, vc, NQ, NKV, T, theta, eps, done);
  }
}

template <int R, int K, int MT, int WARPS, bool NORM, int ROPE = 0, int STAGE = 0>
__global__ void __launch_bounds__(WARPS * 32) gemv_mma(GEMV_MMA_PARAMS) {
  gemv_mma_body<R, K, MT, WARPS, NORM, ROPE, STAGE, false>(GEMV_MMA_ARGS);
}

// gemv_mma with ROPE = 2 F, each head's two blocks a cluster (sm_90).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
template <int R, int K, int MT, int WARPS, bool NORM, int ROPE, int STAGE = 0>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(WARPS * 32) gemv_mma_pair(GEMV_MMA_PARAMS) {
  gemv_mma_body<R, K, MT, WARPS, NORM, ROPE, STAGE, true>(GEMV_MMA_ARGS);
}
#endif

// ---- GEMV of a short output, the reduction split over a block: a router's logits ----------------------
// y[r, n] (+)= sum_k W[n, k] x'[r, k] for N <= 256 (a router, a shared expert's gate), where one warp per
// feature would leave most of the GPU idle and loop over the whole reduction for every row. Block b of 8
// warps computes features [F b, F b + F); warp w takes k in [w K/8, (w + 1) K/8), K a multiple of 2048, so
// every lane holds its weights for all F features after one round of loads. The block then sums its warps
// in order, and with NORM also the squares of x it read: a row's sum is cut the same way whatever R is.
template <int R, int K, int F, bool NORM>
__global__ void __launch_bounds__(256) gemv_split(const half* __restrict__ W, const float* __restrict__ x,
                                                   float* __restrict__ y, int N, int accumulate,
                                                   const half* __restrict__ nw, float eps) {
  STRATA_PDL_LAUNCH();
  constexpr int KW = K / 8, STEPS = KW / 256;
  static_assert(K % 2048 == 0, "gemv_split takes K a multiple of 2048");
  __shared__ float red[8][F + 1][R];  // per warp: the F features' sums, then the squares, of each row
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n0 = blockIdx.x * F;
  uint4 pk[F][STEPS];
#pragma unroll
  for (int f = 0; f < F; ++f)
#pragma unroll
    for (int s = 0; s < STEPS; ++s)
      pk[f][s] = __ldg(reinterpret_cast<const uint4*>(W + (size_t)min(n0 + f, N - 1) * K + warp * KW) + s * 32 +
                       lane);
  STRATA_PDL_WAIT();
  float acc[F][R], ss[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    ss[r] = 0.f;
#pragma unroll
    for (int f = 0; f < F; ++f) acc[f][r] = 0.f;
  }
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    const int k0 = warp * KW + s * 256 + lane * 8;
    float nf[8];
    if (NORM) unpack8(__ldg(reinterpret_cast<const uint4*>(nw + k0)), nf);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float4* xr = reinterpret_cast<const float4*>(x + (size_t)r * K + k0);
      float4 a = xr[0], b = xr[1];
      if (NORM) {
        ss[r] += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
        a.x *= nf[0]; a.y *= nf[1]; a.z *= nf[2]; a.w *= nf[3];
        b.x *= nf[4]; b.y *= nf[5]; b.z *= nf[6]; b.w *= nf[7];
      }
#pragma unroll
      for (int f = 0; f < F; ++f) {
        float wf[8];
        unpack8(pk[f][s], wf);
        acc[f][r] += dot8(wf, a, b);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int f = 0; f < F; ++f) {
      const float v = warp_sum(acc[f][r]);
      if (lane == 0) red[warp][f][r] = v;
    }
    if (NORM) {
      const float v = warp_sum(ss[r]);
      if (lane == 0) red[warp][F][r] = v;
    }
  }
  __syncthreads();
  if (threadIdx.x < F * R) {
    const int f = threadIdx.x / R, r = threadIdx.x % R, n = n0 + f;
    if (n >= N) return;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) v += red[w][f][r];
    if (NORM) {
      float sq = 0.f;
#pragma unroll
      for (int w = 0; w < 8; ++w) sq += red[w][F][r];
      v *= rsqrtf(sq / K + eps);
    }
    float* dst = y + (size_t)r * N + n;
    *dst = accumulate ? *dst + v : v;
  }
}

// Any K (small models): one warp per output feature, scalar loads; nw == nullptr means no norm.
__global__ void gemv_any(const half* __restrict__ W, const float* __restrict__ x, float* __restrict__ y, int R,
                         int N, int K, int accumulate, const half* __restrict__ nw, float eps) {
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp >= N) return;
  const half* w = W + (size_t)warp * K;
  for (int r = 0; r < R; ++r) {
    const float* xr = x + (size_t)r * K;
    float acc = 0.f, ss = 0.f;
    for (int k = lane; k < K; k += 32) {
      const float xv = xr[k];
      acc += __half2float(w[k]) * (nw != nullptr ? xv * __half2float(nw[k]) : xv);
      ss += xv * xv;
    }
    acc = warp_sum(acc);
    if (nw != nullptr) acc *= rsqrtf(warp_sum(ss) / K + eps);
    if (lane == 0) {
      float* dst = y + (size_t)r * N + warp;
      *dst = accumulate ? *dst + acc : acc;
    }
  }
}

// ---- residual add + RMSNorm ------------------------------------------------------------------------
// resid[r] += delta[r] (when delta is given); out[r] = resid[r] * rsqrt(mean(resid[r]^2) + eps) * w.
__global__ void add_rmsnorm(float* __restrict__ resid, const float* __restrict__ delta, const half* __restrict__ w,
                            float* __restrict__ out, int H, float eps) {
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  const int r = blockIdx.x;
  float* xr = resid + (size_t)r * H;
  __shared__ float partial[32];
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    float v = xr[i];
    if (delta != nullptr) {
      v += delta[(size_t)r * H + i];
      xr[i] = v;
    }
    ss += v * v;
  }
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float t = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.f;
    t = warp_sum(t);
    if (threadIdx.x == 0) partial[0] = rsqrtf(t / H + eps);
  }
  __syncthreads();
  const float inv = partial[0];
  for (int i = threadIdx.x; i < H; i += blockDim.x) out[(size_t)r * H + i] = xr[i] * inv * __half2float(w[i]);
}

// ---- q/k RMSNorm + NeoX RoPE + KV write ------------------------------------------------------------
// qkv[r] = [q heads (NQ*D) | k heads (NKV*D) | v heads (NKV*D)]. Block (r, head) for NQ + NKV heads,
// 32 * ceil(D/64) threads, one per rotation pair. q goes to q_out[r, h, :]; k and v go to the cache at (slot[r], kv head, pos[r]).
// Cache layout per layer: [slots, NKV, T, D] fp16.
__global__ void qk_norm_rope_kv(const float* __restrict__ qkv, const half* __restrict__ qn, const half* __restrict__ kn,
                                const int* __restrict__ pos, const int* __restrict__ slot, float* __restrict__ q_out,
                                half* __restrict__ kc, half* __restrict__ vc, int NQ, int NKV, int D, int T,
                                float theta, float eps) {
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  const int r = blockIdx.x, h = blockIdx.y, i = threadIdx.x, half_d = D >> 1;
  const float* row = qkv + (size_t)r * (NQ + 2 * NKV) * D;
  const bool is_q = h < NQ, live = i < half_d;
  const float* src = row + (size_t)h * D;
  const float a = live ? src[i] : 0.f, b = live ? src[i + half_d] : 0.f;
  __shared__ float red[33];
  const float ss = warp_sum(a * a + b * b);
  if ((i & 31) == 0) red[i >> 5] = ss;
  __syncthreads();
  if (i == 0) {
    float t = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) t += red[w];
    red[32] = head_inv_rms(t, D, eps);
  }
  __syncthreads();
  if (!live) return;
  const int p = pos[r];
  const float2 rot = rope_pair(a, b, red[32], is_q ? qn : kn, i, D, p, theta);
  const float ra = rot.x, rb = rot.y;
  if (is_q) {
    float* dst = q_out + ((size_t)r * NQ + h) * D;
    dst[i] = ra;
    dst[i + half_d] = rb;
  } else {
    const int kvh = h - NQ;
    const size_t off = (((size_t)slot[r] * NKV + kvh) * T + p) * D;
    kc[off + i] = __float2half(ra);
    kc[off + i + half_d] = __float2half(rb);
    const float* v = row + (size_t)(NQ + NKV + kvh) * D;
    vc[off + i] = __float2half(v[i]);
    vc[off + i + half_d] = __float2half(v[i + half_d]);
  }
}

// The prefill path's form of qk_norm_rope_kv: one warp per (row, head), 8 per block (item = block * 8 + warp
// over R (NQ + NKV) items), each lane taking rotation pairs lane, lane + 32, ... of D / 2 <= 128. q is written
// as two fp16 parts, q_hi = fp16(q) and q_lo = fp16(q - q_hi), for the flash kernel's two products.
__global__ void __launch_bounds__(256) qk_norm_rope_split(const float* __restrict__ qkv, const half* __restrict__ qn,
                                                          const half* __restrict__ kn, const int* __restrict__ pos,
                                                          const int* __restrict__ slot, half* __restrict__ q_hi,
                                                          half* __restrict__ q_lo, half* __restrict__ kc,
                                                          half* __restrict__ vc, int R, int NQ, int NKV, int D, int T,
                                                          float theta, float eps) {
  const int item = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31, half_d = D >> 1;
  const int heads = NQ + NKV;
  if (item >= R * heads) return;
  const int r = item / heads, h = item % heads;
  const float* src = qkv + (size_t)r * (NQ + 2 * NKV) * D + (size_t)h * D;
  float a[4], b[4], ss = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int i = lane + 32 * j;
    a[j] = i < half_d ? src[i] : 0.f;
    b[j] = i < half_d ? src[i + half_d] : 0.f;
    ss += a[j] * a[j] + b[j] * b[j];
  }
  const float inv = rsqrtf(warp_sum(ss) / D + eps);
  const bool is_q = h < NQ;
  const half* nw = is_q ? qn : kn;
  const int p = pos[r];
  const size_t q_off = ((size_t)r * NQ + h) * D;
  const size_t kv_off = (((size_t)slot[r] * NKV + (h - NQ)) * T + p) * D;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int i = lane + 32 * j;
    if (i >= half_d) break;
    const float na = a[j] * inv * __half2float(nw[i]), nb = b[j] * inv * __half2float(nw[i + half_d]);
    const float inv_freq = powf(theta, -2.f * (float)i / (float)D);
    float sn, cs;
    sincosf((float)p * inv_freq, &sn, &cs);
    const float ra = na * cs - nb * sn, rb = nb * cs + na * sn;
    if (is_q) {
      const half ha = __float2half(ra), hb = __float2half(rb);
      q_hi[q_off + i] = ha;
      q_hi[q_off + i + half_d] = hb;
      q_lo[q_off + i] = __float2half(ra - __half2float(ha));
      q_lo[q_off + i + half_d] = __float2half(rb - __half2float(hb));
    } else {
      kc[kv_off + i] = __float2half(ra);
      kc[kv_off + i + half_d] = __float2half(rb);
      const float* v = src + (size_t)NKV * D;  // this KV head's v
      vc[kv_off + i] = __float2half(v[i]);
      vc[kv_off + i + half_d] = __float2half(v[i + half_d]);
    }
  }
}

// ---- decode attention (split over position chunks, one kernel) ----------------------------------------
// Block (r, kv head, chunk c) of B threads handles positions [c*C, c*C + C) of slot[r] for the G query
// heads of that KV head: an unnormalised partial result with its max and sum (flash-decoding). Splitting
// positions over blocks keeps the GPU busy for a handful of rows. The partials are merged in the same
// kernel, by the blocks that finish last (a counter per merge, which that block sets back to zero), so one
// kernel does what a partial and a combine kernel did, without the second launch and its wait:
// * a row of at most ATTN_MERGE_GROUP live chunks: the last of its blocks to finish merges them all;
// * a longer row: the chunks are merged in groups of ATTN_MERGE_GROUP consecutive chunks, each by the last
//   of its group to finish, into one partial of the same form (kept in the scratch of the group's first
//   chunk), and the last group to finish merges the groups. A merge thus reads at most a few dozen partials,
//   not one per 64 positions of a 32k context, and the groups merge in parallel.
// The grouping depends only on the row's position, so a row's result does not depend on the window.
// A block's time is the length of its threads' chains of dependent arithmetic (all G heads over C
// positions), so a window of one or two rows takes B = 256, and more rows, whose blocks fill the GPU, take
// B = 128. Both sum in one order, fixed by W "canonical" warps (the partial sums of a B = 32 W block): with
// B = 128 and W = 8 a thread does the work of two threads of the 256-thread block, one after the other, so
// a row's result is the same bit for bit whichever B its window took. (W = 4 at head dim 16, and where the
// shared memory of 8 warps' sums does not fit: those shapes run at 128 threads only.)
// Scratch layout: acc [R, NKV, NC, G, D], ml [R, NKV, NC, G, 2]; done [R, NKV, 1 + ceil(NC / ATTN_MERGE_GROUP)]
// int (the row's merge, then each group's), zero between launches.
constexpr int ATTN_CHUNK = 64;
constexpr int ATTN_MERGE_GROUP = 16;

// Merge `count` partials of one (row, KV head), at chunk slots first, first + stride, ... of acc [NC, G, D] and
// ml [NC, G, 2] (read through L2: other blocks wrote them), in that order: M = max m, L = sum l e^(m - M), and
// per element sum acc e^(m - M), each term divided by L when FINAL (into out [G D]), else kept as a partial of
// the same form in slot `first` (acc, then M and L). Block-wide; `red` is shared memory of CAP + 2 G floats.
template <int G, int D, int B, bool FINAL>
__device__ __forceinline__ void attn_merge(float* acc, float* ml, int first, int stride, int count, float* red,
                                           int cap, float* __restrict__ out) {
  constexpr int PER = (G * D + B - 1) / B;  // elements per thread
  // Partials are loaded MC at a time (32 registers a thread), so the merge waits on one round trip to L2 per
  // MC of them; the first MC go out before the statistics below.
  constexpr int MC = PER >= 32 ? 1 : 32 / PER;
  const int tid = threadIdx.x;
  float* stat = red + cap;  // [G, 2]: each head's M and total
  float v[MC][PER];
#pragma unroll
  for (int cc = 0; cc < MC; ++cc)
#pragma unroll
    for (int c = 0; c < PER; ++c)
      v[cc][c] = cc < count && c * B + tid < G * D
                     ? __ldcg(acc + (size_t)(first + cc * stride) * G * D + c * B + tid)
                     : 0.f;
  // The partials' maxima and totals [count, G, 2], staged in shared memory when they fit (up to cap / 2G
  // partials), else read through L2 where they lie.
  const bool staged = count * G * 2 <= cap;
  if (staged)
    for (int i = tid; i < count * G * 2; i += B) {
      const int cc = i / (G * 2), j = i % (G * 2);
      red[i] = __ldcg(ml + (size_t)(first + cc * stride) * G * 2 + j);
    }
  __syncthreads();
  auto mlv = [&](int cc, int g, int k) {
    return staged ? red[(cc * G + g) * 2 + k] : __ldcg(ml + ((size_t)(first + cc * stride) * G + g) * 2 + k);
  };
  if (tid < G) {
    const int g = tid;
    float m = -STRATA_INF;
    for (int cc = 0; cc < count; ++cc) m = fmaxf(m, mlv(cc, g, 0));
    float l = 0.f;
    for (int cc = 0; cc < count; ++cc) l += mlv(cc, g, 1) * __expf(mlv(cc, g, 0) - m);
    stat[g * 2] = m;
    stat[g * 2 + 1] = l;
  }
  __syncthreads();
  float a[PER];
#pragma unroll
  for (int c = 0; c < PER; ++c) a[c] = 0.f;
  for (int c0 = 0; c0 < count; c0 += MC) {
    if (c0 > 0)
#pragma unroll
      for (int cc = 0; cc < MC; ++cc)
#pragma unroll
        for (int c = 0; c < PER; ++c)
          v[cc][c] = c0 + cc < count && c * B + tid < G * D
                         ? __ldcg(acc + (size_t)(first + (c0 + cc) * stride) * G * D + c * B + tid)
                         : 0.f;
#pragma unroll
    for (int cc = 0; cc < MC; ++cc) {
      if (c0 + cc >= count) break;
#pragma unroll
      for (int c = 0; c < PER; ++c) {
        const int g = min((c * B + tid) / D, G - 1);
        const float w = __expf(mlv(c0 + cc, g, 0) - stat[g * 2]);
        a[c] += v[cc][c] * (FINAL ? w / stat[g * 2 + 1] : w);
      }
    }
  }
  if (FINAL) {
#pragma unroll
    for (int c = 0; c < PER; ++c)
      if (c * B + tid < G * D) out[c * B + tid] = a[c];
    return;
  }
  // A group's partial into its first chunk's slot: each thread read that slot's elements it now writes, and
  // the statistics were all read before the barrier above (or, not staged, are read again below: barrier).
  __syncthreads();
  float* dst = acc + (size_t)first * G * D;
#pragma unroll
  for (int c = 0; c < PER; ++c)
    if (c * B + tid < G * D) dst[c * B + tid] = a[c];
  if (tid < G) {
    float* dml = ml + (size_t)first * G * 2;
    dml[tid * 2] = stat[tid * 2];
    dml[tid * 2 + 1] = stat[tid * 2 + 1];
  }
}

// The merges of a row longer than ATTN_MERGE_GROUP chunks, for chunk c's block once its partial is written:
// the last of its group to finish merges the group, and the last group the groups (`attn_merge`). Not
// inlined, so that the short rows' path keeps its registers and code.
// `red` is shared memory of cap + 2 G floats.
template <int G, int D, int B>
__device__ __noinline__ void attn_merge_grouped(float* accr, float* mlr, int c, int live, int* counters,
                                                float* red, int cap, int* last, float* out) {
  const int grp = c / ATTN_MERGE_GROUP, first = grp * ATTN_MERGE_GROUP;
  if (!last_to_finish(counters + 1 + grp, min(ATTN_MERGE_GROUP, live - first), last)) return;
  attn_merge<G, D, B, false>(accr, mlr, first, 1, min(ATTN_MERGE_GROUP, live - first), red, cap, nullptr);
  const int groups = (live + ATTN_MERGE_GROUP - 1) / ATTN_MERGE_GROUP;
  if (last_to_finish(counters, groups, last))
    attn_merge<G, D, B, true>(accr, mlr, 0, ATTN_MERGE_GROUP, groups, red, cap, out);
}

template <int D, int G, int B, int W>
__global__ void __launch_bounds__(B) attn_split(const float* __restrict__ q, const half* __restrict__ kc,
                                                 const half* __restrict__ vc, const int* __restrict__ pos,
                                                 const int* __restrict__ slot, float* __restrict__ part_acc,
                                                 float* __restrict__ part_ml, int* __restrict__ done,
                                                 float* __restrict__ out, int NKV, int T, int NC, float scale) {
  // DG 16-byte pieces of a head; TP threads per position for the scores. A score is the sum of QP partial
  // sums, partial p over pieces p, p + QP, ... in order, added as ((P0 + P1) + (P2 + P3)); a thread holds
  // PT of them. P @ V sums QG position groups, group g over positions g, g + QG, ... in order; a warp holds
  // 32 / DG of them (summed by shuffles) and the block's W canonical warps are summed in order.
  constexpr int C = ATTN_CHUNK, DG = D / 8, TP = B / C, QP = DG < 4 ? DG : 4, PT = QP / TP;
  constexpr int PG = B / DG, QG = W * 32 / DG, PASSES = W / (B / 32), NV = C / QG, NK = DG / QP;
  static_assert(D >= 16 && D <= 256 && (DG & (DG - 1)) == 0, "head dim must be 16, 32, 64, 128 or 256");
  static_assert((B == 128 || B == 256) && TP <= QP && PASSES >= 1 && PASSES * (B / 32) == W && C % QG == 0,
                "unsupported block shape");
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  __shared__ float qs[G * D];
  __shared__ float sc[G * C];
  __shared__ float red[W * G * D];
  __shared__ int last;
  const int r = blockIdx.x, kvh = blockIdx.y, c = blockIdx.z, tid = threadIdx.x, NQ = NKV * G;
  const int n = pos[r] + 1, t0 = c * C;
  if (t0 >= n) return;  // past this row's position: neither counted nor merged
  const int tn = min(C, n - t0), live = (n + C - 1) / C;
  const size_t base = ((size_t)slot[r] * NKV + kvh) * T * D + (size_t)t0 * D;
  // The key pieces of this thread's partials, loaded first so that they are in flight while q is staged in
  // shared memory: partial part * PT + i takes pieces m QP + part PT + i (neighbouring threads' q values then
  // lie in different shared-memory banks).
  const int t = tid / TP, part = tid % TP;
  uint4 kr[PT][NK];
  if (t < tn) {
    const uint4* ks = reinterpret_cast<const uint4*>(kc + base + (size_t)t * D);
#pragma unroll
    for (int i = 0; i < PT; ++i)
#pragma unroll
      for (int m = 0; m < NK; ++m) kr[i][m] = ks[m * QP + part * PT + i];
  }
  // The values this thread sums in P @ V (below), loaded now so that they too are in flight while q is staged
  // and the scores are computed: in pass ps, thread (pg, dg) takes group ps PG + pg's positions, dims
  // [dg*8, dg*8 + 8).
  const int dg = tid % DG, pg = tid / DG;
  uint4 vr[PASSES][NV];
#pragma unroll
  for (int ps = 0; ps < PASSES; ++ps)
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int tv = ps * PG + pg + j * QG;
      if (tv < tn) vr[ps][j] = *reinterpret_cast<const uint4*>(vc + base + (size_t)tv * D + dg * 8);
    }
  constexpr int PER = (G * D + B - 1) / B;  // q values (and merged outputs) per thread
#pragma unroll
  for (int c = 0; c < PER; ++c)
    if (c * B + tid < G * D) qs[c * B + tid] = q[((size_t)r * NQ + kvh * G) * D + c * B + tid] * scale;
  __syncthreads();
  {
    float s[PT][G];
#pragma unroll
    for (int i = 0; i < PT; ++i)
#pragma unroll
      for (int g = 0; g < G; ++g) s[i][g] = 0.f;
    if (t < tn) {
#pragma unroll
      for (int m = 0; m < NK; ++m)
#pragma unroll
        for (int i = 0; i < PT; ++i) {
          float kf[8];
          unpack8(kr[i][m], kf);
#pragma unroll
          for (int g = 0; g < G; ++g) {
            const float* qg = qs + g * D + (m * QP + part * PT + i) * 8;
#pragma unroll
            for (int j = 0; j < 8; ++j) s[i][g] += qg[j] * kf[j];
          }
        }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float v = PT == 2 ? s[0][g] + s[PT - 1][g] : s[0][g];
#pragma unroll
      for (int o = 1; o < TP; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (part == 0) sc[g * C + t] = t < tn ? v : -STRATA_INF;
    }
  }
  __syncthreads();
  // Softmax statistics of the chunk: one warp per head.
  const int warp = tid >> 5, lane = tid & 31;
  float* ml = part_ml + (((size_t)r * NKV + kvh) * NC + c) * G * 2;
  for (int g = warp; g < G; g += B / 32) {
    float m = fmaxf(sc[g * C + lane], sc[g * C + lane + 32]);
    m = warp_max(m);
    const float p0 = __expf(sc[g * C + lane] - m), p1 = __expf(sc[g * C + lane + 32] - m);
    sc[g * C + lane] = p0;
    sc[g * C + lane + 32] = p1;
    const float l = warp_sum(p0 + p1);
    if (lane == 0) { ml[g * 2] = m; ml[g * 2 + 1] = l; }
  }
  __syncthreads();
  // P @ V: one 16-byte V load serves 8 dims of G heads. A pass's position groups are summed inside each warp
  // with shuffles; the canonical warp ps (B / 32) + warp keeps the sums in shared memory.
#pragma unroll
  for (int ps = 0; ps < PASSES; ++ps) {
    float acc[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int tv = ps * PG + pg + j * QG;
      if (tv >= tn) break;
      float vf[8];
      unpack8(vr[ps][j], vf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = sc[g * C + tv];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] += p * vf[e];
      }
    }
#pragma unroll
    for (int o = DG; o < 32; o <<= 1)
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] += __shfl_xor_sync(0xffffffffu, acc[g][j], o);
    if (lane < DG)
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int j = 0; j < 8; ++j) red[((ps * (B / 32) + warp) * G + g) * D + dg * 8 + j] = acc[g][j];
  }
  __syncthreads();
  float* dst = part_acc + (((size_t)r * NKV + kvh) * NC + c) * G * D;
  for (int i = tid; i < G * D; i += B) {
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) a += red[w * G * D + i];
    dst[i] = a;
  }

  const int groups = (NC + ATTN_MERGE_GROUP - 1) / ATTN_MERGE_GROUP;
  int* const counters = done + ((size_t)r * NKV + kvh) * (1 + groups);  // the row's merge, then each group's
  if (live > ATTN_MERGE_GROUP) {
    attn_merge_grouped<G, D, B>(part_acc + ((size_t)r * NKV + kvh) * NC * G * D,
                                part_ml + ((size_t)r * NKV + kvh) * NC * G * 2, c, live, counters, red,
                                W * G * D - 2 * G, &last, out + (size_t)r * NQ * D + (size_t)kvh * G * D);
    return;
  }
  if (!last_to_finish(counters, live, &last)) return;
  // The merge: out[r, (kvh*G + g)*D + d] = sum_c acc_c e^(m_c - M) / sum_c l_c e^(m_c - M), chunks in order.
  // Other blocks' partials are read through L2 (__ldcg). It is `attn_merge`'s arithmetic, written out here
  // as it was before long rows merged in groups: a form that merged these rows through `attn_merge` too
  // (every merge inlined) ran the short rows' step 2.5-3.8% slower on an H200.
  const float* mlr = part_ml + ((size_t)r * NKV + kvh) * NC * G * 2;
  const float* accr = part_acc + ((size_t)r * NKV + kvh) * NC * G * D;
  // The first MC chunks' partial sums (32 registers a thread) are loaded now, together and before the
  // statistics below, so that the merge waits on one round trip to L2 for them instead of one per chunk;
  // later chunks (contexts past MC * ATTN_CHUNK positions) are loaded one chunk at a time.
  constexpr int MC = PER >= 32 ? 1 : 32 / PER;
  float early[MC][PER];
#pragma unroll
  for (int cc = 0; cc < MC; ++cc)
#pragma unroll
    for (int c = 0; c < PER; ++c)
      early[cc][c] = cc < live && c * B + tid < G * D ? __ldcg(accr + (size_t)cc * G * D + c * B + tid) : 0.f;
  // The chunks' maxima and totals [live, G, 2] are staged in shared memory when they fit, as the at most
  // ATTN_MERGE_GROUP chunks merged here do at every head shape taken, and read through L2 otherwise.
  constexpr int CAP = W * G * D - 2 * G;
  float* stat = red + CAP;  // [G, 2]: each head's M and total
  const bool staged = live * G * 2 <= CAP;
  if (staged)
    for (int i = tid; i < live * G * 2; i += B) red[i] = __ldcg(mlr + i);
  const float* mls = staged ? red : mlr;
  __syncthreads();
  if (tid < G) {
    const int g = tid;
    float m = -STRATA_INF;
    for (int cc = 0; cc < live; ++cc) m = fmaxf(m, mls[(cc * G + g) * 2]);
    float l = 0.f;
    for (int cc = 0; cc < live; ++cc) l += mls[(cc * G + g) * 2 + 1] * __expf(mls[(cc * G + g) * 2] - m);
    stat[g * 2] = m;
    stat[g * 2 + 1] = l;
  }
  __syncthreads();
  float a[PER];
#pragma unroll
  for (int c = 0; c < PER; ++c) a[c] = 0.f;
#pragma unroll
  for (int cc = 0; cc < MC; ++cc) {
    if (cc >= live) break;
#pragma unroll
    for (int c = 0; c < PER; ++c) {
      const int g = min((c * B + tid) / D, G - 1);
      a[c] += early[cc][c] * (__expf(mls[(cc * G + g) * 2] - stat[g * 2]) / stat[g * 2 + 1]);
    }
  }
  for (int cc = MC; cc < live; ++cc) {
    float v[PER];
#pragma unroll
    for (int c = 0; c < PER; ++c) v[c] = c * B + tid < G * D ? __ldcg(accr + (size_t)cc * G * D + c * B + tid) : 0.f;
#pragma unroll
    for (int c = 0; c < PER; ++c) {
      const int g = min((c * B + tid) / D, G - 1);
      a[c] += v[c] * (__expf(mls[(cc * G + g) * 2] - stat[g * 2]) / stat[g * 2 + 1]);
    }
  }
#pragma unroll
  for (int c = 0; c < PER; ++c)
    if (c * B + tid < G * D) out[(size_t)r * NQ * D + (size_t)kvh * G * D + c * B + tid] = a[c];
}

// ---- decode attention on tensor cores ------------------------------------------------------------------
// attn_tc computes what attn_split does (each row's causal attention over positions 0..pos[r] of its slot,
// partials merged by the blocks that finish last, in the same scratch and counters), for head dims up to 128
// and up to 16 query heads per KV head, with its products on tensor cores and a long row streamed:
// * Block (r, kvh, s) of 4 warps takes `per` consecutive chunks of ATTN_CHUNK positions of row r: a row of
//   up to `one_run_chunks` chunks is one run (one block, no partials, no merge), a row of up to
//   `short_chunks` splits into at most `short_splits` runs (per = ceil(chunks / short_splits)), a longer
//   one into at most `splits` (per = ceil(chunks / splits)). A row thus has at most `splits`
//   partials (short_splits <= splits), whose slots in the scratch are NC apart (NC >= min(chunks of the
//   context, splits)), and the grid at most `splits` blocks a row and KV head, however long the context. A
//   block streams its chunks: K and V of chunk j + 1 land in shared memory (cp.async) while chunk j is
//   computed. The split depends only on the row's position and the three counts (ops.py's, the same for
//   every window), so a row's result does not depend on its window.
// * The G query heads of the KV head are the 16 rows of an m16n8k16 product (rows past G are zero), and
//   warp w takes keys [16 w, 16 w + 16) of each chunk: S = q K^T with q scaled into base 2 and split into
//   two fp16 parts (hi + lo, about 22 bits of q), an online softmax per head, and O += P V with P split the
//   same way, all accumulated in fp32. The 4 warps' maxima, totals and O merge in shared memory, in warp
//   order, into the block's partial in attn_split's form (natural-log maxima).
// * A row of one run writes its output directly; otherwise the partials merge as attn_split's chunks do
//   (`attn_merge`; in groups of ATTN_MERGE_GROUP past that many).
// Fragment layouts are flash.cu's (mma.m16n8k16, lane = 4 gq + tq); K is read with ldmatrix (B = K^T) and V
// with ldmatrix.trans (B = V) from rows padded to D + 8 halves.
// Grid (R, NKV, min(NC, splits)), 128 threads, `attention_tc_shared_bytes(D, G)` of dynamic shared memory (two
// buffers of K and V tiles [ATTN_CHUNK, D + 8] fp16, then q's two parts [G + 1, D + 8] fp16).
namespace attn_tc_ops {

using namespace tensor_core;

// (x0, x1) as two half2s, hi = fp16(x) and lo = fp16(x - hi), lower column in the low 16 bits.
__device__ __forceinline__ void split_half2(float x0, float x1, unsigned& hi, unsigned& lo) {
  const half2 h = __floats2half2_rn(x0, x1);
  const half2 l = __floats2half2_rn(x0 - __low2float(h), x1 - __high2float(h));
  hi = *reinterpret_cast<const unsigned*>(&h);
  lo = *reinterpret_cast<const unsigned*>(&l);
}

// Positions [t0, t0 + ATTN_CHUNK) of a [T, D] fp16 matrix into the padded shared tile at dst; positions at or
// past `end` are zeros (the cache there may hold anything, and 0 * NaN would poison P V).
template <int D>
__device__ __forceinline__ void load_chunk(unsigned dst, const half* __restrict__ src, int t0, int end) {
  constexpr int LD = D + 8, CH = D / 8;
#pragma unroll
  for (int i = threadIdx.x; i < ATTN_CHUNK * CH; i += 128) {
    const int row = i / CH, col = (i % CH) * 8;
    const bool valid = t0 + row < end;
    cp_async16(dst + (row * LD + col) * 2, valid ? src + (size_t)(t0 + row) * D + col : src, valid);
  }
  cp_async_commit();
}

}  // namespace attn_tc_ops

// FEW only names a second instantiation for windows of few rows, compiled the same: ops.py gives it another
// preferred shared-memory carveout (`attention_tc_carveout`).
template <int D, int G, int FEW>
__global__ void __launch_bounds__(128) attn_tc(const float* __restrict__ q, const half* __restrict__ kc,
                                               const half* __restrict__ vc, const int* __restrict__ pos,
                                               const int* __restrict__ slot, float* __restrict__ part_acc,
                                               float* __restrict__ part_ml, int* __restrict__ done,
                                               float* __restrict__ out, int NKV, int T, int NC, int splits,
                                               int short_splits, int short_chunks, int one_run_chunks,
                                               float scale_log2) {
  using namespace attn_tc_ops;
  static_assert(D % 16 == 0 && D <= 128 && G >= 1 && G <= 16, "head dim a multiple of 16 up to 128, G <= 16");
  constexpr int C = ATTN_CHUNK, LD = D + 8, KS = D / 16, DT = D / 8;
  constexpr int TILE = C * LD * 2, BUF = 2 * TILE;  // bytes: K (or V) of a chunk; K and V
  constexpr float LN2 = 0.69314718f;
  extern __shared__ __align__(16) unsigned char attn_tiles[];  // [2 buffers][K, V][C][LD], [2][G + 1][LD] fp16
  __shared__ int last;
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  const int r = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z, NQ = NKV * G;
  const int n = pos[r] + 1, live = (n + C - 1) / C;
  const int most = live <= one_run_chunks ? 1 : live <= short_chunks ? short_splits : splits;  // runs, at most
  const int per = (live + most - 1) / most;
  const int used = (live + per - 1) / per;  // this row's partials
  if (n <= 0 || s >= used) return;
  const int c0 = s * per, c1 = min(c0 + per, live);
  const unsigned base = smem_addr(attn_tiles);
  const size_t head = ((size_t)slot[r] * NKV + kvh) * T * D;
  load_chunk<D>(base, kc + head, c0 * C, n);
  load_chunk<D>(base + TILE, vc + head, c0 * C, n);

  // q scaled into base 2 and split, [2 parts][G + 1 rows][LD] fp16 behind the tile buffers, read as A
  // fragments with ldmatrix at each step (rows are heads, columns dims); row G is zeros, which the lanes of
  // the product's rows past G read.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
  const float* qr = q + ((size_t)r * NQ + kvh * G) * D;
  unsigned* q_tile = reinterpret_cast<unsigned*>(attn_tiles + 2 * BUF);
  for (int i = threadIdx.x; i < (G + 1) * D / 2; i += 128) {
    const int row = i / (D / 2), col = (i % (D / 2)) * 2;
    const float2 v = row < G ? *reinterpret_cast<const float2*>(qr + (size_t)row * D + col) : make_float2(0.f, 0.f);
    split_half2(v.x * scale_log2, v.y * scale_log2, q_tile[(row * LD + col) / 2],
                q_tile[((G + 1 + row) * LD + col) / 2]);
  }
  float o[DT][4];
#pragma unroll
  for (int t = 0; t < DT; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float mx[2] = {-STRATA_INF, -STRATA_INF}, sum[2] = {0.f, 0.f};
  // ldmatrix rows of this lane: K as keys x dims (B = K^T), V as keys x dims with .trans (B = V).
  const int k_row = (lane & 7) + ((lane >> 4) << 3), k_col = ((lane >> 3) & 1) << 3;
  const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3), v_col = (lane >> 4) << 3;
  const unsigned k_lane = base + ((warp * 16 + k_row) * LD + k_col) * 2;
  const unsigned v_lane = base + TILE + ((warp * 16 + v_row) * LD + v_col) * 2;
  const unsigned q_lane = base + 2 * BUF + (min(v_row, G) * LD + v_col) * 2;  // q's rows addressed as V's
  for (int j = c0; j < c1; ++j) {
    const unsigned buf = ((j - c0) & 1) * BUF;
    if (j + 1 < c1) {
      load_chunk<D>(base + BUF - buf, kc + head, (j + 1) * C, n);
      load_chunk<D>(base + BUF - buf + TILE, vc + head, (j + 1) * C, n);
      cp_async_wait<2>();  // chunk j's two groups have landed
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    // S [16 heads x 16 keys] = (q_hi + q_lo) K^T, in two 8-key tiles.
    float sc[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) sc[h][0] = sc[h][1] = sc[h][2] = sc[h][3] = 0.f;
#pragma unroll
    for (int k = 0; k < KS; ++k) {
      unsigned qh[4], ql[4], b[4];  // b[0..1]: keys 0..7 of the warp's 16, b[2..3]: keys 8..15
      ldsm_x4(qh, q_lane + k * 32);
      ldsm_x4(ql, q_lane + (G + 1) * LD * 2 + k * 32);
      ldsm_x4(b, k_lane + buf + k * 32);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mma16816(sc[h], qh, b[2 * h], b[2 * h + 1]);
        mma16816(sc[h], ql, b[2 * h], b[2 * h + 1]);
      }
    }
    const int kb = j * C + warp * 16;  // the warp's first key
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (kb + h * 8 + 2 * tq + (e & 1) >= n) sc[h][e] = -STRATA_INF;
    // Online softmax per head (rows gq and gq + 8 of this lane; a head's keys span its quad's 4 lanes).
    unsigned ph[4], pl[4];  // P's A fragments (hi, lo)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      float m = fmaxf(mx[h2], fmaxf(fmaxf(sc[0][2 * h2], sc[0][2 * h2 + 1]), fmaxf(sc[1][2 * h2], sc[1][2 * h2 + 1])));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      const float ms = m == -STRATA_INF ? 0.f : m;  // a warp whose keys are all past the row stays at zero
      const float alpha = exp2f(mx[h2] - ms);       // 0 while nothing was seen; 1 when the max is unchanged
      mx[h2] = m;
      sum[h2] *= alpha;
#pragma unroll
      for (int t = 0; t < DT; ++t) {
        o[t][2 * h2] *= alpha;
        o[t][2 * h2 + 1] *= alpha;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float p0 = exp2f(sc[h][2 * h2] - ms), p1 = exp2f(sc[h][2 * h2 + 1] - ms);
        sum[h2] += p0 + p1;
        split_half2(p0, p1, ph[2 * h + h2], pl[2 * h + h2]);
      }
    }
    // O [16 heads x D] += P [16 x 16 keys] V [16 keys x D].
#pragma unroll
    for (int t = 0; t < DT; t += 2) {
      unsigned b[4];  // b[0..1]: dims t*8.., b[2..3]: dims t*8+8..
      ldsm_x4_trans(b, v_lane + buf + t * 16);
      mma16816(o[t], ph, b[0], b[1]);
      mma16816(o[t], pl, b[0], b[1]);
      mma16816(o[t + 1], ph, b[2], b[3]);
      mma16816(o[t + 1], pl, b[2], b[3]);
    }
    __syncthreads();  // every warp is done with this buffer before chunk j + 2 lands in it
  }
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    sum[h2] += __shfl_xor_sync(0xffffffffu, sum[h2], 1);
    sum[h2] += __shfl_xor_sync(0xffffffffu, sum[h2], 2);
  }

  // The warps' partials [4][G][D], maxima and totals [4][G], in the tile buffers (every warp is past them).
  float* wo = reinterpret_cast<float*>(attn_tiles);
  float* wm = wo + 4 * G * D;
  float* wl = wm + 4 * G;
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    const int row = gq + 8 * h2;
    if (row >= G) continue;
#pragma unroll
    for (int t = 0; t < DT; ++t)
      *reinterpret_cast<float2*>(wo + (warp * G + row) * D + t * 8 + 2 * tq) = make_float2(o[t][2 * h2], o[t][2 * h2 + 1]);
    if (tq == 0) {
      wm[warp * G + row] = mx[h2];
      wl[warp * G + row] = sum[h2];
    }
  }
  __syncthreads();
  float* accr = part_acc + ((size_t)r * NKV + kvh) * NC * G * D;
  float* mlr = part_ml + ((size_t)r * NKV + kvh) * NC * G * 2;
  float* outr = out + (size_t)r * NQ * D + (size_t)kvh * G * D;
  for (int i = threadIdx.x; i < G * D; i += 128) {
    const int g = i / D;
    float m = wm[g];
#pragma unroll
    for (int w = 1; w < 4; ++w) m = fmaxf(m, wm[w * G + g]);  // finite: warp 0 holds the block's first key
    float a = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float f = exp2f(wm[w * G + g] - m);
      a += wo[w * G * D + i] * f;
      l += wl[w * G + g] * f;
    }
    if (used == 1) {
      outr[i] = a / l;
    } else {
      accr[(size_t)s * G * D + i] = a;
      if (i % D == 0) {
        mlr[((size_t)s * G + g) * 2] = m * LN2;
        mlr[((size_t)s * G + g) * 2 + 1] = l;
      }
    }
  }
  if (used == 1) return;
  float* red = reinterpret_cast<float*>(attn_tiles);  // the merge's scratch: the tile buffers again
  constexpr int CAP = 2 * BUF / 4 - 2 * G;
  const int groups = (NC + ATTN_MERGE_GROUP - 1) / ATTN_MERGE_GROUP;
  int* const counters = done + ((size_t)r * NKV + kvh) * (1 + groups);  // the row's merge, then each group's
  if (used > ATTN_MERGE_GROUP) {
    attn_merge_grouped<G, D, 128>(accr, mlr, s, used, counters, red, CAP, &last, outr);
    return;
  }
  if (last_to_finish(counters, used, &last)) attn_merge<G, D, 128, true>(accr, mlr, 0, 1, used, red, CAP, outr);
}

// ---- routed experts -----------------------------------------------------------------------------------
// Each expert's weights are found through a table of device addresses: GUp[e] points at expert e's gate_up
// [2I, H] (gate rows, then up rows), Dp[e] at its down [H, I]. An address may be a VRAM slot of the expert
// cache, a helper slot on another GPU (read over the peer link) or pinned, mapped host memory (read over the
// host link), so the cache can move an expert by rewriting one table entry, with no recapture of the graphs
// that read it. With counts non-null, the blocks of feature tile 0 also add each assignment to counts[sel],
// when slot_of[sel] < 0 (the expert holds no VRAM slot) to misses[0], and when slot_of[sel] < -1 (a helper
// slot) to misses[1]: the cache's view of the routing.
// Routing is the fp32 softmax over E, top-k by rank (ties to the lower expert index), weights renormalised
// over the k chosen when norm_topk is set. The wide kernels read it from route_topk, run before them (idx
// [R, K] and wts [R, K]); moe_gate_up_any computes it inside, every block for its own row.
// Block-wide ranking of logits l[E] (E <= 256, 256 threads): thread e's expert is e, and it gets its rank
// (0 = the largest logit, ties to the lower index), its softmax numerator exp(l[e] - max), and every thread
// the max and the two totals: over all experts and over the top k.
struct Ranked {
  int rank;
  float p, m, z, zk;
};

__device__ __forceinline__ Ranked block_rank(const float* __restrict__ l, int E, int topk) {
  __shared__ __align__(16) float ls[256];
  __shared__ float red[3][8];  // per warp: max, softmax total, top-k total
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float v = tid < E ? l[tid] : -STRATA_INF;
  ls[tid] = v;
  float m = warp_max(v);
  if (lane == 0) red[0][warp] = m;
  __syncthreads();
  m = red[0][0];
#pragma unroll
  for (int w = 1; w < 8; ++w) m = fmaxf(m, red[0][w]);
  // The rank counts the logits above this thread's (ties: those of lower index), four at a time from one
  // 16-byte shared load that every thread of the warp reads alike, into four counters: a fourth of the
  // loads and four independent chains instead of one.
  int rank = 0;
  if (tid < E) {
    const float4* l4 = reinterpret_cast<const float4*>(ls);
    int c0 = 0, c1 = 0, c2 = 0, c3 = 0;
    const int E4 = E / 4;
    for (int q = 0; q < E4; ++q) {
      const float4 o = l4[q];
      const int e = 4 * q;
      c0 += (o.x > v) || (o.x == v && e < tid);
      c1 += (o.y > v) || (o.y == v && e + 1 < tid);
      c2 += (o.z > v) || (o.z == v && e + 2 < tid);
      c3 += (o.w > v) || (o.w == v && e + 3 < tid);
    }
    for (int e = 4 * E4; e < E; ++e) {
      const float o = ls[e];
      c0 += (o > v) || (o == v && e < tid);
    }
    rank = (c0 + c1) + (c2 + c3);
  }
  const float p = tid < E ? __expf(v - m) : 0.f;
  float z = warp_sum(p), zk = warp_sum(tid < E && rank < topk ? p : 0.f);
  if (lane == 0) { red[1][warp] = z; red[2][warp] = zk; }
  __syncthreads();
  float zt = 0.f, zkt = 0.f;
  for (int w = 0; w < 8; ++w) { zt += red[1][w]; zkt += red[2][w]; }
  return {tid < E ? rank : E, p, m, zt, zkt};  // call once per launch: its shared arrays are not reused
}

__device__ __forceinline__ void block_route(const float* __restrict__ l, int E, int topk, int j, int norm_topk,
                                            int* sel, float* weight) {
  // Block-wide: *sel = the j-th ranked expert of logits l[E] (E <= 256), *weight its routing weight.
  const Ranked r = block_rank(l, E, topk);
  if (r.rank == j) {
    *sel = threadIdx.x;
    *weight = r.p / (norm_topk ? r.zk : r.z);
  }
  __syncthreads();
}

__device__ __forceinline__ void count_assignment(int sel, const int* __restrict__ slot_of,
                                                 float* __restrict__ counts, float* __restrict__ misses) {
  if (counts == nullptr) return;
  atomicAdd(counts + sel, 1.f);
  const int where = slot_of[sel];
  if (where < 0) atomicAdd(misses, 1.f);
  if (where < -1) atomicAdd(misses + 1, 1.f);
}

__device__ __forceinline__ void note_route(int a, int sel, float weight, int* __restrict__ idx,
                                           float* __restrict__ wts, const int* __restrict__ slot_of,
                                           float* __restrict__ counts, float* __restrict__ misses) {
  idx[a] = sel;
  wts[a] = weight;
  count_assignment(sel, slot_of, counts, misses);
}

// Warp w of the block computes feature i = tile * 8 + w of assignment a (row r, expert sel):
// h[a, i] = silu(gate_i . x'[r]) * (up_i . x'[r]), inv the row's inverse RMS.
template <int H, int I>
__device__ __forceinline__ void gate_up_feature(const half* __restrict__ base, const float* __restrict__ xr,
                                                const half* __restrict__ nw, float inv, int a, int i,
                                                float* __restrict__ h) {
  const int lane = threadIdx.x & 31;
  const uint4* wg = reinterpret_cast<const uint4*>(base + (size_t)i * H);
  const uint4* wu = reinterpret_cast<const uint4*>(base + (size_t)(I + i) * H);
  constexpr int STEPS = H / 256;
  uint4 pg[STEPS], pu[STEPS];
#pragma unroll
  for (int s = 0; s < STEPS; ++s) { pg[s] = __ldg(wg + s * 32 + lane); pu[s] = __ldg(wu + s * 32 + lane); }
  float g = 0.f, u = 0.f;
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    float gf[8], uf[8], nf[8];
    unpack8(pg[s], gf);
    unpack8(pu[s], uf);
    const int k0 = s * 256 + lane * 8;
    unpack8(__ldg(reinterpret_cast<const uint4*>(nw + k0)), nf);
    const float4* xq = reinterpret_cast<const float4*>(xr + k0);
    const float4 xa = xq[0], xb = xq[1];
    const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const float xn = xv[t] * nf[t];
      g += gf[t] * xn;
      u += uf[t] * xn;
    }
  }
  g = warp_sum(g) * inv;
  u = warp_sum(u) * inv;
  if (lane == 0) h[(size_t)a * I + i] = g / (1.f + __expf(-g)) * u;
}

// Block (place p, feature tile) of a window already routed (idx [R, K] from route_topk, A = R K <= 256
// assignments): the assignments are taken in order of expert, and block (p, tile) computes the one at place
// p of that order. Assignments that share an expert so run side by side, and all but the first find its
// weights in L2: a window of 8 rows (about 54 distinct experts in 64 assignments) reads each expert from
// memory about once. Routing outside the kernel also spares every block the ranking of all E experts
// before its first weight load. Each assignment's sums do not depend on the window (batch invariance).
// With TABLE (ops.MoeForm's tables) the block reads all E experts' addresses (GUp [E]) beside the routing,
// instead of the chosen experts' after it, so an expert's weights are one round trip after the wait, not
// two; E is then GUp's length.
template <int H, int I, bool TABLE = false>
__global__ void __launch_bounds__(256) moe_gate_up(const unsigned long long* __restrict__ GUp,
                                                    const float* __restrict__ x, const half* __restrict__ nw,
                                                    const int* __restrict__ idx, int A, int topk, float eps,
                                                    float* __restrict__ h, const int* __restrict__ slot_of,
                                                    float* __restrict__ counts, float* __restrict__ misses, int E) {
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  __shared__ int at, ids[256];
  __shared__ unsigned long long bases[256];
  __shared__ float inv[1];
  __shared__ float part[8];
  // A one-row window's blocks all read row 0: its loads for the norm go out first, beside the routing's and
  // the experts' addresses. The sums are those of block_inv_rms<1, H> (each thread's k in order, the warp,
  // then the warps in order).
  const bool one_row = A == topk;
  constexpr int XS = H / 256;
  float xv[XS];
  if (one_row)
#pragma unroll
    for (int k = 0; k < XS; ++k) xv[k] = x[threadIdx.x + 256 * k];
  if (TABLE && threadIdx.x < E) bases[threadIdx.x] = GUp[threadIdx.x];
  if (threadIdx.x < A) {
    const int e = idx[threadIdx.x];
    ids[threadIdx.x] = e;
    if (!TABLE) bases[threadIdx.x] = GUp[e];
  }
  if (one_row) {
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < XS; ++k) ss += xv[k] * xv[k];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  }
  __syncthreads();
  if (one_row && threadIdx.x == 0) {
    float t = 0.f;
    for (int w = 0; w < 8; ++w) t += part[w];
    inv[0] = rsqrtf(t / H + eps);
  }
  if (threadIdx.x < A) {  // the assignment's place in (expert, assignment) order
    const int e = ids[threadIdx.x];
    int place = 0;
    for (int b = 0; b < A; ++b) {
      const int o = ids[b];
      place += (o < e) || (o == e && b < (int)threadIdx.x);
    }
    if (place == blockIdx.x) at = threadIdx.x;
  }
  __syncthreads();
  const int a = at, r = a / topk, sel = ids[a];
  if (!one_row) block_inv_rms<1, H>(x + (size_t)r * H, eps, inv);
  if (blockIdx.y == 0 && threadIdx.x == 0) count_assignment(sel, slot_of, counts, misses);
  const int i = blockIdx.y * 8 + (threadIdx.x >> 5);
  if (i >= I) return;
  gate_up_feature<H, I>(reinterpret_cast<const half*>(bases[TABLE ? sel : a]), x + (size_t)r * H, nw, inv[0], a, i,
                        h);
}

// Blocks of moe_down an SM should hold, for its launch bounds: 2 where a lane's K I / 256 loads of 16 bytes
// fit in registers beside the rest (at most 128 a thread). Without the bound ptxas places most loads beside
// their first use (58 registers at the 30B preset's widths), so a lane has only a few in flight and at one
// row the kernel waits on memory latency (docs/PERFORMANCE.md, "What limits the routed experts"). 0 (no
// bound) where the loads would not fit.
__host__ __device__ constexpr int moe_down_blocks(int I, int K) { return K * (I / 256) <= 24 ? 2 : 0; }

// resid[r, n] += sum_j wts[r, j] * (down[idx[r, j], n, :] . h[r * K + j, :]), j in a fixed order. One warp
// per (r, n). The source loads the rows of all K experts before using any; where `moe_down_blocks` bounds the
// kernel, ptxas keeps that order, so they are all in flight together.
// With TABLE (ops.MoeForm's tables) the block reads all E experts' addresses (Dp [E]) into shared memory
// beside the routing, so a warp's weight loads are one round trip after the wait, not two.
template <int H, int I, int K, bool TABLE = false>
__global__ void __launch_bounds__(256, moe_down_blocks(I, K))
    moe_down(const unsigned long long* __restrict__ Dp, const float* __restrict__ h, const int* __restrict__ idx,
             const float* __restrict__ wts, int R, float* __restrict__ resid, int E) {
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  __shared__ unsigned long long table[TABLE ? 256 : 1], bases[TABLE ? K : 1];
  __shared__ int experts[TABLE ? K : 1];
  if constexpr (TABLE) {  // the row's experts and the table, side by side; a block's 8 warps share a row
    static_assert(H % 8 == 0, "a block's warps share one row");
    const int row = min((int)(blockIdx.x * blockDim.x >> 5) / H, R - 1);
    if (threadIdx.x < K) experts[threadIdx.x] = idx[row * K + threadIdx.x];
    if (threadIdx.x < E) table[threadIdx.x] = Dp[threadIdx.x];
    __syncthreads();
    if (threadIdx.x < K) bases[threadIdx.x] = table[experts[threadIdx.x]];
    __syncthreads();
  }
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (warp >= R * H) return;
  const int r = warp / H, n = warp % H;
  constexpr int STEPS = I / 256;
  uint4 pk[K][STEPS];
#pragma unroll
  for (int j = 0; j < K; ++j) {
    unsigned long long base;
    if constexpr (TABLE)
      base = bases[j];
    else
      base = Dp[idx[r * K + j]];
    const uint4* w = reinterpret_cast<const uint4*>(reinterpret_cast<const half*>(base) + (size_t)n * I);
#pragma unroll
    for (int s = 0; s < STEPS; ++s) pk[j][s] = __ldg(w + s * 32 + lane);
  }
  float total = 0.f;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    float acc = 0.f;
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      float wf[8];
      unpack8(pk[j][s], wf);
      const float4* hr = reinterpret_cast<const float4*>(h + (size_t)(r * K + j) * I + s * 256 + lane * 8);
      const float4 p = hr[0], q = hr[1];
      const float hv[8] = {p.x, p.y, p.z, p.w, q.x, q.y, q.z, q.w};
#pragma unroll
      for (int t = 0; t < 8; ++t) acc += wf[t] * hv[t];
    }
    total += wts[r * K + j] * warp_sum(acc);
  }
  if (lane == 0) resid[(size_t)r * H + n] += total;
}

// Any H, I (small models): the same contracts with routing inside (block (feature tile, assignment) routes
// its own row and writes idx and wts from tile 0), scalar loads.
__global__ void __launch_bounds__(256) moe_gate_up_any(const unsigned long long* __restrict__ GUp,
                                                        const float* __restrict__ x, const half* __restrict__ nw,
                                                        const float* __restrict__ logits, int E, int topk,
                                                        int norm_topk, float eps, int H, int I,
                                                        float* __restrict__ h, int* __restrict__ idx,
                                                        float* __restrict__ wts, const int* __restrict__ slot_of,
                                                        float* __restrict__ counts, float* __restrict__ misses) {
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  __shared__ int sel;
  __shared__ float weight, part[8];
  const int a = blockIdx.y, r = a / topk, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  block_route(logits + (size_t)r * E, E, topk, a % topk, norm_topk, &sel, &weight);
  const float* xr = x + (size_t)r * H;
  float ss = 0.f;
  for (int k = threadIdx.x; k < H; k += blockDim.x) ss += xr[k] * xr[k];
  ss = warp_sum(ss);
  if (lane == 0) part[warp] = ss;
  __syncthreads();
  float tot = 0.f;
  for (int w = 0; w < 8; ++w) tot += part[w];
  const float inv = rsqrtf(tot / H + eps);
  if (blockIdx.x == 0 && threadIdx.x == 0) note_route(a, sel, weight, idx, wts, slot_of, counts, misses);
  const int i = blockIdx.x * 8 + warp;
  if (i >= I) return;
  const half* base = reinterpret_cast<const half*>(GUp[sel]);
  float g = 0.f, u = 0.f;
  for (int k = lane; k < H; k += 32) {
    const float xn = xr[k] * __half2float(nw[k]);
    g += __half2float(base[(size_t)i * H + k]) * xn;
    u += __half2float(base[(size_t)(I + i) * H + k]) * xn;
  }
  g = warp_sum(g) * inv;
  u = warp_sum(u) * inv;
  if (lane == 0) h[(size_t)a * I + i] = g / (1.f + __expf(-g)) * u;
}

__global__ void moe_down_any(const unsigned long long* __restrict__ Dp, const float* __restrict__ h,
                             const int* __restrict__ idx, const float* __restrict__ wts, int R, int topk, int H,
                             int I, float* __restrict__ resid) {
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (warp >= R * H) return;
  const int r = warp / H, n = warp % H;
  float total = 0.f;
  for (int j = 0; j < topk; ++j) {
    const int a = r * topk + j;
    const half* w = reinterpret_cast<const half*>(Dp[idx[a]]) + (size_t)n * I;
    float acc = 0.f;
    for (int k = lane; k < I; k += 32) acc += __half2float(w[k]) * h[(size_t)a * I + k];
    total += wts[a] * warp_sum(acc);
  }
  if (lane == 0) resid[(size_t)r * H + n] += total;
}

// out[r, i] = silu(gu[r, i]) * gu[r, I + i]: the SwiGLU of a dense MLP or shared expert.
__global__ void silu_mul(const float* __restrict__ gu, float* __restrict__ out, int R, int I) {
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= R * I) return;
  const int r = i / I, c = i % I;
  const float g = gu[(size_t)r * 2 * I + c];
  out[i] = g / (1.f + __expf(-g)) * gu[(size_t)r * 2 * I + I + c];
}

// resid[r, n] += scale(r) * y[r, n]; scale is sigmoid(gate[r]) when gate is given (the shared expert), else 1.
__global__ void add_scaled(float* __restrict__ resid, const float* __restrict__ y, const float* __restrict__ gate,
                           int R, int H) {
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= R * H) return;
  const float s = gate == nullptr ? 1.f : 1.f / (1.f + __expf(-gate[i / H]));
  resid[i] += s * y[i];
}

// ---- embedding gather and argmax --------------------------------------------------------------------
__global__ void embed(const half* __restrict__ table, const int* __restrict__ ids, float* __restrict__ out, int H) {
  const int r = blockIdx.x;
  const half* row = table + (size_t)ids[r] * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) out[(size_t)r * H + i] = __half2float(row[i]);
}

// ---- each row's argmax, ties to the lower index (as numpy.argmax) ---------------------------------------
// Two kernels. argmax_part: block (b, r) of 256 threads takes the b-th of NB equal slices of row r's logits
// and writes the slice's (max, index) to part_v / part_i [R, NB]; each thread has all its loads in flight
// before it compares any (one block per row read a 151,936-word row in 33 us, one load at a time).
// argmax_merge: one warp per row takes the NB candidates in order.
__device__ __forceinline__ void better(float v, int i, float& best, int& bi) {
  if (v > best || (v == best && i < bi)) { best = v; bi = i; }
}

__device__ __forceinline__ void warp_argmax(float& best, int& bi) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    better(ov, oi, best, bi);
  }
}

__global__ void __launch_bounds__(256) argmax_part(const float* __restrict__ logits, int V, int NB,
                                                   float* __restrict__ part_v, int* __restrict__ part_i) {
  constexpr int B = 256, U = 8;
  const int b = blockIdx.x, r = blockIdx.y;
  const int per = (V + NB - 1) / NB, lo = b * per, hi = min(V, lo + per);
  const float* l = logits + (size_t)r * V;
  float best = -STRATA_INF;
  int bi = 0x7fffffff;
  for (int i0 = lo + (int)threadIdx.x; i0 < hi; i0 += U * B) {
    float v[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int i = i0 + j * B;
      v[j] = i < hi ? l[i] : -STRATA_INF;
    }
#pragma unroll
    for (int j = 0; j < U; ++j)
      if (i0 + j * B < hi) better(v[j], i0 + j * B, best, bi);
  }
  warp_argmax(best, bi);
  __shared__ float sv[B / 32];
  __shared__ int si[B / 32];
  if ((threadIdx.x & 31) == 0) { sv[threadIdx.x >> 5] = best; si[threadIdx.x >> 5] = bi; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < B / 32; ++w) better(sv[w], si[w], best, bi);
    part_v[(size_t)r * NB + b] = best;
    part_i[(size_t)r * NB + b] = bi;
  }
}

__global__ void argmax_merge(const float* __restrict__ part_v, const int* __restrict__ part_i, int NB,
                             int* __restrict__ out) {
  const int r = blockIdx.x;
  float best = -STRATA_INF;
  int bi = 0x7fffffff;
  for (int b = threadIdx.x; b < NB; b += 32) better(part_v[(size_t)r * NB + b], part_i[(size_t)r * NB + b], best, bi);
  warp_argmax(best, bi);
  if (threadIdx.x == 0) out[r] = bi;
}

// ---- a request's logit bias and penalties, before its token is chosen ----------------------------------
// models/ops/adjust.py states the rule, reference/kernels.py is the NumPy twin. Adjusted row a is window row
// rows[a] of slot slot[a]: x = (l + bias[s, t]) - (frequency[a] * c + presence[a]) where the count c of token
// t is above 0, else l + bias[s, t]; in double without fused multiply-adds, rounded once to float, so that
// the host's NumPy arithmetic gives the same value bit for bit. c is the slot's count plus the row's
// occurrences among tokens[extra_from[a] ...] (extra_count[a] of them: the proposals a speculative row
// follows; tokens may be null where no row has any).
constexpr int ADJUST_EXTRA = 8;
__global__ void adjust_logits(float* __restrict__ logits, int V, const long long* __restrict__ rows,
                              const long long* __restrict__ slot, const int* __restrict__ counts,
                              const double* __restrict__ bias, const double* __restrict__ frequency,
                              const double* __restrict__ presence, const long long* __restrict__ tokens,
                              const long long* __restrict__ extra_from, const int* __restrict__ extra_count) {
  const int a = blockIdx.y;
  __shared__ long long extra[ADJUST_EXTRA];
  __shared__ int n_extra;
  if (threadIdx.x == 0) {
    n_extra = tokens == nullptr ? 0 : min(extra_count[a], ADJUST_EXTRA);
    for (int k = 0; k < n_extra; ++k) extra[k] = tokens[extra_from[a] + k];
  }
  __syncthreads();
  float* l = logits + (size_t)rows[a] * V;
  const size_t s = (size_t)slot[a] * V;
  const double f = frequency[a], p = presence[a];
  const int ne = n_extra;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < V; t += gridDim.x * blockDim.x) {
    double x = __dadd_rn((double)l[t], bias[s + t]);
    int c = counts[s + t];
    for (int k = 0; k < ne; ++k) c += extra[k] == t;
    if (c > 0) x = __dsub_rn(x, __dadd_rn(__dmul_rn(f, (double)c), p));
    l[t] = __double2float_rn(x);
  }
}

// counts[slot[i], tokens[i]] += add[i] for i < n (a slot and token may repeat).
__global__ void count_tokens(int* __restrict__ counts, int V, const long long* __restrict__ slot,
                             const long long* __restrict__ tokens, const int* __restrict__ add, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) atomicAdd(counts + (size_t)slot[i] * V + tokens[i], add[i]);
}

// ---- choosing each row's token on the device --------------------------------------------------------
// One block of 1024 threads per row; models/ops/choose.py states the rule, reference/kernels.py is the NumPy
// twin. inv_temp[r] == 0: the argmax (lowest index on ties). Otherwise, on the weights w = exp((l - max l) *
// inv_temp) of the row's logits l:
//  * top_k[r] in (0, V): only the tokens whose logit is at least the k-th largest stay (ties at it all stay);
//  * top_p[r] < 1: a token stays while the weight of the staying tokens before it, in descending order of
//    logit and then ascending index, is below top_p times their total. Weights are summed for this cut in
//    2^-40 fixed point: integer sums do not depend on the order the threads add them, so the cut is the same
//    in every run;
//  * the draw: the first staying token, in index order, whose cumulative weight exceeds u[r] times the
//    staying total (each thread sums a contiguous chunk, the chunks' sums are scanned across the block).
// The k-th largest logit and the top-p boundary are found by radix selection on the logits' bits.
// distribution_rows makes the same cuts and writes, instead of a draw, the whole distribution the draw takes
// (float64): what a sampled window decided on the device draws its proposals from and verifies them with.

typedef unsigned long long u64;

__device__ __forceinline__ unsigned order_key(float v) {
  // A float's bits as an unsigned key with the float's order (larger float, larger key).
  const unsigned u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Whether token i of logit v stays through a row's cuts: its key at least the top-k cut's, and, with a top-p
// cut (by_p), above the cut's key or at it and at most the index of the last tie the cut keeps.
__device__ __forceinline__ bool keeps_token(int i, float v, unsigned cut_k, bool by_p, unsigned cut_p,
                                            int cut_tie) {
  const unsigned kv = order_key(v);
  return kv >= cut_k && (!by_p || kv > cut_p || (kv == cut_p && i <= cut_tie));
}

// Block-wide inclusive scan of one value per thread (T float or int); *total gets the block's sum.
template <typename T>
__device__ __forceinline__ T block_scan(T v, T* sums, T* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (int)(blockDim.x >> 5);
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T n = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += n;
  }
  __syncthreads();
  if (lane == 31) sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T w = lane < warps ? sums[lane] : T(0);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const T n = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += n;
    }
    sums[lane] = w;
  }
  __syncthreads();
  *total = sums[warps - 1];
  return v + (warp > 0 ? sums[warp - 1] : T(0));
}

// The state of a radix selection between its passes (shared): the key bits chosen so far (prefix, under
// mask), the weight of the keys above them (over) and of the chosen bin (bin_weight).
struct RadixState {
  unsigned prefix, mask;
  u64 over, bin_weight;
};

// One pass of a radix selection: the next 8 bits (at shift) of the key K, from a histogram of the values of
// l[V] whose key matches the bits chosen so far. Every thread reads *st after it.
template <class Weight>
__device__ void radix_pass(const float* __restrict__ l, int V, Weight weight, u64 need, u64* hist, int shift,
                           RadixState* st) {
  const int lane = threadIdx.x & 31;
  u64* mine = hist + ((threadIdx.x >> 5) & 7) * 256;
  for (int b = threadIdx.x; b < 8 * 256; b += blockDim.x) hist[b] = 0ull;
  __syncthreads();
  const unsigned p = st->prefix, m = st->mask;
  const int step = (int)blockDim.x;
  for (int i0 = 0; i0 < V; i0 += 4 * step) {  // every thread the same number of times: warps converge
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // four coalesced loads in flight before any is used
      const int i = i0 + j * step + (int)threadIdx.x;
      v[j] = i < V ? l[i] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = i0 + j * step + (int)threadIdx.x;
      unsigned bin = 256u;
      u64 w = 0ull;
      if (i < V) {
        const unsigned k = order_key(v[j]);
        if ((k & m) == p) {
          w = weight(v[j]);
          if (w) bin = (k >> shift) & 255u;
        }
      }
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (bin < 256u) {
        const unsigned lo = __reduce_add_sync(peers, (unsigned)(w & 0xffffffull));
        const unsigned hi = __reduce_add_sync(peers, (unsigned)(w >> 24));
        if (lane == __ffs(peers) - 1) atomicAdd(mine + bin, ((u64)hi << 24) + lo);
      }
    }
  }
  __syncthreads();
  for (int b = threadIdx.x; b < 256; b += blockDim.x) {
    u64 total = 0ull;
    for (int g = 0; g < 8; ++g) total += hist[g * 256 + b];
    hist[b] = total;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int b = 255;
    u64 over = st->over;
    for (; b > 0 && over + hist[b] < need; --b) over += hist[b];
    st->over = over;
    st->prefix |= (unsigned)b << shift;
    st->mask |= 255u << shift;
    st->bin_weight = hist[b];
  }
  __syncthreads();
}

// Block-wide: the key K of the logits l[V] where the weight counted from the largest key down first reaches
// need: weight(keys > K) < need <= weight(keys >= K). *above = weight(keys > K), *at = weight(keys == K).
// 8 bits of the key a pass (radix_pass); weight(v) is a logit's weight. Each group of 4 warps fills its own
// 256-bin histogram of u64 weights (hist: 8 x 256, shared), and the lanes of a warp that fall in one bin add
// their weights together first (weights below 2^40, split in two halves a warp can sum in 32 bits), so few
// atomics meet on one address; the groups' histograms are then summed. Integer sums: the result does not
// depend on the order of the adds.
template <class Weight>
__device__ void radix_select(const float* __restrict__ l, int V, Weight weight, u64 need, u64* hist,
                             unsigned* key, u64* above, u64* at) {
  __shared__ RadixState st;
  if (threadIdx.x == 0) st = RadixState{0u, 0u, 0ull, 0ull};  // read after the first pass's barrier
  for (int shift = 24; shift >= 0; shift -= 8) radix_pass(l, V, weight, need, hist, shift, &st);
  *key = st.prefix;
  *above = st.over;
  *at = st.bin_weight;
}

constexpr int CHOOSE_CAP = 2048;  // tokens choose_rows gathers into shared memory, at most
constexpr int CHOOSE_CUTS = 7;    // candidate cuts below a row's largest logit mx: mx - 2^(j - 1) gaps

// The candidate cuts below a row's largest logit mx, in gaps of `gap`: cut j's key (the key of mx - 2^(j - 1)
// gap) into key[j], and the counts c and weights m above them (m[CHOOSE_CUTS]: every token's) set to zero.
__device__ __forceinline__ void start_cuts(float mx, float gap, unsigned* key, int* c, u64* m) {
#pragma unroll
  for (int j = 0; j < CHOOSE_CUTS; ++j) {
    key[j] = order_key(mx - ldexpf(gap, j - 1));
    c[j] = 0;
    m[j] = 0ull;
  }
  m[CHOOSE_CUTS] = 0ull;
}

// A warp's sums of its threads' counts c[CHOOSE_CUTS] and weights m[CHOOSE_CUTS + 1] above the candidate
// cuts (butterflies: every lane gets them), written by lane 0 to the warp's row of shared memory, wc and wm.
__device__ __forceinline__ void warp_cut_sums(int* c, u64* m, int* wc, u64* wm) {
#pragma unroll
  for (int j = 0; j <= CHOOSE_CUTS; ++j) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      if (j < CHOOSE_CUTS) c[j] += __shfl_xor_sync(0xffffffffu, c[j], o);
      m[j] += __shfl_xor_sync(0xffffffffu, m[j], o);
    }
    if ((threadIdx.x & 31) == 0) {
      if (j < CHOOSE_CUTS) wc[j] = c[j];
      wm[j] = m[j];
    }
  }
}

// Block-wide, over l[n]: for each candidate cut j, the key of mx - 2^(j - 1) * gap (key[j]), the tokens
// whose key is at least that (count[j]) and their weights (mass[j]), all shared; returns the weight of all
// n. Every thread reads the results. Integer sums (lanes, then warps in order): exact whatever the order.
template <class Weight>
__device__ u64 cut_sums(const float* __restrict__ l, int n, float mx, float gap, Weight weight, unsigned* key,
                        int* count, u64* mass) {
  __shared__ int wc[32][CHOOSE_CUTS];
  __shared__ u64 wm[32][CHOOSE_CUTS + 1];
  const int warp = threadIdx.x >> 5, warps = (int)(blockDim.x >> 5);
  unsigned lo[CHOOSE_CUTS];
  int c[CHOOSE_CUTS];
  u64 m[CHOOSE_CUTS + 1];  // m[CHOOSE_CUTS]: every token's weight
  start_cuts(mx, gap, lo, c, m);
#pragma unroll 2
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = l[i];
    const unsigned kv = order_key(v);
    const u64 w = weight(v);
    m[CHOOSE_CUTS] += w;
#pragma unroll
    for (int j = 0; j < CHOOSE_CUTS; ++j)
      if (kv >= lo[j]) { ++c[j]; m[j] += w; }
  }
  warp_cut_sums(c, m, wc[warp], wm[warp]);
  __syncthreads();
  if (threadIdx.x <= CHOOSE_CUTS) {
    const int j = threadIdx.x;
    int cs = 0;
    u64 ms = 0ull;
    for (int w = 0; w < warps; ++w) {
      if (j < CHOOSE_CUTS) cs += wc[w][j];
      ms += wm[w][j];
    }
    if (j < CHOOSE_CUTS) {
      key[j] = lo[j];
      count[j] = cs;
    }
    mass[j] = ms;
  }
  __syncthreads();
  return mass[CHOOSE_CUTS];
}

// Every thread gets the block's sum of v: a warp's lanes by a butterfly, then the warps' sums in order, so
// the sum is the same in every run. scratch: 32 of T, shared.
template <typename T>
__device__ __forceinline__ T block_total(T v, T* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (int)(blockDim.x >> 5);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T t = T(0);
  for (int w = 0; w < warps; ++w) t += scratch[w];
  return t;
}

// What the split kernels (choose_split_cuts, choose_split_gather, below) find for one row, in global memory,
// before its merge block runs choose_row: the row's largest logit and its index, each slice's counts and
// weights above the candidate cuts, and, where a candidate cut holds every token the row's cuts can keep and
// fits, those tokens in index order (n >= 0; n = -1: none gathered, the merge reads the whole row). A
// distribution's merge leaves its cuts here (t onwards) for distribution_split_write.
constexpr int SPLIT_MAX = 128;  // slices a row is cut into, at most (ops.py: argmax_slices)
struct ChoosePrep {
  float mx;
  int arg, n;
  u64 total;  // top-p without top-k: the weight of every token (fixed point), which sets top-p's need
  int count[SPLIT_MAX][CHOOSE_CUTS];
  u64 mass[SPLIT_MAX][CHOOSE_CUTS + 1];
  float cv[CHOOSE_CAP];
  int ci[CHOOSE_CAP];
  float t;
  unsigned cut_k, cut_p;
  int cut_tie, by_p;
  double dtotal;
};
constexpr int CHOOSE_PREP_BYTES = 32768;  // ops.py allocates this much a row
static_assert(sizeof(ChoosePrep) <= CHOOSE_PREP_BYTES, "ops.py's CHOOSE_PREP_BYTES is too small");

// Row r's ChoosePrep in scratch of CHOOSE_PREP_BYTES a row.
__device__ __forceinline__ ChoosePrep* prep_row(void* scratch, int r) {
  return reinterpret_cast<ChoosePrep*>(reinterpret_cast<char*>(scratch) + (size_t)r * CHOOSE_PREP_BYTES);
}

// A token's weight for the top-p cut, in 2^-40 fixed point: its float32 weight exp((v - mx) t), which
// choose_row and choose_split_cuts both sum through this one function, so the sums are the same integers.
__device__ __forceinline__ u64 fixed_weight(float v, float mx, float t) {
  return (u64)((double)__expf((v - mx) * t) * 1099511627776.0);
}

// One row of choose_rows (token: its chosen token) or of distribution_rows (dist: its distribution [V]), by
// one block of 1024 threads: l the row's logits, t its 1 / temperature, k its top-k, p its top-p, u its
// uniform (a draw only). With prep (the split kernels' findings for the row), the row's max and its first
// gather come from there instead of passes of this block over the row; every later step is the same, so the
// token and the distribution are the same bit for bit. With prep and neither token nor dist, the
// distribution's cuts and total go to prep, and distribution_split_write writes the row.
__device__ __forceinline__ void choose_row(const float* __restrict__ l, int V, float t, int k, float p, float u,
                                           int cap, long long* __restrict__ token, double* __restrict__ dist,
                                           ChoosePrep* __restrict__ prep = nullptr) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warps = (int)(blockDim.x >> 5);
  float best = -STRATA_INF;
  int bi = 0x7fffffff;
  if (prep == nullptr) {
#pragma unroll 4
    for (int i = tid; i < V; i += blockDim.x) better(l[i], i, best, bi);
  }
  warp_argmax(best, bi);
  __shared__ float sv[32], fsums[32];
  __shared__ int si[32], isums[32], found, last, tie_cut;
  __shared__ u64 hist[8 * 256];
  __shared__ unsigned kth, pkey;
  if (lane == 0) { sv[warp] = best; si[warp] = bi; }
  if (tid == 0) { found = 0x7fffffff; last = -1; tie_cut = 0x7fffffff; kth = 0u; pkey = 0u; }
  __syncthreads();
  if (tid == 0) {
    if (prep != nullptr) {
      sv[0] = prep->mx;
      si[0] = prep->arg;
    } else {
      for (int w = 1; w < warps; ++w) better(sv[w], si[w], sv[0], si[0]);
    }
  }
  __syncthreads();
  const bool stats = prep != nullptr && token == nullptr && dist == nullptr;  // a split distribution
  if (t <= 0.f) {  // the argmax
    if (token != nullptr && tid == 0) *token = si[0];
    if (dist != nullptr)
      for (int i = tid; i < V; i += blockDim.x) dist[i] = i == si[0] ? 1.0 : 0.0;
    if (stats && tid == 0) prep->t = t;
    return;
  }
  const float mx = sv[0];
  const bool by_p = p < 1.f;
  // The row the rest reads: all V logits, or, once at most `cap` (<= CHOOSE_CAP) tokens are known to hold
  // every token top-k or top-p can keep, those, gathered in index order into shared memory (cv values, ci
  // their indices). Thread tid gathers from the same contiguous chunk of V the draw below sums, so its share
  // of them is [g0, g0 + gn) and every sum below adds the same nonzero terms in the same order: the token is
  // the same bit for bit. The tokens are known to hold them either from a candidate cut (cut_sums: at least
  // k tokens, or at least top-p's weight, lie above it), or, for top-k, after two radix passes.
  __shared__ unsigned cut_key[CHOOSE_CUTS];
  __shared__ int cut_count[CHOOSE_CUTS];
  __shared__ u64 cut_mass[CHOOSE_CUTS + 1];
  __shared__ float cv[CHOOSE_CAP];
  __shared__ int ci[CHOOSE_CAP];
  const int chunk = (V + blockDim.x - 1) / blockDim.x;
  const int a = min(tid * chunk, V), b = min(a + chunk, V);
  const int room = min(cap, CHOOSE_CAP);
  const float* vals = l;  // the row the rest reads, n long; index(j) its token index
  int n = V, g0 = a, gn = b - a;
  bool compact = false;
  if (prep != nullptr && prep->n >= 0) {  // gathered by the split kernels, in index order
    const int m = prep->n;
    for (int j = tid; j < m; j += blockDim.x) {
      cv[j] = prep->cv[j];
      ci[j] = prep->ci[j];
    }
    __syncthreads();
    auto first_from = [&](int from) {  // the first gathered token whose index is at least `from`
      int lo = 0, hi = m;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (ci[mid] < from) lo = mid + 1; else hi = mid;
      }
      return lo;
    };
    g0 = first_from(a);
    gn = first_from(b) - g0;
    vals = cv;
    n = m;
    compact = true;
  }
  auto gather = [&](unsigned from) {  // every token whose key is at least `from` (they fit in cv)
    int mine = 0;
#pragma unroll 4
    for (int i = a; i < b; ++i) mine += order_key(l[i]) >= from;
    int all;
    const int incl = block_scan(mine, isums, &all);
    int o = incl - mine;
    for (int i = a; i < b && o < incl; ++i) {
      const float v = l[i];
      if (order_key(v) >= from) { cv[o] = v; ci[o] = i; ++o; }
    }
    __syncthreads();
    vals = cv;
    n = all;
    g0 = incl - mine;
    gn = mine;
    compact = true;
  };
  unsigned key;
  u64 above, at;
  if (k > 0 && k < V) {
    // The k-th largest logit: counted from the top, the k-th token's key, 8 bits a pass. The passes read
    // only the gathered tokens once those are known to hold every key they count: from the tightest cut
    // (in logits) with k tokens above it, or else once the keys at or above the first 16 bits fit in cv.
    if (room > 0 && prep == nullptr) {  // (with prep, choose_split_gather made this choice)
      cut_sums(l, V, mx, 1.f, [](float) { return 0ull; }, cut_key, cut_count, cut_mass);
      for (int j = 0; j < CHOOSE_CUTS; ++j)
        if (cut_count[j] >= k) {
          if (cut_count[j] <= room) gather(cut_key[j]);
          break;
        }
    }
    __shared__ RadixState ks;
    if (tid == 0) ks = RadixState{0u, 0u, 0ull, 0ull};  // read after the first pass's barrier
    auto one = [](float) { return 1ull; };
    radix_pass(vals, n, one, (u64)k, hist, 24, &ks);
    radix_pass(vals, n, one, (u64)k, hist, 16, &ks);
    if (!compact && ks.over + ks.bin_weight <= (u64)room) gather(ks.prefix);
    radix_pass(vals, n, one, (u64)k, hist, 8, &ks);
    radix_pass(vals, n, one, (u64)k, hist, 0, &ks);
    key = ks.prefix;
    above = ks.over;
    at = ks.bin_weight;
    if (tid == 0) kth = key;
    __syncthreads();
  }
  const unsigned cut_k = kth;
  if (!compact && k > 0 && k < V && above + at <= (u64)room) gather(cut_k);
  auto index = [&](int j) -> int { return compact ? ci[j] : j; };  // the token at vals[j]
  if (by_p) {
    auto fixed = [&](float v) -> u64 {
      return order_key(v) >= cut_k ? fixed_weight(v, mx, t) : 0ull;
    };
    // The cut weighs from the top; with the weight of the tokens above each candidate cut (in logits over
    // inv_temp), the tightest one that holds need and fits in cv is gathered first.
    // Without top-k, the split kernels summed every token's weight and made the gather's choice.
    const bool split = prep != nullptr && !(k > 0 && k < V);
    const u64 total = split ? prep->total : cut_sums(vals, n, mx, 1.f / t, fixed, cut_key, cut_count, cut_mass);
    const u64 need = (u64)((double)p * (double)total);  // a token stays while the weight before it < need
    if (!compact && room > 0 && !split)
      for (int j = 0; j < CHOOSE_CUTS; ++j)
        if (cut_mass[j] >= need) {
          if (cut_count[j] <= room) gather(cut_key[j]);
          break;
        }
    radix_select(vals, n, fixed, need, hist, &key, &above, &at);
    // Tokens of key K: each weighs the same (one logit); the first m of them in index order stay, those
    // with the weight before them (above, plus the ties before them) under need.
    __shared__ u64 tie_w;
    if (tid == 0) { pkey = key; tie_w = 0ull; }
    __syncthreads();
    // Count each thread's ties in a contiguous chunk; scan; the m-th tie ends the kept ties.
    const int tchunk = (n + blockDim.x - 1) / blockDim.x;
    const int a0 = min(tid * tchunk, n), b0 = min(a0 + tchunk, n);
    int ties = 0;
    u64 each = 0ull;
#pragma unroll 4
    for (int j = a0; j < b0; ++j)
      if (order_key(vals[j]) == key) { ++ties; each = fixed(vals[j]); }
    int all_ties;
    const int incl = block_scan(ties, isums, &all_ties);
    if (ties > 0 && incl == ties) tie_w = each;  // the first thread holding ties: one tie's weight
    __syncthreads();
    const u64 m64 = tie_w > 0ull ? (need - above + tie_w - 1ull) / tie_w : (u64)all_ties;
    const int m = (int)min((u64)all_ties, max(m64, 1ull));
    if (m < all_ties && ties > 0 && incl - ties < m && m <= incl) {
      int seen = incl - ties;
      for (int j = a0; j < b0; ++j)
        if (order_key(vals[j]) == key && ++seen == m) { tie_cut = index(j); break; }
    }
    __syncthreads();
  }
  const unsigned cut_p = pkey;
  const int cut_tie = tie_cut;
  auto stays = [&](int i, float v) { return keeps_token(i, v, cut_k, by_p, cut_p, cut_tie); };
  if (dist != nullptr || stats) {
    // The distribution the draw below takes: the same float32 weights of the staying tokens, over their sum
    // in float64 (each thread its share of vals in order, then the block's in order: the same in every run).
    __shared__ double dsums[32];
    double ds = 0.0;
    for (int j = g0; j < g0 + gn; ++j) {
      const float v = vals[j];
      if (stays(index(j), v)) ds += (double)__expf((v - mx) * t);
    }
    const double dtotal = block_total(ds, dsums);
    if (stats) {  // distribution_split_write writes the row
      if (tid == 0) {
        prep->t = t;
        prep->cut_k = cut_k;
        prep->cut_p = cut_p;
        prep->cut_tie = cut_tie;
        prep->by_p = by_p;
        prep->dtotal = dtotal;
      }
      return;
    }
    for (int i = tid; i < V; i += blockDim.x) {
      const float v = l[i];
      dist[i] = stays(i, v) ? (double)__expf((v - mx) * t) / dtotal : 0.0;
    }
    return;
  }
  float s = 0.f;
  int nz = -1;
#pragma unroll 4
  for (int j = g0; j < g0 + gn; ++j) {
    const float v = vals[j];
    const int i = index(j);
    const float w = stays(i, v) ? __expf((v - mx) * t) : 0.f;
    s += w;
    if (w > 0.f) nz = i;
  }
  if (nz >= 0) atomicMax(&last, nz);
  float total;
  const float incl = block_scan(s, fsums, &total);
  const float excl = incl - s, target = u * total;
  if (s > 0.f && excl <= target && target < incl) {
    float c = excl;
    int at_i = nz;  // rounding left the crossing past the chunk's end: its last staying token
    for (int j = g0; j < g0 + gn; ++j) {
      const float v = vals[j];
      const int i = index(j);
      c += stays(i, v) ? __expf((v - mx) * t) : 0.f;
      if (c > target) { at_i = i; break; }
    }
    atomicMin(&found, at_i);
  }
  __syncthreads();
  if (tid == 0) *token = found != 0x7fffffff ? found : last;  // u * total rounded up to the total: the last
}

__global__ void __launch_bounds__(1024) choose_rows(const float* __restrict__ logits, int V,
                                                    const float* __restrict__ inv_temp,
                                                    const int* __restrict__ top_k, const float* __restrict__ top_p,
                                                    const float* __restrict__ u, long long* __restrict__ out,
                                                    int cap) {
  const int r = blockIdx.x;
  choose_row(logits + (size_t)r * V, V, inv_temp[r], top_k[r], top_p[r], u[r], cap, out + r, nullptr);
}

// out[r] (float64 [V]) = the distribution choose_rows draws row r's token from, at one inv_temp (> 0), top_k
// and top_p for every row: its float32 weights exp((l - max l) * inv_temp) of the tokens that stay after both
// cuts, over their sum in float64. A sampled window decided on the device verifies its proposals against it and draws them from
// it (models/ops/choose.py).
__global__ void __launch_bounds__(1024) distribution_rows(const float* __restrict__ logits, int V, float inv_temp,
                                                          int top_k, float top_p, int cap, double* __restrict__ out) {
  const int r = blockIdx.x;
  choose_row(logits + (size_t)r * V, V, inv_temp, top_k, top_p, 0.f, cap, nullptr, out + (size_t)r * V);
}

// ---- a row's choice split over slices of the row ----------------------------------------------------------
// One block of choose_rows or distribution_rows reads a whole 151,936-word row in each of its first passes
// (the max, the candidate cuts, the gather): tens of microseconds each on one SM. The split form runs those
// passes over NB slices of each row in parallel (blocks (b, r) of 256 threads), then the rest in one block
// per row, through the same choose_row:
//  1. argmax_part: each slice's largest logit and its index;
//  2. choose_split_cuts: the row's max from its slices' (the lowest index on ties, as one block finds it),
//     then for the candidate cuts choose_row would weigh first (top-k's counts at gaps of 1, or without
//     top-k top-p's weights at gaps of 1 / t) the slice's counts and weights, integer sums;
//  3. choose_split_gather: the slices' sums, then choose_row's rule (the tightest cut that holds k tokens, or
//     top-p's weight, if it fits CHOOSE_CAP); each slice writes its tokens above it at its offset (the
//     count of the slices before it), so the gathered tokens are in index order;
//  4. choose_split_rows or distribution_split_rows: choose_row with the row's ChoosePrep;
//  5. distribution_split_write (a distribution): the row's float64 values from the cuts the merge left.
// Every sum is over the same terms in the same order as one block's, or an integer sum: the token and the
// distribution are the same bit for bit (tests/test_cuda_kernels.py compares the two forms).

// Row r's 1 / temperature, top-k and top-p: from the arrays where given (choose_rows' per-row settings), else
// the scalars (one setting for every row, as distribution_rows takes).
__device__ __forceinline__ void row_params(int r, const float* __restrict__ ta, float t0, const int* __restrict__ ka,
                                           int k0, const float* __restrict__ pa, float p0, float& t, int& k,
                                           float& p) {
  t = ta != nullptr ? ta[r] : t0;
  k = ka != nullptr ? ka[r] : k0;
  p = pa != nullptr ? pa[r] : p0;
}

__global__ void __launch_bounds__(256) choose_split_cuts(const float* __restrict__ logits, int V, int NB,
                                                         const float* __restrict__ part_v,
                                                         const int* __restrict__ part_i,
                                                         const float* __restrict__ ta, float t0,
                                                         const int* __restrict__ ka, int k0,
                                                         const float* __restrict__ pa, float p0, int cap,
                                                         void* __restrict__ prep) {
  const int b = blockIdx.x, r = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  ChoosePrep* pr = prep_row(prep, r);
  float t, p;
  int k;
  row_params(r, ta, t0, ka, k0, pa, p0, t, k, p);
  __shared__ float smx;
  if (warp == 0) {
    float best = -STRATA_INF;
    int bi = 0x7fffffff;
    for (int j = lane; j < NB; j += 32) better(part_v[(size_t)r * NB + j], part_i[(size_t)r * NB + j], best, bi);
    warp_argmax(best, bi);
    if (lane == 0) {
      smx = best;
      if (b == 0) {
        pr->mx = best;
        pr->arg = bi;
      }
    }
  }
  __syncthreads();
  const bool topk = k > 0 && k < V;
  if (t <= 0.f || !(topk || p < 1.f) || min(cap, CHOOSE_CAP) <= 0) return;
  const float mx = smx, gap = topk ? 1.f : 1.f / t;
  const int per = (V + NB - 1) / NB, lo = b * per, hi = min(V, lo + per);
  unsigned key[CHOOSE_CUTS];
  int c[CHOOSE_CUTS];
  u64 m[CHOOSE_CUTS + 1];
  start_cuts(mx, gap, key, c, m);
  constexpr int U = 8;
  for (int i0 = lo + tid; i0 < hi; i0 += U * 256) {
    float v[U];
#pragma unroll
    for (int j = 0; j < U; ++j) v[j] = i0 + j * 256 < hi ? logits[(size_t)r * V + i0 + j * 256] : 0.f;
#pragma unroll
    for (int j = 0; j < U; ++j) {
      if (i0 + j * 256 >= hi) break;
      const unsigned kv = order_key(v[j]);
      const u64 w = topk ? 0ull : fixed_weight(v[j], mx, t);
      m[CHOOSE_CUTS] += w;
#pragma unroll
      for (int q = 0; q < CHOOSE_CUTS; ++q)
        if (kv >= key[q]) { ++c[q]; m[q] += w; }
    }
  }
  __shared__ int wc[8][CHOOSE_CUTS];
  __shared__ u64 wm[8][CHOOSE_CUTS + 1];
  warp_cut_sums(c, m, wc[warp], wm[warp]);
  __syncthreads();
  if (tid <= CHOOSE_CUTS) {
    int cs = 0;
    u64 ms = 0ull;
    for (int w = 0; w < 8; ++w) {
      if (tid < CHOOSE_CUTS) cs += wc[w][tid];
      ms += wm[w][tid];
    }
    if (tid < CHOOSE_CUTS) pr->count[b][tid] = cs;
    pr->mass[b][tid] = ms;
  }
}

__global__ void __launch_bounds__(256) choose_split_gather(const float* __restrict__ logits, int V, int NB,
                                                           const float* __restrict__ ta, float t0,
                                                           const int* __restrict__ ka, int k0,
                                                           const float* __restrict__ pa, float p0, int cap,
                                                           void* __restrict__ prep) {
  const int b = blockIdx.x, r = blockIdx.y, tid = threadIdx.x;
  ChoosePrep* pr = prep_row(prep, r);
  float t, p;
  int k;
  row_params(r, ta, t0, ka, k0, pa, p0, t, k, p);
  const bool topk = k > 0 && k < V;
  const int room = min(cap, CHOOSE_CAP);
  if (t <= 0.f || !(topk || p < 1.f) || room <= 0) {
    if (b == 0 && tid == 0) pr->n = -1;
    return;
  }
  __shared__ int cnt[CHOOSE_CUTS], before[CHOOSE_CUTS], sums[32];
  __shared__ u64 mass[CHOOSE_CUTS + 1];
  if (tid <= CHOOSE_CUTS) {
    int cs = 0, cb = 0;
    u64 ms = 0ull;
    for (int s = 0; s < NB; ++s) {
      if (tid < CHOOSE_CUTS) {
        const int n = pr->count[s][tid];
        cs += n;
        if (s < b) cb += n;
      }
      ms += pr->mass[s][tid];
    }
    if (tid < CHOOSE_CUTS) {
      cnt[tid] = cs;
      before[tid] = cb;
    }
    mass[tid] = ms;
  }
  __syncthreads();
  int cut = -1;  // choose_row's rule, the same in every block
  const u64 need = (u64)((double)p * (double)mass[CHOOSE_CUTS]);
  for (int j = 0; j < CHOOSE_CUTS; ++j)
    if (topk ? cnt[j] >= k : mass[j] >= need) {
      if (cnt[j] <= room) cut = j;
      break;
    }
  if (b == 0 && tid == 0) {
    pr->n = cut >= 0 ? cnt[cut] : -1;
    pr->total = mass[CHOOSE_CUTS];
  }
  if (cut < 0) return;
  const float mx = pr->mx, gap = topk ? 1.f : 1.f / t;
  const unsigned from = order_key(mx - ldexpf(gap, cut - 1));
  const int per = (V + NB - 1) / NB, lo = b * per, hi = min(V, lo + per);
  const int chunk = (hi - lo + 255) / 256, a = min(hi, lo + tid * chunk), e = min(hi, a + chunk);
  const float* l = logits + (size_t)r * V;
  int mine = 0;
  for (int i = a; i < e; ++i) mine += order_key(l[i]) >= from;
  int all;
  const int incl = block_scan(mine, sums, &all);
  int o = before[cut] + incl - mine;
  for (int i = a; i < e && o < before[cut] + incl; ++i) {
    const float v = l[i];
    if (order_key(v) >= from) {
      pr->cv[o] = v;
      pr->ci[o] = i;
      ++o;
    }
  }
}

__global__ void __launch_bounds__(1024) choose_split_rows(const float* __restrict__ logits, int V,
                                                          const float* __restrict__ inv_temp,
                                                          const int* __restrict__ top_k,
                                                          const float* __restrict__ top_p,
                                                          const float* __restrict__ u, long long* __restrict__ out,
                                                          int cap, void* __restrict__ prep) {
  const int r = blockIdx.x;
  choose_row(logits + (size_t)r * V, V, inv_temp[r], top_k[r], top_p[r], u[r], cap, out + r, nullptr,
             prep_row(prep, r));
}

__global__ void __launch_bounds__(1024) distribution_split_rows(const float* __restrict__ logits, int V,
                                                                float inv_temp, int top_k, float top_p, int cap,
                                                                void* __restrict__ prep) {
  const int r = blockIdx.x;
  choose_row(logits + (size_t)r * V, V, inv_temp, top_k, top_p, 0.f, cap, nullptr, nullptr, prep_row(prep, r));
}

__global__ void __launch_bounds__(256) distribution_split_write(const float* __restrict__ logits, int V, int NB,
                                                                void* __restrict__ prep,
                                                                double* __restrict__ out) {
  const int b = blockIdx.x, r = blockIdx.y;
  const ChoosePrep* pr = prep_row(prep, r);
  const int per = (V + NB - 1) / NB, lo = b * per, hi = min(V, lo + per);
  const float* l = logits + (size_t)r * V;
  double* dist = out + (size_t)r * V;
  const float t = pr->t;
  if (t <= 0.f) {
    const int arg = pr->arg;
    for (int i = lo + (int)threadIdx.x; i < hi; i += 256) dist[i] = i == arg ? 1.0 : 0.0;
    return;
  }
  const float mx = pr->mx;
  const unsigned cut_k = pr->cut_k, cut_p = pr->cut_p;
  const int cut_tie = pr->cut_tie;
  const bool by_p = pr->by_p;
  const double dtotal = pr->dtotal;
  for (int i = lo + (int)threadIdx.x; i < hi; i += 256) {  // choose_row's value
    const float v = l[i];
    dist[i] = keeps_token(i, v, cut_k, by_p, cut_p, cut_tie) ? (double)__expf((v - mx) * t) / dtotal : 0.0;
  }
}

// ---- draws from distributions, and a sampled window's acceptance ---------------------------------------------
// The rule of models/ops/distribution.py (`inverse_cdf`, `verify_sampled`), one block of 1024 threads a row
// or a slot. Where the host's CuPy steps take a dozen launches, each of these takes one.
//
// Block-wide inverse CDF over weights weight(i) of i < V (float64, not necessarily summing to 1) at u: the
// first index whose cumulative weight exceeds u times their total. Each thread sums a contiguous chunk in
// index order, the chunks' sums are scanned across the block, and the thread whose chunk holds the crossing
// walks it again; where rounding leaves no chunk holding it, the last index of positive weight. The sums
// run in a fixed order, so the index is the same in every run; it differs from the host's cumulative sum
// only where u times the total falls within rounding of an index's edge.
template <class Weight>
__device__ __forceinline__ int block_inverse_cdf(Weight weight, int V, double u) {
  __shared__ double sums[32];
  __shared__ int found, last;
  const int tid = threadIdx.x;
  if (tid == 0) {
    found = 0x7fffffff;
    last = -1;
  }
  const int chunk = (V + blockDim.x - 1) / blockDim.x, a = min(tid * chunk, V), b = min(a + chunk, V);
  double s = 0.0;
  int nz = -1;
  for (int i = a; i < b; ++i) {
    const double w = weight(i);
    s += w;
    if (w > 0.0) nz = i;
  }
  double total;
  const double incl = block_scan(s, sums, &total);  // (its barriers order the resets above)
  if (nz >= 0) atomicMax(&last, nz);
  const double excl = incl - s, target = u * total;
  if (s > 0.0 && excl <= target && target < incl) {
    double c = excl;
    int at = nz;
    for (int i = a; i < b; ++i) {
      c += weight(i);
      if (c > target) { at = i; break; }
    }
    atomicMin(&found, at);
  }
  __syncthreads();
  const int token = found != 0x7fffffff ? found : (last >= 0 ? last : V - 1);
  __syncthreads();  // found and last are read before any thread leaves for a next call
  return token;
}

// out[r] = the draw from weights w[r] (float64 [R, V]) at u[r * ustride]: a sampled proposal from its
// drafter's distribution.
__global__ void __launch_bounds__(1024) inverse_cdf_rows(const double* __restrict__ w, int V,
                                                         const double* __restrict__ u, int ustride,
                                                         long long* __restrict__ out) {
  const int r = blockIdx.x;
  const double* row = w + (size_t)r * V;
  const int token = block_inverse_cdf([row](int i) { return row[i]; }, V, u[(size_t)r * ustride]);
  if (threadIdx.x == 0) out[r] = token;
}

// Speculative rejection sampling of S slots of n rows (block s: slot s): p [S n, V] the target's
// distributions, q [S (n - 1), V] those the proposals tokens[s n + 1 ...] were drawn from, u [S, ustride]
// the slot's uniforms. Proposal j holds while u[j] q_j(token) < p_j(token); accepted[s] = how many hold,
// from the first; first[s] = the draw at u[n - 1] from norm(max(0, p_a - q_a)) at the first rejection a (p_a
// where that is empty), or from p's last row when every proposal held.
__global__ void __launch_bounds__(1024, 1) verify_sampled_rows(const double* __restrict__ p,
                                                            const double* __restrict__ q,
                                                            const long long* __restrict__ tokens,
                                                            const double* __restrict__ u, int ustride, int n,
                                                            int V, long long* __restrict__ accepted,
                                                            long long* __restrict__ first) {
  const int s = blockIdx.x;
  const double* ps = p + (size_t)s * n * V;
  const double* qs = q + (size_t)s * (n - 1) * V;
  const long long* tk = tokens + (size_t)s * n;
  const double* us = u + (size_t)s * ustride;
  __shared__ int held;
  __shared__ double scratch[32];
  if (threadIdx.x == 0) {
    int a = 0;
    while (a < n - 1) {
      const long long t = tk[a + 1];
      if (!(us[a] * qs[(size_t)a * V + t] < ps[(size_t)a * V + t])) break;
      ++a;
    }
    held = a;
  }
  __syncthreads();
  const int a = held;
  const double* pa = ps + (size_t)a * V;
  const double* qa = a < n - 1 ? qs + (size_t)a * V : nullptr;
  bool residual = qa != nullptr;
  if (residual) {  // an empty residual (p_a <= q_a everywhere) draws from p_a
    double mine = 0.0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) mine += fmax(pa[i] - qa[i], 0.0);
    residual = block_total(mine, scratch) > 0.0;
  }
  const double* qr = residual ? qa : nullptr;  // the residual's q, or none: p_a itself
  const int token = block_inverse_cdf([pa, qr](int i) { return qr != nullptr ? fmax(pa[i] - qr[i], 0.0) : pa[i]; },
                                      V, us[n - 1]);
  if (threadIdx.x == 0) {
    accepted[s] = a;
    first[s] = token;
  }
}

// ---- prefill: the pieces between cuBLAS products for long prompt chunks ------------------------------
// Chunks of more than 64 rows run their products (q/k/v, attention scores and sums, output projection,
// experts grouped by expert) on cuBLAS in fp16; these kernels do the rest.

__device__ __forceinline__ float block_reduce(float v, bool is_max, float* scratch) {
  // All threads of a block of up to 1024 get the block's max or sum; scratch holds 32 floats.
  v = is_max ? warp_max(v) : warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < warps ? scratch[lane] : (is_max ? -STRATA_INF : 0.f);
  t = is_max ? warp_max(t) : warp_sum(t);
  return t;
}

// out[r] = rmsnorm(x[r]) * w in fp16: a product's input.
__global__ void rmsnorm_half(const float* __restrict__ x, const half* __restrict__ w, half* __restrict__ out,
                             int H, float eps) {
  __shared__ float scratch[32];
  const float* xr = x + (size_t)blockIdx.x * H;
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) ss += xr[i] * xr[i];
  const float inv = rsqrtf(block_reduce(ss, false, scratch) / H + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x)
    out[(size_t)blockIdx.x * H + i] = __float2half(xr[i] * inv * __half2float(w[i]));
}

// Block r of 256 threads: idx[r, j], wts[r, j] = the j-th ranked expert of row r and its weight, j < topk, by
// block_route's rule (the same routing the decode expert kernels compute). With counts non-null (an expert
// cache) each assignment is counted as count_assignment counts it.
__global__ void __launch_bounds__(256) route_topk(const float* __restrict__ logits, int E, int topk, int norm_topk,
                                                  int* __restrict__ idx, float* __restrict__ wts,
                                                  const int* __restrict__ slot_of, float* __restrict__ counts,
                                                  float* __restrict__ misses) {
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  const int r = blockIdx.x;
  const Ranked k = block_rank(logits + (size_t)r * E, E, topk);
  if (k.rank < topk) {
    idx[r * topk + k.rank] = threadIdx.x;
    wts[r * topk + k.rank] = k.p / (norm_topk ? k.zk : k.z);
    count_assignment(threadIdx.x, slot_of, counts, misses);
  }
}

// scores [B, R, L] fp32 -> probs [B, R, L] fp16, rows ld elements apart (ld a multiple of 4, so rows load
// as float4). Row r of each batch holds query row r / G (G heads of one KV head per query row), at position
// pos + r / G, and may see keys [0, that position]. Block (r, b): one pass for the running max and sum, one
// to write the probabilities (fp32 arithmetic), zeros past the row's last key.
__global__ void __launch_bounds__(256) softmax_causal(const float* __restrict__ scores, half* __restrict__ probs,
                                                      int R, int L, int ld, int pos, int G) {
  __shared__ float scratch[32];
  const size_t base = ((size_t)blockIdx.y * R + blockIdx.x) * ld;
  const float4* row = reinterpret_cast<const float4*>(scores + base);
  const int valid = min(pos + (int)blockIdx.x / G + 1, L);
  float m = -STRATA_INF, z = 0.f;
  for (int t4 = threadIdx.x; t4 * 4 < valid; t4 += blockDim.x) {
    const float4 v4 = row[t4];
    const float v[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (t4 * 4 + j >= valid) break;
      if (v[j] > m) {
        z = z * __expf(m - v[j]) + 1.f;
        m = v[j];
      } else {
        z += __expf(v[j] - m);
      }
    }
  }
  const float mb = block_reduce(m, true, scratch);
  const float inv = 1.f / block_reduce(m == -STRATA_INF ? 0.f : z * __expf(m - mb), false, scratch);
  half2* out = reinterpret_cast<half2*>(probs + base);
  for (int t4 = threadIdx.x; t4 * 4 < L; t4 += blockDim.x) {
    const float4 v4 = t4 * 4 < valid ? row[t4] : make_float4(0.f, 0.f, 0.f, 0.f);
    const float v[4] = {v4.x, v4.y, v4.z, v4.w};
    float p[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) p[j] = t4 * 4 + j < valid ? __expf(v[j] - mb) * inv : 0.f;
    out[2 * t4] = __floats2half2_rn(p[0], p[1]);
    out[2 * t4 + 1] = __floats2half2_rn(p[2], p[3]);
  }
}

// out[m, i] = silu(gu[m, i]) * gu[m, I + i] in fp16 (fp32 arithmetic): the experts' hidden rows.
__global__ void silu_mul_half(const half* __restrict__ gu, half* __restrict__ out, long M, int I) {
  const long e = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= M * I) return;
  const long m = e / I;
  const int i = (int)(e % I);
  const float g = __half2float(gu[m * 2 * I + i]);
  out[e] = __float2half(g / (1.f + __expf(-g)) * __half2float(gu[m * 2 * I + I + i]));
}

// One block of 1024 threads: rank[a] = a place for assignment a among those of its expert idx[a] (places
// 0..count-1, handed out in no particular order: a row's products do not depend on where it sits in its
// expert's group), and *most = the largest count. E <= 256.
__global__ void __launch_bounds__(1024) moe_group(const int* __restrict__ idx, int A, int E, int* __restrict__ rank,
                                                  int* __restrict__ most) {
  __shared__ int counts[256];
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int a = threadIdx.x; a < A; a += blockDim.x) rank[a] = atomicAdd(&counts[idx[a]], 1);
  __syncthreads();
  if (threadIdx.x < 32) {
    int best = 0;
    for (int e = threadIdx.x; e < E; e += 32) best = max(best, counts[e]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
    if (threadIdx.x == 0) *most = best;
  }
}

// xs[idx[a], rank[a]] = x[a / topk] for every assignment a = r * topk + j: each row copied to the slot its
// expert's group gives it. xs: [E, C, H] fp16. Block a.
__global__ void moe_scatter_rows(const half* __restrict__ x, const int* __restrict__ idx, const int* __restrict__ rank,
                                 half* __restrict__ xs, int topk, int C, int H) {
  const int a = blockIdx.x;
  const half* src = x + (size_t)(a / topk) * H;
  half* dst = xs + ((size_t)idx[a] * C + rank[a]) * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) dst[i] = src[i];
}

// resid[r, n] += sum_j wts[r, j] * ys[idx[r, j], rank[r, j], n], j in order. ys: [E, C, H] fp16. Block r.
__global__ void moe_gather_add(const half* __restrict__ ys, const int* __restrict__ idx, const int* __restrict__ rank,
                               const float* __restrict__ wts, float* __restrict__ resid, int topk, int C, int H) {
  const int r = blockIdx.x;
  for (int n = threadIdx.x; n < H; n += blockDim.x) {
    float t = 0.f;
    for (int j = 0; j < topk; ++j) {
      const int a = r * topk + j;
      t += wts[a] * __half2float(ys[((size_t)idx[a] * C + rank[a]) * H + n]);
    }
    resid[(size_t)r * H + n] += t;
  }
}
