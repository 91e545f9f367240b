// What a built library was compiled to use, as labkit_features() reports it to Python (kernels/
// __init__.py): hardware fused multiply-add, AVX2, AVX-512, OpenMP. The same source builds for any
// of them with the same bits; what changes is the speed, and without hardware FMA every std::fma
// becomes a call into the C library, tens of times slower, so `auto` reads this before it chooses.
#pragma once

extern "C" int labkit_features() {
    int features = 0;
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA) || defined(__FP_FAST_FMAF)
    features |= 1;
#endif
#if defined(__AVX2__)
    features |= 2;
#endif
#if defined(__AVX512F__)
    features |= 4;
#endif
#if defined(_OPENMP)
    features |= 8;
#endif
    return features;
}
