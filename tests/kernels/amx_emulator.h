#ifndef COLIBRI_TESTS_KERNELS_AMX_EMULATOR_H_
#define COLIBRI_TESTS_KERNELS_AMX_EMULATOR_H_

// A scalar model of the AMX instructions the tile kernels use, as the
// Intel SDM describes them (palette 1: 8 tiles of up to 16 rows × 64 bytes),
// for kernels::TileBf16AmxWith and TileQ8AmxWith on CPUs without AMX. It also refuses what the
// hardware faults on: a tile used while unconfigured or after tilerelease,
// a configuration out of range, and tdpbf16ps operands whose shapes do not
// agree (the #UD cases). A refusal throws std::logic_error naming it.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/dtype.h"
#include "kernels/amx_tiles.h"

namespace colibri {
namespace kernels {

struct EmulatedTiles {
  struct State {
    AmxTileConfig config;
    bool configured = false;
    alignas(64) uint8_t tile[8][16][64] = {};  // aligned: C rows are read as f32
    int64_t dot_products = 0;                  // tdpbf16ps and tdpbsud executed
    // Where Prefetch and PrefetchL1 may point, [begin, end) (a test narrows
    // them; anywhere by default), and how many of each were issued.
    uintptr_t prefetch_begin = 0, prefetch_end = UINTPTR_MAX;
    uintptr_t l1_begin = 0, l1_end = UINTPTR_MAX;
    int64_t prefetches = 0, l1_prefetches = 0;
  };
  static State& state() {
    thread_local State s;
    return s;
  }

  static void Configure(const AmxTileConfig& c) {
    if (c.palette != 1) Fail("ldtilecfg: palette " + std::to_string(c.palette));
    for (int t = 0; t < 8; ++t) {
      if (c.rows[t] > 16 || c.colsb[t] > 64 || (c.rows[t] == 0) != (c.colsb[t] == 0)) {
        Fail("ldtilecfg: tile " + std::to_string(t) + " rows " + std::to_string(c.rows[t]) + " colsb " +
             std::to_string(c.colsb[t]));
      }
    }
    State& s = state();
    s.config = c;
    s.configured = true;
    std::memset(s.tile, 0, sizeof(s.tile));
  }
  template <int kTile>
  static void Zero() {
    Use(kTile);
    std::memset(state().tile[kTile], 0, sizeof(state().tile[kTile]));
  }
  template <int kTile>
  static void Load(const void* base, int64_t stride) {
    Use(kTile);
    State& s = state();
    std::memset(s.tile[kTile], 0, sizeof(s.tile[kTile]));
    for (int r = 0; r < s.config.rows[kTile]; ++r) {
      std::memcpy(s.tile[kTile][r], static_cast<const uint8_t*>(base) + r * stride, s.config.colsb[kTile]);
    }
  }
  template <int kTile>
  static void Store(void* base, int64_t stride) {
    Use(kTile);
    const State& s = state();
    for (int r = 0; r < s.config.rows[kTile]; ++r) {
      std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.tile[kTile][r], s.config.colsb[kTile]);
    }
  }
  // tdpbf16ps: C[m][n] += Σ_k A[m][2k]·B[k][2n] + A[m][2k+1]·B[k][2n+1] in
  // f32, k in order, each product added to C (the SDM sums the even and the
  // odd products apart first: the same sum, other last bits); inputs and
  // results below the normal range are 0.
  template <int kC, int kA, int kB>
  static void DotBf16() {
    static_assert(kC != kA && kC != kB && kA != kB, "tdpbf16ps needs three distinct tiles");
    const auto [m_rows, n_cols, k_pairs] = Operands("tdpbf16ps", kC, kA, kB);
    State& s = state();
    for (int m = 0; m < m_rows; ++m) {
      float* row = reinterpret_cast<float*>(s.tile[kC][m]);
      for (int k = 0; k < k_pairs; ++k) {
        for (int n = 0; n < n_cols; ++n) {
          float acc = row[n];
          for (int i = 0; i < 2; ++i)
            acc = Flush(acc + Bf16(s.tile[kA][m], 2 * k + i) * Bf16(s.tile[kB][k], 2 * n + i));
          row[n] = acc;
        }
      }
    }
    ++s.dot_products;
  }
  // tdpbsud: C[m][n] += Σ_k Σ_i A[m][4k+i] · B[k][4n+i] in int32 (wrapping),
  // A's bytes signed, B's unsigned.
  template <int kC, int kA, int kB>
  static void DotS8U8() {
    static_assert(kC != kA && kC != kB && kA != kB, "tdpbsud needs three distinct tiles");
    const auto [m_rows, n_cols, k_quads] = Operands("tdpbsud", kC, kA, kB);
    State& s = state();
    for (int m = 0; m < m_rows; ++m) {
      for (int n = 0; n < n_cols; ++n) {
        uint32_t acc;
        std::memcpy(&acc, s.tile[kC][m] + 4 * n, 4);
        for (int k = 0; k < k_quads; ++k) {
          for (int i = 0; i < 4; ++i) {
            const int32_t a = static_cast<int8_t>(s.tile[kA][m][4 * k + i]);
            const int32_t b = s.tile[kB][k][4 * n + i];
            acc += static_cast<uint32_t>(a * b);
          }
        }
        std::memcpy(s.tile[kC][m] + 4 * n, &acc, 4);
      }
    }
    ++s.dot_products;
  }
  static void Prefetch(const void* p) {
    State& s = state();
    Hint("prefetch", p, s.prefetch_begin, s.prefetch_end);
    ++s.prefetches;
  }
  static void PrefetchL1(const void* p) {
    State& s = state();
    Hint("prefetch to L1", p, s.l1_begin, s.l1_end);
    ++s.l1_prefetches;
  }
  static void Release() { state().configured = false; }

 private:
  struct Dims {
    int m, n, k;  // rows of C and A, 4-byte columns of C and B, 4-byte columns of A = rows of B
  };
  // The dimensions of a tile product c += a · b, refusing unconfigured
  // tiles and shapes that do not agree (the hardware's #UD).
  static Dims Operands(const char* instruction, int c, int a, int b) {
    Use(c), Use(a), Use(b);
    const AmxTileConfig& config = state().config;
    const Dims d{config.rows[c], config.colsb[c] / 4, config.colsb[a] / 4};
    if (config.rows[a] != d.m || config.colsb[b] != config.colsb[c] || config.rows[b] != d.k) {
      Fail(std::string(instruction) + ": shapes C " + Shape(c) + ", A " + Shape(a) + ", B " + Shape(b) +
           " do not agree");
    }
    return d;
  }
  static void Fail(const std::string& what) { throw std::logic_error("emulated AMX: " + what); }
  // A hint cannot fault, so a wrong address would go unseen on the hardware.
  static void Hint(const char* what, const void* p, uintptr_t begin, uintptr_t end) {
    const auto at = reinterpret_cast<uintptr_t>(p);
    if (at < begin || at >= end) Fail(std::string(what) + " of an address outside the bytes the test allows");
  }
  static void Use(int tile) {
    const State& s = state();
    if (!s.configured) Fail("tile " + std::to_string(tile) + " used without a configuration");
    if (s.config.rows[tile] == 0) Fail("tile " + std::to_string(tile) + " is not configured");
  }
  static std::string Shape(int tile) {
    return std::to_string(state().config.rows[tile]) + "x" + std::to_string(state().config.colsb[tile]) + "B";
  }
  static float Flush(float v) { return std::fabs(v) < 1.17549435e-38f ? 0.f : v; }
  static float Bf16(const uint8_t* row, int i) {
    uint16_t bits;
    std::memcpy(&bits, row + 2 * i, sizeof(bits));
    return Flush(common::Bf16ToFloat(bits));
  }
};

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_TESTS_KERNELS_AMX_EMULATOR_H_
