#include "expert_node/expert_store.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/anonymous_memory.h"
#include "common/cgroup_limits.h"
#include "common/file_verifier.h"
#include "common/log_line.h"
#include "common/parallel_for.h"
#include "common/sigbus_guard.h"
#include "common/status_macros.h"
#include "kernels/dispatch.h"
#include "kernels/expert_executor.h"

namespace colibri {
namespace expert_node {
namespace {

// Free reserved 2 MiB pages (of `node`, or of the host for -1) that no
// mapping has reserved, in bytes. A pod's hugetlb limit may allow fewer:
// copies that do not get them are counted once made (ExpertServer).
int64_t FreeHugetlbBytes(int node) {
  const std::string host = "/sys/kernel/mm/hugepages/hugepages-2048kB/";
  const std::string dir =
      node >= 0 ? absl::StrCat("/sys/devices/system/node/node", node, "/hugepages/hugepages-2048kB/") : host;
  const auto pages = [](const std::string& path) -> int64_t {
    int64_t n = 0;
    const std::optional<std::string> text = common::ReadKernelFile(path, 64);
    return text.has_value() && absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &n) ? n : 0;
  };
  // Reservations are counted for the host only: they may be on any node.
  return std::max<int64_t>(0, pages(dir + "free_hugepages") - pages(host + "resv_hugepages")) * (int64_t{2} << 20);
}

// The bytes an expert's views point into: its mapped file or its copy.
std::pair<const uint8_t*, size_t> Backing(const common::ExpertWeights& e) {
  if (e.copy != nullptr) return {e.copy->data(), e.copy->size()};
  return {e.file->data(), e.file->size()};
}

// common::ParallelFor; the error of the lowest index that failed, else OK.
absl::Status ParallelFor(size_t n, int threads, const std::function<absl::Status(size_t)>& fn) {
  std::vector<absl::Status> status(n);
  common::ParallelFor(n, threads, [&](size_t i) { status[i] = fn(i); });
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

std::string MemlockLimit() {
  rlimit limit;
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return "unknown";
  return limit.rlim_cur == RLIM_INFINITY ? "unlimited" : absl::StrCat(limit.rlim_cur, " bytes");
}

}  // namespace

const char* ResidencyName(Residency residency) {
  switch (residency) {
    case Residency::kLocked: return "locked";
    case Residency::kCopy: return "copy";
    case Residency::kPaged: return "paged";
  }
  return "?";
}

absl::StatusOr<Residency> ParseResidency(const std::string& name) {
  for (Residency r : {Residency::kLocked, Residency::kCopy, Residency::kPaged}) {
    if (name == ResidencyName(r)) return r;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("StoreOptions::residency '", name, "' is not one of locked, copy, paged"));
}

WeightSet::~WeightSet() {
  stop_locking_ = true;
  if (!locker_.joinable()) return;
  if (locker_.get_id() == std::this_thread::get_id()) {
    locker_.detach();  // released on its own locking thread: it ends right after
  } else {
    locker_.join();
  }
}

void WeightSet::AwaitLock() const { lock_done_.WaitForNotification(); }

std::string WeightSet::placement() const {
  const char* lock = "";
  switch (lock_state_.load()) {
    case kNotLocked: lock = ", not locked"; break;
    case kLocking: lock = ", being locked in RAM"; break;
    case kLocked: lock = ", locked in RAM"; break;
    case kRefused: lock = ", not locked (mlock refused)"; break;
  }
  return absl::StrCat(copy_description_.empty() ? "mapped files" : absl::StrCat("copied (", copy_description_, ")"),
                      q8_records_ ? ", with int8 tile records" : "", lock, " (residency ", ResidencyName(residency_),
                      ")");
}

absl::StatusOr<const common::ExpertWeights*> WeightSet::Find(int64_t layer, int64_t expert) const {
  auto it = experts_.find({layer, expert});
  if (it == experts_.end()) {
    return absl::FailedPreconditionError(absl::StrCat("this node does not own layer ", layer, " expert ", expert));
  }
  return it->second.get();
}

absl::StatusOr<std::unique_ptr<ExpertStore>> ExpertStore::Create(const std::string& model_dir,
                                                                 const StoreOptions& options, std::ostream* log) {
  COLIBRI_ASSIGN_OR_RETURN(std::unique_ptr<common::ModelDir> model, common::ModelDir::Open(model_dir));
  return Create(std::move(model), options, log);
}

absl::StatusOr<std::unique_ptr<ExpertStore>> ExpertStore::Create(std::unique_ptr<common::ModelDir> model,
                                                                 const StoreOptions& options, std::ostream* log) {
  if (options.q8_records && options.residency == Residency::kPaged && !options.hugepages && options.numa_node < 0) {
    return absl::InvalidArgumentError(
        "StoreOptions::q8_records needs residency locked or copy, not paged (or the weights copied: hugepages, "
        "numa_node)");
  }
  std::unique_ptr<ExpertStore> store(new ExpertStore(options, log));
  const std::string model_dir = model->dir();
  COLIBRI_ASSIGN_OR_RETURN(std::shared_ptr<const WeightSet> set,
                           store->Load(std::move(model), options.shard, 1, 0, {}));
  common::MutexLock lock(&store->mu_);  // no other thread sees the store yet; the lock states the rule
  store->last_version_ = set->version();
  store->current_ = std::move(set);
  store->model_dir_ = model_dir;
  store->shard_ = options.shard;
  return store;
}

std::shared_ptr<const WeightSet> ExpertStore::Current() const {
  common::MutexLock lock(&mu_);
  return current_;
}

void ExpertStore::SetMemoryReserve(int64_t bytes) { memory_reserve_.store(bytes); }

void ExpertStore::SetLockListener(std::function<void(const WeightSet&)> listener) {
  common::MutexLock lock(&listener_mu_);
  lock_listener_ = std::move(listener);
}

bool ExpertStore::IsCurrent(const WeightSet& set) const {
  common::MutexLock lock(&mu_);
  return current_.get() == &set;
}

std::set<std::pair<uint64_t, uint64_t>> ExpertStore::MappedFiles() const {
  common::MutexLock lock(&mu_);
  std::set<std::pair<uint64_t, uint64_t>> files;
  for (const auto* set : {&current_, &previous_}) {
    if (*set == nullptr) continue;
    for (const auto& [key, weights] : (*set)->experts_) {
      if (weights->file != nullptr) files.insert({weights->file->identity().device, weights->file->identity().inode});
    }
  }
  return files;
}

int64_t ExpertStore::ResidentBytes() const {
  common::MutexLock lock(&mu_);
  int64_t bytes = 0;
  for (const auto* set : {&current_, &previous_}) {
    if (*set != nullptr) bytes += static_cast<int64_t>((*set)->resident_bytes());
  }
  return bytes + retired_bytes_->load();
}

void ExpertStore::Retire(const std::shared_ptr<const WeightSet>& set) {
  if (set == nullptr || set->resident_bytes() == 0) return;
  retired_bytes_->fetch_add(static_cast<int64_t>(set->resident_bytes()));
  set->retired_bytes_ = retired_bytes_;  // the deleter (Load) takes them off once the set is freed
}

absl::Status ExpertStore::CheckMemory(int64_t resident, int64_t held, const std::string& what) const {
  const int64_t limit = options_.memory_limit, reserve = memory_reserve_.load();
  if (limit < 0 || resident + held + reserve <= limit) return absl::OkStatus();
  const auto gb = [](int64_t b) { return absl::StrFormat("%.2f GB", static_cast<double>(b) / 1e9); };
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": ", gb(resident), " of weights held in memory (", ResidencyName(options_.residency),
      options_.residency == Residency::kPaged ? ", copied" : "", "), beside ", gb(held), " of the weights served and ",
      gb(reserve), " kept for calls in flight and the process, pass the memory limit of ", gb(limit),
      options_.memory_limit_source.empty() ? "" : " (" + options_.memory_limit_source + ")",
      ": past it the kernel kills the process", options_.memory_advice.empty() ? "" : ". " + options_.memory_advice));
}

void ExpertStore::SetMaxDModel(int64_t d_model) {
  common::MutexLock lock(&mu_);
  max_d_model_ = d_model;
}

std::string ExpertStore::model_dir() const {
  common::MutexLock lock(&mu_);
  return model_dir_;
}

std::shared_ptr<const WeightSet> ExpertStore::ForModel(const std::string& model_id) const {
  common::MutexLock lock(&mu_);
  if (model_id.empty() || current_->model().model_id() == model_id) return current_;
  if (previous_ != nullptr && previous_->model().model_id() == model_id) return previous_;
  return nullptr;
}

std::shared_ptr<const WeightSet> ExpertStore::Previous() const {
  common::MutexLock lock(&mu_);
  return previous_;
}

ExpertStore::Served ExpertStore::CurrentAndPrevious() const {
  common::MutexLock lock(&mu_);
  return {current_, previous_};
}

absl::Status ExpertStore::Reload(const std::string& model_dir, const std::optional<ShardSpec>& shard,
                                 bool keep_previous, const std::function<bool()>& abandon) {
  if (!reload_mu_.TryLock()) return absl::AbortedError("another reload is in progress");
  absl::Status status = ReloadLocked(model_dir, shard, keep_previous, abandon);
  reload_mu_.Unlock();
  return status;
}

absl::Status ExpertStore::ReloadLocked(const std::string& model_dir, const std::optional<ShardSpec>& shard,
                                       bool keep_previous, const std::function<bool()>& abandon) {
  std::string dir;
  ShardSpec spec;
  uint64_t version = 0;
  int64_t max_d_model = 0;
  {
    common::MutexLock lock(&mu_);
    dir = model_dir.empty() ? model_dir_ : model_dir;
    spec = shard.has_value() ? *shard : shard_;
    version = last_version_ + 1;
    max_d_model = max_d_model_;
  }
  COLIBRI_ASSIGN_OR_RETURN(std::unique_ptr<common::ModelDir> model, common::ModelDir::Open(dir));
  if (max_d_model > 0) {  // from the manifest, before anything is mapped, verified or locked
    if (const int64_t d_model = model->manifest().d_model; d_model > max_d_model) {
      return absl::FailedPreconditionError(absl::StrCat(
          dir, " has d_model ", d_model, ", above the ", max_d_model,
          " this node's message limits were set for at start (--max_rows and --max_message_bytes): not installed, "
          "the weights in use stay; restart the node to serve it"));
    }
  }
  COLIBRI_ASSIGN_OR_RETURN(std::shared_ptr<const WeightSet> next,
                           Load(std::move(model), spec, version, ResidentBytes(), MappedFiles()));
  if (abandon && abandon()) {
    return absl::CancelledError(
        absl::StrCat("the caller gave up while ", dir, " was loading: not installed, the weights in use stay"));
  }
  // Sets replaced here are freed outside the lock, when their last in-flight call ends.
  std::shared_ptr<const WeightSet> released[2];
  {
    common::MutexLock lock(&mu_);
    if (keep_previous) {
      const common::Manifest& a = current_->model().manifest();
      const common::Manifest& b = next->model().manifest();
      if (a.d_model != b.d_model || a.n_layers != b.n_layers || a.total_experts() != b.total_experts()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "keep_previous: the new model (d_model ", b.d_model, ", ", b.n_layers, " layers, ", b.total_experts(),
            " experts) has another shape than the one serving (d_model ", a.d_model, ", ", a.n_layers, " layers, ",
            a.total_experts(), " experts); a change of shape needs a new cluster (blue/green)"));
      }
      if (next->model().model_id() == current_->model().model_id()) {
        // The model serving, again (a stage repeated): it replaces the
        // current set, and the previous version stays served.
        released[0] = std::move(current_);
      } else {
        released[0] = std::move(previous_);
        previous_ = std::move(current_);
        previous_dir_ = model_dir_;
        previous_shard_ = shard_;
      }
    } else {
      released[0] = std::move(previous_);
      released[1] = std::move(current_);
      previous_ = nullptr;
    }
    last_version_ = next->version();
    current_ = std::move(next);
    model_dir_ = dir;
    shard_ = spec;
    for (const auto& set : released) Retire(set);
  }
  return absl::OkStatus();
}

absl::Status ExpertStore::Drop(const std::string& model_id) {
  if (!reload_mu_.TryLock()) return absl::AbortedError("a reload is in progress");
  std::shared_ptr<const WeightSet> released;
  absl::Status status;
  {
    common::MutexLock lock(&mu_);
    if (previous_ != nullptr && previous_->model().model_id() == model_id) {
      released = std::move(previous_);
    } else if (current_->model().model_id() == model_id && previous_ != nullptr) {
      released = std::move(current_);
      current_ = std::move(previous_);
      model_dir_ = previous_dir_;
      shard_ = previous_shard_;
    } else if (current_->model().model_id() == model_id) {
      status = absl::FailedPreconditionError(
          absl::StrCat("model ", model_id, " is the only model this node serves: load another before dropping it"));
    } else {
      status = absl::NotFoundError(absl::StrCat("this node does not serve model ", model_id));
    }
    Retire(released);
  }
  reload_mu_.Unlock();
  return status;
}

absl::Status ExpertStore::LockAll(WeightSet* set, const std::vector<LockRange>& ranges, std::ostream* log) {
  const absl::Time start = absl::Now();
  absl::Status status;
  for (const auto& [data, size, layer, expert] : ranges) {
    // In pieces: mlock holds the process's memory-map lock while it faults
    // pages in, which would stall every other thread's mmap (and page
    // faults) for the whole expert; and a set being destroyed stops between them.
    constexpr size_t kPiece = size_t{64} << 20;
    size_t done = 0;
    while (done < size && !set->stop_locking_.load() && mlock(data + done, std::min(kPiece, size - done)) == 0) {
      done += kPiece;
    }
    if (set->stop_locking_.load()) break;
    if (done >= size) continue;
    status = absl::FailedPreconditionError(absl::StrCat(
        "mlock of ", size, " bytes for layer ", layer, " expert ", expert, " refused (", std::strerror(errno),
        "; RLIMIT_MEMLOCK is ", MemlockLimit(),
        "). Fix: raise the limit (`ulimit -l unlimited`, systemd LimitMEMLOCK=infinity; in a container, "
        "the runtime's unit's, e.g. containerd.service), or as root grant CAP_IPC_LOCK (Kubernetes: "
        "securityContext.capabilities.add: [IPC_LOCK]), or set StoreOptions::require_mlock to false to run "
        "unlocked"));
    common::LogLine(log, absl::StrCat("WARNING: ", status.message(), "; continuing with unlocked weights"));
    break;
  }
  set->lock_state_ = status.ok() && !set->stop_locking_.load() ? WeightSet::kLocked : WeightSet::kRefused;
  if (set->lock_state_ == WeightSet::kLocked) {  // until now calls may have waited on the pages' first reads
    common::LogLine(
        log, absl::StrFormat("weights version %d locked in RAM: %.2f GB in %.1f s", set->version(),
                             static_cast<double>(set->bytes_) / 1e9, absl::ToDoubleSeconds(absl::Now() - start)));
  }
  set->lock_done_.Notify();
  return status;
}

absl::StatusOr<std::shared_ptr<const WeightSet>> ExpertStore::Load(
    std::unique_ptr<common::ModelDir> model, const ShardSpec& shard, uint64_t version, int64_t held,
    const std::set<std::pair<uint64_t, uint64_t>>& mapped) const {
  // Freed whole (the locking thread joined, mappings and copies released)
  // before a retired set's bytes leave the count.
  std::shared_ptr<WeightSet> set(new WeightSet(), [](WeightSet* done) {
    const std::shared_ptr<std::atomic<int64_t>> retired = std::move(done->retired_bytes_);
    const int64_t bytes = static_cast<int64_t>(done->resident_bytes());
    delete done;
    if (retired != nullptr) retired->fetch_sub(bytes);
  });
  set->version_ = version;
  set->model_ = std::move(model);
  const common::Manifest& m = set->model_->manifest();
  COLIBRI_ASSIGN_OR_RETURN(set->owned_, shard.Resolve(m.n_layers, m.total_experts()));
  std::vector<std::unique_ptr<common::ExpertWeights>> loaded;
  std::vector<const common::MappedFile*> files;
  for (const auto& [layer, expert] : set->owned_) {
    COLIBRI_ASSIGN_OR_RETURN(auto weights, set->model_->LoadExpert(layer, expert, /*verify_checksum=*/false));
    files.push_back(weights->file.get());
    loaded.push_back(std::move(weights));
  }
  if (options_.verify_checksums) {
    COLIBRI_ASSIGN_OR_RETURN(
        common::VerifyReport report,
        common::VerifyMappedFiles(*set->model_, files, {options_.verify_threads, options_.verify_cache}));
    common::LogLine(log_, report.Describe());
  }
  const bool copy = options_.residency == Residency::kCopy || options_.hugepages || options_.numa_node >= 0;
  // StoreOptions::q8_records, where the kernels have int8 tiles for the weights (else said in the log).
  const bool records = options_.q8_records;
  const bool resident = copy || options_.residency != Residency::kPaged;
  if (resident) {  // before anything is copied or locked
    int64_t bytes = 0;
    for (const auto& weights : loaded) {
      const size_t size = Backing(*weights).second;
      const common::FileIdentity& id = weights->file->identity();
      if (copy) {
        bytes += static_cast<int64_t>(common::AnonymousMemory::SizeFor(size));
      } else if (mapped.count({id.device, id.inode}) == 0) {  // a file a held set maps shares its pages
        bytes += static_cast<int64_t>(size);
      }
      if (records) bytes += static_cast<int64_t>(kernels::Q8RecordsFootprint(*weights, kernels::SelectedKernels()));
    }
    // Reserved huge pages are the hugetlb pool's, not counted in memory.max.
    if (copy && options_.hugepages) bytes = std::max<int64_t>(0, bytes - FreeHugetlbBytes(options_.numa_node));
    COLIBRI_RETURN_IF_ERROR(CheckMemory(bytes, held, absl::StrCat("cannot load ", set->model_->dir())));
  }
  std::atomic<bool> records_refused{false};
  std::atomic<int64_t> unguarded{0};  // files past the SIGBUS guard's slots
  // Copies are independent per expert: on verify_threads threads.
  const absl::Status placed = ParallelFor(loaded.size(), options_.verify_threads, [&](size_t i) -> absl::Status {
    common::ExpertWeights& weights = *loaded[i];
    if (copy) {
      COLIBRI_RETURN_IF_ERROR(common::CopyExpertToMemory(&weights, {options_.hugepages, options_.numa_node}));
    } else {
      // Served from the page cache: a file truncated in place must fail the
      // calls that read it (DATA_LOSS), not kill the node with SIGBUS.
      if (!weights.file->Guard()) unguarded.fetch_add(1, std::memory_order_relaxed);
    }
    if (records) {
      const absl::Status built =
          kernels::AttachQ8Records(&weights, kernels::SelectedKernels(), {options_.hugepages, options_.numa_node});
      if (built.code() == absl::StatusCode::kFailedPrecondition) {
        if (!records_refused.exchange(true)) {
          common::LogLine(log_, absl::StrCat("int8 tile records not built: ", built.message()));
        }
      } else if (!built.ok()) {
        return built;
      }
    }
    return absl::OkStatus();
  });
  if (!placed.ok()) return placed;
  if (unguarded.load() > 0) {
    common::LogLine(
        log_,
        absl::StrCat(unguarded.load(), " expert files are not guarded against truncation (every one of the ",
                     common::SigbusGuard::kSlots, " guard slots is taken): a file truncated in place kills the node"));
  }
  std::vector<LockRange> ranges;
  for (std::unique_ptr<common::ExpertWeights>& weights : loaded) {
    const auto [data, size] = Backing(*weights);
    ranges.push_back({data, size, weights->layer, weights->expert});
    set->bytes_ += size;
    if (resident && (weights->copy == nullptr || !absl::StartsWith(weights->copy->description(), "hugetlb"))) {
      set->resident_bytes_ += size;
    }
    for (const auto& memory : weights->q8_records) {
      ranges.push_back({memory->data(), memory->size(), weights->layer, weights->expert});
      set->bytes_ += memory->size();
      set->resident_bytes_ += memory->size();  // anonymous memory, always
      set->q8_records_ = true;
    }
    if (weights->copy != nullptr) set->copy_description_ = weights->copy->description();
    set->experts_[{weights->layer, weights->expert}] = std::move(weights);
  }
  set->residency_ = options_.residency;
  if (options_.residency == Residency::kPaged) {
    set->lock_done_.Notify();
  } else if (options_.require_mlock) {
    COLIBRI_RETURN_IF_ERROR(LockAll(set.get(), ranges, nullptr));
  } else {
    // Serving does not wait for the locks: the pages are in the page cache
    // (or the copy) already; locking a large shard takes seconds.
    set->lock_state_ = WeightSet::kLocking;
    set->locker_ = std::thread([this, s = set.get(), ranges = std::move(ranges), log = log_] {
      common::SigbusGuard::UnblockHere();  // locking touches mapped pages
      (void)LockAll(s, ranges, log);
      common::MutexLock lock(&listener_mu_);  // the store outlives its sets' lockers
      if (lock_listener_) lock_listener_(*s);
    });
  }
  common::LogLine(log_, absl::StrCat("loaded ", set->owned_.size(), " experts of ", set->model_->dir(), " (version ",
                                     version, ", ", set->placement(), ")"));
  return std::shared_ptr<const WeightSet>(std::move(set));
}

}  // namespace expert_node
}  // namespace colibri
