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

#include <cstdint>

namespace colibri {
namespace kernels {

// How far ahead of its loads a kernel that streams a block's weights front
// to back (the blocked f32/f16/bf16 layouts) prefetches them into L2. The
// hardware prefetchers alone kept too few misses in flight on an Intel Xeon
// (Emerald Rapids, 2 vCPUs): the bf16 kernel read 16 GB/s where a read probe
// read 27; 4 KiB ahead gave 23-25, 16 KiB to 64 KiB 26-28 (one core: 8.7 ->
// 13 GB/s where the probe read 13.5-14). The lines may lie past the block or the
// matrix: a prefetch never faults.
constexpr int64_t kStreamAheadBytes = 16 << 10;

// Prefetches into L2 the kLines 64-byte lines kStreamAheadBytes after p
// (computed as an integer: the address may lie past the allocation).
template <int kLines>
inline void PrefetchStreamAhead(const uint8_t* p) {
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(p) + kStreamAheadBytes;
#pragma GCC unroll 4
  for (int i = 0; i < kLines; ++i) _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * i), _MM_HINT_T1);
}

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_X86_SIMD_H_
