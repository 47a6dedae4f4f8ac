// Causal flash attention for long prefill chunks (FlashAttention-2 style, fp16 tensor cores, fp32 softmax).
//
// One block of 4 warps per (KV head, tile of BM = 64 WT flattened query rows). Flattened row m = i * G + g is
// query row i of the chunk (position pos0 + i) and query head kvh * G + g, so the G heads of one KV head share
// every K/V tile a block loads. Each warp owns WT tiles of 16 rows. With one tile its q fragments (hi and, if
// split, lo parts) stay in registers; with two, the block's q sits in shared memory and is read with
// ldmatrix at each step. Key tiles of BN positions stream through two shared buffers with cp.async: K and V
// of tile j + 1 load while tile j is computed. Per tile a warp computes S = q_hi K^T (+ q_lo K^T: two
// m16n8k16 MMAs per step into one fp32 accumulator when q is split), masks keys past each row's position
// (only in tiles that reach past the block's first row), updates the running max and sum, rescales its fp32
// output accumulator when some row of the warp has a new max, and adds P V with P rounded to fp16 straight
// from the score registers (the accumulator layout of S is the A-operand layout of P V). Tiles past the
// block's last row are never loaded. Rows are normalised and written as fp16 at the end.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .f16 inputs and .f32 accumulators; lane = 4 * gq + tq):
//   A (16x16, row-major): reg0 (row gq, cols 2tq..+1), reg1 (row gq+8, same cols), reg2 (row gq, cols
//     2tq+8..+9), reg3 (row gq+8, cols 2tq+8..+9).
//   B (16x8, column n contiguous in k): reg0 (k 2tq..+1, col gq), reg1 (k 2tq+8..+9, col gq).
//   C (16x8 fp32): c0, c1 (row gq, cols 2tq, 2tq+1), c2, c3 (row gq+8, same cols).
// K tiles are read with ldmatrix (rows = keys, so B = K^T), V tiles with ldmatrix.trans (rows = keys, so
// B = V). Shared rows are padded to D + 8 halves, which puts the 8 rows an ldmatrix reads in distinct banks.
// q from shared memory is read with ldmatrix as V is addressed, without .trans: A's four registers in order.
//
// Layouts: q_hi, q_lo, out [n, NQ, D] fp16; k_cache, v_cache [S, NKV, T, D] fp16, contiguous.

#include <cuda_fp16.h>
#include "tensor_core.cuh"

#define FLASH_NEG_INF __int_as_float(0xff800000)

namespace flash {

inline constexpr int WARPS = 4, THREADS = WARPS * 32;

using namespace tensor_core;

// Wait until at most one committed group is still in flight.
__device__ __forceinline__ void cp_async_wait_one() { cp_async_wait<1>(); }

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
  const half2 h = __floats2half2_rn(lo, hi);  // .x (lo) in the low 16 bits: the lower column
  return *reinterpret_cast<const unsigned*>(&h);
}

// Rows [0, BN) of a [T, D] fp16 matrix from row t0 into the padded shared tile at shared address dst; rows
// at or past `end` are zeros (the cache past the chunk may hold anything, and 0 * NaN would poison P V).
template <int D, int BN>
__device__ __forceinline__ void load_tile(unsigned dst, const half* __restrict__ src, int t0, int end) {
  constexpr int LD = D + 8, CH = D / 8;  // 16-byte chunks per row
#pragma unroll
  for (int c = threadIdx.x; c < BN * CH; c += THREADS) {
    const int r = c / CH, col = (c % CH) * 8;
    const bool valid = t0 + r < end;
    cp_async16(dst + (r * LD + col) * 2, valid ? src + (size_t)(t0 + r) * D + col : src, valid);
  }
}

}  // namespace flash

// The shape of one instantiation: head dim D, whether q arrives in two parts (SPLIT_Q: q_hi + q_lo, two
// products over the keys) or as q_hi alone, WT tiles of 16 rows per warp (BM = 64 WT rows per block) and BN
// keys per tile. A warp's rows share every K and V fragment it loads from shared memory, so WT = 2 halves
// the shared-memory reads per tensor-core product; its q fragments then come from shared memory each step
// instead of registers, which hold the two tiles' output accumulators.
// Grid (NKV, ceil(n G / BM)), THREADS threads, shared_bytes of dynamic shared memory. scale_log2 = scale *
// log2(e): softmax runs in base 2. With ``where`` set, the slot and first position are read from it
// ({slot, pos0}, device ints) instead of the arguments: a replayed graph reads each chunk's own.
template <int D, bool SPLIT_Q, int WT, int BN>
__global__ void __launch_bounds__(flash::THREADS, 2)
    flash_prefill(const half* __restrict__ q_hi, const half* __restrict__ q_lo, const half* __restrict__ kc,
                  const half* __restrict__ vc, half* __restrict__ out, int n, int NQ, int NKV, int G, int T,
                  int slot, int pos0, const int* __restrict__ where, float scale_log2) {
  using namespace flash;
  if (where != nullptr) {
    slot = where[0];
    pos0 = where[1];
  }
  static_assert(D % 16 == 0 && D <= 256, "head dim must be a multiple of 16, at most 256");
  static_assert((WT == 1 || WT == 2) && BN % 16 == 0, "one or two row tiles per warp, key tiles of 16s");
  constexpr int BM = WARPS * 16 * WT;  // flattened query rows per block
  constexpr int LD = D + 8;            // shared row stride in halves
  constexpr int KS = D / 16;           // k-steps of q K^T
  constexpr int NT = BN / 8;           // 8-key column tiles of S
  constexpr int DT = D / 8;            // 8-wide column tiles of the output
  constexpr int QP = SPLIT_Q ? 2 : 1;  // parts of q
  constexpr bool Q_SHARED = WT > 1;    // q fragments read from shared memory each step
  extern __shared__ __align__(16) half shared_tiles[];  // [2 buffers][K, V][BN][LD], then [QP][BM][LD]
  constexpr int BUF = 2 * BN * LD * 2;                  // bytes per buffer
  constexpr int TILE = BN * LD * 2;                     // bytes of K (or V) in a buffer
  const unsigned base = smem_addr(shared_tiles);

  const int kvh = blockIdx.x;
  const int m0 = (gridDim.y - 1 - blockIdx.y) * BM;  // the longest rows (most keys) start first
  const int rows = n * G;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;

  // This thread's rows (gq and gq + 8 of each of the warp's 16-row tiles): element offset in q/out, last
  // visible key.
  size_t off[WT][2];
  int lim[WT][2];
  bool live[WT][2];
#pragma unroll
  for (int u = 0; u < WT; ++u)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int m = m0 + (warp * WT + u) * 16 + gq + 8 * r, i = m / G;
      live[u][r] = m < rows;
      off[u][r] = live[u][r] ? ((size_t)i * NQ + kvh * G + (m - i * G)) * D : 0;
      lim[u][r] = pos0 + i;
    }

  // q fragments (A layout), zero for rows past the chunk: in registers, or (Q_SHARED) the block's q tile in
  // shared memory behind the K/V buffers, read with ldmatrix at every step.
  unsigned qf[Q_SHARED ? 1 : WT * QP][Q_SHARED ? 1 : KS][4];
  const unsigned q_tile = base + 2 * BUF;  // [QP][BM][LD]
  if constexpr (Q_SHARED) {
    constexpr int CH = D / 8;  // 16-byte chunks per row
    for (int c = threadIdx.x; c < QP * BM * CH; c += THREADS) {
      const int part = c / (BM * CH), rm = (c / CH) % BM, col = (c % CH) * 8, m = m0 + rm, i = m / G;
      const bool valid = m < rows;
      const half* src = part ? q_lo : q_hi;
      cp_async16(q_tile + ((part * BM + rm) * LD + col) * 2,
                 valid ? src + ((size_t)i * NQ + kvh * G + (m - i * G)) * D + col : src, valid);
    }
  } else {
#pragma unroll
    for (int f = 0; f < WT * QP; ++f)
#pragma unroll
      for (int k = 0; k < KS; ++k)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int u = f / QP, r = j & 1;
          const size_t at = off[u][r] + k * 16 + (j >> 1) * 8 + 2 * tq;
          qf[f][k][j] = live[u][r] ? *reinterpret_cast<const unsigned*>((f % QP ? q_lo : q_hi) + at) : 0u;
        }
  }

  const int last_row = min(n - 1, (m0 + BM - 1) / G);
  const int end = pos0 + last_row + 1;                // keys [0, end) are visible to some row of the block
  const int tiles = (end + BN - 1) / BN;
  const int mask_from = (pos0 + m0 / G + 1) / BN;     // earlier tiles are visible to every row of the block
  const size_t head = ((size_t)slot * NKV + kvh) * T * D;
  const half* kg = kc + head;
  const half* vg = vc + head;

  float o[WT][DT][4];
#pragma unroll
  for (int u = 0; u < WT; ++u)
#pragma unroll
    for (int t = 0; t < DT; ++t) o[u][t][0] = o[u][t][1] = o[u][t][2] = o[u][t][3] = 0.f;
  float mx[WT][2], sum[WT][2];
#pragma unroll
  for (int u = 0; u < WT; ++u) mx[u][0] = mx[u][1] = FLASH_NEG_INF, sum[u][0] = sum[u][1] = 0.f;

  // ldmatrix addresses: lane supplies one row of one of four 8x8 matrices (matrix lane / 8).
  const int k_row = (lane & 7) + ((lane >> 4) << 3), k_col = ((lane >> 3) & 1) << 3;  // K: keys x dims
  const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3), v_col = (lane >> 4) << 3;  // V, and q: rows x dims
  // This lane's row of buffer 0's K and V tiles and of its warp's first q tile; steps add constants.
  const unsigned k_lane = base + (k_row * LD + k_col) * 2;
  const unsigned v_lane = base + TILE + (v_row * LD + v_col) * 2;
  const unsigned q_lane = q_tile + ((warp * WT * 16 + v_row) * LD + v_col) * 2;

  // Tile j's K and V land in buffer j & 1 while tile j - 1 is computed from the other (the q tile lands
  // with tile 0).
  load_tile<D, BN>(base, kg, 0, end);
  load_tile<D, BN>(base + TILE, vg, 0, end);
  cp_async_commit();
  for (int j = 0; j < tiles; ++j) {
    const int t0 = j * BN;
    const unsigned buf = (j & 1) * BUF;  // this tile's buffer, as a byte offset
    if (j + 1 < tiles) {
      const unsigned next = base + (BUF - buf);
      load_tile<D, BN>(next, kg, t0 + BN, end);
      load_tile<D, BN>(next + TILE, vg, t0 + BN, end);
    }
    cp_async_commit();  // possibly empty, so that one wait count fits every tile
    cp_async_wait_one();  // tile j has landed
    __syncthreads();

    // S[16 WT x BN] = (q_hi + q_lo) K^T, or q_hi K^T, unscaled. With both parts, q_hi's product goes into
    // each accumulator first.
    float s[WT][NT][4];
#pragma unroll
    for (int u = 0; u < WT; ++u)
#pragma unroll
      for (int t = 0; t < NT; ++t) s[u][t][0] = s[u][t][1] = s[u][t][2] = s[u][t][3] = 0.f;
#pragma unroll
    for (int k = 0; k < KS; ++k) {
      unsigned qs[Q_SHARED ? WT * QP : 1][4];
      if constexpr (Q_SHARED) {
#pragma unroll
        for (int f = 0; f < WT * QP; ++f)
          ldsm_x4(qs[f], q_lane + (((f % QP) * BM + (f / QP) * 16) * LD + k * 16) * 2);
      }
#pragma unroll
      for (int t = 0; t < NT; t += 2) {
        unsigned b[4];  // b[0..1]: keys t*8.., b[2..3]: keys t*8+8..
        ldsm_x4(b, k_lane + buf + (t * 8 * LD + k * 16) * 2);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int f = 0; f < WT * QP; ++f) {
            if constexpr (Q_SHARED)
              mma16816(s[f / QP][t + h], qs[f], b[2 * h], b[2 * h + 1]);
            else
              mma16816(s[f / QP][t + h], qf[f][k], b[2 * h], b[2 * h + 1]);
          }
      }
    }
    if (j >= mask_from) {
#pragma unroll
      for (int u = 0; u < WT; ++u)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (t0 + t * 8 + 2 * tq + (e & 1) > lim[u][e >> 1]) s[u][t][e] = FLASH_NEG_INF;
    }

    // Online softmax per row; a row's max and sum are spread over the 4 lanes of its quad.
    float ms[WT][2], alpha[WT][2];
    bool moved = false;  // some row of this lane's has a new max
#pragma unroll
    for (int u = 0; u < WT; ++u)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float m = mx[u][r];
#pragma unroll
        for (int t = 0; t < NT; ++t) m = fmaxf(m, fmaxf(s[u][t][2 * r], s[u][t][2 * r + 1]));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        // Tile 0 holds key 0, visible to every row, so m is finite; the guard keeps exp2 of -inf - -inf out.
        ms[u][r] = m == FLASH_NEG_INF ? 0.f : m * scale_log2;
        alpha[u][r] = exp2f(mx[u][r] * scale_log2 - ms[u][r]);  // 0 on the first tile (mx = -inf)
        moved |= m != mx[u][r];
        mx[u][r] = m;
      }
    // Rescale the output only when some row of the warp has a new max: otherwise every alpha is 1 but for
    // the rounding residue of m * scale_log2 (the compiler may fuse it into the subtraction), so skipping
    // moves at most the output's last bits; past the first tiles of a long row most tiles move no row's max.
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int u = 0; u < WT; ++u)
#pragma unroll
        for (int t = 0; t < DT; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[u][t][e] *= alpha[u][e >> 1];
    }
    unsigned p[WT][BN / 16][4];  // P in A layout, one fragment per 16 keys
#pragma unroll
    for (int u = 0; u < WT; ++u)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        sum[u][r] *= alpha[u][r];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const float p0 = exp2f(s[u][t][2 * r] * scale_log2 - ms[u][r]);
          const float p1 = exp2f(s[u][t][2 * r + 1] * scale_log2 - ms[u][r]);
          sum[u][r] += p0 + p1;
          // Key tile t is half (t & 1) of 16-key step t / 2: A regs 0/1 for the first half, 2/3 for the second.
          p[u][t >> 1][((t & 1) << 1) + r] = pack_half2(p0, p1);
        }
      }

    // O[16 WT x D] += P[16 WT x BN] V[BN x D].
#pragma unroll
    for (int k = 0; k < BN / 16; ++k)
#pragma unroll
      for (int t = 0; t < DT; t += 2) {
        unsigned b[4];  // b[0..1]: dims t*8.., b[2..3]: dims t*8+8..
        ldsm_x4_trans(b, v_lane + buf + (k * 16 * LD + t * 8) * 2);
#pragma unroll
        for (int u = 0; u < WT; ++u) {
          mma16816(o[u][t], p[u][k], b[0], b[1]);
          mma16816(o[u][t + 1], p[u][k], b[2], b[3]);
        }
      }
    __syncthreads();  // every warp is done with tile j before tile j + 2 overwrites its buffer
  }

#pragma unroll
  for (int u = 0; u < WT; ++u)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float z = sum[u][r];
      z += __shfl_xor_sync(0xffffffffu, z, 1);
      z += __shfl_xor_sync(0xffffffffu, z, 2);
      if (!live[u][r]) continue;
      const float inv = 1.f / z;
#pragma unroll
      for (int t = 0; t < DT; ++t)
        *reinterpret_cast<half2*>(out + off[u][r] + t * 8 + 2 * tq) =
            __floats2half2_rn(o[u][t][2 * r] * inv, o[u][t][2 * r + 1] * inv);
    }
}
