// Grouped expert products for long prefill chunks (strata_runtime/cuda/grouped.py).
//
// A chunk of n rows routed top-k makes A = n k assignments (row, choice). moe_tiles groups them by expert on
// the device: `order` lists the assignments expert by expert, and `tiles` cuts each expert's run of `order`
// into tiles of at most BM rows (expert, first place, rows). The two products then run one block per (tile,
// output tile), so the launches need no host read: their grids are sized for the most tiles any routing can
// make (ceil(A / BM) + E) and blocks past the real count return at once. Each block reads its expert's weight
// tile once for up to BM rows, on tensor cores (mma.sync m16n8k16, fp16 inputs, fp32 accumulation), through a
// three-stage cp.async pipeline in shared memory.
//
//   moe_gate_up: hid[p, i] = silu(x[row(p)] . Wgu[e][i]) * (x[row(p)] . Wgu[e][I + i]), p a place in `order`,
//                the gate and up features of one output in the same thread, so the SwiGLU is fused and hid is
//                written once in fp16.
//   moe_down:    ys[order[p], h] = hid[p] . Wd[e][h], fp16, each assignment's own row (r k + j).
//   moe_combine: resid[r] += sum_j wts[r, j] ys[r k + j], j in order.
//
// Every output element is one dot product over K summed in the same order whatever tile or place its row
// has, so a row's result does not depend on the other rows of the chunk or their routing.
//
// Layouts: x [n, H] fp16; Wgu[e] [2I, H] and Wd[e] [H, I] fp16, each expert found through a table of
// addresses [E] (u64), as the decode expert kernels find it: a VRAM slot, a helper GPU's slot or pinned,
// mapped host memory, which a block then reads over that link, once per tile; hid [A, I] fp16 (places);
// ys [A, H] fp16 (assignments); tiles [max_tiles] int4 (expert, first place, rows, 0). K (the reduction) is
// a multiple of 8.

#include <cuda_fp16.h>

namespace {

constexpr int BM = 128;      // rows of a tile
constexpr int BK = 64;       // reduction per stage: 8 chunks of 16 bytes per row
constexpr int STAGES = 3;
constexpr int THREADS = 256;  // 8 warps: 2 along the rows x 4 along the weight rows, each 64 x BN / 4
// BN, a template parameter: weight rows of a block (moe_gate_up: BN / 2 gate and BN / 2 up, interleaved by
// 8). A block's dynamic shared memory is STAGES * (BM + BN) * BK halves.

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool full) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(full ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void mma_16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte offset of 16-byte chunk c of row r in a [rows][BK] fp16 tile: chunks are swizzled by the row so that
// the eight rows one ldmatrix reads fall in eight different bank groups.
__device__ __forceinline__ unsigned tile_offset(int r, int c) { return (unsigned)(r * BK + ((c ^ (r & 7)) << 3)) * 2u; }

// acc[mi][ni][c] += the block's [BM, BN] tile over the reduction: `a_rows` are this thread's BM / 32 rows
// of the row tile (rows row0 + 32 i) and `b_rows` its BN / 32 weight rows; those whose `a_ok` / `b_ok` is
// false (past a tile's end) are read as zeros, from a valid address. The warp computes only its first LIVE
// 16-row slices (`tile_product_rows`); every thread takes part in the loads.
template <int BN, int LIVE>
__device__ __forceinline__ void tile_product(const half* const* a_rows, const bool* a_ok, const half* const* b_rows,
                                             const bool* b_ok, int K, float (&acc)[4][BN / 32][4]) {
  constexpr int STAGE_HALFS = (BM + BN) * BK, NI = BN / 32;
  extern __shared__ __align__(16) unsigned char smem[];
  const unsigned base = (unsigned)__cvta_generic_to_shared(smem);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wm = warp >> 2, wn = warp & 3;
  const int chunk = tid & 7, row0 = tid >> 3;  // this thread loads chunk `chunk` of rows row0 + 32 i
  const int steps = (K + BK - 1) / BK;

  auto load = [&](int step) {
    const unsigned stage = base + (unsigned)((step % STAGES) * STAGE_HALFS) * 2u;
    const int k = step * BK + chunk * 8;
    const bool in = k < K;
#pragma unroll
    for (int i = 0; i < BM / 32; ++i)
      cp_async16(stage + tile_offset(row0 + 32 * i, chunk), a_rows[i] + (in ? k : 0), a_ok[i] && in);
#pragma unroll
    for (int i = 0; i < BN / 32; ++i)
      cp_async16(stage + BM * BK * 2 + tile_offset(row0 + 32 * i, chunk), b_rows[i] + (in ? k : 0),
                 b_ok[i] && in);
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) load(s);
    cp_async_commit();
  }
  for (int step = 0; step < steps; ++step) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // this stage landed for every thread, and every warp is done with the stage refilled next
    if (step + STAGES - 1 < steps) load(step + STAGES - 1);
    cp_async_commit();
    const unsigned a_tile = base + (unsigned)((step % STAGES) * STAGE_HALFS) * 2u;
    const unsigned b_tile = a_tile + BM * BK * 2;
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks) {
      unsigned a[4][4], b[NI][2];
#pragma unroll
      for (int mi = 0; mi < LIVE; ++mi)
        ldmatrix_x4(a[mi], a_tile + tile_offset(wm * 64 + mi * 16 + (lane & 15), ks * 2 + (lane >> 4)));
#pragma unroll
      for (int p = 0; p < NI / 2; ++p) {
        const int m = lane >> 3;
        unsigned r[4];
        ldmatrix_x4(r, b_tile + tile_offset(wn * (BN / 4) + p * 16 + (m >> 1) * 8 + (lane & 7), ks * 2 + (m & 1)));
        b[2 * p][0] = r[0];
        b[2 * p][1] = r[1];
        b[2 * p + 1][0] = r[2];
        b[2 * p + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < LIVE; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) mma_16816(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
    }
  }
  cp_async_wait<0>();
}

// tile_product over a tile whose first `rows` rows are kept: each warp computes only its 16-row slices that
// hold some of them, so an expert's last, partly filled tile costs products for its rows, not for BM. The
// slices it skips keep acc zero and are never stored. The count is the same for a whole warp, and the warps
// of a block may run different counts: they meet at the same barriers, since every thread loads.
template <int BN>
__device__ __forceinline__ void tile_product_rows(const half* const* a_rows, const bool* a_ok,
                                                  const half* const* b_rows, const bool* b_ok, int K, int rows,
                                                  float (&acc)[4][BN / 32][4]) {
  const int wm = threadIdx.x >> 7;  // the warp's half of the tile's rows
  switch (min(4, max(0, (rows - wm * 64 + 15) / 16))) {
    case 4: tile_product<BN, 4>(a_rows, a_ok, b_rows, b_ok, K, acc); break;
    case 3: tile_product<BN, 3>(a_rows, a_ok, b_rows, b_ok, K, acc); break;
    case 2: tile_product<BN, 2>(a_rows, a_ok, b_rows, b_ok, K, acc); break;
    case 1: tile_product<BN, 1>(a_rows, a_ok, b_rows, b_ok, K, acc); break;
    default: tile_product<BN, 0>(a_rows, a_ok, b_rows, b_ok, K, acc);
  }
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

// This thread's rows of a tile of `rows` places (row0 + 32 i, i < N): row_at(r) is the element offset of
// place r's row in src; rows past the tile get a valid address and ok = false (read as zeros).
template <int N, class RowAt>
__device__ __forceinline__ void tile_rows(const half* src, int rows, RowAt row_at, const half** out, bool* ok) {
  const int row0 = threadIdx.x >> 3;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int r = row0 + 32 * i;
    ok[i] = r < rows;
    out[i] = src + (ok[i] ? row_at(r) : (size_t)0);
  }
}

}  // namespace

// One block of 1024 threads. rank: scratch [A]. order [A]: the assignments grouped by expert (experts in
// order, an expert's assignments in no particular order). tiles [max_tiles] and *n_tiles as above. E <= 1024.
__global__ void __launch_bounds__(1024) moe_tiles(const int* __restrict__ idx, int A, int E,
                                                             int* __restrict__ rank, int* __restrict__ order,
                                                             int4* __restrict__ tiles, int* __restrict__ n_tiles) {
  __shared__ int count[1024], first[1024], first_tile[1024];
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int a = threadIdx.x; a < A; a += blockDim.x) rank[a] = atomicAdd(&count[idx[a]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int place = 0, tile = 0;
    for (int e = 0; e < E; ++e) {
      first[e] = place;
      first_tile[e] = tile;
      place += count[e];
      tile += (count[e] + BM - 1) / BM;
    }
    *n_tiles = tile;
  }
  __syncthreads();
  for (int a = threadIdx.x; a < A; a += blockDim.x) order[first[idx[a]] + rank[a]] = a;
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    for (int t = 0; t * BM < count[e]; ++t)
      tiles[first_tile[e] + t] = make_int4(e, first[e] + t * BM, min(BM, count[e] - t * BM), 0);
}

// Grid (max_tiles, ceil(I / (BN / 2))), THREADS threads.
template <int BN>
__global__ void __launch_bounds__(THREADS, 256 / BN)
    moe_gate_up(const half* __restrict__ x, const unsigned long long* __restrict__ w_at,
                const int* __restrict__ order,
                const int4* __restrict__ tiles, const int* __restrict__ n_tiles, half* __restrict__ hid, int H, int I,
                int topk) {
  if ((int)blockIdx.x >= *n_tiles) return;
  const int4 tile = tiles[blockIdx.x];
  const int place0 = tile.y, rows = tile.z, i0 = blockIdx.y * (BN / 2);
  const half* w = reinterpret_cast<const half*>(w_at[tile.x]);  // [2I, H]
  const int tid = threadIdx.x, row0 = tid >> 3;
  const half* a_rows[BM / 32];
  const half* b_rows[BN / 32];
  bool a_ok[BM / 32], b_ok[BN / 32];
  tile_rows<BM / 32>(x, rows, [&](int r) { return (size_t)(order[place0 + r] / topk) * H; }, a_rows, a_ok);
#pragma unroll
  for (int i = 0; i < BN / 32; ++i) {
    // Block column c: 16-column group c / 16 holds gate features then up features of the same 8 outputs.
    const int c = row0 + 32 * i, out = i0 + (c >> 4) * 8 + (c & 7);
    b_ok[i] = out < I;
    b_rows[i] = w + (b_ok[i] ? ((size_t)(c & 8 ? I : 0) + out) * H : 0);
  }
  float acc[4][BN / 32][4] = {};
  tile_product_rows<BN>(a_rows, a_ok, b_rows, b_ok, H, rows, acc);
  const int warp = tid >> 5, lane = tid & 31, wm = warp >> 2, wn = warp & 3;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int p = 0; p < BN / 64; ++p) {
      const float* gate = acc[mi][2 * p];
      const float* up = acc[mi][2 * p + 1];
      const int out = i0 + (wn * (BN / 64) + p) * 8 + (lane & 3) * 2;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wm * 64 + mi * 16 + (lane >> 2) + 8 * h;
        if (r >= rows || out >= I) continue;
        half* dst = hid + (size_t)(place0 + r) * I + out;
        const float v0 = silu(gate[2 * h]) * up[2 * h], v1 = silu(gate[2 * h + 1]) * up[2 * h + 1];
        if (out + 1 < I)
          *reinterpret_cast<half2*>(dst) = __floats2half2_rn(v0, v1);
        else
          *dst = __float2half(v0);
      }
    }
}

// Grid (max_tiles, ceil(H / BN)), THREADS threads.
template <int BN>
__global__ void __launch_bounds__(THREADS, 256 / BN)
    moe_down(const half* __restrict__ hid, const unsigned long long* __restrict__ w_at,
             const int* __restrict__ order,
             const int4* __restrict__ tiles, const int* __restrict__ n_tiles, half* __restrict__ ys, int H, int I) {
  if ((int)blockIdx.x >= *n_tiles) return;
  const int4 tile = tiles[blockIdx.x];
  const int place0 = tile.y, rows = tile.z, h0 = blockIdx.y * BN;
  const half* w = reinterpret_cast<const half*>(w_at[tile.x]);  // [H, I]
  const int tid = threadIdx.x;
  const half* a_rows[BM / 32];
  const half* b_rows[BN / 32];
  bool a_ok[BM / 32], b_ok[BN / 32];
  tile_rows<BM / 32>(hid, rows, [&](int r) { return (size_t)(place0 + r) * I; }, a_rows, a_ok);
  tile_rows<BN / 32>(w, H - h0, [&](int r) { return (size_t)(h0 + r) * I; }, b_rows, b_ok);
  float acc[4][BN / 32][4] = {};
  tile_product_rows<BN>(a_rows, a_ok, b_rows, b_ok, I, rows, acc);
  const int warp = tid >> 5, lane = tid & 31, wm = warp >> 2, wn = warp & 3;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wm * 64 + mi * 16 + (lane >> 2) + 8 * h;
      if (r >= rows) continue;
      half* dst = ys + (size_t)order[place0 + r] * H;
#pragma unroll
      for (int ni = 0; ni < BN / 32; ++ni) {
        const int col = h0 + wn * (BN / 4) + ni * 8 + (lane & 3) * 2;
        const float* c = acc[mi][ni];
        if (col + 1 < H)
          *reinterpret_cast<half2*>(dst + col) = __floats2half2_rn(c[2 * h], c[2 * h + 1]);
        else if (col < H)
          dst[col] = __float2half(c[2 * h]);
      }
    }
}

// resid[r, h] += sum_j wts[r, j] ys[r k + j, h], j in order. Block r.
__global__ void moe_combine(const half* __restrict__ ys, const float* __restrict__ wts,
                                       float* __restrict__ resid, int topk, int H) {
  const int r = blockIdx.x;
  for (int h = threadIdx.x; h < H; h += blockDim.x) {
    float t = 0.f;
    for (int j = 0; j < topk; ++j) t += wts[r * topk + j] * __half2float(ys[((size_t)r * topk + j) * H + h]);
    resid[(size_t)r * H + h] += t;
  }
}
