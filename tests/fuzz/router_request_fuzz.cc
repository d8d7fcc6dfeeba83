// Fuzz target: the router's request path — bytes -> ForwardRequest
// (protobuf) -> ParseForwardRequest -> Router::Forward (routing in every
// mode, validation, the plan, the in-process experts, aggregation, output
// dtypes) on a tiny int4 model.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "router_node/engine.h"
#include "router_node/forward_request.h"
#include "tests/fuzz/fuzz_model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static std::unique_ptr<colibri::Engine> engine = [] {
    colibri::Engine::Options options;
    options.threads = 1;
    options.max_tokens = 64;
    return std::move(colibri::Engine::Open(colibri::fuzz::TinyModel(), options).value());
  }();
  colibri::v1::ForwardRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  auto input = colibri::router_node::ParseForwardRequest(request);
  if (!input.ok()) return 0;
  (void)engine->Forward(*input);
  return 0;
}
