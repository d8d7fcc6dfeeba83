#ifndef COLIBRI_ROUTER_NODE_ENGINE_H_
#define COLIBRI_ROUTER_NODE_ENGINE_H_

// colibri::Engine — Colibri embedded in a program: the router's core with
// in-process experts (every expert of the model on this process's thread
// pool), no network. The same code path as colibri-router --local, and the
// same bits as a distributed router for the same model and routes.
//
//   auto engine = colibri::Engine::Open("model/", {});
//   std::vector<float> y(T * d_model);
//   absl::Status s = (*engine)->Forward(layer, token_ids, x, absl::MakeSpan(y));
//
// Thread-safe: Forward may be called from many threads; layers run one at a
// time on the engine's pool.

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "expert_node/expert_store.h"
#include "kernels/thread_pool.h"
#include "router_node/local_backend.h"
#include "router_node/router.h"

namespace colibri {

class Engine {
 public:
  struct Options {
    int threads = 0;           // compute threads; 0: one per allowed CPU (of numa_node)
    int numa_node = -1;        // >= 0: bind threads and weight copies to this node
    bool lock_memory = false;  // mlock the weights (a warning goes to `log` if refused)
    bool hugepages = false;    // copy the weights to transparent-huge-page memory
    // int8/int4 models: build int8 tile records at load (StoreOptions::q8_records;
    // needs lock_memory, hugepages or a numa_node). Their tile thresholds are the kernel
    // profile's for records: a node started with --q8_records answers like an
    // engine with this set, not like one without.
    bool q8_records = false;
    bool verify_checksums = true;  // hash every file at load
    int64_t max_tokens = 65536;    // tokens per Forward
    // > 0: concurrent Forward calls of one layer (from several threads) are
    // merged into one pass (router_node/layer_batcher.h); 0: off.
    absl::Duration batch_window = absl::ZeroDuration();
    int64_t batch_max_tokens = 256;
    // The memory this process may use, in bytes. A load whose resident weights
    // (locked, copied to huge pages or a NUMA node, int8 records) would not fit
    // in it beside 256 MiB for the process is refused FAILED_PRECONDITION before
    // anything is copied or locked, rather than killed by the kernel halfway.
    // Unset: the limit of the process's cgroup (common::ReadCgroupLimits), if
    // it has one; -1: none. Mapped weights (the default) count nothing: the
    // kernel may reclaim them. `memory_limit_source` names the limit in errors.
    std::optional<int64_t> memory_limit;
    std::string memory_limit_source;
    std::ostream* log = nullptr;                 // warnings; null: none. Must outlive the engine.
    common::MetricsRegistry* metrics = nullptr;  // optional; must outlive the engine
  };

  // Loads every expert, gate and LUT of the converted model in `model_dir`.
  // Errors name the file and the reason (NOT_FOUND, DATA_LOSS for a checksum,
  // INVALID_ARGUMENT for a malformed file or option).
  static absl::StatusOr<std::unique_ptr<Engine>> Open(const std::string& model_dir, const Options& options);

  // The general call: any routing mode, input and output dtype, routes and
  // timings returned. Errors as router_node::Router::Forward.
  absl::StatusOr<router_node::ForwardOutput> Forward(const router_node::ForwardInput& input);

  // The common call: LUT routing, f32 in and out. `hidden` and `out` hold
  // token_ids.size() * d_model values (INVALID_ARGUMENT otherwise).
  absl::Status Forward(int32_t layer, absl::Span<const int32_t> token_ids, absl::Span<const float> hidden,
                       absl::Span<float> out);

  const common::Manifest& manifest() const { return router_->manifest(); }
  router_node::Router& router() { return *router_; }
  // Bytes of weights held in memory whatever the kernel needs (locked or copied).
  int64_t resident_bytes() const { return store_->ResidentBytes(); }

 private:
  Engine() = default;

  std::unique_ptr<expert_node::ExpertStore> store_;
  std::unique_ptr<kernels::ThreadPool> pool_;
  std::unique_ptr<router_node::LocalBackend> backend_;
  std::unique_ptr<router_node::Router> router_;
};

}  // namespace colibri

#endif  // COLIBRI_ROUTER_NODE_ENGINE_H_
