// Part of kernels.cu, which includes it (NVRTC compiles kernels.cu as one unit): a row's choice split over slices.

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

// Row r's 1 / temperature, top-k, top-p and min-p cut: from the arrays where given (choose_rows' per-row
// settings), else the scalars (one setting for every row, as distribution_rows takes).
__device__ __forceinline__ void row_params(int r, const float* __restrict__ ta, float t0, const int* __restrict__ ka,
                                           int k0, const float* __restrict__ pa, float p0,
                                           const float* __restrict__ ma, float m0, float& t, int& k, float& p,
                                           float& m) {
  t = ta != nullptr ? ta[r] : t0;
  k = ka != nullptr ? ka[r] : k0;
  p = pa != nullptr ? pa[r] : p0;
  m = ma != nullptr ? ma[r] : m0;
}

__global__ void __launch_bounds__(256) choose_split_cuts(const float* __restrict__ logits, int V, int NB,
                                                         const float* __restrict__ part_v,
                                                         const int* __restrict__ part_i,
                                                         const float* __restrict__ ta, float t0,
                                                         const int* __restrict__ ka, int k0,
                                                         const float* __restrict__ pa, float p0,
                                                         const float* __restrict__ ma, float m0, int cap,
                                                         void* __restrict__ prep) {
  const int b = blockIdx.x, r = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  ChoosePrep* pr = prep_row(prep, r);
  float t, p, lmp;
  int k;
  row_params(r, ta, t0, ka, k0, pa, p0, ma, m0, t, k, p, lmp);
  __shared__ float smx;
  if (warp == 0) {
    float best = -STRATA_INF;
    int bi = ARGMAX_NONE;
    for (int j = lane; j < NB; j += 32) better(part_v[(size_t)r * NB + j], part_i[(size_t)r * NB + j], best, bi);
    warp_argmax(best, bi);
    if (lane == 0) {
      smx = best;
      if (b == 0) {
        pr->mx = best;
        pr->arg = argmax_index(bi);
      }
    }
  }
  __syncthreads();
  const bool topk = k > 0 && k < V;
  const int per = (V + NB - 1) / NB, lo = b * per, hi = min(V, lo + per);
  if (t > 0.f && lmp > -STRATA_INF)  // the least key through the min-p cut, in this slice
    pr->mkey[b] = min_p_key(logits + (size_t)r * V + lo, hi - lo, smx, t, lmp);
  if (t <= 0.f || !(topk || p < 1.f) || min(cap, CHOOSE_CAP) <= 0) return;
  const float mx = smx, gap = topk ? 1.f : 1.f / t;
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
      const u64 w = topk || !min_p_keeps(v[j], mx, t, lmp) ? 0ull : fixed_weight(v[j], mx, t);
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
                                                           const float* __restrict__ pa, float p0,
                                                           const float* __restrict__ ma, float m0, int cap,
                                                           void* __restrict__ prep) {
  const int b = blockIdx.x, r = blockIdx.y, tid = threadIdx.x;
  ChoosePrep* pr = prep_row(prep, r);
  float t, p, lmp;
  int k;
  row_params(r, ta, t0, ka, k0, pa, p0, ma, m0, t, k, p, lmp);
  if (b == 0 && tid == 0) {  // the row's min-p key: the least of the slices' (0: no cut)
    unsigned m = t > 0.f && lmp > -STRATA_INF ? ~0u : 0u;
    if (m)
      for (int s = 0; s < NB; ++s) m = min(m, pr->mkey[s]);
    pr->cut_m = m;
  }
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
  const u64 need = max((u64)((double)p * (double)mass[CHOOSE_CUTS]), 1ull);  // as choose_row's
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
                                                          int cap, void* __restrict__ prep,
                                                          const float* __restrict__ lmp) {
  const int r = blockIdx.x;
  const float m = lmp != nullptr ? lmp[r] : -STRATA_INF;
  choose_row<true>(logits + (size_t)r * V, V, inv_temp[r], top_k[r], top_p[r], m, u[r], cap, out + r, nullptr,
                   prep_row(prep, r));
}

__global__ void __launch_bounds__(1024) distribution_split_rows(const float* __restrict__ logits, int V,
                                                                float inv_temp, int top_k, float top_p, int cap,
                                                                void* __restrict__ prep, float lmp) {
  const int r = blockIdx.x;
  choose_row<true>(logits + (size_t)r * V, V, inv_temp, top_k, top_p, lmp, 0.f, cap, nullptr, nullptr,
                   prep_row(prep, r));
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
