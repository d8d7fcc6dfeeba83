// Fuzz target: an expert node's request path — bytes -> ComputeRequest
// (protobuf) -> ParseComputeRequest -> ComputeEngine::Compute (validation,
// then the kernels) on a tiny int4 model with every expert loaded.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <sstream>

#include "expert_node/compute_engine.h"
#include "expert_node/compute_request.h"
#include "expert_node/expert_store.h"
#include "tests/fuzz/fuzz_model.h"

namespace {

struct Node {
  std::unique_ptr<colibri::expert_node::ExpertStore> store;
  std::unique_ptr<colibri::kernels::ThreadPool> pool;
  std::unique_ptr<colibri::expert_node::ComputeEngine> engine;
};

Node& GetNode() {
  static Node node = [] {
    Node n;
    colibri::expert_node::StoreOptions options;
    options.residency = colibri::expert_node::Residency::kPaged;
    static std::ostringstream log;
    n.store = std::move(colibri::expert_node::ExpertStore::Create(colibri::fuzz::TinyModel(), options, &log).value());
    n.pool = std::move(colibri::kernels::ThreadPool::Create({1, -1, false}).value());
    n.engine = std::make_unique<colibri::expert_node::ComputeEngine>(
        n.store.get(), n.pool.get(), colibri::expert_node::ComputeEngine::Limits{64, 4096});
    return n;
  }();
  return node;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Node& node = GetNode();
  colibri::v1::ComputeRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  colibri::expert_node::ComputeInput input;
  input.check_finite = size % 2 == 0;
  if (!colibri::expert_node::ParseComputeRequest(request, 32, 4, node.engine->limits(), &input).ok()) return 0;
  (void)node.engine->Compute(input);
  return 0;
}
