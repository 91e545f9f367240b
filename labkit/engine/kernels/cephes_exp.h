// exp(x) for x in [-87, 88] (the caller clamps), Cephes' expf polynomial, relative error ~1e-7,
// written so that a loop of it vectorizes (std::exp and std::floor are scalar calls):
// n = round(x / ln 2) by the magic-number trick, r = x - n ln 2 in two steps, exp(r) by a degree-6
// polynomial, times 2^n built in the exponent bits (a bit cast: memcpy would keep the loop scalar).
// Shared by paged_decode.cpp (the softmax) and rowwise.cpp (the MLP gate); every fma is explicit,
// so the bits are what this says under any compiler (the kernels build with -ffp-contract=off).
#pragma once
#include <cmath>
#include <cstdint>

inline float cephes_exp(float x) {
    const float n = std::fma(x, 1.44269504088896341f, 12582912.0f) - 12582912.0f;
    const float r = std::fma(n, 2.12194440e-4f, std::fma(n, -0.693359375f, x));
    float p = 1.9875691500e-4f;
    p = std::fma(p, r, 1.3981999507e-3f);
    p = std::fma(p, r, 8.3334519073e-3f);
    p = std::fma(p, r, 4.1665795894e-2f);
    p = std::fma(p, r, 1.6666665459e-1f);
    p = std::fma(p, r, 5.0000001201e-1f);
    p = std::fma(p * r, r, r + 1.0f);
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    return p * __builtin_bit_cast(float, bits);
}
