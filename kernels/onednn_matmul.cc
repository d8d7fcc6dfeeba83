#include "kernels/onednn_matmul.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>
#include <vector>

#include "common/mutex.h"
#include "dnnl.hpp"
#include "kernels/dispatch.h"

namespace colibri {
namespace kernels {
namespace {

using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t>;  // type, T, K, n, ldd

struct Cached {
  dnnl::matmul primitive;
  dnnl::memory::desc src, weights, dst;
  size_t scratchpad_bytes = 0;
};

// The engine, with oneDNN kept off AMX first where Colibri is (it can be set
// only before oneDNN's first primitive): with COLIBRI_MAX_ISA below
// avx512_amx, or AMX unusable, no oneDNN kernel runs tile instructions either.
dnnl::engine MakeEngine() {
  if (KeepOneDnnOffAmx() && dnnl::set_max_cpu_isa(dnnl::cpu_isa::avx512_core_bf16) != dnnl::status::success) {
    std::fprintf(stderr, "colibri: could not keep oneDNN off AMX (dnnl::set_max_cpu_isa)\n");
  }
  return dnnl::engine(dnnl::engine::kind::cpu, 0);
}

dnnl::engine& Engine() {
  static dnnl::engine engine = MakeEngine();
  return engine;
}

const Cached& Lookup(const Key& key) {
  static common::Mutex mu;
  static std::map<Key, Cached>* cache = new std::map<Key, Cached>();  // never destroyed
  common::MutexLock lock(&mu);
  auto it = cache->find(key);
  if (it != cache->end()) return it->second;
  const auto [type, t, k, n, ldd] = key;
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  const bool bf16 = type == static_cast<int>(common::DType::kBF16);
  Cached c;
  c.src = dnnl::memory::desc({t, k}, bf16 ? dt::bf16 : dt::f32, tag::ab);
  c.weights = dnnl::memory::desc({k, n}, bf16 ? dt::bf16 : dt::f32, bf16 ? tag::BA16a64b2a : tag::BA16a64b);
  c.dst = dnnl::memory::desc({t, n}, dt::f32, dnnl::memory::dims{ldd, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  try {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(c.src, c.weights, c.dst), attr, Engine());
    c.scratchpad_bytes = pd.scratchpad_desc().get_size();
    c.primitive = dnnl::matmul(pd);
  } catch (const dnnl::error& e) {
    std::fprintf(stderr, "colibri: oneDNN cannot create a matmul (T=%ld K=%ld n=%ld): %s\n", static_cast<long>(t),
                 static_cast<long>(k), static_cast<long>(n), e.what());
    std::abort();
  }
  return cache->emplace(key, std::move(c)).first->second;
}

}  // namespace

bool OnednnMatmulAvailable(common::DType type) {
  const auto probe = [](common::DType t) {
    using dt = dnnl::memory::data_type;
    using tag = dnnl::memory::format_tag;
    const bool bf16 = t == common::DType::kBF16;
    try {
      const dnnl::memory::desc src({2, 64}, bf16 ? dt::bf16 : dt::f32, tag::ab);
      const dnnl::memory::desc weights({64, 64}, bf16 ? dt::bf16 : dt::f32, bf16 ? tag::BA16a64b2a : tag::BA16a64b);
      const dnnl::memory::desc dst({2, 64}, dt::f32, tag::ab);
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, weights, dst), Engine());
      // Its reference implementation (plain loops, "ref:any") is no matmul to choose.
      return std::strncmp(pd.impl_info_str(), "ref", 3) != 0;
    } catch (const dnnl::error&) {
      return false;
    }
  };
  static const bool bf16 = probe(common::DType::kBF16);
  static const bool f32 = probe(common::DType::kF32);
  return type == common::DType::kBF16 ? bf16 : type == common::DType::kF32 && f32;
}

void OnednnMatmul(common::DType type, int64_t num_tokens, int64_t cols, int64_t n, const void* src, const void* weights,
                  float* dst, int64_t ldd) {
  const Cached& c = Lookup(Key{static_cast<int>(type), num_tokens, cols, n, ldd});
  thread_local dnnl::stream stream(Engine());
  thread_local std::vector<uint8_t> scratchpad;
  if (scratchpad.size() < std::max<size_t>(1, c.scratchpad_bytes))
    scratchpad.resize(std::max<size_t>(1, c.scratchpad_bytes));
  dnnl::engine& engine = Engine();
  // oneDNN takes non-const handles; it only reads src and weights.
  dnnl::memory src_mem(c.src, engine, const_cast<void*>(src));
  dnnl::memory wei_mem(c.weights, engine, const_cast<void*>(weights));
  dnnl::memory dst_mem(c.dst, engine, dst);
  dnnl::memory scratch_mem(dnnl::memory::desc({std::max<int64_t>(1, static_cast<int64_t>(c.scratchpad_bytes))},
                                              dnnl::memory::data_type::u8, dnnl::memory::format_tag::a),
                           engine, scratchpad.data());
  c.primitive.execute(stream, {{DNNL_ARG_SRC, src_mem},
                               {DNNL_ARG_WEIGHTS, wei_mem},
                               {DNNL_ARG_DST, dst_mem},
                               {DNNL_ARG_SCRATCHPAD, scratch_mem}});
  stream.wait();
}

}  // namespace kernels
}  // namespace colibri
