// Paged decode attention on the CPU: one query per sequence against its cached keys and values,
// read straight from the block pool through the sequence's block table (no gathered copy).
//
// Layout (float32, contiguous):
//   q      (rows, heads, dim), rows and heads at any stride (q_row_stride, q_head_stride), dim contiguous
//   pool   (2, kv_heads, num_blocks, block_size, dim)   keys at [0], values at [1]
//   tables (rows, table_width) int32 block ids; only the first ceil(length / block_size) are read
//   lengths(rows,) int32 cached positions each row attends over (>= 1)
//   out    (rows, heads, dim)
//
// Each (row, kv_head) pair is one task; a task computes every query head of its group in a fixed
// order that depends only on that row's length and the dimensions, never on the thread, the other
// rows, or the number of rows. So a row's output is bitwise the same decoded alone or in a batch.
// Dot products use LANES independent accumulators summed pairwise in a fixed order (with AVX-512,
// 16 keys' reductions share one transposing tree, score_keys); the weighted sum of values adds positions in order, elementwise.
// No -ffast-math: the compiler may not reorder a reduction, so the order written is the order run;
// and no contraction (-ffp-contract=off, kernels/__init__.py): every fused multiply-add is a
// std::fma or an intrinsic in the source, so the rounding does not depend on how a loop compiles.
// The softmax is two-pass over a per-task score buffer (max, then exp and sum), in float32.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "build_features.h"
#include "cephes_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int LANES = 16;
constexpr double PARALLEL_WORK = 1 << 18;  // multiply-adds of q.k per step below which one thread runs it

// D > 0: the head size known at compile time (loops unrolled, accumulators in registers);
// D == 0: any head size, read at run time. Which one runs depends only on the model's head size.
template <int D>
inline float dot(const float* __restrict__ a, const float* __restrict__ b, int dim_arg) {
    const int dim = D > 0 ? D : dim_arg;
    float acc[LANES] = {0};
    int j = 0;
    for (; j + LANES <= dim; j += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] = std::fma(a[j + l], b[j + l], acc[l]);
    float tail = 0.0f;
    for (; j < dim; ++j) tail = std::fma(a[j], b[j], tail);
    for (int w = LANES / 2; w >= 1; w /= 2)  // pairwise, fixed order
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    return acc[0] + tail;
}

#if defined(__AVX512F__)
// The scores of up to 16 neighbouring keys for one query head, all at once: each key's D products
// go into one 16-lane accumulator in the order of dot<D> (a multiply, then fused multiply-adds),
// and the 16 accumulators are summed lane-wise by one transposing tree (lanes j and j + 8, then
// j and j + 4, j + 2, j + 1), so each key's sum comes out in its own lane of one vector: about 15
// shuffles and adds for 16 keys instead of a horizontal reduction per key. Every key takes the same
// path whatever its neighbours or how many of the 16 are present (absent ones are zeros whose
// lanes are not stored), so a row's scores still depend on that row alone.
template <int D>
inline void score_keys(const float* __restrict__ q, const float* __restrict__ keys, int n, float scale,
                       float* __restrict__ out, const char* next) {
    static_assert(D % 16 == 0 && D > 0, "score_keys needs whole vectors");
    constexpr int V = D / 16;
    __m512 qv[V];
    for (int v = 0; v < V; ++v) qv[v] = _mm512_loadu_ps(q + 16 * v);
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) {
        if (next != nullptr)  // key i's place in the next block, read from memory while this one computes
            for (int l = 0; l < D / 16; ++l) _mm_prefetch(next + (static_cast<int64_t>(i) * D + 16 * l) * 4, _MM_HINT_T0);
        if (i < n) {
            const float* k = keys + static_cast<int64_t>(i) * D;
            __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
            for (int v = 1; v < V; ++v) a = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(k + 16 * v), a);
            acc[i] = a;
        } else {
            acc[i] = _mm512_setzero_ps();
        }
    }
    __m512 c[8], e[4], g[2];
    for (int i = 0; i < 8; ++i)  // keys 2i, 2i+1: lanes j + (j + 8), 8 partial sums each
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)  // keys 4i..4i+3: 4 partial sums each, one 128-bit lane per key
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)  // 2 partial sums each, two keys per 128-bit lane
        g[i] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * i], e[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(e[2 * i], e[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // the sums, key L + 4j in element 4L + j; put back in key order and scale
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512 scores = _mm512_mul_ps(_mm512_permutexvar_ps(order, sums), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1u), scores);
}
#endif

// The scores of a block's n keys for one query head (scaled): score_keys where the head size is a
// whole number of vectors, dot<D> one key at a time otherwise. Which one runs depends only on D.
template <int D>
inline void score_block(const float* __restrict__ q, const float* __restrict__ keys, int n, int dim, float scale,
                        float* __restrict__ out, const float* next) {
#if defined(__AVX512F__)
    if constexpr (D > 0 && D % 16 == 0 && D <= 128) {
        for (int s = 0; s < n; s += 16)
            score_keys<D>(q, keys + static_cast<int64_t>(s) * D, n - s < 16 ? n - s : 16, scale, out + s,
                          next == nullptr ? nullptr : reinterpret_cast<const char*>(next + static_cast<int64_t>(s) * D));
        return;
    }
#endif
    (void)next;
    for (int i = 0; i < n; ++i) out[i] = dot<D>(q, keys + static_cast<int64_t>(i) * dim, dim) * scale;
}

// y += sum over i < n of w[i] * x[i * D ...]: one output row of a block's weighted values, added in
// position order (the same order for every head size; with D known, y stays in registers).
template <int D>
inline void weighted_rows(float* __restrict__ y, const float* __restrict__ w, const float* __restrict__ x, int n,
                          int dim_arg, const float* next) {
    const int dim = D > 0 ? D : dim_arg;
    if constexpr (D > 0) {
        float acc[D];
        for (int j = 0; j < D; ++j) acc[j] = y[j];
        for (int i = 0; i < n; ++i) {
            if (next != nullptr)  // row i of the next block of values
                for (int l = 0; l < D; l += 16) __builtin_prefetch(next + static_cast<int64_t>(i) * D + l);
            for (int j = 0; j < D; ++j) acc[j] = std::fma(w[i], x[static_cast<int64_t>(i) * D + j], acc[j]);
        }
        for (int j = 0; j < D; ++j) y[j] = acc[j];
    } else {
        (void)next;
        for (int i = 0; i < n; ++i)
            for (int j = 0; j < dim; ++j) y[j] = std::fma(w[i], x[static_cast<int64_t>(i) * dim + j], y[j]);
    }
}

// exp(x) for x <= 0 (scores minus their maximum), clamped where expf underflows.
inline float exp_nonpositive(float x) { return cephes_exp(x < -87.0f ? -87.0f : x); }

// Each head's scores start on a 64-byte boundary, in every thread's buffer alike, so no loop over
// them is split differently (peeled for alignment) in one thread than in another.
constexpr int64_t ALIGN_FLOATS = 16;
inline int64_t score_row(int length) { return (length + ALIGN_FLOATS - 1) / ALIGN_FLOATS * ALIGN_FLOATS; }

// One (row, kv head): every query head of the group against the row's first `length` positions.
// Pass 1 scores each position block by block, pass 2 turns each head's scores into
// probabilities, pass 3 sums the values weighted by them. A block's keys or values (a few KiB)
// stay in L1 while the group's heads pass over them.
template <int D>
void attend_one(const float* q, const float* keys, const float* values, const int32_t* table, int length,
                int group, int dim_arg, int block_size, int64_t block_stride, float scale, float* scores,
                float* out, int64_t q_head_stride, int64_t out_head_stride) {
    const int dim = D > 0 ? D : dim_arg;
    const int64_t row = score_row(length);
    const int blocks = (length + block_size - 1) / block_size;
    for (int b = 0; b < blocks; ++b) {
        const float* base = keys + table[b] * block_stride;
        const int first = b * block_size, n = length - first < block_size ? length - first : block_size;
        // the first head asks for the next block of keys (after the last, the first block of values)
        const float* next = b + 1 < blocks ? keys + table[b + 1] * block_stride : values + table[0] * block_stride;
        for (int g = 0; g < group; ++g)
            score_block<D>(q + g * q_head_stride, base, n, dim, scale, scores + g * row + first, g == 0 ? next : nullptr);
    }
    for (int g = 0; g < group; ++g) {
        float* sg = scores + g * row;
        float best = -INFINITY;
        for (int p = 0; p < length; ++p) best = sg[p] > best ? sg[p] : best;
        for (int p = 0; p < length; ++p) sg[p] = exp_nonpositive(sg[p] - best);
        float total = 0.0f;
        for (int p = 0; p < length; ++p) total += sg[p];
        const float inv = 1.0f / total;
        for (int p = 0; p < length; ++p) sg[p] *= inv;
        std::memset(out + g * out_head_stride, 0, sizeof(float) * dim);
    }
    for (int b = 0; b < blocks; ++b) {
        const float* base = values + table[b] * block_stride;
        const int first = b * block_size, n = length - first < block_size ? length - first : block_size;
        const float* next = b + 1 < blocks ? values + table[b + 1] * block_stride : nullptr;
        for (int g = 0; g < group; ++g)
            weighted_rows<D>(out + g * out_head_stride, scores + g * row + first, base, n, dim, g == 0 ? next : nullptr);
    }
}

using AttendFn = void (*)(const float*, const float*, const float*, const int32_t*, int, int, int, int, int64_t, float,
                          float*, float*, int64_t, int64_t);

AttendFn attend_for(int dim) {
    switch (dim) {
        case 16: return attend_one<16>;
        case 32: return attend_one<32>;
        case 64: return attend_one<64>;
        case 80: return attend_one<80>;
        case 96: return attend_one<96>;
        case 128: return attend_one<128>;
        default: return attend_one<0>;
    }
}

}  // namespace

extern "C" int labkit_paged_decode(const float* q, const float* pool, const int32_t* tables, const int32_t* lengths,
                                   float* out, int64_t q_row_stride, int64_t q_head_stride, int rows, int heads,
                                   int kv_heads, int dim, int num_blocks, int block_size, int table_width,
                                   int max_length, float scale, int threads) {
    if (rows <= 0 || kv_heads <= 0 || heads % kv_heads != 0) return 1;
    const int group = heads / kv_heads;
    const int64_t block_stride = static_cast<int64_t>(block_size) * dim;
    const int64_t head_stride = static_cast<int64_t>(num_blocks) * block_stride;  // one kv head's blocks
    const int64_t half = static_cast<int64_t>(kv_heads) * head_stride;             // keys | values
    const int tasks = rows * kv_heads;
    const AttendFn attend = attend_for(dim);
    // Threads only when there is enough work to pay for waking them (like torch's grain size):
    // a small step would otherwise wait at the closing barrier for a thread the OS has parked.
    // Tasks are handed out one at a time (dynamic), so a thread that is descheduled holds up at
    // most its own task. Which thread runs a task never changes its result.
    const double work = static_cast<double>(rows) * heads * max_length * dim;
    if (work < PARALLEL_WORK) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        const size_t floats = static_cast<size_t>(group) * score_row(max_length > 0 ? max_length : 1);
        float* scores = static_cast<float*>(std::aligned_alloc(64, floats * sizeof(float)));
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < tasks; ++t) {
            const int row = t / kv_heads, h = t % kv_heads;
            const int64_t q_off = row * q_row_stride + static_cast<int64_t>(h) * group * q_head_stride;
            const int64_t out_off = (static_cast<int64_t>(row) * heads + static_cast<int64_t>(h) * group) * dim;
            attend(q + q_off, pool + h * head_stride, pool + half + h * head_stride,
                       tables + static_cast<int64_t>(row) * table_width, lengths[row], group, dim, block_size,
                   block_stride, scale, scores, out + out_off, q_head_stride, dim);
        }
        std::free(scores);
    }
    return 0;
}
