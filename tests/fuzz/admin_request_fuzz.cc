// Fuzz target: an expert node's admin path — bytes -> ReloadRequest
// (protobuf) -> ParseReloadRequest (root confinement, shard spec) ->
// ExpertStore::Reload (keeping the previous set or not) or Drop on a tiny
// int4 model whose parent is the model root. Whatever happens, a weight set
// must serve.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <sstream>

#include "expert_node/expert_store.h"
#include "expert_node/reload_request.h"
#include "tests/fuzz/fuzz_model.h"

namespace {

colibri::expert_node::ExpertStore& GetStore() {
  static std::unique_ptr<colibri::expert_node::ExpertStore> store = [] {
    colibri::expert_node::StoreOptions options;
    options.residency = colibri::expert_node::Residency::kPaged;
    options.verify_checksums = false;  // speed: checksums have their own tests and fuzz target
    static std::ostringstream log;
    return std::move(colibri::expert_node::ExpertStore::Create(colibri::fuzz::TinyModel(), options, &log).value());
  }();
  return *store;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  colibri::expert_node::ExpertStore& store = GetStore();
  colibri::v1::ReloadRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  const std::string root = std::filesystem::path(colibri::fuzz::TinyModel()).parent_path().string();
  colibri::expert_node::ReloadInput input;
  if (!colibri::expert_node::ParseReloadRequest(request, size % 3 == 0 ? "" : root, &input).ok()) return 0;
  if (input.drop_model_id.empty()) {
    (void)store.Reload(input.model_dir, input.shard, input.keep_previous);
  } else {
    (void)store.Drop(input.drop_model_id);
  }
  // A reload or a drop never leaves the node without weights, nor a previous set without a current one.
  if (store.Current() == nullptr) std::abort();
  if (store.ForModel(store.Current()->model().model_id()) != store.Current()) std::abort();
  return 0;
}
