// Fuzz target: the C API. The input is read as: layer (int32), routing
// (int32), n_tokens (0..64 from one byte), then token ids, hidden values and
// client routes as raw int32/float data (short inputs leave the rest zero);
// colibri_forward must answer every combination with a status, never crash.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "router_node/colibri.h"
#include "tests/fuzz/fuzz_model.h"

namespace {

template <typename T>
T Take(const uint8_t*& p, const uint8_t* end) {
  T v{};
  const size_t n = std::min<size_t>(sizeof(T), static_cast<size_t>(end - p));
  std::memcpy(&v, p, n);
  p += n;
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static colibri_engine* engine = [] {
    colibri_options options;
    colibri_options_init(&options);
    options.threads = 1;
    options.max_tokens = 64;
    colibri_engine* e = nullptr;
    if (colibri_init(colibri::fuzz::TinyModel().c_str(), &options, &e) != COLIBRI_OK) std::abort();
    return e;
  }();
  const uint8_t* p = data;
  const uint8_t* end = data + size;
  const int32_t layer = Take<int32_t>(p, end);
  const int32_t routing = Take<int32_t>(p, end);
  const int64_t n = Take<uint8_t>(p, end) % 65;
  std::vector<int32_t> ids(n), experts(n * 2);
  std::vector<float> hidden(n * 32), weights(n * 2), out(n * 32), route_weights(n * 2);
  std::vector<int32_t> route_experts(n * 2);
  for (auto& v : ids) v = Take<int32_t>(p, end);
  for (auto& v : hidden) v = Take<float>(p, end);
  for (auto& v : experts) v = Take<int32_t>(p, end);
  for (auto& v : weights) v = Take<float>(p, end);
  (void)colibri_forward(engine, layer, routing, ids.data(), n, hidden.data(), experts.data(), weights.data(),
                        out.data(), route_experts.data(), route_weights.data());
  (void)colibri_forward_batch(engine, layer, ids.data(), n, hidden.data(), out.data());
  (void)colibri_last_error(nullptr);
  return 0;
}
