#ifndef COLIBRI_EXPERT_NODE_PAGED_WEIGHTS_H_
#define COLIBRI_EXPERT_NODE_PAGED_WEIGHTS_H_

// Paged residency (StoreOptions::residency = kPaged): weights stay
// file-backed and are read in when routed to, so a node can serve a shard
// larger than its memory, bound by storage read bandwidth for cold experts.
//
// As soon as a Compute call arrives — its layer and experts known, before it
// waits for the compute thread — Acquire has a background thread read those
// experts' files and map their pages (MADV_POPULATE_READ), so the reads
// overlap the work queued ahead of it and its kernels do not fault, and pins them
// until the call is done. With a memory budget, the experts used are kept in
// least-recently-used order, and when their bytes exceed the budget the
// coldest unpinned ones are evicted (the mapping's pages dropped, then the
// file's page cache: common/mapped_file.h Evict). The budget counts whole
// expert files and bounds what this node keeps; the kernel may still evict
// earlier under memory pressure (a cgroup's memory.max), which costs reads,
// not failures. A race is possible and harmless: an expert pinned again
// while it is being evicted is read back in by its call's page faults.
//
// Thread-safe. Pins hold their weight set; a reload (a new set) starts the
// bookkeeping afresh.

#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/metrics.h"
#include "common/mutex.h"
#include "expert_node/expert_store.h"

namespace colibri {
namespace expert_node {

// What this process has faulted and read from storage so far
// (getrusage and /proc/self/io; read_bytes -1 where unavailable).
struct ProcessIo {
  int64_t major_faults = 0;
  int64_t minor_faults = 0;
  int64_t read_bytes = -1;
};
ProcessIo SampleProcessIo();

class PagedWeights {
 public:
  struct Options {
    int64_t memory_budget = 0;                   // bytes of expert files kept; <= 0: no limit (never evict)
    common::MetricsRegistry* metrics = nullptr;  // optional; must outlive this
  };

  // Keeps a call's experts from being evicted; releases them when destroyed.
  class Pin {
   public:
    Pin() = default;
    Pin(Pin&& other) noexcept { *this = std::move(other); }
    Pin& operator=(Pin&& other) noexcept;
    ~Pin();

   private:
    friend class PagedWeights;
    PagedWeights* owner_ = nullptr;
    std::shared_ptr<const WeightSet> set_;
    std::vector<const common::ExpertWeights*> experts_;
  };

  explicit PagedWeights(Options options);
  ~PagedWeights();  // finishes the queued work and joins the background thread

  // Starts reading the experts of `layer` in `experts` that `set` owns
  // (others are skipped: the call fails on them later) and pins them. A set
  // that is not paged gets an empty pin and no work.
  // A set other than the last one's restarts the bookkeeping and drops this
  // object's reference to the last (a caller holding locks keeps its own,
  // from set(), so that the last's release — unmapping it — comes after them).
  Pin Acquire(std::shared_ptr<const WeightSet> set, int64_t layer, const std::vector<int64_t>& experts);
  // The set the bookkeeping is for (null before the first Acquire).
  std::shared_ptr<const WeightSet> set() const;

  struct Stats {
    int64_t kept_bytes = 0;  // bytes of the experts kept (used, not evicted since)
    int64_t prefetches = 0;  // experts asked to be read in
    int64_t evictions = 0;   // experts evicted
  };
  Stats stats() const;
  // Blocks until the background thread has done everything queued so far
  // (tests and benchmarks).
  void Drain();

 private:
  struct Task {
    std::shared_ptr<const WeightSet> set;  // keeps the experts' mappings alive
    std::vector<const common::ExpertWeights*> prefetch;
    std::vector<const common::ExpertWeights*> evict;
  };
  void Release(const Pin& pin);
  // Picks the coldest unpinned experts over the budget. REQUIRES mu_.
  std::vector<const common::ExpertWeights*> OverBudget() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Loop();
  void Gauge(const common::ExpertWeights& e);

  const Options options_;
  mutable common::Mutex mu_;
  common::CondVar cv_;                                                // tasks_ grew, or stopping_
  std::shared_ptr<const WeightSet> set_ ABSL_GUARDED_BY(mu_);         // the set the bookkeeping is for
  std::list<const common::ExpertWeights*> lru_ ABSL_GUARDED_BY(mu_);  // most recently used first
  std::map<const common::ExpertWeights*, std::list<const common::ExpertWeights*>::iterator> kept_ ABSL_GUARDED_BY(mu_);
  std::map<const common::ExpertWeights*, int> pins_ ABSL_GUARDED_BY(mu_);
  int64_t kept_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t prefetches_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<Task> tasks_ ABSL_GUARDED_BY(mu_);
  int64_t tasks_done_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t tasks_queued_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace expert_node
}  // namespace colibri

#endif  // COLIBRI_EXPERT_NODE_PAGED_WEIGHTS_H_
