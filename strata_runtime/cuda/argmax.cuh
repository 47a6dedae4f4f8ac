// Part of kernels.cu, which includes it (NVRTC compiles kernels.cu as one unit): embedding, argmax, logit bias and penalties.

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
// (best, bi) starts as (-inf, ARGMAX_NONE). A NaN never wins (every comparison with it is false), so a row of
// NaNs alone leaves ARGMAX_NONE, which each kernel's last step turns into the row's first index (argmax_index):
// every row gets an index of the vocabulary, never 2^31 - 1, which as a token would send the next window's
// embedding far outside its table.
constexpr int ARGMAX_NONE = 0x7fffffff;
__device__ __forceinline__ void better(float v, int i, float& best, int& bi) {
  if (v > best || (v == best && i < bi)) { best = v; bi = i; }
}

__device__ __forceinline__ int argmax_index(int bi) { return bi == ARGMAX_NONE ? 0 : bi; }

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
  int bi = ARGMAX_NONE;
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
  int bi = ARGMAX_NONE;
  for (int b = threadIdx.x; b < NB; b += 32) better(part_v[(size_t)r * NB + b], part_i[(size_t)r * NB + b], best, bi);
  warp_argmax(best, bi);
  if (threadIdx.x == 0) out[r] = argmax_index(bi);
}

// ---- a request's logit bias and penalties, before its token is chosen ----------------------------------
// models/ops/adjust.py states the rule, reference/kernels.py is the NumPy twin. Adjusted row a is window row
// rows[a] of slot slot[a]: x = l + bias[s, t]; where the token was seen (its count nonzero: ADJUST_SEEN marks a
// prompt token) and repetition[a] is not 1, x / r above 0 and x * r otherwise; then x - (frequency[a] * c +
// presence[a]) where the count c of times generated (below ADJUST_SEEN) is above 0; in double without fused
// multiply-adds, rounded once to float, so that the host's NumPy arithmetic gives the same value bit for bit.
// c is the slot's count plus the row's occurrences among tokens[extra_from[a] ...] (extra_count[a] of them:
// the proposals a speculative row follows; tokens may be null where no row has any); repetition may be null
// (1 for every row).
constexpr int ADJUST_EXTRA = 8;
constexpr int ADJUST_SEEN = 1 << 30;
__global__ void adjust_logits(float* __restrict__ logits, int V, const long long* __restrict__ rows,
                              const long long* __restrict__ slot, const int* __restrict__ counts,
                              const double* __restrict__ bias, const double* __restrict__ frequency,
                              const double* __restrict__ presence, const long long* __restrict__ tokens,
                              const long long* __restrict__ extra_from, const int* __restrict__ extra_count,
                              const double* __restrict__ repetition) {
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
  const double f = frequency[a], p = presence[a], r = repetition != nullptr ? repetition[a] : 1.0;
  const int ne = n_extra;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < V; t += gridDim.x * blockDim.x) {
    double x = __dadd_rn((double)l[t], bias[s + t]);
    const int raw = counts[s + t];
    int c = raw & (ADJUST_SEEN - 1);
    for (int k = 0; k < ne; ++k) c += extra[k] == t;
    if (r != 1.0 && (raw != 0 || c > 0)) x = x > 0.0 ? __ddiv_rn(x, r) : __dmul_rn(x, r);
    if (c > 0) x = __dsub_rn(x, __dadd_rn(__dmul_rn(f, (double)c), p));
    l[t] = __double2float_rn(x);
  }
}

// A grammar's allowed tokens: row rows[a] of logits [R, V] keeps token t where bit t of its mask is set
// (bits[a * W + t / 32], bit t % 32: llguidance's packed bitmask) and becomes minus infinity elsewhere.
// reference/kernels.py's mask_logits is the NumPy twin.
__global__ void mask_logits(float* __restrict__ logits, int V, const long long* __restrict__ rows,
                            const unsigned* __restrict__ bits, int W) {
  const int a = blockIdx.y;
  float* l = logits + (size_t)rows[a] * V;
  const unsigned* m = bits + (size_t)a * W;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < V; t += gridDim.x * blockDim.x) {
    if (!((m[t >> 5] >> (t & 31)) & 1u)) l[t] = -STRATA_INF;
  }
}

// counts[slot[i], tokens[i]] += add[i] for i < n (a slot and token may repeat).
__global__ void count_tokens(int* __restrict__ counts, int V, const long long* __restrict__ slot,
                             const long long* __restrict__ tokens, const int* __restrict__ add, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) atomicAdd(counts + (size_t)slot[i] * V + tokens[i], add[i]);
}
