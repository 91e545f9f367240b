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
// Dot products and the weighted sum of values use LANES independent accumulators (the compiler
// vectorizes the lane loop) summed in a fixed order at the end.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int LANES = 16;

inline float dot(const float* a, const float* b, int dim) {
    float acc[LANES] = {0};
    int j = 0;
    for (; j + LANES <= dim; j += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] += a[j + l] * b[j + l];
    float tail = 0.0f;
    for (; j < dim; ++j) tail += a[j] * b[j];
    for (int w = LANES / 2; w >= 1; w /= 2)  // pairwise, fixed order
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    return acc[0] + tail;
}

inline void axpy(float* y, float a, const float* x, int dim) {
    for (int j = 0; j < dim; ++j) y[j] += a * x[j];
}

void attend_one(const float* q, const float* keys, const float* values, const int32_t* table, int length,
                int group, int dim, int block_size, int64_t block_stride, float scale, float* scores, float* out,
                int64_t q_head_stride, int64_t out_head_stride) {
    for (int g = 0; g < group; ++g) {
        const float* qg = q + g * q_head_stride;
        float* sg = scores + static_cast<int64_t>(g) * length;
        float best = -INFINITY;
        for (int p = 0; p < length; ++p) {
            const float* k = keys + table[p / block_size] * block_stride + static_cast<int64_t>(p % block_size) * dim;
            float s = dot(qg, k, dim) * scale;
            sg[p] = s;
            best = s > best ? s : best;
        }
        float total = 0.0f;
        for (int p = 0; p < length; ++p) {
            float e = std::exp(sg[p] - best);
            sg[p] = e;
            total += e;
        }
        float* og = out + g * out_head_stride;
        std::memset(og, 0, sizeof(float) * dim);
        for (int p = 0; p < length; ++p) {
            const float* v = values + table[p / block_size] * block_stride + static_cast<int64_t>(p % block_size) * dim;
            axpy(og, sg[p], v, dim);
        }
        float inv = 1.0f / total;
        for (int j = 0; j < dim; ++j) og[j] *= inv;
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
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> scores(static_cast<size_t>(group) * (max_length > 0 ? max_length : 1));
#pragma omp for schedule(static)
        for (int t = 0; t < tasks; ++t) {
            const int row = t / kv_heads, h = t % kv_heads;
            const int64_t q_off = row * q_row_stride + static_cast<int64_t>(h) * group * q_head_stride;
            const int64_t out_off = (static_cast<int64_t>(row) * heads + static_cast<int64_t>(h) * group) * dim;
            attend_one(q + q_off, pool + h * head_stride, pool + half + h * head_stride,
                       tables + static_cast<int64_t>(row) * table_width, lengths[row], group, dim, block_size,
                       block_stride, scale, scores.data(), out + out_off, q_head_stride, dim);
        }
    }
    return 0;
}
