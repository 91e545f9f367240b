// A matrix product whose every output element is summed in one fixed order: the batch-invariant
// mode's matmul, as fast as the library's at the decode step's few rows.
//
//   y[m, n] = bias[n] + sum over k = 0, 1, ..., K-1 of x[m, k] * w[k, n]
//
// Each element is a chain of fused multiply-adds in k order, started from zero, then one add of its
// bias. A fused multiply-add rounds once, however it is computed (vector or scalar), so the chain
// gives the same bits whatever the number of rows in the call, which rows share a register tile,
// how the columns are split between threads, or whether the vector or the scalar path runs. That
// is batch invariance by construction: no probing, no padding, no tile of a fixed size.
//
// Layout (float32):
//   x      (M, K) rows at stride ldx, k contiguous
//   packed (P, K, NR) the weight (K, N) cut into P = ceil(N / NR) panels of NR columns, each panel
//          stored k-major so one k reads NR contiguous floats; columns past N are zero
//   bias   (N,) or null
//   y      (M, N) rows at stride ldy
//
// The register tile is MR rows x NR columns (8 x 48 with AVX-512: 24 accumulators). Rows are taken
// in blocks of MC, copied k-major, so that a block's rows stay in cache while every panel passes
// over them; a panel passes over a block's tiles KC k at a time, prefetching its next KC, so that
// it is read from memory once per block, not once per tile; panels are handed out to threads one
// at a time (a descheduled thread holds up one panel, not a share of them). None of that changes
// any element's order.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "build_features.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int NR = 48;       // columns per panel (3 vectors of 16 floats)
constexpr int MR = 8;        // rows per register tile
constexpr int64_t MC = 128;  // rows per cache block
constexpr int64_t KC = 64;   // k per step of a panel's pass over a block's row tiles (see run)
constexpr int64_t PF = 32;   // k ahead that a single tile prefetches its panels (6 KiB each)
constexpr double PARALLEL_WORK = 1 << 16;  // multiply-adds below which one thread runs the call

#if defined(__AVX512F__)
// R rows against P neighbouring panels (3 * P vectors of 16 columns). P > 1 only for a call of at
// most 4 rows: more independent chains, and P panels streamed at once, for the memory-bound case.
template <int R, int P = 1>
inline void tile(const float* __restrict__ x, const float* __restrict__ panel, int64_t K,
                 const float* __restrict__ bias, float* __restrict__ y, int64_t ldy, int cols) {
    constexpr int V = 3 * P;
    const int64_t panel_stride = K * NR;
    __m512 acc[R][V];
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < V; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        __m512 b[V];
        if (k + PF < K)  // a tile of few rows streams its panels from memory: ask PF rows ahead
            for (int j = 0; j < V; ++j)
                _mm_prefetch(reinterpret_cast<const char*>(panel + (j / 3) * panel_stride + (k + PF) * NR + 16 * (j % 3)),
                             _MM_HINT_T0);
        for (int j = 0; j < V; ++j) b[j] = _mm512_loadu_ps(panel + (j / 3) * panel_stride + k * NR + 16 * (j % 3));
        for (int i = 0; i < R; ++i) {
            const __m512 a = _mm512_set1_ps(x[k * R + i]);
            for (int j = 0; j < V; ++j) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
        }
    }
    for (int j = 0; j < V; ++j) {  // columns of panel j / 3; only the last panel may be ragged
        const int left = (j / 3 == P - 1 ? cols : NR) - 16 * (j % 3);
        if (left <= 0) continue;
        const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
        const int64_t at = (j / 3) * NR + 16 * (j % 3);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + at) : _mm512_setzero_ps();
        for (int i = 0; i < R; ++i) {
            const __m512 v = bias ? _mm512_add_ps(acc[i][j], bv) : acc[i][j];
            _mm512_mask_storeu_ps(y + i * ldy + at, mask, v);
        }
    }
}
#endif

#if defined(__AVX512F__)
// tile<R> over k in [k0, k0 + kc) only: the accumulators start from zero (first) or from acc_io,
// where the previous part left them, and go back there, or out to y with the bias (last). Storing
// and reloading a float32 accumulator does not change it, so the chain of every element is the one
// tile<R> makes over the whole of K, bit for bit. While it computes, it asks for the first
// `ahead` cache lines at `next` (a share of the panel's next part), one line per k.
template <int R>
inline void tile_part(const float* __restrict__ x, const float* __restrict__ panel, int64_t kc, float* __restrict__ acc_io,
                      bool first, bool last, const float* __restrict__ bias, float* __restrict__ y, int64_t ldy,
                      int cols, const char* next, int64_t ahead) {
    __m512 acc[R][3];
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < 3; ++j) acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_io + i * NR + 16 * j);
    for (int64_t k = 0; k < kc; ++k) {
        if (k < ahead) _mm_prefetch(next + 64 * k, _MM_HINT_T0);
        __m512 b[3];
        for (int j = 0; j < 3; ++j) b[j] = _mm512_loadu_ps(panel + k * NR + 16 * j);
        for (int i = 0; i < R; ++i) {
            const __m512 a = _mm512_set1_ps(x[k * R + i]);
            for (int j = 0; j < 3; ++j) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
        }
    }
    if (!last) {
        for (int i = 0; i < R; ++i)
            for (int j = 0; j < 3; ++j) _mm512_storeu_ps(acc_io + i * NR + 16 * j, acc[i][j]);
        return;
    }
    for (int j = 0; j < 3; ++j) {
        const int left = cols - 16 * j;
        if (left <= 0) continue;
        const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
        for (int i = 0; i < R; ++i) {
            const __m512 v = bias ? _mm512_add_ps(acc[i][j], bv) : acc[i][j];
            _mm512_mask_storeu_ps(y + i * ldy + 16 * j, mask, v);
        }
    }
}
#endif

// The same chains, one lane at a time with std::fma (which rounds once, as the vector fma does);
// used where AVX-512 is missing and by the test that checks both paths give the same bits.
template <int R>
inline void tile_scalar(const float* __restrict__ x, const float* __restrict__ panel, int64_t K,
                        const float* __restrict__ bias, float* __restrict__ y, int64_t ldy, int cols) {
    float acc[R][NR] = {};
    for (int64_t k = 0; k < K; ++k) {
        const float* p = panel + k * NR;
        for (int i = 0; i < R; ++i) {
            const float a = x[k * R + i];
            for (int c = 0; c < NR; ++c) acc[i][c] = std::fma(a, p[c], acc[i][c]);
        }
    }
    for (int i = 0; i < R; ++i)
        for (int c = 0; c < cols; ++c) y[i * ldy + c] = bias ? acc[i][c] + bias[c] : acc[i][c];
}

using TileFn = void (*)(const float*, const float*, int64_t, const float*, float*, int64_t, int);
using PartFn = void (*)(const float*, const float*, int64_t, float*, bool, bool, const float*, float*, int64_t, int,
                        const char*, int64_t);

#if defined(__AVX512F__)
constexpr TileFn VECTOR[MR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};
constexpr int WIDE_ROWS = 4;  // calls of up to this many rows take several panels per tile
constexpr int WIDE_PANELS[WIDE_ROWS + 1] = {0, 4, 2, 2, 2};
constexpr TileFn WIDE[WIDE_ROWS + 1] = {nullptr, tile<1, 4>, tile<2, 2>, tile<3, 2>, tile<4, 2>};
constexpr PartFn PARTS[MR + 1] = {nullptr,      tile_part<1>, tile_part<2>, tile_part<3>, tile_part<4>,
                                  tile_part<5>, tile_part<6>, tile_part<7>, tile_part<8>};
#endif
// The scalar path keeps 2 rows per tile: 96 accumulators already fill the vector registers.
constexpr int MR_SCALAR = 2;
constexpr TileFn SCALAR[MR_SCALAR + 1] = {nullptr, tile_scalar<1>, tile_scalar<2>};

#if defined(__AVX512F__)
// A call of at most WIDE_ROWS rows: one tile of all its rows against groups of P panels (the last
// group's leftover panels one at a time). Each element's chain is the same as in any other tile.
int run_wide(const float* x, int M, int64_t K, int64_t ldx, const float* packed, int64_t N, const float* bias,
             float* y, int64_t ldy, int threads, bool parallel) {
    const int P = WIDE_PANELS[M];
    const int64_t panels = (N + NR - 1) / NR, groups = (panels + P - 1) / P;
    std::vector<float> a(size_t(M) * size_t(K));
    for (int64_t k = 0; k < K; ++k)
        for (int j = 0; j < M; ++j) a[k * M + j] = x[j * ldx + k];
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (parallel)
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = g * P, count = panels - first < P ? panels - first : P;
        for (int64_t p = first; p < first + count; p += (count == P ? P : 1)) {
            const float* b = bias ? bias + p * NR : nullptr;
            const int64_t last = count == P ? first + P - 1 : p;  // the last panel this call covers
            const int cols = int(N - last * NR < NR ? N - last * NR : NR);
            const TileFn fn = count == P ? WIDE[M] : VECTOR[M];
            fn(a.data(), packed + p * K * NR, K, b, y + p * NR, ldy, cols);
        }
    }
    return 0;
}
#endif

int run(const float* x, int64_t M, int64_t K, int64_t ldx, const float* packed, int64_t N, const float* bias,
        float* y, int64_t ldy, int threads, bool vector) {
    if (M < 0 || K < 1 || N < 1 || ldx < K || ldy < N || threads < 1) return 1;
    const TileFn* tiles = SCALAR;
    int mr = MR_SCALAR;
#if defined(__AVX512F__)
    if (vector) {
        tiles = VECTOR;
        mr = MR;
    }
#else
    (void)vector;
#endif
    const int64_t panels = (N + NR - 1) / NR;
    const bool parallel = threads > 1 && double(M) * double(K) * double(N) >= PARALLEL_WORK && panels > 1;
#if defined(__AVX512F__)
    if (vector && M <= WIDE_ROWS && M > 0) return run_wide(x, int(M), K, ldx, packed, N, bias, y, ldy, threads, parallel);
#endif
    // A block's rows are copied k-major, each tile's rows side by side (a[k * r + i]), so a tile
    // reads its rows' values for one k from one cache line instead of r lines far apart.
    std::vector<float> block(size_t(MC < M ? MC : M) * size_t(K));
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t rows = M - m0 < MC ? M - m0 : MC;
        for (int64_t i = 0; i < rows; i += mr) {
            const int r = int(rows - i < mr ? rows - i : mr);
            float* a = block.data() + i * K;
            for (int64_t k = 0; k < K; ++k)
                for (int j = 0; j < r; ++j) a[k * r + j] = x[(m0 + i + j) * ldx + k];
        }
#if defined(__AVX512F__)
        if (vector && rows > MR) {
            // Every row tile of the block takes a panel KC k at a time: a part of the panel
            // (12 KiB) is read from memory once, by the first tile, and from L1 by the others,
            // while the tiles ask for the next part a line at a time; a tile that streamed the
            // whole panel alone waited on memory at a fraction of the FMA rate.
            const int64_t tiles_per_block = (rows + mr - 1) / mr;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (parallel)
            for (int64_t p = 0; p < panels; ++p) {
                alignas(64) float partial[MC * NR];
                const float* panel = packed + p * K * NR;
                const int cols = int(N - p * NR < NR ? N - p * NR : NR);
                const float* b = bias ? bias + p * NR : nullptr;
                for (int64_t k0 = 0; k0 < K; k0 += KC) {
                    const int64_t kc = K - k0 < KC ? K - k0 : KC;
                    const int64_t next_k = k0 + kc, next_kc = K - next_k < KC ? K - next_k : KC;
                    const int64_t lines = next_kc * NR * int64_t(sizeof(float)) / 64;  // 0 after the last part
                    const int64_t share = (lines + tiles_per_block - 1) / tiles_per_block;
                    const char* next = reinterpret_cast<const char*>(panel + next_k * NR);
                    for (int64_t i = 0, t = 0; i < rows; i += mr, ++t) {
                        const int r = int(rows - i < mr ? rows - i : mr);
                        const int64_t from = t * share, ahead = lines - from < share ? lines - from : share;
                        PARTS[r](block.data() + i * K + k0 * r, panel + k0 * NR, kc, partial + i * NR, k0 == 0,
                                 next_k == K, b, y + (m0 + i) * ldy + p * NR, ldy, cols, next + 64 * from,
                                 ahead > 0 ? ahead : 0);
                    }
                }
            }
            continue;
        }
#endif
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (parallel)
        for (int64_t p = 0; p < panels; ++p) {
            const float* panel = packed + p * K * NR;
            const int cols = int(N - p * NR < NR ? N - p * NR : NR);
            const float* b = bias ? bias + p * NR : nullptr;
            for (int64_t i = 0; i < rows; i += mr) {
                const int r = int(rows - i < mr ? rows - i : mr);
                tiles[r](block.data() + i * K, panel, K, b, y + (m0 + i) * ldy + p * NR, ldy, cols);
            }
        }
    }
    return 0;
}

}  // namespace

extern "C" int labkit_fixed_matmul(const float* x, int64_t M, int64_t K, int64_t ldx, const float* packed, int64_t N,
                                   const float* bias, float* y, int64_t ldy, int threads, int vector) {
    return run(x, M, K, ldx, packed, N, bias, y, ldy, threads, vector != 0);
}

extern "C" int labkit_fixed_matmul_panel_width() { return NR; }

extern "C" int labkit_fixed_matmul_has_vector() {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
