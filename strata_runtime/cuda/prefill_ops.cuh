// Part of kernels.cu, which includes it (NVRTC compiles kernels.cu as one unit): the prefill's pieces between cuBLAS products.

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
