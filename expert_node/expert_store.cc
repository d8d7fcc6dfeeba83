#include "expert_node/expert_store.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace colibri {
namespace expert_node {
namespace {

// The bytes an expert's views point into: its mapped file or its copy.
std::pair<const uint8_t*, size_t> Backing(const common::ExpertWeights& e) {
  if (e.copy != nullptr) return {e.copy->data(), e.copy->size()};
  return {e.file->data(), e.file->size()};
}

std::string MemlockLimit() {
  rlimit limit;
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return "unknown";
  return limit.rlim_cur == RLIM_INFINITY ? "unlimited" : absl::StrCat(limit.rlim_cur, " bytes");
}

}  // namespace

absl::StatusOr<const common::ExpertWeights*> WeightSet::Find(int64_t layer, int64_t expert) const {
  auto it = experts_.find({layer, expert});
  if (it == experts_.end()) {
    return absl::FailedPreconditionError(absl::StrCat("this node does not own layer ", layer, " expert ", expert));
  }
  return it->second.get();
}

absl::StatusOr<std::unique_ptr<ExpertStore>> ExpertStore::Create(const std::string& model_dir,
                                                                 const StoreOptions& options, std::ostream* log) {
  std::unique_ptr<ExpertStore> store(new ExpertStore(options, log));
  COLIBRI_ASSIGN_OR_RETURN(std::shared_ptr<const WeightSet> set, store->Load(model_dir, options.shard, 1));
  common::MutexLock lock(&store->mu_);  // no other thread sees the store yet; the lock states the rule
  store->current_ = std::move(set);
  store->model_dir_ = model_dir;
  store->shard_ = options.shard;
  return store;
}

std::shared_ptr<const WeightSet> ExpertStore::Current() const {
  common::MutexLock lock(&mu_);
  return current_;
}

std::string ExpertStore::model_dir() const {
  common::MutexLock lock(&mu_);
  return model_dir_;
}

absl::Status ExpertStore::Reload(const std::string& model_dir, const std::optional<ShardSpec>& shard) {
  if (!reload_mu_.TryLock()) return absl::AbortedError("another reload is in progress");
  absl::Status status = ReloadLocked(model_dir, shard);
  reload_mu_.Unlock();
  return status;
}

absl::Status ExpertStore::ReloadLocked(const std::string& model_dir, const std::optional<ShardSpec>& shard) {
  std::string dir;
  ShardSpec spec;
  uint64_t version = 0;
  {
    common::MutexLock lock(&mu_);
    dir = model_dir.empty() ? model_dir_ : model_dir;
    spec = shard.has_value() ? *shard : shard_;
    version = current_->version() + 1;
  }
  COLIBRI_ASSIGN_OR_RETURN(std::shared_ptr<const WeightSet> next, Load(dir, spec, version));
  std::shared_ptr<const WeightSet> previous;
  {
    common::MutexLock lock(&mu_);
    previous = std::move(current_);  // freed when its last in-flight call ends
    current_ = std::move(next);
    model_dir_ = dir;
    shard_ = spec;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const WeightSet>> ExpertStore::Load(const std::string& model_dir, const ShardSpec& shard,
                                                                   uint64_t version) const {
  auto set = std::make_shared<WeightSet>();
  set->version_ = version;
  COLIBRI_ASSIGN_OR_RETURN(set->model_, common::ModelDir::Open(model_dir));
  const common::Manifest& m = set->model_->manifest();
  COLIBRI_ASSIGN_OR_RETURN(set->owned_, shard.Resolve(m.n_layers, m.total_experts()));
  // Locked weights are the node's own copy (anonymous memory): a weight file
  // truncated or rewritten in place can then neither kill the node (SIGBUS
  // on a mapped page past the new end) nor change weights under live calls.
  const bool copy = options_.hugepages || options_.numa_node >= 0 || options_.lock_memory;
  bool locked = options_.lock_memory;
  std::string copy_description;
  for (const auto& [layer, expert] : set->owned_) {
    COLIBRI_ASSIGN_OR_RETURN(auto weights, set->model_->LoadExpert(layer, expert, options_.verify_checksums));
    if (copy) {
      COLIBRI_RETURN_IF_ERROR(common::CopyExpertToMemory(weights.get(), {options_.hugepages, options_.numa_node}));
      copy_description = weights->copy->description();
    } else if (weights->file != nullptr) {
      // Served from the page cache: a file truncated in place must fail the
      // calls that read it (DATA_LOSS), not kill the node with SIGBUS.
      weights->file->Guard();
    }
    const auto [data, size] = Backing(*weights);
    if (locked && mlock(data, size) != 0) {
      const std::string why = absl::StrCat(
          "mlock of ", size, " bytes for layer ", layer, " expert ", expert, " refused (", std::strerror(errno),
          "; RLIMIT_MEMLOCK is ", MemlockLimit(),
          "). Fix: raise the limit (`ulimit -l unlimited`, systemd LimitMEMLOCK=infinity, or Kubernetes "
          "securityContext.capabilities.add: [IPC_LOCK]) or set StoreOptions::require_mlock to false to run unlocked");
      if (options_.require_mlock) return absl::FailedPreconditionError(why);
      if (log_ != nullptr) *log_ << "WARNING: " << why << "; continuing with unlocked weights\n";
      locked = false;
    }
    madvise(const_cast<uint8_t*>(data), size, MADV_WILLNEED);  // advice only: failure is harmless
    set->bytes_ += size;
    set->experts_[{layer, expert}] = std::move(weights);
  }
  set->locked_ = locked;
  set->placement_ = absl::StrCat(copy ? absl::StrCat("copied (", copy_description, ")") : "mapped files",
                                 locked ? ", locked in RAM" : ", not locked");
  if (log_ != nullptr) {
    *log_ << "loaded " << set->owned_.size() << " experts of " << model_dir << " (version " << version << ", "
          << set->placement_ << ")\n";
  }
  return std::shared_ptr<const WeightSet>(std::move(set));
}

}  // namespace expert_node
}  // namespace colibri
