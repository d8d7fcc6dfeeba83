#include "kernels/x86_simd.h"

#include "kernels/bandwidth.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/dispatch.h"

namespace colibri {
namespace kernels {
namespace {

__attribute__((target("avx512f"))) uint64_t ReadAvx512(const uint8_t* p, size_t n) {
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  for (size_t i = 0; i + 256 <= n; i += 256) {
    a = _mm512_xor_si512(a, _mm512_load_si512(p + i));
    b = _mm512_xor_si512(b, _mm512_load_si512(p + i + 64));
    c = _mm512_xor_si512(c, _mm512_load_si512(p + i + 128));
    d = _mm512_xor_si512(d, _mm512_load_si512(p + i + 192));
  }
  const __m512i x = _mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d));
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(x));
}

__attribute__((target("avx2"))) uint64_t ReadAvx2(const uint8_t* p, size_t n) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (size_t i = 0; i + 128 <= n; i += 128) {
    a = _mm256_xor_si256(a, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    b = _mm256_xor_si256(b, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    c = _mm256_xor_si256(c, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    d = _mm256_xor_si256(d, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  const __m256i x = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
  return static_cast<uint64_t>(_mm256_extract_epi64(x, 0) ^ _mm256_extract_epi64(x, 3));
}

uint64_t ReadScalar(const uint8_t* p, size_t n) {
  uint64_t acc[4] = {};
  for (size_t i = 0; i + 32 <= n; i += 32) {
    for (int j = 0; j < 4; ++j) {
      uint64_t v;
      std::memcpy(&v, p + i + 8 * j, 8);
      acc[j] ^= v;
    }
  }
  return acc[0] ^ acc[1] ^ acc[2] ^ acc[3];
}

}  // namespace

std::unique_ptr<ReadProbe> ReadProbe::Create(ThreadPool& pool, size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  bytes = (bytes + kHuge - 1) / kHuge * kHuge;
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return nullptr;
  madvise(mem, bytes, MADV_HUGEPAGE);
  auto* buffer = static_cast<uint8_t*>(mem);
  const size_t share = bytes / pool.size() / 256 * 256;
  pool.Run([&](int w) { std::memset(buffer + w * share, w + 1, share); });  // first touch by its reader
  return std::unique_ptr<ReadProbe>(new ReadProbe(pool, buffer, bytes, share));
}

ReadProbe::~ReadProbe() { munmap(buffer_, bytes_); }

double ReadProbe::Pass() {
  static const Isa isa = DetectIsa();
  std::atomic<uint64_t> sink{0};
  const auto start = std::chrono::steady_clock::now();
  pool_.Run([&](int w) {
    const uint8_t* p = buffer_ + w * share_;
    const uint64_t v = isa >= Isa::kAvx512 ? ReadAvx512(p, share_)
                       : isa == Isa::kAvx2 ? ReadAvx2(p, share_)
                                           : ReadScalar(p, share_);
    sink.fetch_xor(v, std::memory_order_relaxed);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return static_cast<double>(share_) * pool_.size() / seconds / 1e9;
}

BandwidthResult MeasureReadBandwidth(ThreadPool& pool, size_t bytes, int passes) {
  const std::unique_ptr<ReadProbe> probe = passes >= 1 ? ReadProbe::Create(pool, bytes) : nullptr;
  if (probe == nullptr) return {};
  probe->Pass();  // warm-up
  std::vector<double> gbps;
  for (int pass = 0; pass < passes; ++pass) gbps.push_back(probe->Pass());
  std::sort(gbps.begin(), gbps.end());
  BandwidthResult r;
  r.best_gbps = gbps.back();
  r.median_gbps = gbps[gbps.size() / 2];
  return r;
}

}  // namespace kernels
}  // namespace colibri
