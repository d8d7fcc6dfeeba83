#include "kernels/x86_simd.h"

#include "kernels/thread_pool.h"

#include <numa.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "common/cgroup_limits.h"
#include "common/cpu_affinity.h"
#include "common/sigbus_guard.h"

namespace colibri {
namespace kernels {
namespace {

// How long an idle worker spins for the next job before it sleeps: long
// enough to catch back-to-back layer calls, short enough not to burn a core.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(200);

void Pause() { _mm_pause(); }

}  // namespace

absl::StatusOr<std::unique_ptr<ThreadPool>> ThreadPool::Create(const Options& options) {
  if (options.num_threads > kMaxThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat("thread pool: ", options.num_threads, " threads is over the limit of ", kMaxThreads));
  }
  std::vector<int> cpus = common::ThreadCpus();
  if (options.numa_node >= 0) {
    if (numa_available() < 0) {
      return absl::UnavailableError(
          absl::StrCat("NUMA node ", options.numa_node, " requested but libnuma reports no NUMA support"));
    }
    if (options.numa_node > numa_max_node()) {
      return absl::InvalidArgumentError(
          absl::StrCat("NUMA node ", options.numa_node, " does not exist (max ", numa_max_node(), ")"));
    }
    bitmask* mask = numa_allocate_cpumask();
    if (numa_node_to_cpus(options.numa_node, mask) < 0) numa_bitmask_clearall(mask);  // a gap in the numbering
    std::vector<int> node_cpus;
    for (int c : cpus) {
      if (numa_bitmask_isbitset(mask, c)) node_cpus.push_back(c);
    }
    numa_free_cpumask(mask);
    if (node_cpus.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("NUMA node ", options.numa_node, " has no CPUs this process may use"));
    }
    cpus = node_cpus;
  }
  const double quota = common::ReadCgroupLimits().cpus;
  const int n = options.num_threads > 0 ? options.num_threads : common::DefaultThreads(cpus.size(), quota);
  // CPUs shared with others (a quota below the CPUs allowed): no CPU of its
  // own per worker, but a NUMA node's CPUs stay the workers' set.
  const bool shared = quota > 0 && quota < static_cast<double>(cpus.size());
  if (!options.pin || (shared && options.numa_node < 0)) cpus.clear();
  std::unique_ptr<ThreadPool> pool(
      new ThreadPool(std::move(cpus), n, options.caller_joins, /*per_cpu=*/options.pin && !shared));
  if (!pool->start_error_.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat("thread pool: cannot start ", n, " threads (",
                                                     pool->workers_.size(), " started): ", pool->start_error_));
  }
  return pool;
}

ThreadPool::ThreadPool(std::vector<int> cpus, int num_threads, bool caller_joins, bool per_cpu)
    : cpus_(std::move(cpus)),
      per_cpu_(per_cpu && !cpus_.empty()),
      num_threads_(num_threads),
      caller_joins_(caller_joins) {
  try {
    for (int i = caller_joins ? 1 : 0; i < num_threads; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
  } catch (const std::system_error& e) {  // out of threads (EAGAIN): joinable threads must not be destroyed
    start_error_ = e.what();
    StopWorkers();
  }
}

ThreadPool::~ThreadPool() { StopWorkers(); }

void ThreadPool::StopWorkers() {
  {
    common::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
    ++generation_;
    published_generation_.store(generation_, std::memory_order_release);
  }
  start_cv_.SignalAll();
  for (std::thread& t : workers_) t.join();
}

absl::StatusOr<int> ThreadPool::NumaNodeOfAllowedCpus() {
  if (numa_available() < 0) return -1;
  std::vector<int> nodes;
  for (const int cpu : common::ThreadCpus()) {
    const int node = numa_node_of_cpu(cpu);
    if (node >= 0 && std::find(nodes.begin(), nodes.end(), node) == nodes.end()) nodes.push_back(node);
  }
  if (nodes.size() == 1) return nodes[0];
  if (nodes.empty()) return absl::FailedPreconditionError("no allowed CPU belongs to a NUMA node");
  std::string list;
  for (const int n : nodes) absl::StrAppend(&list, list.empty() ? "" : ",", n);
  return absl::FailedPreconditionError(absl::StrCat("the CPUs this process may use span NUMA nodes ", list,
                                                    "; restrict it to one node (taskset/numactl, or Kubernetes' "
                                                    "topology manager) or set ThreadPool::Options::numa_node"));
}

namespace {

// A job that throws (oneDNN's errors, std::bad_alloc) would leave the pool's
// other workers waiting at a barrier for this one: the process ends here,
// saying why, instead of hanging or unwinding through the pool.
void RunJob(const std::function<void(int)>& job, int index) {
  try {
    job(index);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "colibri: a kernel job threw on worker %d: %s\n", index, e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "colibri: a kernel job threw on worker %d\n", index);
    std::abort();
  }
}

}  // namespace

void ThreadPool::WorkerLoop(int index) {
  common::SigbusGuard::UnblockHere();  // workers read mapped weights
  if (!cpus_.empty())
    common::PinThread(per_cpu_ ? std::vector<int>{cpus_[index % cpus_.size()]} : cpus_);  // best effort
  omp_set_num_threads(1);  // oneDNN parallel regions started here stay on this thread
  uint64_t seen = 0;
  for (;;) {
    // Spin briefly for the next job, then sleep. After the first few
    // spins, yield: a thread that has work (the gRPC thread sending this
    // job's result, on a machine with few cores) runs instead of waiting
    // for the spin to end; with nothing else runnable, yield returns at once.
    const auto spin_until = std::chrono::steady_clock::now() + kSpinBeforeSleep;
    int spins = 0;
    while (published_generation_.load(std::memory_order_acquire) == seen &&
           std::chrono::steady_clock::now() < spin_until) {
      if (++spins < 64) {
        Pause();
      } else {
        std::this_thread::yield();
      }
    }
    const std::function<void(int)>* job;
    {
      common::MutexLock lock(&mu_);
      while (generation_ == seen) start_cv_.Wait(&mu_);
      seen = generation_;
      if (stop_) return;
      job = job_;
    }
    RunJob(*job, index);
    {
      common::MutexLock lock(&mu_);
      if (--remaining_ == 0) done_cv_.Signal();
    }
  }
}

void ThreadPool::Run(const std::function<void(int)>& job) {
  common::MutexLock run_lock(&run_mu_);
  // A joining caller runs on worker 0's CPU for the job (else it may share a
  // CPU with a pinned worker while another CPU idles), then gets its own
  // affinity back: it may be anyone's thread.
  std::vector<int> caller_cpus;
  if (caller_joins_ && !cpus_.empty()) caller_cpus = common::ThreadCpus();
  const bool repin = !caller_cpus.empty();
  if (caller_joins_) {
    thread_local bool single_omp = false;  // oneDNN regions in the caller's share stay on the caller
    if (!single_omp) {
      omp_set_num_threads(1);
      single_omp = true;
    }
    if (repin) common::PinThread(per_cpu_ ? std::vector<int>{cpus_[0]} : cpus_);  // best effort
  }
  {
    common::MutexLock lock(&mu_);
    job_ = &job;
    remaining_ = static_cast<int>(workers_.size());
    ++generation_;
    published_generation_.store(generation_, std::memory_order_release);
  }
  start_cv_.SignalAll();
  if (caller_joins_) RunJob(job, 0);
  if (repin) common::PinThread(caller_cpus);
  common::MutexLock lock(&mu_);
  while (remaining_ != 0) done_cv_.Wait(&mu_);
  job_ = nullptr;
}

void ThreadPool::Barrier() {
  const uint64_t phase = barrier_phase_.load(std::memory_order_acquire);
  if (barrier_count_.fetch_add(1, std::memory_order_acq_rel) + 1 == size()) {
    barrier_count_.store(0, std::memory_order_relaxed);
    barrier_phase_.store(phase + 1, std::memory_order_release);
    return;
  }
  int spins = 0;
  while (barrier_phase_.load(std::memory_order_acquire) == phase) {
    if (++spins < 4096) {
      Pause();
    } else {
      std::this_thread::yield();  // an oversubscribed machine: let the others run
    }
  }
}

}  // namespace kernels
}  // namespace colibri
