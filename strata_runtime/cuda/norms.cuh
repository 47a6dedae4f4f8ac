// Part of kernels.cu, which includes it (NVRTC compiles kernels.cu as one unit): residual add + RMSNorm, and q/k norm + RoPE + KV write.

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
