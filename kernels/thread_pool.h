#ifndef COLIBRI_KERNELS_THREAD_POOL_H_
#define COLIBRI_KERNELS_THREAD_POOL_H_

// The compute threads of whoever owns the weights (an expert node, or the
// embedded engine): N workers started once, pinned to CPUs (the CPUs of one
// NUMA node when asked), which run one parallel job at a time.
//
// Threading model (docs/KERNELS.md): this pool is the only source of
// parallelism. oneDNN runs inside each worker on that worker's share of the
// work with its OpenMP team limited to the one calling thread, so oneDNN's
// threads never compete with ours.
//
// Run() is thread-safe (jobs from several callers are serialized). By
// default the caller waits and never computes, so a gRPC thread never runs
// kernels. With Options::caller_joins the caller does worker 0's share
// itself — for an owner with a thread of its own that only runs jobs (the
// expert node's compute thread): one thread fewer to wake per job, and no
// wake-up of the caller when the job ends.

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"

namespace colibri {
namespace kernels {

class ThreadPool {
 public:
  static constexpr int kMaxThreads = 4096;
  struct Options {
    // 0: one per CPU allowed (of the NUMA node, if set), at most the
    // cgroup's CPU quota rounded up (common/cgroup_limits.h).
    int num_threads = 0;
    int numa_node = -1;  // >= 0: pin to that node's CPUs (libnuma)
    // Pin worker i to the i-th allowed CPU (round robin) — unless a CPU
    // quota allows fewer CPUs than the process may run on: the CPUs are then
    // shared with other processes (a container without exclusive CPUs), and
    // every one of them would pin to the same first ones; the workers are
    // then pinned to the NUMA node's CPUs as a set, or not at all.
    bool pin = true;
    // Run's caller is worker 0 (moved to worker 0's CPU for the job when
    // pinning, its own affinity restored after); only num_threads - 1
    // threads are started.
    bool caller_joins = false;
  };

  // INVALID_ARGUMENT for num_threads over kMaxThreads or a NUMA node
  // that does not exist or has no CPUs allowed to this process; UNAVAILABLE
  // if libnuma reports no NUMA support while a node was asked for;
  // RESOURCE_EXHAUSTED naming the system's error if a thread cannot be
  // started (the ones started are stopped first).
  static absl::StatusOr<std::unique_ptr<ThreadPool>> Create(const Options& options);

  // The NUMA node every CPU this process may run on belongs to — the node a
  // container's CPU set was placed on (Kubernetes' topology manager with the
  // static CPU manager). FAILED_PRECONDITION naming the nodes if the CPUs
  // span several; -1 (bind nothing) where libnuma reports no NUMA support
  // (a kernel without it, or get_mempolicy refused: in a container, without
  // CAP_SYS_NICE).
  static absl::StatusOr<int> NumaNodeOfAllowedCpus();
  ~ThreadPool();  // joins the workers
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return num_threads_; }
  // The CPUs workers are pinned to (empty when not pinned): worker i to the
  // i-th (round robin) when pinned_per_cpu(), else each to all of them (a
  // NUMA node's CPUs shared with other processes).
  const std::vector<int>& cpus() const { return cpus_; }
  bool pinned_per_cpu() const { return per_cpu_; }

  // Runs job(worker_index) on every worker and returns when all returned.
  void Run(const std::function<void(int)>& job);

  // Called from inside a job by every worker: returns when all workers of
  // the current job have arrived. Reusable any number of times per job.
  void Barrier();

 private:
  ThreadPool(std::vector<int> cpus, int num_threads, bool caller_joins, bool per_cpu);
  void WorkerLoop(int index);
  void StopWorkers();  // stops and joins the started workers

  std::vector<int> cpus_;
  const bool per_cpu_;
  const int num_threads_;
  const bool caller_joins_;
  std::vector<std::thread> workers_;
  std::string start_error_;  // why a worker could not be started (the constructor's failure)

  common::Mutex run_mu_;  // one job at a time

  common::Mutex mu_;
  common::CondVar start_cv_;
  common::CondVar done_cv_;
  const std::function<void(int)>* job_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int remaining_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<uint64_t> published_generation_{0};  // spin-read copy of generation_

  // Sense-reversing barrier.
  std::atomic<int> barrier_count_{0};
  std::atomic<uint64_t> barrier_phase_{0};
};

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_THREAD_POOL_H_
