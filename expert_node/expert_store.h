#ifndef COLIBRI_EXPERT_NODE_EXPERT_STORE_H_
#define COLIBRI_EXPERT_NODE_EXPERT_STORE_H_

// The weights an expert node owns: the (layer, expert) files of its shard,
// mapped read-only from the model directory, verified (in parallel, skipping
// files unchanged since they were verified), then locked in RAM, copied
// (huge-page / NUMA-bound memory) or left to the page cache (Residency), and
// swapped atomically on reload.
//
// A WeightSet is immutable and shared: each request takes Current() and keeps
// that shared_ptr until it finishes, so a reload never changes the weights
// under a running call; the old set is unmapped when its last user lets go.
// Reload builds and verifies the new set beside the old one and swaps only on
// success: a failed reload leaves the node serving the old weights and
// returns the reason. ExpertStore is thread-safe.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/model_dir.h"
#include "common/mutex.h"
#include "expert_node/shard_spec.h"

namespace colibri {
namespace expert_node {

// Where an expert node's weights live.
enum class Residency {
  // The mapped files, locked in RAM (mlock): nothing is copied, so a start is
  // as fast as the page cache can be locked. The files must not be changed
  // in place while loaded (write new versions to a new directory): a file
  // truncated under the node fails the calls that read it (DATA_LOSS), one
  // rewritten at the same size would change weights unchecked.
  kLocked,
  // A copy in the node's own anonymous memory, locked: files changed in place
  // never reach the node; a start pays for the copy.
  kCopy,
  // The mapped files, not locked: the kernel reads them in on use and may
  // drop them under memory pressure (a model larger than RAM; see
  // expert_node/paged_weights.h for the prefetch and the memory budget).
  kPaged,
};
const char* ResidencyName(Residency residency);  // "locked", "copy", "paged"
// INVALID_ARGUMENT naming the value and the choices.
absl::StatusOr<Residency> ParseResidency(const std::string& name);

struct StoreOptions {
  ShardSpec shard;  // default: all experts of all layers
  Residency residency = Residency::kLocked;
  bool verify_checksums = true;  // hash every owned file at load (files unchanged since verified excepted)
  int verify_threads = 1;        // threads hashing files
  // Where verified files are remembered (common/file_verifier.h): empty =
  // next to the model or in the user's cache, "off" = nowhere.
  std::string verify_cache;
  bool require_mlock = false;  // fail (instead of warning and running unlocked) if mlock is refused
  bool hugepages = false;      // copy weights to huge-page memory (common/anonymous_memory.h; implies a copy)
  int numa_node = -1;          // >= 0: copy weights to memory bound to this node (implies a copy)
  // int8/int4 models on a CPU with int8 tiles (AVX512_VNNI, AMX): build
  // every matrix's int8 tile records at load (kernels::BuildQ8Records; a
  // second copy of ~1.1 bytes a weight for int8, ~0.63 for int4, on the same pages and node as the
  // weights, locked with them), so calls on tiles read them instead of
  // repacking each block per call (the same bits for a call on tiles), and
  // take tiles from the kernel profile's *_records_tile_min_tokens rows.
  // Not with kPaged unless the weights are copied (hugepages, numa_node).
  // Elsewhere it is said in the log and has no effect.
  bool q8_records = false;
  // The memory this process may use (its cgroup's limit,
  // common::ReadCgroupLimits; -1: none) and the part of it kept free of
  // weights (calls in flight, the process itself; see SetMemoryReserve). A
  // load whose resident weights — copies, locked mappings, int8 records —
  // would not fit beside the sets already held is refused FAILED_PRECONDITION
  // before anything is copied or locked: past the limit the kernel kills the
  // process (locked pages cannot be reclaimed). `memory_limit_source` names
  // the limit in that message, `memory_advice` ends it with what the caller
  // can change (in its own option names).
  int64_t memory_limit = -1;
  int64_t memory_reserve = 0;
  std::string memory_limit_source;
  std::string memory_advice;
};

class WeightSet {
 public:
  WeightSet() = default;
  ~WeightSet();  // stops and joins the background locking, if it still runs
  WeightSet(const WeightSet&) = delete;
  WeightSet& operator=(const WeightSet&) = delete;

  const common::ModelDir& model() const { return *model_; }
  uint64_t version() const { return version_; }
  // True once every owned expert is locked in RAM. Locking runs in the
  // background after the set is loaded (the weights are served from the
  // page cache meanwhile), unless StoreOptions::require_mlock.
  bool locked() const { return lock_state_.load() == kLocked; }
  // Blocks until the background locking has finished (at once if none runs).
  void AwaitLock() const;
  // Where the weights live, for logs and GetNodeInfo: e.g. "mapped files,
  // locked in RAM (residency locked)".
  std::string placement() const;
  const std::vector<std::pair<int64_t, int64_t>>& owned() const { return owned_; }
  // Bytes of the owned experts' files (or their copies).
  uint64_t bytes() const { return bytes_; }
  // The part of bytes() and the int8 records held in the process's memory
  // whatever the kernel needs (copies, locked mappings): all of it but the
  // mapped files of paged residency.
  uint64_t resident_bytes() const { return resident_bytes_; }
  Residency residency() const { return residency_; }
  // Whether the owned experts' int8 tile records are built (StoreOptions::q8_records took effect).
  bool q8_records() const { return q8_records_; }

  // FAILED_PRECONDITION naming the layer and expert when this set does not own it.
  absl::StatusOr<const common::ExpertWeights*> Find(int64_t layer, int64_t expert) const;

 private:
  friend class ExpertStore;
  enum LockState { kNotLocked, kLocking, kLocked, kRefused };
  std::unique_ptr<common::ModelDir> model_;
  uint64_t version_ = 0;
  Residency residency_ = Residency::kLocked;
  uint64_t bytes_ = 0;
  uint64_t resident_bytes_ = 0;
  std::string copy_description_;  // empty: the mapped files are served
  bool q8_records_ = false;       // StoreOptions::q8_records took effect
  std::vector<std::pair<int64_t, int64_t>> owned_;
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<common::ExpertWeights>> experts_;
  std::atomic<int> lock_state_{kNotLocked};
  std::atomic<bool> stop_locking_{false};
  std::thread locker_;
  mutable common::Notification lock_done_;
  // Set when the store retires this set (ExpertStore::Retire): its deleter
  // takes resident_bytes() off the count once the set, its mappings and
  // copies are gone.
  mutable std::shared_ptr<std::atomic<int64_t>> retired_bytes_;
};

class ExpertStore {
 public:
  // Loads `model_dir`'s shard. Errors name the file and the reason (see
  // ModelDir); FAILED_PRECONDITION if mlock is refused and require_mlock.
  // Warnings (mlock refused, huge pages refused) go to `log`, which must
  // outlive the store.
  static absl::StatusOr<std::unique_ptr<ExpertStore>> Create(const std::string& model_dir, const StoreOptions& options,
                                                             std::ostream* log);
  // The same for a model directory opened already.
  static absl::StatusOr<std::unique_ptr<ExpertStore>> Create(std::unique_ptr<common::ModelDir> model,
                                                             const StoreOptions& options, std::ostream* log);

  // The weights new calls should use. Never null after Create.
  std::shared_ptr<const WeightSet> Current() const;
  // The set serving `model_id`: the current one, or the previous one kept by
  // a Reload with keep_previous; empty: the current one. Null if neither.
  std::shared_ptr<const WeightSet> ForModel(const std::string& model_id) const;
  // The previous set kept by Reload(keep_previous), or null.
  std::shared_ptr<const WeightSet> Previous() const;
  // Both at one moment (a reload or Drop between two separate reads would
  // give one set twice, or one no longer served).
  struct Served {
    std::shared_ptr<const WeightSet> current, previous;
  };
  Served CurrentAndPrevious() const;

  // Loads `model_dir` (empty: the current directory again) with `shard`
  // (nullopt: the current one) beside the current set, then swaps — unless
  // `abandon` (may be empty) says true once the set is loaded: CANCELLED,
  // nothing changed (a caller that gave up must not find the reload done
  // later). With `keep_previous`, the set it replaces stays served to calls
  // naming its model (ForModel) until Drop or the next reload; the new model
  // must have its shape, else FAILED_PRECONDITION. The same model as the
  // current one again (a stage repeated) replaces the current set and keeps
  // the previous one. On error the current set stays. ABORTED if another
  // reload is running.
  absl::Status Reload(const std::string& model_dir, const std::optional<ShardSpec>& shard, bool keep_previous = false,
                      const std::function<bool()>& abandon = {});
  // Stops serving `model_id`: the previous set is released; the current one
  // is replaced by the previous set (a roll-back). NOT_FOUND if neither
  // serves it, FAILED_PRECONDITION if it is the only set. ABORTED if a reload
  // is running.
  absl::Status Drop(const std::string& model_id);

  // Reloads of a model whose d_model is above `d_model` are refused
  // (FAILED_PRECONDITION, nothing changed): the server's gRPC message
  // limits, fixed at start, hold calls of up to this d_model. <= 0: no bound
  // (the default).
  void SetMaxDModel(int64_t d_model);
  // StoreOptions::memory_reserve for the loads from now on (the server sets
  // it once its in-flight budget is known).
  void SetMemoryReserve(int64_t bytes);
  // resident_bytes() of the sets in memory: those served (current and
  // previous), and those a reload or Drop replaced that calls in flight still
  // hold (a file such a set shares with a new one is counted twice, which errs
  // towards refusing).
  int64_t ResidentBytes() const;
  // Called (from the locking thread) with a set whose background locking
  // has ended; empty: none. Once this returns, the previous listener is not
  // running and will not run. The listener must not keep or copy a
  // reference to a set (Current() included): releasing the last one would
  // join that set's locking thread from a locking thread.
  void SetLockListener(std::function<void(const WeightSet&)> listener);
  // Whether `set` is the current set (no reference taken).
  bool IsCurrent(const WeightSet& set) const;

  std::string model_dir() const;

 private:
  ExpertStore(StoreOptions options, std::ostream* log)
      : options_(std::move(options)), log_(log), memory_reserve_(options_.memory_reserve) {}
  // Maps (or copies) `model`'s experts that `shard` owns; the set keeps `model`.
  // `held`: resident bytes of the sets that stay in memory meanwhile;
  // `mapped`: (device, inode) of the files they map (pages a new set
  // mapping the same files shares).
  absl::StatusOr<std::shared_ptr<const WeightSet>> Load(std::unique_ptr<common::ModelDir> model, const ShardSpec& shard,
                                                        uint64_t version, int64_t held,
                                                        const std::set<std::pair<uint64_t, uint64_t>>& mapped) const;
  std::set<std::pair<uint64_t, uint64_t>> MappedFiles() const;  // of the sets served, where not copied
  // Counts a set replaced (not served any more) as held until it is freed.
  void Retire(const std::shared_ptr<const WeightSet>& set) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION when `resident` new bytes beside `held` pass the memory limit.
  absl::Status CheckMemory(int64_t resident, int64_t held, const std::string& what) const;
  // Bytes of one owned expert to lock: its weights, or one of its int8 tile records.
  struct LockRange {
    const uint8_t* data;
    size_t size;
    int64_t layer;
    int64_t expert;
  };
  // Locks `ranges` in RAM, sets the set's lock state and notifies its
  // waiters; stops early if the set is being destroyed. A refusal is logged
  // as a warning to `log` (if not null), naming the expert, and returned.
  static absl::Status LockAll(WeightSet* set, const std::vector<LockRange>& ranges, std::ostream* log);
  absl::Status ReloadLocked(const std::string& model_dir, const std::optional<ShardSpec>& shard, bool keep_previous,
                            const std::function<bool()>& abandon) ABSL_EXCLUSIVE_LOCKS_REQUIRED(reload_mu_);

  const StoreOptions options_;
  std::ostream* const log_;
  // Before the sets: destroyed after them, whose lockers may still call it.
  mutable common::Mutex listener_mu_;
  std::function<void(const WeightSet&)> lock_listener_ ABSL_GUARDED_BY(listener_mu_);

  common::Mutex reload_mu_;  // one reload at a time
  mutable common::Mutex mu_;
  std::shared_ptr<const WeightSet> current_ ABSL_GUARDED_BY(mu_);
  uint64_t last_version_ ABSL_GUARDED_BY(mu_) = 0;  // the newest set's: a roll-back does not reuse numbers
  std::string model_dir_ ABSL_GUARDED_BY(mu_);
  ShardSpec shard_ ABSL_GUARDED_BY(mu_);
  // Kept by a Reload with keep_previous (a roll-out), with its directory and shard.
  std::shared_ptr<const WeightSet> previous_ ABSL_GUARDED_BY(mu_);
  std::string previous_dir_ ABSL_GUARDED_BY(mu_);
  ShardSpec previous_shard_ ABSL_GUARDED_BY(mu_);
  int64_t max_d_model_ ABSL_GUARDED_BY(mu_) = 0;
  // The resident_bytes() of replaced sets not freed yet (a call in flight
  // holds them; the last holder frees them on its own thread). Shared with
  // those sets' deleters, which may run after the store is gone.
  const std::shared_ptr<std::atomic<int64_t>> retired_bytes_ = std::make_shared<std::atomic<int64_t>>(0);
  std::atomic<int64_t> memory_reserve_;
};

}  // namespace expert_node
}  // namespace colibri

#endif  // COLIBRI_EXPERT_NODE_EXPERT_STORE_H_
