// Part of kernels.cu, which includes it (NVRTC compiles kernels.cu as one unit): decode attention.

// ---- decode attention (split over position chunks, one kernel) ----------------------------------------
// Block (r, kv head, chunk c) of B threads handles positions [c*C, c*C + C) of slot[r] for the G query
// heads of that KV head: an unnormalised partial result with its max and sum (flash-decoding). Splitting
// positions over blocks keeps the GPU busy for a handful of rows. The partials are merged in the same
// kernel, by the blocks that finish last (a counter per merge, which that block sets back to zero), so one
// kernel does what a partial and a combine kernel did, without the second launch and its wait:
// * a row of at most ATTN_MERGE_GROUP live chunks: the last of its blocks to finish merges them all;
// * a longer row: the chunks are merged in groups of ATTN_MERGE_GROUP consecutive chunks, each by the last
//   of its group to finish, into one partial of the same form (kept in the scratch of the group's first
//   chunk), and the last group to finish merges the groups. A merge thus reads at most a few dozen partials,
//   not one per 64 positions of a 32k context, and the groups merge in parallel.
// The grouping depends only on the row's position, so a row's result does not depend on the window.
// A block's time is the length of its threads' chains of dependent arithmetic (all G heads over C
// positions), so a window of one or two rows takes B = 256, and more rows, whose blocks fill the GPU, take
// B = 128. Both sum in one order, fixed by W "canonical" warps (the partial sums of a B = 32 W block): with
// B = 128 and W = 8 a thread does the work of two threads of the 256-thread block, one after the other, so
// a row's result is the same bit for bit whichever B its window took. (W = 4 at head dim 16, and where the
// shared memory of 8 warps' sums does not fit: those shapes run at 128 threads only.)
// Scratch layout: acc [R, NKV, NC, G, D], ml [R, NKV, NC, G, 2]; done [R, NKV, 1 + ceil(NC / ATTN_MERGE_GROUP)]
// int (the row's merge, then each group's), zero between launches.
constexpr int ATTN_CHUNK = 64;
constexpr int ATTN_MERGE_GROUP = 16;

// Merge `count` partials of one (row, KV head), at chunk slots first, first + stride, ... of acc [NC, G, D] and
// ml [NC, G, 2] (read through L2: other blocks wrote them), in that order: M = max m, L = sum l e^(m - M), and
// per element sum acc e^(m - M), each term divided by L when FINAL (into out [G D]), else kept as a partial of
// the same form in slot `first` (acc, then M and L). Block-wide; `red` is shared memory of CAP + 2 G floats.
template <int G, int D, int B, bool FINAL>
__device__ __forceinline__ void attn_merge(float* acc, float* ml, int first, int stride, int count, float* red,
                                           int cap, float* __restrict__ out) {
  constexpr int PER = (G * D + B - 1) / B;  // elements per thread
  // Partials are loaded MC at a time (32 registers a thread), so the merge waits on one round trip to L2 per
  // MC of them; the first MC go out before the statistics below.
  constexpr int MC = PER >= 32 ? 1 : 32 / PER;
  const int tid = threadIdx.x;
  float* stat = red + cap;  // [G, 2]: each head's M and total
  float v[MC][PER];
#pragma unroll
  for (int cc = 0; cc < MC; ++cc)
#pragma unroll
    for (int c = 0; c < PER; ++c)
      v[cc][c] = cc < count && c * B + tid < G * D
                     ? __ldcg(acc + (size_t)(first + cc * stride) * G * D + c * B + tid)
                     : 0.f;
  // The partials' maxima and totals [count, G, 2], staged in shared memory when they fit (up to cap / 2G
  // partials), else read through L2 where they lie.
  const bool staged = count * G * 2 <= cap;
  if (staged)
    for (int i = tid; i < count * G * 2; i += B) {
      const int cc = i / (G * 2), j = i % (G * 2);
      red[i] = __ldcg(ml + (size_t)(first + cc * stride) * G * 2 + j);
    }
  __syncthreads();
  auto mlv = [&](int cc, int g, int k) {
    return staged ? red[(cc * G + g) * 2 + k] : __ldcg(ml + ((size_t)(first + cc * stride) * G + g) * 2 + k);
  };
  if (tid < G) {
    const int g = tid;
    float m = -STRATA_INF;
    for (int cc = 0; cc < count; ++cc) m = fmaxf(m, mlv(cc, g, 0));
    float l = 0.f;
    for (int cc = 0; cc < count; ++cc) l += mlv(cc, g, 1) * __expf(mlv(cc, g, 0) - m);
    stat[g * 2] = m;
    stat[g * 2 + 1] = l;
  }
  __syncthreads();
  float a[PER];
#pragma unroll
  for (int c = 0; c < PER; ++c) a[c] = 0.f;
  for (int c0 = 0; c0 < count; c0 += MC) {
    if (c0 > 0)
#pragma unroll
      for (int cc = 0; cc < MC; ++cc)
#pragma unroll
        for (int c = 0; c < PER; ++c)
          v[cc][c] = c0 + cc < count && c * B + tid < G * D
                         ? __ldcg(acc + (size_t)(first + (c0 + cc) * stride) * G * D + c * B + tid)
                         : 0.f;
#pragma unroll
    for (int cc = 0; cc < MC; ++cc) {
      if (c0 + cc >= count) break;
#pragma unroll
      for (int c = 0; c < PER; ++c) {
        const int g = min((c * B + tid) / D, G - 1);
        const float w = __expf(mlv(c0 + cc, g, 0) - stat[g * 2]);
        a[c] += v[cc][c] * (FINAL ? w / stat[g * 2 + 1] : w);
      }
    }
  }
  if (FINAL) {
#pragma unroll
    for (int c = 0; c < PER; ++c)
      if (c * B + tid < G * D) out[c * B + tid] = a[c];
    return;
  }
  // A group's partial into its first chunk's slot: each thread read that slot's elements it now writes, and
  // the statistics were all read before the barrier above (or, not staged, are read again below: barrier).
  __syncthreads();
  float* dst = acc + (size_t)first * G * D;
#pragma unroll
  for (int c = 0; c < PER; ++c)
    if (c * B + tid < G * D) dst[c * B + tid] = a[c];
  if (tid < G) {
    float* dml = ml + (size_t)first * G * 2;
    dml[tid * 2] = stat[tid * 2];
    dml[tid * 2 + 1] = stat[tid * 2 + 1];
  }
}

// The merges of a row longer than ATTN_MERGE_GROUP chunks, for chunk c's block once its partial is written:
// the last of its group to finish merges the group, and the last group the groups (`attn_merge`). Not
// inlined, so that the short rows' path keeps its registers and code.
// `red` is shared memory of cap + 2 G floats.
template <int G, int D, int B>
__device__ __noinline__ void attn_merge_grouped(float* accr, float* mlr, int c, int live, int* counters,
                                                float* red, int cap, int* last, float* out) {
  const int grp = c / ATTN_MERGE_GROUP, first = grp * ATTN_MERGE_GROUP;
  if (!last_to_finish(counters + 1 + grp, min(ATTN_MERGE_GROUP, live - first), last)) return;
  attn_merge<G, D, B, false>(accr, mlr, first, 1, min(ATTN_MERGE_GROUP, live - first), red, cap, nullptr);
  const int groups = (live + ATTN_MERGE_GROUP - 1) / ATTN_MERGE_GROUP;
  if (last_to_finish(counters, groups, last))
    attn_merge<G, D, B, true>(accr, mlr, 0, ATTN_MERGE_GROUP, groups, red, cap, out);
}

template <int D, int G, int B, int W>
__global__ void __launch_bounds__(B) attn_split(const float* __restrict__ q, const half* __restrict__ kc,
                                                 const half* __restrict__ vc, const int* __restrict__ pos,
                                                 const int* __restrict__ slot, float* __restrict__ part_acc,
                                                 float* __restrict__ part_ml, int* __restrict__ done,
                                                 float* __restrict__ out, int NKV, int T, int NC, float scale) {
  // DG 16-byte pieces of a head; TP threads per position for the scores. A score is the sum of QP partial
  // sums, partial p over pieces p, p + QP, ... in order, added as ((P0 + P1) + (P2 + P3)); a thread holds
  // PT of them. P @ V sums QG position groups, group g over positions g, g + QG, ... in order; a warp holds
  // 32 / DG of them (summed by shuffles) and the block's W canonical warps are summed in order.
  constexpr int C = ATTN_CHUNK, DG = D / 8, TP = B / C, QP = DG < 4 ? DG : 4, PT = QP / TP;
  constexpr int PG = B / DG, QG = W * 32 / DG, PASSES = W / (B / 32), NV = C / QG, NK = DG / QP;
  static_assert(D >= 16 && D <= 256 && (DG & (DG - 1)) == 0, "head dim must be 16, 32, 64, 128 or 256");
  static_assert((B == 128 || B == 256) && TP <= QP && PASSES >= 1 && PASSES * (B / 32) == W && C % QG == 0,
                "unsupported block shape");
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  __shared__ float qs[G * D];
  __shared__ float sc[G * C];
  __shared__ float red[W * G * D];
  __shared__ int last;
  const int r = blockIdx.x, kvh = blockIdx.y, c = blockIdx.z, tid = threadIdx.x, NQ = NKV * G;
  const int n = pos[r] + 1, t0 = c * C;
  if (t0 >= n) return;  // past this row's position: neither counted nor merged
  const int tn = min(C, n - t0), live = (n + C - 1) / C;
  const size_t base = ((size_t)slot[r] * NKV + kvh) * T * D + (size_t)t0 * D;
  // The key pieces of this thread's partials, loaded first so that they are in flight while q is staged in
  // shared memory: partial part * PT + i takes pieces m QP + part PT + i (neighbouring threads' q values then
  // lie in different shared-memory banks).
  const int t = tid / TP, part = tid % TP;
  uint4 kr[PT][NK];
  if (t < tn) {
    const uint4* ks = reinterpret_cast<const uint4*>(kc + base + (size_t)t * D);
#pragma unroll
    for (int i = 0; i < PT; ++i)
#pragma unroll
      for (int m = 0; m < NK; ++m) kr[i][m] = ks[m * QP + part * PT + i];
  }
  // The values this thread sums in P @ V (below), loaded now so that they too are in flight while q is staged
  // and the scores are computed: in pass ps, thread (pg, dg) takes group ps PG + pg's positions, dims
  // [dg*8, dg*8 + 8).
  const int dg = tid % DG, pg = tid / DG;
  uint4 vr[PASSES][NV];
#pragma unroll
  for (int ps = 0; ps < PASSES; ++ps)
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int tv = ps * PG + pg + j * QG;
      if (tv < tn) vr[ps][j] = *reinterpret_cast<const uint4*>(vc + base + (size_t)tv * D + dg * 8);
    }
  constexpr int PER = (G * D + B - 1) / B;  // q values (and merged outputs) per thread
#pragma unroll
  for (int c = 0; c < PER; ++c)
    if (c * B + tid < G * D) qs[c * B + tid] = q[((size_t)r * NQ + kvh * G) * D + c * B + tid] * scale;
  __syncthreads();
  {
    float s[PT][G];
#pragma unroll
    for (int i = 0; i < PT; ++i)
#pragma unroll
      for (int g = 0; g < G; ++g) s[i][g] = 0.f;
    if (t < tn) {
#pragma unroll
      for (int m = 0; m < NK; ++m)
#pragma unroll
        for (int i = 0; i < PT; ++i) {
          float kf[8];
          unpack8(kr[i][m], kf);
#pragma unroll
          for (int g = 0; g < G; ++g) {
            const float* qg = qs + g * D + (m * QP + part * PT + i) * 8;
#pragma unroll
            for (int j = 0; j < 8; ++j) s[i][g] += qg[j] * kf[j];
          }
        }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float v = PT == 2 ? s[0][g] + s[PT - 1][g] : s[0][g];
#pragma unroll
      for (int o = 1; o < TP; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (part == 0) sc[g * C + t] = t < tn ? v : -STRATA_INF;
    }
  }
  __syncthreads();
  // Softmax statistics of the chunk: one warp per head.
  const int warp = tid >> 5, lane = tid & 31;
  float* ml = part_ml + (((size_t)r * NKV + kvh) * NC + c) * G * 2;
  for (int g = warp; g < G; g += B / 32) {
    float m = fmaxf(sc[g * C + lane], sc[g * C + lane + 32]);
    m = warp_max(m);
    const float p0 = __expf(sc[g * C + lane] - m), p1 = __expf(sc[g * C + lane + 32] - m);
    sc[g * C + lane] = p0;
    sc[g * C + lane + 32] = p1;
    const float l = warp_sum(p0 + p1);
    if (lane == 0) { ml[g * 2] = m; ml[g * 2 + 1] = l; }
  }
  __syncthreads();
  // P @ V: one 16-byte V load serves 8 dims of G heads. A pass's position groups are summed inside each warp
  // with shuffles; the canonical warp ps (B / 32) + warp keeps the sums in shared memory.
#pragma unroll
  for (int ps = 0; ps < PASSES; ++ps) {
    float acc[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int tv = ps * PG + pg + j * QG;
      if (tv >= tn) break;
      float vf[8];
      unpack8(vr[ps][j], vf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = sc[g * C + tv];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] += p * vf[e];
      }
    }
#pragma unroll
    for (int o = DG; o < 32; o <<= 1)
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] += __shfl_xor_sync(0xffffffffu, acc[g][j], o);
    if (lane < DG)
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int j = 0; j < 8; ++j) red[((ps * (B / 32) + warp) * G + g) * D + dg * 8 + j] = acc[g][j];
  }
  __syncthreads();
  float* dst = part_acc + (((size_t)r * NKV + kvh) * NC + c) * G * D;
  for (int i = tid; i < G * D; i += B) {
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) a += red[w * G * D + i];
    dst[i] = a;
  }

  const int groups = (NC + ATTN_MERGE_GROUP - 1) / ATTN_MERGE_GROUP;
  int* const counters = done + ((size_t)r * NKV + kvh) * (1 + groups);  // the row's merge, then each group's
  if (live > ATTN_MERGE_GROUP) {
    attn_merge_grouped<G, D, B>(part_acc + ((size_t)r * NKV + kvh) * NC * G * D,
                                part_ml + ((size_t)r * NKV + kvh) * NC * G * 2, c, live, counters, red,
                                W * G * D - 2 * G, &last, out + (size_t)r * NQ * D + (size_t)kvh * G * D);
    return;
  }
  if (!last_to_finish(counters, live, &last)) return;
  // The merge: out[r, (kvh*G + g)*D + d] = sum_c acc_c e^(m_c - M) / sum_c l_c e^(m_c - M), chunks in order.
  // Other blocks' partials are read through L2 (__ldcg). It is `attn_merge`'s arithmetic, written out here
  // as it was before long rows merged in groups: a form that merged these rows through `attn_merge` too
  // (every merge inlined) ran the short rows' step 2.5-3.8% slower on an H200.
  const float* mlr = part_ml + ((size_t)r * NKV + kvh) * NC * G * 2;
  const float* accr = part_acc + ((size_t)r * NKV + kvh) * NC * G * D;
  // The first MC chunks' partial sums (32 registers a thread) are loaded now, together and before the
  // statistics below, so that the merge waits on one round trip to L2 for them instead of one per chunk;
  // later chunks (contexts past MC * ATTN_CHUNK positions) are loaded one chunk at a time.
  constexpr int MC = PER >= 32 ? 1 : 32 / PER;
  float early[MC][PER];
#pragma unroll
  for (int cc = 0; cc < MC; ++cc)
#pragma unroll
    for (int c = 0; c < PER; ++c)
      early[cc][c] = cc < live && c * B + tid < G * D ? __ldcg(accr + (size_t)cc * G * D + c * B + tid) : 0.f;
  // The chunks' maxima and totals [live, G, 2] are staged in shared memory when they fit, as the at most
  // ATTN_MERGE_GROUP chunks merged here do at every head shape taken, and read through L2 otherwise.
  constexpr int CAP = W * G * D - 2 * G;
  float* stat = red + CAP;  // [G, 2]: each head's M and total
  const bool staged = live * G * 2 <= CAP;
  if (staged)
    for (int i = tid; i < live * G * 2; i += B) red[i] = __ldcg(mlr + i);
  const float* mls = staged ? red : mlr;
  __syncthreads();
  if (tid < G) {
    const int g = tid;
    float m = -STRATA_INF;
    for (int cc = 0; cc < live; ++cc) m = fmaxf(m, mls[(cc * G + g) * 2]);
    float l = 0.f;
    for (int cc = 0; cc < live; ++cc) l += mls[(cc * G + g) * 2 + 1] * __expf(mls[(cc * G + g) * 2] - m);
    stat[g * 2] = m;
    stat[g * 2 + 1] = l;
  }
  __syncthreads();
  float a[PER];
#pragma unroll
  for (int c = 0; c < PER; ++c) a[c] = 0.f;
#pragma unroll
  for (int cc = 0; cc < MC; ++cc) {
    if (cc >= live) break;
#pragma unroll
    for (int c = 0; c < PER; ++c) {
      const int g = min((c * B + tid) / D, G - 1);
      a[c] += early[cc][c] * (__expf(mls[(cc * G + g) * 2] - stat[g * 2]) / stat[g * 2 + 1]);
    }
  }
  for (int cc = MC; cc < live; ++cc) {
    float v[PER];
#pragma unroll
    for (int c = 0; c < PER; ++c) v[c] = c * B + tid < G * D ? __ldcg(accr + (size_t)cc * G * D + c * B + tid) : 0.f;
#pragma unroll
    for (int c = 0; c < PER; ++c) {
      const int g = min((c * B + tid) / D, G - 1);
      a[c] += v[c] * (__expf(mls[(cc * G + g) * 2] - stat[g * 2]) / stat[g * 2 + 1]);
    }
  }
#pragma unroll
  for (int c = 0; c < PER; ++c)
    if (c * B + tid < G * D) out[(size_t)r * NQ * D + (size_t)kvh * G * D + c * B + tid] = a[c];
}

// ---- decode attention on tensor cores ------------------------------------------------------------------
// attn_tc computes what attn_split does (each row's causal attention over positions 0..pos[r] of its slot,
// partials merged by the blocks that finish last, in the same scratch and counters), for head dims up to 128
// and up to 16 query heads per KV head, with its products on tensor cores and a long row streamed:
// * Block (r, kvh, s) of 4 warps takes `per` consecutive chunks of ATTN_CHUNK positions of row r: a row of
//   up to `one_run_chunks` chunks is one run (one block, no partials, no merge), a row of up to
//   `short_chunks` splits into at most `short_splits` runs (per = ceil(chunks / short_splits)), a longer
//   one into at most `splits` (per = ceil(chunks / splits)). A row thus has at most `splits`
//   partials (short_splits <= splits), whose slots in the scratch are NC apart (NC >= min(chunks of the
//   context, splits)), and the grid at most `splits` blocks a row and KV head, however long the context. A
//   block streams its chunks: K and V of chunk j + 1 land in shared memory (cp.async) while chunk j is
//   computed. The split depends only on the row's position and the three counts (choices.py's, the same for
//   every window), so a row's result does not depend on its window.
// * The G query heads of the KV head are the 16 rows of an m16n8k16 product (rows past G are zero), and
//   warp w takes keys [16 w, 16 w + 16) of each chunk: S = q K^T with q scaled into base 2 and split into
//   two fp16 parts (hi + lo, about 22 bits of q), an online softmax per head, and O += P V with P split the
//   same way, all accumulated in fp32. The 4 warps' maxima, totals and O merge in shared memory, in warp
//   order, into the block's partial in attn_split's form (natural-log maxima).
// * A row of one run writes its output directly; otherwise the partials merge as attn_split's chunks do
//   (`attn_merge`; in groups of ATTN_MERGE_GROUP past that many).
// Fragment layouts are flash.cu's (mma.m16n8k16, lane = 4 gq + tq); K is read with ldmatrix (B = K^T) and V
// with ldmatrix.trans (B = V) from rows padded to D + 8 halves.
// Grid (R, NKV, min(NC, splits)), 128 threads, `attention_tc_shared_bytes(D, G)` of dynamic shared memory (two
// buffers of K and V tiles [ATTN_CHUNK, D + 8] fp16, then q's two parts [G + 1, D + 8] fp16).
namespace attn_tc_ops {

using namespace tensor_core;

// (x0, x1) as two half2s, hi = fp16(x) and lo = fp16(x - hi), lower column in the low 16 bits.
__device__ __forceinline__ void split_half2(float x0, float x1, unsigned& hi, unsigned& lo) {
  const half2 h = __floats2half2_rn(x0, x1);
  const half2 l = __floats2half2_rn(x0 - __low2float(h), x1 - __high2float(h));
  hi = *reinterpret_cast<const unsigned*>(&h);
  lo = *reinterpret_cast<const unsigned*>(&l);
}

// Positions [t0, t0 + ATTN_CHUNK) of a [T, D] fp16 matrix into the padded shared tile at dst; positions at or
// past `end` are zeros (the cache there may hold anything, and 0 * NaN would poison P V).
template <int D>
__device__ __forceinline__ void load_chunk(unsigned dst, const half* __restrict__ src, int t0, int end) {
  constexpr int LD = D + 8, CH = D / 8;
#pragma unroll
  for (int i = threadIdx.x; i < ATTN_CHUNK * CH; i += 128) {
    const int row = i / CH, col = (i % CH) * 8;
    const bool valid = t0 + row < end;
    cp_async16(dst + (row * LD + col) * 2, valid ? src + (size_t)(t0 + row) * D + col : src, valid);
  }
  cp_async_commit();
}

}  // namespace attn_tc_ops

// FEW only names a second instantiation for windows of few rows, compiled the same: ops.py gives it another
// preferred shared-memory carveout (`attention_tc_carveout`).
template <int D, int G, int FEW>
__global__ void __launch_bounds__(128) attn_tc(const float* __restrict__ q, const half* __restrict__ kc,
                                               const half* __restrict__ vc, const int* __restrict__ pos,
                                               const int* __restrict__ slot, float* __restrict__ part_acc,
                                               float* __restrict__ part_ml, int* __restrict__ done,
                                               float* __restrict__ out, int NKV, int T, int NC, int splits,
                                               int short_splits, int short_chunks, int one_run_chunks,
                                               float scale_log2) {
  using namespace attn_tc_ops;
  static_assert(D % 16 == 0 && D <= 128 && G >= 1 && G <= 16, "head dim a multiple of 16 up to 128, G <= 16");
  constexpr int C = ATTN_CHUNK, LD = D + 8, KS = D / 16, DT = D / 8;
  constexpr int TILE = C * LD * 2, BUF = 2 * TILE;  // bytes: K (or V) of a chunk; K and V
  constexpr float LN2 = 0.69314718f;
  extern __shared__ __align__(16) unsigned char attn_tiles[];  // [2 buffers][K, V][C][LD], [2][G + 1][LD] fp16
  __shared__ int last;
  STRATA_PDL_LAUNCH();
  STRATA_PDL_WAIT();
  const int r = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z, NQ = NKV * G;
  const int n = pos[r] + 1, live = (n + C - 1) / C;
  const int most = live <= one_run_chunks ? 1 : live <= short_chunks ? short_splits : splits;  // runs, at most
  const int per = (live + most - 1) / most;
  const int used = (live + per - 1) / per;  // this row's partials
  if (n <= 0 || s >= used) return;
  const int c0 = s * per, c1 = min(c0 + per, live);
  const unsigned base = smem_addr(attn_tiles);
  const size_t head = ((size_t)slot[r] * NKV + kvh) * T * D;
  load_chunk<D>(base, kc + head, c0 * C, n);
  load_chunk<D>(base + TILE, vc + head, c0 * C, n);

  // q scaled into base 2 and split, [2 parts][G + 1 rows][LD] fp16 behind the tile buffers, read as A
  // fragments with ldmatrix at each step (rows are heads, columns dims); row G is zeros, which the lanes of
  // the product's rows past G read.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
  const float* qr = q + ((size_t)r * NQ + kvh * G) * D;
  unsigned* q_tile = reinterpret_cast<unsigned*>(attn_tiles + 2 * BUF);
  for (int i = threadIdx.x; i < (G + 1) * D / 2; i += 128) {
    const int row = i / (D / 2), col = (i % (D / 2)) * 2;
    const float2 v = row < G ? *reinterpret_cast<const float2*>(qr + (size_t)row * D + col) : make_float2(0.f, 0.f);
    split_half2(v.x * scale_log2, v.y * scale_log2, q_tile[(row * LD + col) / 2],
                q_tile[((G + 1 + row) * LD + col) / 2]);
  }
  float o[DT][4];
#pragma unroll
  for (int t = 0; t < DT; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float mx[2] = {-STRATA_INF, -STRATA_INF}, sum[2] = {0.f, 0.f};
  // ldmatrix rows of this lane: K as keys x dims (B = K^T), V as keys x dims with .trans (B = V).
  const int k_row = (lane & 7) + ((lane >> 4) << 3), k_col = ((lane >> 3) & 1) << 3;
  const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3), v_col = (lane >> 4) << 3;
  const unsigned k_lane = base + ((warp * 16 + k_row) * LD + k_col) * 2;
  const unsigned v_lane = base + TILE + ((warp * 16 + v_row) * LD + v_col) * 2;
  const unsigned q_lane = base + 2 * BUF + (min(v_row, G) * LD + v_col) * 2;  // q's rows addressed as V's
  for (int j = c0; j < c1; ++j) {
    const unsigned buf = ((j - c0) & 1) * BUF;
    if (j + 1 < c1) {
      load_chunk<D>(base + BUF - buf, kc + head, (j + 1) * C, n);
      load_chunk<D>(base + BUF - buf + TILE, vc + head, (j + 1) * C, n);
      cp_async_wait<2>();  // chunk j's two groups have landed
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    // S [16 heads x 16 keys] = (q_hi + q_lo) K^T, in two 8-key tiles.
    float sc[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) sc[h][0] = sc[h][1] = sc[h][2] = sc[h][3] = 0.f;
#pragma unroll
    for (int k = 0; k < KS; ++k) {
      unsigned qh[4], ql[4], b[4];  // b[0..1]: keys 0..7 of the warp's 16, b[2..3]: keys 8..15
      ldsm_x4(qh, q_lane + k * 32);
      ldsm_x4(ql, q_lane + (G + 1) * LD * 2 + k * 32);
      ldsm_x4(b, k_lane + buf + k * 32);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mma16816(sc[h], qh, b[2 * h], b[2 * h + 1]);
        mma16816(sc[h], ql, b[2 * h], b[2 * h + 1]);
      }
    }
    const int kb = j * C + warp * 16;  // the warp's first key
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (kb + h * 8 + 2 * tq + (e & 1) >= n) sc[h][e] = -STRATA_INF;
    // Online softmax per head (rows gq and gq + 8 of this lane; a head's keys span its quad's 4 lanes).
    unsigned ph[4], pl[4];  // P's A fragments (hi, lo)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      float m = fmaxf(mx[h2], fmaxf(fmaxf(sc[0][2 * h2], sc[0][2 * h2 + 1]), fmaxf(sc[1][2 * h2], sc[1][2 * h2 + 1])));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      const float ms = m == -STRATA_INF ? 0.f : m;  // a warp whose keys are all past the row stays at zero
      const float alpha = exp2f(mx[h2] - ms);       // 0 while nothing was seen; 1 when the max is unchanged
      mx[h2] = m;
      sum[h2] *= alpha;
#pragma unroll
      for (int t = 0; t < DT; ++t) {
        o[t][2 * h2] *= alpha;
        o[t][2 * h2 + 1] *= alpha;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float p0 = exp2f(sc[h][2 * h2] - ms), p1 = exp2f(sc[h][2 * h2 + 1] - ms);
        sum[h2] += p0 + p1;
        split_half2(p0, p1, ph[2 * h + h2], pl[2 * h + h2]);
      }
    }
    // O [16 heads x D] += P [16 x 16 keys] V [16 keys x D].
#pragma unroll
    for (int t = 0; t < DT; t += 2) {
      unsigned b[4];  // b[0..1]: dims t*8.., b[2..3]: dims t*8+8..
      ldsm_x4_trans(b, v_lane + buf + t * 16);
      mma16816(o[t], ph, b[0], b[1]);
      mma16816(o[t], pl, b[0], b[1]);
      mma16816(o[t + 1], ph, b[2], b[3]);
      mma16816(o[t + 1], pl, b[2], b[3]);
    }
    __syncthreads();  // every warp is done with this buffer before chunk j + 2 lands in it
  }
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    sum[h2] += __shfl_xor_sync(0xffffffffu, sum[h2], 1);
    sum[h2] += __shfl_xor_sync(0xffffffffu, sum[h2], 2);
  }

  // The warps' partials [4][G][D], maxima and totals [4][G], in the tile buffers (every warp is past them).
  float* wo = reinterpret_cast<float*>(attn_tiles);
  float* wm = wo + 4 * G * D;
  float* wl = wm + 4 * G;
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    const int row = gq + 8 * h2;
    if (row >= G) continue;
#pragma unroll
    for (int t = 0; t < DT; ++t)
      *reinterpret_cast<float2*>(wo + (warp * G + row) * D + t * 8 + 2 * tq) = make_float2(o[t][2 * h2], o[t][2 * h2 + 1]);
    if (tq == 0) {
      wm[warp * G + row] = mx[h2];
      wl[warp * G + row] = sum[h2];
    }
  }
  __syncthreads();
  float* accr = part_acc + ((size_t)r * NKV + kvh) * NC * G * D;
  float* mlr = part_ml + ((size_t)r * NKV + kvh) * NC * G * 2;
  float* outr = out + (size_t)r * NQ * D + (size_t)kvh * G * D;
  for (int i = threadIdx.x; i < G * D; i += 128) {
    const int g = i / D;
    float m = wm[g];
#pragma unroll
    for (int w = 1; w < 4; ++w) m = fmaxf(m, wm[w * G + g]);  // finite: warp 0 holds the block's first key
    float a = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float f = exp2f(wm[w * G + g] - m);
      a += wo[w * G * D + i] * f;
      l += wl[w * G + g] * f;
    }
    if (used == 1) {
      outr[i] = a / l;
    } else {
      accr[(size_t)s * G * D + i] = a;
      if (i % D == 0) {
        mlr[((size_t)s * G + g) * 2] = m * LN2;
        mlr[((size_t)s * G + g) * 2 + 1] = l;
      }
    }
  }
  if (used == 1) return;
  float* red = reinterpret_cast<float*>(attn_tiles);  // the merge's scratch: the tile buffers again
  constexpr int CAP = 2 * BUF / 4 - 2 * G;
  const int groups = (NC + ATTN_MERGE_GROUP - 1) / ATTN_MERGE_GROUP;
  int* const counters = done + ((size_t)r * NKV + kvh) * (1 + groups);  // the row's merge, then each group's
  if (used > ATTN_MERGE_GROUP) {
    attn_merge_grouped<G, D, 128>(accr, mlr, s, used, counters, red, CAP, &last, outr);
    return;
  }
  if (last_to_finish(counters, used, &last)) attn_merge<G, D, 128, true>(accr, mlr, 0, 1, used, red, CAP, outr);
}
