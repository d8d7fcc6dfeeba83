#ifndef COLIBRI_EXPERT_NODE_EXPERT_STORE_H_
#define COLIBRI_EXPERT_NODE_EXPERT_STORE_H_

// The weights an expert node owns: the (layer, expert) files of its shard,
// mapped read-only from the model directory, verified, locked in RAM and
// advised — or copied into huge-page / NUMA-bound memory — and swapped
// atomically on reload.
//
// A WeightSet is immutable and shared: each request takes Current() and keeps
// that shared_ptr until it finishes, so a reload never changes the weights
// under a running call; the old set is unmapped when its last user lets go.
// Reload builds and verifies the new set beside the old one and swaps only on
// success: a failed reload leaves the node serving the old weights and
// returns the reason. ExpertStore is thread-safe.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/model_dir.h"
#include "common/mutex.h"
#include "expert_node/shard_spec.h"

namespace colibri {
namespace expert_node {

struct StoreOptions {
  ShardSpec shard;               // default: all experts of all layers
  bool verify_checksums = true;  // hash every owned file at load
  // Copy the weights into anonymous memory and mlock them: files changed in
  // place afterwards never reach the node. false: serve from the mapped
  // files (page cache), which must then not be truncated or rewritten in
  // place while loaded (write new versions to a new directory and Reload it).
  bool lock_memory = true;
  bool require_mlock = false;  // fail (instead of warning and running unlocked) if mlock is refused
  bool hugepages = false;      // copy weights to MADV_HUGEPAGE anonymous memory
  int numa_node = -1;          // >= 0: copy weights to memory bound to this node (implies a copy)
};

class WeightSet {
 public:
  const common::ModelDir& model() const { return *model_; }
  uint64_t version() const { return version_; }
  // True if every owned expert is locked in RAM.
  bool locked() const { return locked_; }
  // Where the weights live, for logs and GetNodeInfo: e.g. "mapped files, locked".
  const std::string& placement() const { return placement_; }
  const std::vector<std::pair<int64_t, int64_t>>& owned() const { return owned_; }
  // Bytes of the owned experts' files (or their copies).
  uint64_t bytes() const { return bytes_; }

  // FAILED_PRECONDITION naming the layer and expert when this set does not own it.
  absl::StatusOr<const common::ExpertWeights*> Find(int64_t layer, int64_t expert) const;

 private:
  friend class ExpertStore;
  std::unique_ptr<common::ModelDir> model_;
  uint64_t version_ = 0;
  bool locked_ = false;
  uint64_t bytes_ = 0;
  std::string placement_;
  std::vector<std::pair<int64_t, int64_t>> owned_;
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<common::ExpertWeights>> experts_;
};

class ExpertStore {
 public:
  // Loads `model_dir`'s shard. Errors name the file and the reason (see
  // ModelDir); FAILED_PRECONDITION if mlock is refused and require_mlock.
  // Warnings (mlock refused, huge pages refused) go to `log`, which must
  // outlive the store.
  static absl::StatusOr<std::unique_ptr<ExpertStore>> Create(const std::string& model_dir, const StoreOptions& options,
                                                             std::ostream* log);

  // The weights new calls should use. Never null after Create.
  std::shared_ptr<const WeightSet> Current() const;

  // Loads `model_dir` (empty: the current directory again) with `shard`
  // (nullopt: the current one) beside the current set, then swaps. On error
  // the current set stays. ABORTED if another reload is running.
  absl::Status Reload(const std::string& model_dir, const std::optional<ShardSpec>& shard);

  std::string model_dir() const;

 private:
  ExpertStore(StoreOptions options, std::ostream* log) : options_(std::move(options)), log_(log) {}
  absl::StatusOr<std::shared_ptr<const WeightSet>> Load(const std::string& model_dir, const ShardSpec& shard,
                                                        uint64_t version) const;
  absl::Status ReloadLocked(const std::string& model_dir, const std::optional<ShardSpec>& shard)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(reload_mu_);

  const StoreOptions options_;
  std::ostream* const log_;

  common::Mutex reload_mu_;  // one reload at a time
  mutable common::Mutex mu_;
  std::shared_ptr<const WeightSet> current_ ABSL_GUARDED_BY(mu_);
  std::string model_dir_ ABSL_GUARDED_BY(mu_);
  ShardSpec shard_ ABSL_GUARDED_BY(mu_);
};

}  // namespace expert_node
}  // namespace colibri

#endif  // COLIBRI_EXPERT_NODE_EXPERT_STORE_H_
