// Calibrated routing on the device: add B to the router logits of each row's intended experts.
//
// The rules, and this kernel's NumPy twin (route_bias, same arguments), are strata_runtime/reference/routing.py;
// the routing model that fills the tables is strata_runtime/experts/routing.py. This kernel must choose
// bit-identical sets. Everything is integer hashing (splitmix64 on uint64), uniforms of 24 bits (exact in
// float32) compared with float32 thresholds, and an inverse-CDF binary search over the same float32 table, so
// no floating-point rounding can differ between the two. The only float arithmetic is the final
// logits[r, e] += B, one IEEE add in both (compiled without fast math: strata_runtime/cuda/routing.py).
//
// Block r (one warp) handles row r: the row is at position pos[r] of slot slot[r], whose request has seed
// seeds[s] and CDF tables cdf[s] ([L, E] float32, layer-major). Each of the k lanes:
//   1. finds its latest change u* <= t: the first i in [0, lookback) with u = t - i >= 0 and (u == 0 or
//      uniform(STAY, layer, lane, 0, u) >= p_stay); none found: u* = max(t - lookback + 1, 0). The warp
//      tests 32 positions per pass and takes the first with a ballot.
//   2. in lane order, picks the first attempt a in [0, 32) (warp lane a tries attempt a) whose candidate
//      first_above(cdf, uniform(DRAW, layer, lane, a, u*)) no earlier lane holds; when all 32 collide, the
//      first free expert after its attempt-0 candidate, cyclically.
// Then warp lane j adds B to logits[r, chosen[j]] (the k experts are distinct, so no two lanes write one).
//
// The row's CDF (E <= 256) is first copied to shared memory, where every search reads it. No header is
// needed. Nothing is allocated and nothing is read back: the launch can be captured in a CUDA graph, with
// pos and slot read from device memory at replay. Letters: R rows, E experts, L model layers, S slots, k top-k.

#define ROUTE_MAX_K 32           // reference/routing.py MAX_TOP_K
#define ROUTE_MAX_E 256          // reference/routing.py MAX_KERNEL_EXPERTS: the CDF row is searched in shared memory
#define ROUTE_KIND_STAY 1ull     // reference/routing.py KIND_STAY
#define ROUTE_KIND_DRAW 2ull     // reference/routing.py KIND_DRAW
#define ROUTE_FULL 0xffffffffu

__device__ __forceinline__ unsigned long long route_mix64(unsigned long long z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// reference/routing.py hash_uniform: the word packs kind (4 bits), layer (12), lane (8), attempt (8), position (32).
__device__ __forceinline__ float route_uniform(unsigned long long seed, unsigned long long kind, int layer,
                                              int lane, int attempt, int pos) {
  const unsigned long long word = (kind << 60) | ((unsigned long long)(unsigned)layer << 48) |
                                  ((unsigned long long)(unsigned)lane << 40) |
                                  ((unsigned long long)(unsigned)attempt << 32) |
                                  (unsigned long long)(unsigned)pos;
  const unsigned long long h = route_mix64(seed ^ route_mix64(word));
  // h >> 40 < 2^24 converts exactly; the product with 2^-24 is exact.
  return (float)(unsigned)(h >> 40) * 5.9604644775390625e-08f;
}

// reference/routing.py first_above: the first e with cdf[e] > u, or E - 1 when there is none.
__device__ __forceinline__ int route_first_above(const float* cdf, int E, float u) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (cdf[mid] > u)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

__global__ void __launch_bounds__(32)
    route_bias(float* __restrict__ logits, const int* __restrict__ pos, const int* __restrict__ slot,
               const float* __restrict__ cdf, const unsigned long long* __restrict__ seeds, int E, int L,
               int layer, float p_stay, int topk, float bias, int lookback) {
  __shared__ int origin[ROUTE_MAX_K];
  __shared__ int chosen[ROUTE_MAX_K];
  __shared__ float q[ROUTE_MAX_E];  // [E] this request's CDF at this layer: every search reads it
  const int r = blockIdx.x, lane = threadIdx.x;
  const int t = pos[r], s = slot[r];
  const unsigned long long seed = seeds[s];
  const float* row = cdf + ((unsigned long long)s * L + layer) * E;
  for (int e = lane; e < E; e += 32) q[e] = row[e];

  // 1. Each lane's latest change position (found, the offset back from t, is warp-uniform).
  for (int j = 0; j < topk; ++j) {
    int found = -1;
    for (int base = 0; base < lookback && found < 0; base += 32) {
      const int i = base + lane, u = t - i;
      bool change = false;
      if (i < lookback && u >= 0)
        change = u == 0 || route_uniform(seed, ROUTE_KIND_STAY, layer, j, 0, u) >= p_stay;
      const unsigned m = __ballot_sync(ROUTE_FULL, change);
      if (m) found = base + __ffs(m) - 1;
    }
    if (lane == 0) origin[j] = found >= 0 ? t - found : (t - lookback + 1 > 0 ? t - lookback + 1 : 0);
  }
  __syncwarp();

  // 2. Each lane's expert, distinct from the earlier lanes'.
  for (int j = 0; j < topk; ++j) {
    const int e = route_first_above(q, E, route_uniform(seed, ROUTE_KIND_DRAW, layer, j, lane, origin[j]));
    bool free = true;
    for (int i = 0; i < j; ++i) free = free && chosen[i] != e;
    const unsigned m = __ballot_sync(ROUTE_FULL, free);
    const int first = __shfl_sync(ROUTE_FULL, e, m ? __ffs(m) - 1 : 0);  // the pick, or attempt 0's candidate
    if (lane == 0) {
      int pick = first;
      if (!m) {
        for (int step = 1; step <= E; ++step) {
          const int c = (first + step) % E;
          bool taken = false;
          for (int i = 0; i < j; ++i) taken = taken || chosen[i] == c;
          if (!taken) {
            pick = c;
            break;
          }
        }
      }
      chosen[j] = pick;
    }
    __syncwarp();
  }

  // 3. The bias.
  if (lane < topk) logits[(unsigned long long)r * E + chosen[lane]] += bias;
}
