#include "router_node/engine.h"

#include <cstring>
#include <ostream>

#include "absl/strings/str_cat.h"
#include "common/cgroup_limits.h"
#include "common/status_macros.h"
#include "kernels/dispatch.h"

namespace colibri {
namespace {

// Where warnings go when the embedding program gives no log: nowhere.
std::ostream* NullStream() {
  static std::ostream null_stream(nullptr);
  return &null_stream;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Open(const std::string& model_dir, const Options& options) {
  std::unique_ptr<Engine> e(new Engine());
  expert_node::StoreOptions store;
  store.verify_checksums = options.verify_checksums;
  store.residency = options.lock_memory ? expert_node::Residency::kLocked : expert_node::Residency::kPaged;
  store.verify_threads = options.threads > 0 ? options.threads : common::UsableCpus();
  store.hugepages = options.hugepages;
  store.q8_records = options.q8_records;
  store.numa_node = options.numa_node;
  if (options.memory_limit.has_value()) {
    store.memory_limit = *options.memory_limit;
    store.memory_limit_source = options.memory_limit_source;
  } else if (const common::CgroupLimits cgroup = common::ReadCgroupLimits(); cgroup.memory_bytes >= 0) {
    store.memory_limit = cgroup.memory_bytes;
    store.memory_limit_source = cgroup.memory_file;
  }
  store.memory_reserve = common::kProcessMemoryBytes;
  store.memory_advice =
      "Raise the limit, or open the engine without Engine::Options::lock_memory, hugepages and numa_node: the "
      "weights then stay mapped files, which the kernel may reclaim";
  // The pool first: a NUMA node it cannot use is refused before the weights are read.
  COLIBRI_ASSIGN_OR_RETURN(e->pool_, kernels::ThreadPool::Create({options.threads, options.numa_node, /*pin=*/true}));
  COLIBRI_ASSIGN_OR_RETURN(e->store_, expert_node::ExpertStore::Create(
                                          model_dir, store, options.log != nullptr ? options.log : NullStream()));
  kernels::SelectedKernels();  // the kernel profile is read (or measured, once per host) now, not in the first call
  e->backend_ = std::make_unique<router_node::LocalBackend>(e->store_.get(), e->pool_.get());
  router_node::RouterOptions router;
  router.max_tokens = options.max_tokens;
  router.batching.window = options.batch_window;
  router.batching.max_tokens = options.batch_max_tokens;
  router.verify_checksums = options.verify_checksums;
  router.metrics = options.metrics;
  COLIBRI_ASSIGN_OR_RETURN(e->router_, router_node::Router::Create(model_dir, e->backend_.get(), router));
  return e;
}

absl::StatusOr<router_node::ForwardOutput> Engine::Forward(const router_node::ForwardInput& input) {
  router_node::CallControl control;
  return router_->Forward(input, control);
}

absl::Status Engine::Forward(int32_t layer, absl::Span<const int32_t> token_ids, absl::Span<const float> hidden,
                             absl::Span<float> out) {
  const int64_t d_model = manifest().d_model;
  const int64_t values = static_cast<int64_t>(token_ids.size()) * d_model;
  if (static_cast<int64_t>(out.size()) != values) {
    return absl::InvalidArgumentError(absl::StrCat("out holds ", out.size(), " values; ", token_ids.size(),
                                                   " tokens x d_model ", d_model, " need ", values));
  }
  router_node::ForwardInput in;
  in.layer = layer;
  in.token_ids = token_ids;
  in.hidden = hidden.data();
  in.hidden_bytes = static_cast<int64_t>(hidden.size()) * 4;
  in.num_tokens = static_cast<int64_t>(token_ids.size());
  in.cols = d_model;
  COLIBRI_ASSIGN_OR_RETURN(router_node::ForwardOutput result, Forward(in));
  if (!result.output.empty()) std::memcpy(out.data(), result.output.data(), result.output.size());
  return absl::OkStatus();
}

}  // namespace colibri
