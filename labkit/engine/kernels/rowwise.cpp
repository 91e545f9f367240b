// The row-wise work between a layer's matmuls, each in one native pass: RMSNorm (with the residual
// add before it), rotary positions, the K/V write into the paged pool, the Llama MLP's gate, and the
// greedy argmax.
//
// Why native: at the decode step each of these is a few thousand to a few hundred thousand floats,
// and torch runs each as several parallel ops (RMSNorm alone is pow, mean, add, rsqrt and two
// muls), each paying a dispatch and, on a busy 2-core machine, a wait for a descheduled thread.
// Here a call is one loop over rows that stays on the calling thread unless it is large (a prefill
// pass), and every row is computed by the same code whatever its neighbours, so a row's bits never
// depend on the batch: the batch-invariant mode can use them as they are.
//
// Layout: float32, rows at a stride (``ld``), elements contiguous within a row.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "build_features.h"
#include "cephes_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// ---- silu(gate) * up, the Llama MLP's gate, fused into one pass ---------------------------------
// out[m, j] = gate / (1 + exp(-gate)) * up for gate = gu[m, j], up = gu[m, I + j]: layers.silu's
// formula followed by mul_, with exp from Cephes' polynomial over a clamped range (so a gate below
// -88 gives a tiny number where torch gives -0, and -inf gives -inf where torch gives NaN). Every element goes through the
// one compiled 16-lane function below (a row's ragged end is copied into a padded chunk, not run by
// a scalar tail), so an element's bits never depend on where in the tensor it sits. torch's own exp
// is a parallel op even for a few thousand elements; on a busy 2-core machine each of its calls
// waits for a descheduled thread, so the step's elementwise work stays on one thread here.
constexpr int LANES = 16;
constexpr int64_t PARALLEL_ELEMENTS = 1 << 17;
// Every lane through cephes_exp (its argument, -gate, clamped to [-87, 88]); a NaN gate stays NaN.
__attribute__((noinline)) void silu_mul_chunk(const float* __restrict__ gate, const float* __restrict__ up,
                                              float* __restrict__ out) {
    for (int l = 0; l < LANES; ++l) {
        float x = -gate[l];
        x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : (x == x ? x : 0.0f));
        out[l] = gate[l] / (cephes_exp(x) + 1.0f) * up[l];
    }
}

void silu_mul_row(const float* gu, int64_t width, float* out) {
    int64_t j = 0;
    for (; j + LANES <= width; j += LANES) silu_mul_chunk(gu + j, gu + width + j, out + j);
    if (j < width) {
        float g[LANES] = {}, u[LANES] = {}, o[LANES];
        std::memcpy(g, gu + j, (width - j) * sizeof(float));
        std::memcpy(u, gu + width + j, (width - j) * sizeof(float));
        silu_mul_chunk(g, u, o);
        std::memcpy(out + j, o, (width - j) * sizeof(float));
    }
}

// ---- greedy choice: the index of each row's largest logit, as torch.argmax picks it ---------------
// The first index of the maximum, or of the first NaN if the row has one (torch counts NaN as the
// largest). One vectorized pass finds the maximum and whether a NaN is present, a second finds
// where it first occurs. torch's argmax over a step's logits runs a scalar loop.
int64_t argmax_row(const float* __restrict__ x, int64_t width) {
    float top = -INFINITY;
    bool nan = false;
    int64_t j = 0;
#if defined(__AVX512F__)
    __m512 best = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; j + LANES <= width; j += LANES) {
        const __m512 v = _mm512_loadu_ps(x + j);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_max_ps(best, v);
    }
    nan = unordered != 0;
    top = _mm512_reduce_max_ps(best);
#endif
    for (; j < width; ++j) {
        nan |= x[j] != x[j];
        top = x[j] > top ? x[j] : top;
    }
    int64_t k = 0;
#if defined(__AVX512F__)
    const __m512 wanted = _mm512_set1_ps(top);
    for (; k + LANES <= width; k += LANES) {
        const __m512 v = _mm512_loadu_ps(x + k);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, wanted, _CMP_EQ_OQ);
        if (hit) return k + __builtin_ctz(hit);
    }
#endif
    for (; k < width; ++k)
        if (nan ? x[k] != x[k] : x[k] == top) return k;
    return 0;  // every entry -inf: the first, as torch gives
}

// ---- RMSNorm, after the residual add --------------------------------------------------------------
// x += r when r is given (the residual stream, updated in place, as ``o.add_(x)`` did), then
// h = x * (1 / sqrt(mean(x^2) + eps)) * w. The sum of squares runs in 16 lanes, each adding every
// 16th square in order, then the lanes in a fixed tree and the ragged end last: one order per width.
void rms_norm_row(float* __restrict__ x, const float* __restrict__ r, const float* __restrict__ w, int64_t width,
                  float eps, float* __restrict__ h) {
    if (r != nullptr)
        for (int64_t j = 0; j < width; ++j) x[j] = x[j] + r[j];
    float acc[LANES] = {};
    int64_t j = 0;
    for (; j + LANES <= width; j += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] = acc[l] + x[j + l] * x[j + l];
    for (int half = LANES / 2; half > 0; half /= 2)
        for (int l = 0; l < half; ++l) acc[l] = acc[l] + acc[l + half];
    float sum = acc[0];
    for (; j < width; ++j) sum = sum + x[j] * x[j];
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(width) + eps);
    for (int64_t k = 0; k < width; ++k) h[k] = x[k] * scale * w[k];
}

// ---- rotary positions, in place -------------------------------------------------------------------
// Each head of d floats becomes x * cos + turn(x) * sin, turn(x) = (x[d/2:], x[:d/2]) and sin's first
// half negated (layers.RopeTable's tables): the products and the sum rounded as layers.rotate rounds
// them (separate multiplies, one add: the kernels are built with -ffp-contract=off, so the compiler
// does not fuse them into an fma), so the
// result is bitwise the torch path's.
void rope_row(float* __restrict__ x, int64_t heads, int64_t d, const float* __restrict__ cos,
              const float* __restrict__ sin) {
    const int64_t half = d / 2;
    float turned[1024];
    for (int64_t h = 0; h < heads; ++h) {
        float* head = x + h * d;
        for (int64_t i = 0; i < half; ++i) {
            turned[i] = head[i + half] * sin[i];
            turned[i + half] = head[i] * sin[i + half];
        }
        for (int64_t i = 0; i < d; ++i) head[i] = head[i] * cos[i] + turned[i];
    }
}

}  // namespace

extern "C" int labkit_argmax_rows(const float* x, int64_t rows, int64_t width, int64_t ld, int64_t* out,
                                  int threads) {
    if (rows < 0 || width < 1 || ld < width || threads < 1) return 1;
    const bool parallel = threads > 1 && rows > 1 && rows * width >= (PARALLEL_ELEMENTS << 3);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (parallel)
    for (int64_t m = 0; m < rows; ++m) out[m] = argmax_row(x + m * ld, width);
    return 0;
}

extern "C" int labkit_silu_mul(const float* gate_up, int64_t rows, int64_t width, int64_t ld, float* out,
                               int threads) {
    if (rows < 0 || width < 1 || ld < 2 * width || threads < 1) return 1;
    const bool parallel = threads > 1 && rows > 1 && rows * width >= PARALLEL_ELEMENTS;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (parallel)
    for (int64_t m = 0; m < rows; ++m) silu_mul_row(gate_up + m * ld, width, out + m * width);
    return 0;
}

extern "C" int labkit_rms_norm(float* x, const float* residual, int64_t rows, int64_t width, int64_t ldx,
                               int64_t ldr, const float* weight, float eps, float* out, int threads) {
    if (rows < 0 || width < 1 || ldx < width || (residual != nullptr && ldr < width) || threads < 1) return 1;
    const bool parallel = threads > 1 && rows > 1 && rows * width >= PARALLEL_ELEMENTS;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
    for (int64_t m = 0; m < rows; ++m)
        rms_norm_row(x + m * ldx, residual == nullptr ? nullptr : residual + m * ldr, weight, width, eps,
                     out + m * width);
    return 0;
}

extern "C" int labkit_rope(float* x, int64_t rows, int64_t ldx, int64_t heads, int64_t d, const float* cos,
                           const float* sin, int64_t ldt, int threads) {
    if (rows < 0 || heads < 1 || d < 2 || d % 2 || d > 1024 || ldx < heads * d || ldt < d || threads < 1) return 1;
    const bool parallel = threads > 1 && rows > 1 && rows * heads * d >= PARALLEL_ELEMENTS;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
    for (int64_t m = 0; m < rows; ++m) rope_row(x + m * ldx, heads, d, cos + m * ldt, sin + m * ldt);
    return 0;
}

// k and v: rows x (heads x d) at row stride ld. pool: one layer's (2, heads, slots, d), keys then
// values. Row m goes to slot slot_of[m] of every head; a slot out of range refuses the whole call
// before anything is written.
extern "C" int labkit_kv_write(const float* k, const float* v, int64_t rows, int64_t ld, int64_t heads, int64_t d,
                               const int64_t* slot_of, float* pool, int64_t slots) {
    if (rows < 0 || heads < 1 || d < 1 || ld < heads * d || slots < 1) return 1;
    for (int64_t m = 0; m < rows; ++m)
        if (slot_of[m] < 0 || slot_of[m] >= slots) return 2;
    float* keys = pool;
    float* values = pool + heads * slots * d;
    for (int64_t m = 0; m < rows; ++m)
        for (int64_t h = 0; h < heads; ++h) {
            std::memcpy(keys + (h * slots + slot_of[m]) * d, k + m * ld + h * d, d * sizeof(float));
            std::memcpy(values + (h * slots + slot_of[m]) * d, v + m * ld + h * d, d * sizeof(float));
        }
    return 0;
}
