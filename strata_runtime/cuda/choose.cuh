// Part of kernels.cu, which includes it (NVRTC compiles kernels.cu as one unit): choosing each row's token.

// ---- choosing each row's token on the device --------------------------------------------------------
// One block of 1024 threads per row; models/ops/choose.py states the rule, reference/kernels.py is the NumPy
// twin. inv_temp[r] == 0: the argmax (lowest index on ties). Otherwise, on the weights w = exp((l - max l) *
// inv_temp) of the row's logits l:
//  * top_k[r] in (0, V): only the tokens whose logit is at least the k-th largest stay (ties at it all stay);
//  * lmp[r] > -inf (min-p, as ln(min_p)): only the tokens with (l - max l) * inv_temp >= lmp[r] stay, in float32
//    without contraction, as the NumPy twin computes it. Those are the tokens at or above one key (the test is
//    monotone in l), which one pass over the row finds and the top-k cut then includes; top-p weighs only
//    what both leave;
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
  // A float's bits as an unsigned key with the float's order (larger float, larger key). -0 takes +0's key:
  // the two are equal, so they tie and go by index, as the NumPy twin and the host's rule order them.
  const unsigned u = __float_as_uint(v) == 0x80000000u ? 0u : __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Whether a token of logit v passes a row's min-p cut lmp (ln(min_p), -inf: none) below its largest logit mx at
// 1 / temperature t: (v - mx) * t >= lmp, rounded as the NumPy twin rounds it.
__device__ __forceinline__ bool min_p_keeps(float v, float mx, float t, float lmp) {
  return lmp == -STRATA_INF || __fmul_rn(__fsub_rn(v, mx), t) >= lmp;
}

// Block-wide: the least key of a token of l[V] that passes the min-p cut lmp (min_p_keeps; the largest logit mx
// always does), so that the tokens passing are those whose key is at least it. Every thread gets it.
__device__ __forceinline__ unsigned min_p_key(const float* __restrict__ l, int V, float mx, float t, float lmp) {
  __shared__ unsigned least_key;  // (the split kernels find it over slices: choose_split_cuts)
  if (threadIdx.x == 0) least_key = ~0u;
  __syncthreads();
  unsigned least = ~0u;
#pragma unroll 4
  for (int i = threadIdx.x; i < V; i += blockDim.x)
    if (min_p_keeps(l[i], mx, t, lmp)) least = min(least, order_key(l[i]));
  least = __reduce_min_sync(0xffffffffu, least);
  if ((threadIdx.x & 31) == 0) atomicMin(&least_key, least);
  __syncthreads();
  const unsigned key = least_key;
  __syncthreads();  // read by every thread before another call resets it
  return key;
}

// Whether token i of logit v stays through a row's cuts: its key at least the top-k and min-p cut's, and, with
// a top-p cut (by_p), above the cut's key or at it and at most the index of the last tie the cut keeps.
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
constexpr int SPLIT_MAX = 128;  // slices a row is cut into, at most (choices.py: argmax_slices)
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
  unsigned mkey[SPLIT_MAX];  // each slice's least key through the min-p cut (choose_split_cuts)
  unsigned cut_m;            // the row's: the least of them (choose_split_gather)
};
constexpr int CHOOSE_PREP_BYTES = 32768;  // ops.py's choose_scratch allocates this much a row
static_assert(sizeof(ChoosePrep) <= CHOOSE_PREP_BYTES, "choices.py's CHOOSE_PREP_BYTES is too small");

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
// one block of 1024 threads: l the row's logits, t its 1 / temperature, k its top-k, p its top-p, lmp its
// min-p cut (ln(min_p), -inf: none), u its uniform (a draw only). With prep (the split kernels' findings for
// the row), the row's max and its first gather come from there instead of passes of this block over the row;
// every later step is the same, so the token and the distribution are the same bit for bit. With prep and
// neither token nor dist, the distribution's cuts and total go to prep, and distribution_split_write writes
// the row. SPLIT: prep is given (the split kernels'), and holds the min-p cut's key too.
template <bool SPLIT = false>
__device__ __forceinline__ void choose_row(const float* __restrict__ l, int V, float t, int k, float p, float lmp,
                                           float u, int cap, long long* __restrict__ token,
                                           double* __restrict__ dist, ChoosePrep* __restrict__ prep = nullptr) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warps = (int)(blockDim.x >> 5);
  float best = -STRATA_INF;
  int bi = ARGMAX_NONE;
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
  if (tid == 0) {
    found = 0x7fffffff;
    last = -1;
    tie_cut = 0x7fffffff;
    kth = SPLIT ? prep->cut_m : 0u;  // (split: the min-p cut's key, which the split kernels found)
    pkey = 0u;
  }
  __syncthreads();
  if (tid == 0) {
    if (prep != nullptr) {
      sv[0] = prep->mx;
      si[0] = prep->arg;
    } else {
      for (int w = 1; w < warps; ++w) better(sv[w], si[w], sv[0], si[0]);
      si[0] = argmax_index(si[0]);
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
  if (!SPLIT && lmp > -STRATA_INF) {  // min-p's cut, a key: the top-k cut is the larger of it and its own
    const unsigned m = min_p_key(l, V, mx, t, lmp);
    if (tid == 0) kth = m;
    __syncthreads();
  }
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
    if (tid == 0) kth = max(kth, key);
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
    // A token stays while the weight before it < need; at least 1, so a top-p whose share of the total
    // rounds to 0 keeps the top token.
    const u64 need = max((u64)((double)p * (double)total), 1ull);
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
  // u * total rounded up to the total: the last staying token; none (the weights are NaN: a NaN logit, or
  // every logit NaN): the argmax, so the row still chooses a token of the vocabulary
  if (tid == 0) *token = found != 0x7fffffff ? found : last >= 0 ? last : si[0];
}

// lmp: each row's min-p cut, or null for none.
__global__ void __launch_bounds__(1024) choose_rows(const float* __restrict__ logits, int V,
                                                    const float* __restrict__ inv_temp,
                                                    const int* __restrict__ top_k, const float* __restrict__ top_p,
                                                    const float* __restrict__ u, long long* __restrict__ out,
                                                    int cap, const float* __restrict__ lmp) {
  const int r = blockIdx.x;
  const float m = lmp != nullptr ? lmp[r] : -STRATA_INF;
  choose_row(logits + (size_t)r * V, V, inv_temp[r], top_k[r], top_p[r], m, u[r], cap, out + r, nullptr);
}

// out[r] (float64 [V]) = the distribution choose_rows draws row r's token from, at one inv_temp (> 0), top_k,
// top_p and min-p cut lmp for every row: its float32 weights exp((l - max l) * inv_temp) of the tokens that
// stay after the cuts, over their sum in float64. A sampled window decided on the device verifies its
// proposals against it and draws them from it (models/ops/choose.py).
__global__ void __launch_bounds__(1024) distribution_rows(const float* __restrict__ logits, int V, float inv_temp,
                                                          int top_k, float top_p, int cap, double* __restrict__ out,
                                                          float lmp) {
  const int r = blockIdx.x;
  choose_row(logits + (size_t)r * V, V, inv_temp, top_k, top_p, lmp, 0.f, cap, nullptr, out + (size_t)r * V);
}
