// Part of kernels.cu, which includes it (NVRTC compiles kernels.cu as one unit): q/k RMSNorm and RoPE of one head.

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
