// Part of kernels.cu, which includes it (NVRTC compiles kernels.cu as one unit): the GEMV of a short output.

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
