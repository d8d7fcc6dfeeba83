// bf16 block kernel with AVX512_BF16 (vdpbf16ps); this file's own compile
// flags add -mavx512bf16 to the AVX-512 ones.
//
// The stored layout [K/2][64][2] is the VNNI-pair layout vdpbf16ps reads: the
// 4 zmm of input pair p hold, per 32-bit lane, (w[2p], w[2p+1]) of 16
// consecutive outputs. A tile of up to 6 tokens keeps 4 accumulators per token
// (its 64 outputs); per pair it loads the 4 weight vectors once and, for each
// token, broadcasts the 32-bit pair (x[t][2p], x[t][2p+1]) of x.bf16 and does
// acc += w_even·x_even + w_odd·x_odd with one vdpbf16ps per vector: 24
// accumulators + 4 weights + 1 broadcast registers. Pairs run in increasing
// order, so each token's bits depend on nothing but its own inputs (not on T
// or on its place in the batch). When T needs more than one tile, k is split
// into chunks of 256 KiB of weights and all tiles run over a chunk before the
// next one (partial sums wait in `out`, exactly), so tiles after the first
// read the chunk from L2 instead of memory.

#include "kernels/x86_simd.h"

#include <algorithm>
#include <cstring>

#include "kernels/block_kernel.h"

namespace colibri {
namespace kernels {
namespace {

using common::kBlockRows;

constexpr int64_t kMaxTile = 6;             // tokens per tile
constexpr int64_t kChunkBytes = 256 << 10;  // weights per k-chunk when T > kMaxTile
constexpr int64_t kPairBytes = 64 * 2 * 2;  // one input pair of the block: 4 zmm

inline __m512bh AsBf16(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// Tokens [t0, t0 + TT), inputs [k0, k1) (even bounds).
template <int TT>
void Tile(const uint8_t* wb, const Activations& x, int64_t t0, int64_t k0, int64_t k1, float* out) {
  float* o = out + t0 * kBlockRows;
  __m512 acc[TT][4];
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      acc[t][i] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(o + t * kBlockRows + 16 * i);
    }
  }
  const uint16_t* xs = x.bf16 + t0 * x.cols;
  const uint8_t* p = wb + (k0 / 2) * kPairBytes;
  for (int64_t k = k0; k < k1; k += 2, p += kPairBytes) {
    __m512bh w[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) w[i] = AsBf16(_mm512_loadu_si512(p + 64 * i));
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      int32_t pair;
      std::memcpy(&pair, xs + t * x.cols + k, 4);
      const __m512bh xv = AsBf16(_mm512_set1_epi32(pair));
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) acc[t][i] = _mm512_dpbf16_ps(acc[t][i], w[i], xv);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(o + t * kBlockRows + 16 * i, acc[t][i]);
  }
}

using TileFn = void (*)(const uint8_t*, const Activations&, int64_t, int64_t, int64_t, float*);
constexpr TileFn kTiles[kMaxTile] = {Tile<1>, Tile<2>, Tile<3>, Tile<4>, Tile<5>, Tile<6>};

}  // namespace

void BlockBf16Avx512Bf16(const common::MatrixView& w, int64_t block, const Activations& x, float* out) {
  const int64_t K = x.cols, T = x.num_tokens;
  const int64_t chunk = T <= kMaxTile ? K : std::max<int64_t>(64, kChunkBytes / (kPairBytes / 2) / 64 * 64);
  const uint8_t* wb = w.data + block * w.layout.block_bytes;
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t k1 = std::min(K, k0 + chunk);
    for (int64_t t0 = 0; t0 < T; t0 += kMaxTile) kTiles[std::min(kMaxTile, T - t0) - 1](wb, x, t0, k0, k1, out);
  }
}

}  // namespace kernels
}  // namespace colibri
