// Part of kernels.cu, which includes it (NVRTC compiles kernels.cu as one unit): the GEMV on tensor cores.

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
template <int R, int K, int MT, int WARPS, bool NORM, int ROPE = 0>
__global__ void __launch_bounds__(WARPS * 32)
    gemv_mma(const half* __restrict__ W, const float* __restrict__ x, float* __restrict__ y, int N, int accumulate,
             const half* __restrict__ nw, float eps, const half* __restrict__ qn, const half* __restrict__ kn,
             const int* __restrict__ pos, const int* __restrict__ slot, float* __restrict__ q_out,
             half* __restrict__ kc, half* __restrict__ vc, int NQ, int NKV, int T, float theta,
             int* __restrict__ done) {
  STRATA_PDL_LAUNCH();
  constexpr int J = 4 / MT, UNIT = 32 * J, UNITS = K / UNIT, PER = (UNITS + WARPS - 1) / WARPS, F = 16 * MT;
  constexpr int GROUP = 2;  // units in registers at a time: GROUP * MT * J * 2 loads of 16 bytes a lane
  // The unit loop is unrolled when it is short (a reduction up to 4096, or 2048 with the norm's registers):
  // a longer unrolled loop keeps more than 128 registers live and spills to local memory.
  constexpr int ALL_ROUNDS = (PER + GROUP - 1) / GROUP, ROUNDS = ALL_ROUNDS <= (NORM ? 2 : 4) ? ALL_ROUNDS : 1;
  __shared__ float red[WARPS][F][R + 1];
  __shared__ float squares[WARPS][R];
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
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int j = 0; j < J; ++j)
#pragma unroll
            for (int band = 0; band < 2; ++band)
              pw[slot][m][j][band] = __ldg(rows[m][band] + (u * UNIT + 32 * j) / 8 + t);
      }
    }
  };
  load(0);
  STRATA_PDL_WAIT();
#pragma unroll ROUNDS
  for (int i0 = 0; i0 < PER; i0 += GROUP) {
    if (i0 > 0) load(i0);
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
  }
  static_assert(ROPE == 0 || ROPE % F == 0 || F % ROPE == 0, "a head's features must fill whole blocks");
  if constexpr (ROPE > 0)
    qkv_rope_heads<R, ROPE, WARPS>(y, N, n0, F, qn, kn, pos, slot, q_out, kc, vc, NQ, NKV, T, theta, eps, done);
}
