#ifndef COLIBRI_KERNELS_X86_SIMD_H_
#define COLIBRI_KERNELS_X86_SIMD_H_

// <immintrin.h>, without GCC 12.2's false "-Wuninitialized" warnings from
// its own AVX-512 headers' _mm512_undefined_*() (GCC PR 105593, fixed in
// 12.3). Include this instead of <immintrin.h> in kernel files.

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif  // COLIBRI_KERNELS_X86_SIMD_H_
