#include "expert_node/paged_weights.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <fstream>
#include <string>
#include <utility>

#include "common/sigbus_guard.h"

namespace colibri {
namespace expert_node {
namespace {

constexpr int kMadvPopulateRead = 22;  // MADV_POPULATE_READ, not in every libc's headers

}  // namespace

ProcessIo SampleProcessIo() {
  ProcessIo io;
  rusage usage;
  if (getrusage(RUSAGE_SELF, &usage) == 0) {
    io.major_faults = usage.ru_majflt;
    io.minor_faults = usage.ru_minflt;
  }
  std::ifstream proc("/proc/self/io");
  std::string key;
  int64_t value = 0;
  while (proc >> key >> value) {
    if (key == "read_bytes:") io.read_bytes = value;
  }
  return io;
}

PagedWeights::Pin& PagedWeights::Pin::operator=(Pin&& other) noexcept {
  if (this != &other) {
    if (owner_ != nullptr) owner_->Release(*this);
    owner_ = std::exchange(other.owner_, nullptr);
    set_ = std::move(other.set_);
    experts_ = std::move(other.experts_);
  }
  return *this;
}

PagedWeights::Pin::~Pin() {
  if (owner_ != nullptr) owner_->Release(*this);
}

PagedWeights::PagedWeights(Options options) : options_(options), thread_([this] { Loop(); }) {}

PagedWeights::~PagedWeights() {
  {
    common::MutexLock lock(&mu_);
    stopping_ = true;
    cv_.SignalAll();
  }
  thread_.join();
}

PagedWeights::Pin PagedWeights::Acquire(std::shared_ptr<const WeightSet> set, int64_t layer,
                                        const std::vector<int64_t>& experts) {
  Pin pin;
  if (set == nullptr || set->residency() != Residency::kPaged) return pin;
  for (int64_t expert : experts) {
    absl::StatusOr<const common::ExpertWeights*> e = set->Find(layer, expert);
    if (e.ok() && (*e)->file != nullptr) pin.experts_.push_back(*e);
  }
  if (pin.experts_.empty()) return pin;
  Task task;
  {
    common::MutexLock lock(&mu_);
    if (set_ != set) {  // a reload: the previous set's experts are no longer served
      set_ = set;
      lru_.clear();
      kept_.clear();
      pins_.clear();
      kept_bytes_ = 0;
    }
    for (const common::ExpertWeights* e : pin.experts_) {
      ++pins_[e];
      auto it = kept_.find(e);
      if (it != kept_.end()) {
        lru_.splice(lru_.begin(), lru_, it->second);  // kept already: now the most recent
        continue;
      }
      lru_.push_front(e);
      kept_[e] = lru_.begin();
      kept_bytes_ += static_cast<int64_t>(e->file->size());
      task.prefetch.push_back(e);
    }
    prefetches_ += static_cast<int64_t>(task.prefetch.size());
    task.evict = OverBudget();  // a new call may push older experts out at once
    if (!task.prefetch.empty() || !task.evict.empty()) {
      task.set = set;
      tasks_.push_back(std::move(task));
      ++tasks_queued_;
      cv_.SignalAll();
    }
  }
  pin.owner_ = this;
  pin.set_ = std::move(set);
  return pin;
}

std::shared_ptr<const WeightSet> PagedWeights::set() const {
  common::MutexLock lock(&mu_);
  return set_;
}

void PagedWeights::Release(const Pin& pin) {
  common::MutexLock lock(&mu_);
  if (pin.set_ != set_) return;  // bookkeeping restarted for a newer set
  for (const common::ExpertWeights* e : pin.experts_) {
    auto it = pins_.find(e);
    if (it != pins_.end() && --it->second == 0) pins_.erase(it);
  }
  Task task;
  task.evict = OverBudget();
  if (!task.evict.empty()) {
    task.set = set_;
    tasks_.push_back(std::move(task));
    ++tasks_queued_;
    cv_.SignalAll();
  }
}

std::vector<const common::ExpertWeights*> PagedWeights::OverBudget() {
  std::vector<const common::ExpertWeights*> evict;
  if (options_.memory_budget <= 0) return evict;
  for (auto it = lru_.end(); kept_bytes_ > options_.memory_budget && it != lru_.begin();) {
    --it;
    const common::ExpertWeights* e = *it;
    if (pins_.count(e) != 0) continue;  // in use by a call: stays until released
    kept_bytes_ -= static_cast<int64_t>(e->file->size());
    kept_.erase(e);
    it = lru_.erase(it);
    evict.push_back(e);
  }
  evictions_ += static_cast<int64_t>(evict.size());
  return evict;
}

void PagedWeights::Loop() {
  common::SigbusGuard::UnblockHere();  // prefetching reads mapped weights
  for (;;) {
    Task task;
    {
      common::MutexLock lock(&mu_);
      while (tasks_.empty() && !stopping_) cv_.Wait(&mu_);
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    // Evictions first: they make the room the prefetches need.
    for (const common::ExpertWeights* e : task.evict) {
      e->file->Evict();
      Gauge(*e);
    }
    for (const common::ExpertWeights* e : task.prefetch) {
      // Reads the file and maps its pages here, so the call's kernels do not
      // fault on them (MADV_POPULATE_READ, Linux 5.14); older kernels get
      // readahead into the page cache only.
      void* data = const_cast<uint8_t*>(e->file->data());
      if (madvise(data, e->file->size(), kMadvPopulateRead) != 0) (void)madvise(data, e->file->size(), MADV_WILLNEED);
      Gauge(*e);
    }
    common::MutexLock lock(&mu_);
    ++tasks_done_;
    cv_.SignalAll();
  }
}

void PagedWeights::Gauge(const common::ExpertWeights& e) {
  if (options_.metrics == nullptr) return;
  options_.metrics
      ->GetGauge("colibri_expert_resident_bytes",
                 "Bytes of an expert's weight file in the page cache (paged residency), as of its last "
                 "prefetch or eviction.",
                 {{"layer", std::to_string(e.layer)}, {"expert", std::to_string(e.expert)}})
      ->Set(static_cast<double>(e.file->ResidentBytes()));
}

PagedWeights::Stats PagedWeights::stats() const {
  common::MutexLock lock(&mu_);
  return {kept_bytes_, prefetches_, evictions_};
}

void PagedWeights::Drain() {
  common::MutexLock lock(&mu_);
  const int64_t target = tasks_queued_;
  while (tasks_done_ < target) cv_.Wait(&mu_);
}

}  // namespace expert_node
}  // namespace colibri
