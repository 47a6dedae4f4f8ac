// Part of kernels.cu, which includes it (NVRTC compiles kernels.cu as one unit): the GEMV on CUDA cores.

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

// ---- GEMV through 8-bit weights: y[r, n] = scale[n] * sum_k Q[n, k] x[r, k] ---------------------------------
// The MTP head's draft LM head under spec.draft_head = "int8": Q int8 [N, K] with one fp32 scale per row (the
// row's largest magnitude / 127). One warp per NR consecutive rows of Q; each lane reads 16 bytes (16 weights)
// of a row a step, so a warp streams 512 contiguous bytes. K is a multiple of 16 (rows 16-byte aligned).

// Sixteen signed bytes as floats: each byte b, its sign bit flipped (b + 128), is placed under the exponent
// of 2^23 by one byte permute, and one exact subtraction takes the offset off: 2^23 + b + 128 - (2^23 + 128).
__device__ __forceinline__ void unpack16_i8(const uint4& p, float* f) {
  const unsigned w[4] = {p.x ^ 0x80808080u, p.y ^ 0x80808080u, p.z ^ 0x80808080u, p.w ^ 0x80808080u};
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      f[4 * i + j] = __uint_as_float(__byte_perm(w[i], 0x4B000000u, 0x7540u | j)) - 8388736.f;
}

template <int R, int NR>
__global__ void gemv_i8(const signed char* __restrict__ Q, const float* __restrict__ scale,
                        const float* __restrict__ x, float* __restrict__ y, int N, int K) {
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const int n0 = warp * NR;
  if (n0 >= N) return;
  float acc[NR][R];
#pragma unroll
  for (int j = 0; j < NR; ++j)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[j][r] = 0.f;
#pragma unroll 4
  for (int k0 = lane * 16; k0 < K; k0 += 512) {
    uint4 pk[NR];
#pragma unroll
    for (int j = 0; j < NR; ++j) {
      const int n = min(n0 + j, N - 1);
      pk[j] = __ldg(reinterpret_cast<const uint4*>(Q + (size_t)n * K + k0));
    }
    float wf[NR][16];
#pragma unroll
    for (int j = 0; j < NR; ++j) unpack16_i8(pk[j], wf[j]);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float4* xr = reinterpret_cast<const float4*>(x + (size_t)r * K + k0);
      float xf[16];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float4 v = __ldg(xr + q);
        xf[4 * q] = v.x; xf[4 * q + 1] = v.y; xf[4 * q + 2] = v.z; xf[4 * q + 3] = v.w;
      }
#pragma unroll
      for (int j = 0; j < NR; ++j) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < 16; ++e) s += wf[j][e] * xf[e];
        acc[j][r] += s;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < NR; ++j) {
    const int n = n0 + j;
    const float sc = n < N ? scale[n] : 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float v = warp_sum(acc[j][r]);
      if (lane == 0 && n < N) y[(size_t)r * N + n] = v * sc;
    }
  }
}
