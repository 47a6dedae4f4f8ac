// Part of kernels.cu, which includes it (NVRTC compiles kernels.cu as one unit): the routed experts, and the
// dense MLP's activation and residual add.

// ---- routed experts -----------------------------------------------------------------------------------
// Each expert's weights are found through a table of device addresses: GUp[e] points at expert e's gate_up
// [2I, H] (gate rows, then up rows), Dp[e] at its down [H, I]. An address may be a VRAM slot of the expert
// cache, a helper slot on another GPU (read over the peer link) or pinned, mapped host memory (read over the
// host link), so the cache can move an expert by rewriting one table entry, with no recapture of the graphs
// that read it. With counts non-null, the blocks of feature tile 0 also add each assignment to counts[sel],
// when slot_of[sel] < 0 (the expert holds no VRAM slot) to misses[0], and when slot_of[sel] < -1 (a helper
// slot) to misses[1]: the cache's view of the routing.
// A cache that keeps its misses (experts.keep_misses) also gives the kernels fill[e], the VRAM slot expert e
// is being written into (-1: none), and the slots' addresses: moe_admit, run after the routing, picks those
// slots from a queue of victims, and the gate/up and down kernels write each such expert's weights into its
// slot as they read them from host memory; the next window's moe_admit of the layer points the tables at the
// slot. The weights read are the same either way, so no result changes.
// Routing is the fp32 softmax over E, top-k by rank (ties to the lower expert index), weights renormalised
// over the k chosen when norm_topk is set. The wide kernels read it from route_topk, run before them (idx
// [R, K] and wts [R, K]); moe_gate_up_any computes it inside, every block for its own row.
// Block-wide ranking of logits l[E] (E <= 256, 256 threads): thread e's expert is e, and it gets its rank
// (0 = the largest logit, ties to the lower index), its softmax numerator exp(l[e] - max), and every thread
// the max and the two totals: over all experts and over the top k.
struct Ranked {
  int rank;
  float p, m, z, zk;
};

__device__ __forceinline__ Ranked block_rank(const float* __restrict__ l, int E, int topk) {
  __shared__ __align__(16) float ls[256];
  __shared__ float red[3][8];  // per warp: max, softmax total, top-k total
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float v = tid < E ? l[tid] : -STRATA_INF;
  ls[tid] = v;
  float m = warp_max(v);
  if (lane == 0) red[0][warp] = m;
  __syncthreads();
  m = red[0][0];
#pragma unroll
  for (int w = 1; w < 8; ++w) m = fmaxf(m, red[0][w]);
  // The rank counts the logits above this thread's (ties: those of lower index), four at a time from one
  // 16-byte shared load that every thread of the warp reads alike, into four counters: a fourth of the
  // loads and four independent chains instead of one.
  int rank = 0;
  if (tid < E && strata_isnan(v)) {
    // A NaN ranks below every number (-inf too) and after the NaNs of lower index, as a stable sort of the
    // negated logits orders it: the ranks stay a permutation of 0..E-1, so each of the top k has an expert.
    // (A number never counts a NaN above it: every comparison with a NaN is false.)
    for (int e = 0; e < E; ++e) rank += !strata_isnan(ls[e]) || e < tid;
  } else if (tid < E) {
    const float4* l4 = reinterpret_cast<const float4*>(ls);
    int c0 = 0, c1 = 0, c2 = 0, c3 = 0;
    const int E4 = E / 4;
    for (int q = 0; q < E4; ++q) {
      const float4 o = l4[q];
      const int e = 4 * q;
      c0 += (o.x > v) || (o.x == v && e < tid);
      c1 += (o.y > v) || (o.y == v && e + 1 < tid);
      c2 += (o.z > v) || (o.z == v && e + 2 < tid);
      c3 += (o.w > v) || (o.w == v && e + 3 < tid);
    }
    for (int e = 4 * E4; e < E; ++e) {
      const float o = ls[e];
      c0 += (o > v) || (o == v && e < tid);
    }
    rank = (c0 + c1) + (c2 + c3);
  }
  const float p = tid < E ? __expf(v - m) : 0.f;
  float z = warp_sum(p), zk = warp_sum(tid < E && rank < topk ? p : 0.f);
  if (lane == 0) { red[1][warp] = z; red[2][warp] = zk; }
  __syncthreads();
  float zt = 0.f, zkt = 0.f;
  for (int w = 0; w < 8; ++w) { zt += red[1][w]; zkt += red[2][w]; }
  return {tid < E ? rank : E, p, m, zt, zkt};  // call once per launch: its shared arrays are not reused
}

__device__ __forceinline__ void block_route(const float* __restrict__ l, int E, int topk, int j, int norm_topk,
                                            int* sel, float* weight) {
  // Block-wide: *sel = the j-th ranked expert of logits l[E] (E <= 256), *weight its routing weight.
  const Ranked r = block_rank(l, E, topk);
  if (r.rank == j) {
    *sel = threadIdx.x;
    *weight = r.p / (norm_topk ? r.zk : r.z);
  }
  __syncthreads();
}

__device__ __forceinline__ void count_assignment(int sel, const int* __restrict__ slot_of,
                                                 float* __restrict__ counts, float* __restrict__ misses) {
  if (counts == nullptr) return;
  atomicAdd(counts + sel, 1.f);
  const int where = slot_of[sel];
  if (where < 0) atomicAdd(misses, 1.f);
  if (where < -1) atomicAdd(misses + 1, 1.f);
}

__device__ __forceinline__ void note_route(int a, int sel, float weight, int* __restrict__ idx,
                                           float* __restrict__ wts, const int* __restrict__ slot_of,
                                           float* __restrict__ counts, float* __restrict__ misses) {
  idx[a] = sel;
  wts[a] = weight;
  count_assignment(sel, slot_of, counts, misses);
}

// ---- keeping misses ----------------------------------------------------------------------------------
// The device state of a stage's cache that keeps its misses, as the addresses and sizes moe_admit reads
// (strata_runtime/cuda/experts.py writes it once): tables [L, E] (gate/up and down addresses, tier codes),
// the host copies' addresses [L, E], the slots' addresses [C], fill [L, E], the queue of victims (slots and
// keys, layer * E + expert), the queue's (taken, count), the counters [L, 3] (column 2: experts kept), and E.
enum KeepState {
  KS_GU, KS_DN, KS_CODE, KS_HOST_GU, KS_HOST_DN, KS_SLOT_GU, KS_SLOT_DN, KS_FILL, KS_VICTIMS, KS_KEYS, KS_QUEUE,
  KS_COUNTERS, KS_E, KS_FIELDS
};

// The exclusive prefix count of flag over the block's threads (256), and the total in *total.
__device__ __forceinline__ int block_rank_of(bool flag, int* __restrict__ warps, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned ballot = __ballot_sync(0xffffffffu, flag);
  if (lane == 0) warps[warp] = __popc(ballot);
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < 8; ++w) {
    before += w < warp ? warps[w] : 0;
    all += warps[w];
  }
  *total = all;
  __syncthreads();  // warps[] is reused by the next call
  return before + __popc(ballot & ((1u << lane) - 1u));
}

// One block of 256 threads (E <= 256), before layer j's expert kernels of a window routed to idx [A]: the rule
// of strata_runtime.reference.keep.admit. First the experts the layer's last window kept are committed (the
// tables point at their slots). Then the experts of idx in host memory (tier code -1), in id order, take the
// usable victims among the next 64 of the queue, in queue order: a victim is usable when it still holds its
// slot (tier code or fill equal to it) and is not one of this window's experts of layer j. Each victim is sent
// back to host memory in the tables and its newcomer's fill set to the slot, which the expert kernels then
// write as they read the newcomer from host memory.
__global__ void __launch_bounds__(256) moe_admit(const unsigned long long* __restrict__ st, int j,
                                                  const int* __restrict__ idx, int A) {
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  constexpr int LOOK = 64;
  unsigned long long* gu = reinterpret_cast<unsigned long long*>(st[KS_GU]);
  unsigned long long* dn = reinterpret_cast<unsigned long long*>(st[KS_DN]);
  int* code = reinterpret_cast<int*>(st[KS_CODE]);
  const unsigned long long* host_gu = reinterpret_cast<const unsigned long long*>(st[KS_HOST_GU]);
  const unsigned long long* host_dn = reinterpret_cast<const unsigned long long*>(st[KS_HOST_DN]);
  const unsigned long long* slot_gu = reinterpret_cast<const unsigned long long*>(st[KS_SLOT_GU]);
  const unsigned long long* slot_dn = reinterpret_cast<const unsigned long long*>(st[KS_SLOT_DN]);
  int* fill = reinterpret_cast<int*>(st[KS_FILL]);
  const int* victims = reinterpret_cast<const int*>(st[KS_VICTIMS]);
  const int* keys = reinterpret_cast<const int*>(st[KS_KEYS]);
  int* queue = reinterpret_cast<int*>(st[KS_QUEUE]);
  float* counters = reinterpret_cast<float*>(st[KS_COUNTERS]);
  const int E = (int)st[KS_E], t = threadIdx.x, row = j * E;
  __shared__ int routed[256], usable_at[LOOK], warps[8];
  if (t < E) {
    const int f = fill[row + t];
    if (f >= 0) {
      gu[row + t] = slot_gu[f];
      dn[row + t] = slot_dn[f];
      code[row + t] = f;
      fill[row + t] = -1;
    }
  }
  routed[t] = 0;
  __syncthreads();
  if (t < A) routed[idx[t]] = 1;
  __syncthreads();
  int missing;
  const bool miss = t < E && routed[t] && code[row + t] == -1;
  const int rank = block_rank_of(miss, warps, &missing);
  const int lo = queue[0], hi = min(lo + LOOK, queue[1]);
  if (missing == 0 || lo >= hi) return;
  bool ok = false;
  if (t < hi - lo) {
    const int s = victims[lo + t], key = keys[lo + t], kj = key / E, ke = key % E;
    ok = (code[key] == s || fill[key] == s) && !(kj == j && routed[ke]);
  }
  int usable;
  const int place = block_rank_of(ok, warps, &usable);
  if (ok) usable_at[place] = t;
  __syncthreads();
  const int n = min(missing, usable);
  if (miss && rank < n) {
    const int q = lo + usable_at[rank], s = victims[q], key = keys[q];
    gu[key] = host_gu[key];
    dn[key] = host_dn[key];
    code[key] = -1;
    fill[key] = -1;
    fill[row + t] = s;
  }
  if (t == 0) {
    queue[0] = n == missing ? lo + usable_at[n - 1] + 1 : hi;
    counters[j * 3 + 2] += (float)n;
  }
}

// Warp w of the block computes feature i = tile * 8 + w of assignment a (row r, expert sel):
// h[a, i] = silu(gate_i . x'[r]) * (up_i . x'[r]), inv the row's inverse RMS.
// keep (KEEP only): where the expert is being kept (moe_admit), or null; the rows read are written there.
template <int H, int I, bool KEEP = false>
__device__ __forceinline__ void gate_up_feature(const half* __restrict__ base, const float* __restrict__ xr,
                                                const half* __restrict__ nw, float inv, int a, int i,
                                                float* __restrict__ h, half* __restrict__ keep = nullptr) {
  const int lane = threadIdx.x & 31;
  const uint4* wg = reinterpret_cast<const uint4*>(base + (size_t)i * H);
  const uint4* wu = reinterpret_cast<const uint4*>(base + (size_t)(I + i) * H);
  constexpr int STEPS = H / 256;
  uint4 pg[STEPS], pu[STEPS];
#pragma unroll
  for (int s = 0; s < STEPS; ++s) { pg[s] = __ldg(wg + s * 32 + lane); pu[s] = __ldg(wu + s * 32 + lane); }
  if (KEEP && keep != nullptr) {
    uint4* kg = reinterpret_cast<uint4*>(keep + (size_t)i * H);
    uint4* ku = reinterpret_cast<uint4*>(keep + (size_t)(I + i) * H);
#pragma unroll
    for (int s = 0; s < STEPS; ++s) { kg[s * 32 + lane] = pg[s]; ku[s * 32 + lane] = pu[s]; }
  }
  float g = 0.f, u = 0.f;
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    float gf[8], uf[8], nf[8];
    unpack8(pg[s], gf);
    unpack8(pu[s], uf);
    const int k0 = s * 256 + lane * 8;
    unpack8(__ldg(reinterpret_cast<const uint4*>(nw + k0)), nf);
    const float4* xq = reinterpret_cast<const float4*>(xr + k0);
    const float4 xa = xq[0], xb = xq[1];
    const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const float xn = xv[t] * nf[t];
      g += gf[t] * xn;
      u += uf[t] * xn;
    }
  }
  g = warp_sum(g) * inv;
  u = warp_sum(u) * inv;
  if (lane == 0) h[(size_t)a * I + i] = g / (1.f + __expf(-g)) * u;
}

// Block (place p, feature tile) of a window already routed (idx [R, K] from route_topk, A = R K <= 256
// assignments): the assignments are taken in order of expert, and block (p, tile) computes the one at place
// p of that order. Assignments that share an expert so run side by side, and all but the first find its
// weights in L2: a window of 8 rows (about 54 distinct experts in 64 assignments) reads each expert from
// memory about once. Routing outside the kernel also spares every block the ranking of all E experts
// before its first weight load. Each assignment's sums do not depend on the window (batch invariance).
// KEEP: fill [E] and slot_gu [C] (the slots' gate/up addresses) as the header says.
template <int H, int I, bool KEEP = false>
__global__ void __launch_bounds__(256) moe_gate_up(const unsigned long long* __restrict__ GUp,
                                                    const float* __restrict__ x, const half* __restrict__ nw,
                                                    const int* __restrict__ idx, int A, int topk, float eps,
                                                    float* __restrict__ h, const int* __restrict__ slot_of,
                                                    float* __restrict__ counts, float* __restrict__ misses,
                                                    const int* __restrict__ fill = nullptr,
                                                    const unsigned long long* __restrict__ slot_gu = nullptr) {
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  __shared__ int at, ids[256];
  __shared__ unsigned long long bases[256], keeps[KEEP ? 256 : 1];
  __shared__ float inv[1];
  __shared__ float part[8];
  // A one-row window's blocks all read row 0: its loads for the norm go out first, beside the routing's and
  // the chosen experts' addresses, so the block waits on one round trip for all three. The sums are those of
  // block_inv_rms<1, H> (each thread's k in order, the warp, then the warps in order).
  const bool one_row = A == topk;
  constexpr int XS = H / 256;
  float xv[XS];
  if (one_row)
#pragma unroll
    for (int k = 0; k < XS; ++k) xv[k] = x[threadIdx.x + 256 * k];
  if (threadIdx.x < A) {
    const int e = idx[threadIdx.x];
    ids[threadIdx.x] = e;
    bases[threadIdx.x] = GUp[e];
    if (KEEP) {
      const int f = fill[e];
      keeps[threadIdx.x] = f >= 0 ? slot_gu[f] : 0ull;
    }
  }
  if (one_row) {
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < XS; ++k) ss += xv[k] * xv[k];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  }
  __syncthreads();
  if (one_row && threadIdx.x == 0) {
    float t = 0.f;
    for (int w = 0; w < 8; ++w) t += part[w];
    inv[0] = rsqrtf(t / H + eps);
  }
  if (threadIdx.x < A) {  // the assignment's place in (expert, assignment) order
    const int e = ids[threadIdx.x];
    int place = 0;
    for (int b = 0; b < A; ++b) {
      const int o = ids[b];
      place += (o < e) || (o == e && b < (int)threadIdx.x);
    }
    if (place == blockIdx.x) at = threadIdx.x;
  }
  __syncthreads();
  const int a = at, r = a / topk, sel = ids[a];
  if (!one_row) block_inv_rms<1, H>(x + (size_t)r * H, eps, inv);
  if (blockIdx.y == 0 && threadIdx.x == 0) count_assignment(sel, slot_of, counts, misses);
  const int i = blockIdx.y * 8 + (threadIdx.x >> 5);
  if (i >= I) return;
  gate_up_feature<H, I, KEEP>(reinterpret_cast<const half*>(bases[a]), x + (size_t)r * H, nw, inv[0], a, i, h,
                              KEEP ? reinterpret_cast<half*>(keeps[KEEP ? a : 0]) : nullptr);
}

// warm_lines lines of 128 bytes from warm brought into L2, kept there ahead of lines loaded without a hint,
// one line per thread of the grid in turn (moe_down's ``warm``).
__device__ __forceinline__ void warm_l2(const char* warm, int warm_lines) {
  const int threads = gridDim.x * blockDim.x;
  for (int line = blockIdx.x * blockDim.x + threadIdx.x; line < warm_lines; line += threads)
    asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(warm + ((size_t)line << 7)));
}

// Blocks of moe_down an SM should hold, for its launch bounds: 2 where a lane's K I / 256 loads of 16 bytes
// fit in registers beside the rest (at most 128 a thread). Without the bound ptxas places most loads beside
// their first use (58 registers at the 30B preset's widths), so a lane has only a few in flight and at one
// row the kernel waits on memory latency (docs/PERFORMANCE.md, "What limits the routed experts"). 0 (no
// bound) where the loads would not fit.
__host__ __device__ constexpr int moe_down_blocks(int I, int K) { return K * (I / 256) <= 24 ? 2 : 0; }

// resid[r, n] += sum_j wts[r, j] * (down[idx[r, j], n, :] . h[r * K + j, :]), j in a fixed order. One warp
// per (r, n). The source loads the rows of all K experts before using any; where `moe_down_blocks` bounds the
// kernel, ptxas keeps that order, so they are all in flight together.
// KEEP: fill [E] and slot_dn [C] (the slots' down addresses) as the header says; the rows read of an expert
// being kept are written into its slot.
// WARM (`L2Warm` in choices.py): 0, none (warm and warm_lines unused); 1, the warm_lines lines of 128 bytes at
// warm that the next kernels read are brought into L2 by the grid's threads, one line each in turn, once the
// block's own weight loads are out; 2, the same before the programmatic-launch wait. It changes no value,
// only where the next kernels find their weights.
template <int H, int I, int K, bool KEEP = false, int WARM = 0>
__global__ void __launch_bounds__(256, moe_down_blocks(I, K))
    moe_down(const unsigned long long* __restrict__ Dp, const float* __restrict__ h, const int* __restrict__ idx,
             const float* __restrict__ wts, int R, float* __restrict__ resid, const int* __restrict__ fill,
             const unsigned long long* __restrict__ slot_dn, const char* __restrict__ warm, int warm_lines) {
  STRATA_PDL_LAUNCH();
  if (WARM == 2) warm_l2(warm, warm_lines);
  STRATA_PDL_WAIT();
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (warp >= R * H) {
    if (WARM == 1) warm_l2(warm, warm_lines);
    return;
  }
  const int r = warp / H, n = warp % H;
  constexpr int STEPS = I / 256;
  uint4 pk[K][STEPS];
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const uint4* w = reinterpret_cast<const uint4*>(reinterpret_cast<const half*>(Dp[idx[r * K + j]]) +
                                                    (size_t)n * I);
#pragma unroll
    for (int s = 0; s < STEPS; ++s) pk[j][s] = __ldg(w + s * 32 + lane);
  }
  if (WARM == 1) warm_l2(warm, warm_lines);
  if (KEEP) {
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const int f = fill[idx[r * K + j]];
      if (f < 0) continue;
      uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<half*>(slot_dn[f]) + (size_t)n * I);
#pragma unroll
      for (int s = 0; s < STEPS; ++s) dst[s * 32 + lane] = pk[j][s];
    }
  }
  float total = 0.f;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    float acc = 0.f;
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      float wf[8];
      unpack8(pk[j][s], wf);
      const float4* hr = reinterpret_cast<const float4*>(h + (size_t)(r * K + j) * I + s * 256 + lane * 8);
      const float4 p = hr[0], q = hr[1];
      const float hv[8] = {p.x, p.y, p.z, p.w, q.x, q.y, q.z, q.w};
#pragma unroll
      for (int t = 0; t < 8; ++t) acc += wf[t] * hv[t];
    }
    total += wts[r * K + j] * warp_sum(acc);
  }
  if (lane == 0) resid[(size_t)r * H + n] += total;
}

// Any H, I (small models): the same contracts with routing inside (block (feature tile, assignment) routes
// its own row and writes idx and wts from tile 0), scalar loads.
__global__ void __launch_bounds__(256) moe_gate_up_any(const unsigned long long* __restrict__ GUp,
                                                        const float* __restrict__ x, const half* __restrict__ nw,
                                                        const float* __restrict__ logits, int E, int topk,
                                                        int norm_topk, float eps, int H, int I,
                                                        float* __restrict__ h, int* __restrict__ idx,
                                                        float* __restrict__ wts, const int* __restrict__ slot_of,
                                                        float* __restrict__ counts, float* __restrict__ misses,
                                                        const int* __restrict__ fill,
                                                        const unsigned long long* __restrict__ slot_gu) {
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  __shared__ int sel;
  __shared__ float weight, part[8];
  const int a = blockIdx.y, r = a / topk, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  block_route(logits + (size_t)r * E, E, topk, a % topk, norm_topk, &sel, &weight);
  const float* xr = x + (size_t)r * H;
  float ss = 0.f;
  for (int k = threadIdx.x; k < H; k += blockDim.x) ss += xr[k] * xr[k];
  ss = warp_sum(ss);
  if (lane == 0) part[warp] = ss;
  __syncthreads();
  float tot = 0.f;
  for (int w = 0; w < 8; ++w) tot += part[w];
  const float inv = rsqrtf(tot / H + eps);
  if (blockIdx.x == 0 && threadIdx.x == 0) note_route(a, sel, weight, idx, wts, slot_of, counts, misses);
  const int i = blockIdx.x * 8 + warp;
  if (i >= I) return;
  const half* base = reinterpret_cast<const half*>(GUp[sel]);
  const int f = fill != nullptr ? fill[sel] : -1;
  half* keep = f >= 0 ? reinterpret_cast<half*>(slot_gu[f]) : nullptr;
  float g = 0.f, u = 0.f;
  for (int k = lane; k < H; k += 32) {
    const float xn = xr[k] * __half2float(nw[k]);
    const half wg = base[(size_t)i * H + k], wu = base[(size_t)(I + i) * H + k];
    if (keep != nullptr) {
      keep[(size_t)i * H + k] = wg;
      keep[(size_t)(I + i) * H + k] = wu;
    }
    g += __half2float(wg) * xn;
    u += __half2float(wu) * xn;
  }
  g = warp_sum(g) * inv;
  u = warp_sum(u) * inv;
  if (lane == 0) h[(size_t)a * I + i] = g / (1.f + __expf(-g)) * u;
}

__global__ void moe_down_any(const unsigned long long* __restrict__ Dp, const float* __restrict__ h,
                             const int* __restrict__ idx, const float* __restrict__ wts, int R, int topk, int H,
                             int I, float* __restrict__ resid, const int* __restrict__ fill,
                             const unsigned long long* __restrict__ slot_dn) {
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (warp >= R * H) return;
  const int r = warp / H, n = warp % H;
  float total = 0.f;
  for (int j = 0; j < topk; ++j) {
    const int a = r * topk + j;
    const half* w = reinterpret_cast<const half*>(Dp[idx[a]]) + (size_t)n * I;
    const int f = fill != nullptr ? fill[idx[a]] : -1;
    half* keep = f >= 0 ? reinterpret_cast<half*>(slot_dn[f]) + (size_t)n * I : nullptr;
    float acc = 0.f;
    for (int k = lane; k < I; k += 32) {
      const half wk = w[k];
      if (keep != nullptr) keep[k] = wk;
      acc += __half2float(wk) * h[(size_t)a * I + k];
    }
    total += wts[a] * warp_sum(acc);
  }
  if (lane == 0) resid[(size_t)r * H + n] += total;
}

// out[r, i] = silu(gu[r, i]) * gu[r, I + i]: the SwiGLU of a dense MLP or shared expert.
__global__ void silu_mul(const float* __restrict__ gu, float* __restrict__ out, int R, int I) {
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= R * I) return;
  const int r = i / I, c = i % I;
  const float g = gu[(size_t)r * 2 * I + c];
  out[i] = g / (1.f + __expf(-g)) * gu[(size_t)r * 2 * I + I + c];
}

// resid[r, n] += scale(r) * y[r, n]; scale is sigmoid(gate[r]) when gate is given (the shared expert), else 1.
__global__ void add_scaled(float* __restrict__ resid, const float* __restrict__ y, const float* __restrict__ gate,
                           int R, int H) {
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= R * H) return;
  const float s = gate == nullptr ? 1.f : 1.f / (1.f + __expf(-gate[i / H]));
  resid[i] += s * y[i];
}
