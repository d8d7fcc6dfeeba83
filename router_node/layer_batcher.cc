#include "router_node/layer_batcher.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/mutex.h"

namespace colibri {
namespace router_node {
namespace {

struct Batch;

// One caller, from Submit until it is answered.
struct Entry {
  BatchCall call;
  absl::Time arrival;
  absl::Time deadline;
  int64_t tokens = 0;
  int hook = -1;
  // Guarded by State::mu (the analysis cannot name it from here).
  bool finished = false;       // answered, or being answered by the thread that set it
  bool taken = false;          // in a merged call (no longer queued)
  std::weak_ptr<Batch> batch;  // that call, while it is in flight
};

// Adds one to `count` for its own lifetime.
struct Counted {
  explicit Counted(std::shared_ptr<std::atomic<int64_t>> c) : count(std::move(c)) {
    count->fetch_add(1, std::memory_order_relaxed);
  }
  ~Counted() { count->fetch_sub(1, std::memory_order_release); }
  Counted(const Counted&) = delete;
  Counted& operator=(const Counted&) = delete;
  const std::shared_ptr<std::atomic<int64_t>> count;
};

// One merged call. Counted from its making until the last thread holding
// it lets go and its members are gone (`alive` is declared first, so it is
// destroyed last): the backend may be used until then, also after every
// caller was answered.
struct Batch {
  explicit Batch(std::shared_ptr<std::atomic<int64_t>> count) : alive(std::move(count)) {}

  const Counted alive;
  int32_t layer = 0;
  std::vector<std::shared_ptr<Entry>> members;
  absl::Time sent;
  std::unique_ptr<CallControl> control;  // the latest deadline of the members
  LayerWork work;
  std::vector<float> x;
  std::vector<uint16_t> x_bf16;
  std::vector<float> slots;
  std::vector<int64_t> slot_offset;  // per member: its first slot in `slots`
  BackendStats stats;
  bool cancelled = false;  // guarded by State::mu: every member is gone
  bool solo = false;       // a caller sent again on its own after its merged call failed: not the layer's call
};

}  // namespace

absl::Duration StallThreshold(absl::Duration stall_after, absl::Duration typical) {
  return std::clamp(4 * typical, stall_after, 4 * stall_after);
}

struct LayerBatcher::State : std::enable_shared_from_this<LayerBatcher::State> {
  struct Layer {
    std::deque<std::shared_ptr<Entry>> queue;
    int64_t tokens = 0;                   // queued
    std::multiset<absl::Time> in_flight;  // when each merged call sent and not ended went
    absl::Duration typical;               // moving average of its merged calls' durations (StallThreshold)
    size_t expected = 1;  // callers active at the last merged call's end: the queue goes once it holds as many
    absl::Time idle_since = absl::InfinitePast();  // that end
    // When the queue goes at the latest: `window` after its oldest caller came or the layer became idle.
    absl::Time WindowEnd(absl::Duration window) const { return std::max(queue.front()->arrival, idle_since) + window; }
  };

  State(ExpertBackend* b, int64_t n_layers, int64_t d, const BatchOptions& o)
      : backend(b), d_model(d), options(o), layers(n_layers) {
    if (o.metrics != nullptr) {
      callers_seen = o.metrics->GetHistogram("colibri_router_batch_callers", "Callers in each merged layer call.", {},
                                             {1, 2, 4, 8, 16, 32, 64, 128});
      tokens_seen = o.metrics->GetHistogram("colibri_router_batch_tokens", "Tokens in each merged layer call.", {},
                                            {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024});
      queue_seen = o.metrics->GetHistogram("colibri_router_batch_queue_seconds",
                                           "Time a caller waited before its merged layer call was sent.", {},
                                           common::LatencyBuckets());
    }
  }

  // Whether every merged call of the layer in flight has been out for
  // StallThreshold, on a backend that can compute calls side by side (a
  // synchronous one runs them in turn). REQUIRES: calls in flight.
  bool Stalled(const Layer& l, absl::Time now) const { return now >= StallEnd(l); }
  // When the layer's queue no longer waits for its merged calls in flight:
  // StallThreshold after the youngest went (never on a synchronous backend).
  absl::Time StallEnd(const Layer& l) const {
    return backend->asynchronous() ? *l.in_flight.rbegin() + StallThreshold(options.stall_after, l.typical)
                                   : absl::InfiniteFuture();
  }

  // The layer's queue as a merged call, if it should go now.
  std::shared_ptr<Batch> TakeIfReady(int32_t layer, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Layer& l = layers[layer];
    if (l.queue.empty() || (!l.in_flight.empty() && !Stalled(l, now))) return nullptr;
    const bool ready =
        l.queue.size() >= l.expected || l.tokens >= options.max_tokens || now >= l.WindowEnd(options.window);
    if (!ready) return nullptr;
    auto batch = std::make_shared<Batch>(batches);
    batch->layer = layer;
    batch->sent = now;
    int64_t tokens = 0;
    absl::Time deadline = absl::InfinitePast();
    while (!l.queue.empty()) {
      const std::shared_ptr<Entry>& e = l.queue.front();
      if (!batch->members.empty() && tokens + e->tokens > options.max_tokens) break;
      tokens += e->tokens;
      l.tokens -= e->tokens;
      deadline = std::max(deadline, e->deadline);
      e->taken = true;
      e->batch = batch;
      batch->members.push_back(e);
      l.queue.pop_front();
    }
    batch->control = std::make_unique<CallControl>(deadline);
    l.in_flight.insert(now);
    return batch;
  }

  // The merged call's work: the members' rows one after the other, each
  // expert one work of all its members' rows.
  void Assemble(Batch& b) {
    LayerWork& work = b.work;
    work.layer = b.layer;
    work.bf16_output = true;
    bool bf16_rows = true;
    for (const auto& e : b.members) {
      b.slot_offset.push_back(work.num_slots);
      work.num_tokens += e->call.work->num_tokens;
      work.num_slots += e->call.work->num_slots;
      work.bf16_output = work.bf16_output && e->call.work->bf16_output;
      bf16_rows = bf16_rows && e->call.work->x_bf16 != nullptr;
    }
    b.x.resize(work.num_tokens * d_model);
    if (bf16_rows) b.x_bf16.resize(work.num_tokens * d_model);
    struct Merged {
      ExpertWork work;
      int callers = 0;
    };
    std::map<int32_t, Merged> experts;
    int64_t token = 0;
    for (size_t m = 0; m < b.members.size(); ++m) {
      const LayerWork& w = *b.members[m]->call.work;
      const int64_t values = w.num_tokens * d_model;
      std::copy_n(w.x, values, b.x.data() + token * d_model);
      if (bf16_rows) std::copy_n(w.x_bf16, values, b.x_bf16.data() + token * d_model);
      for (const ExpertWork& src : w.experts) {
        Merged& dst = experts[src.expert];
        dst.work.expert = src.expert;
        for (const int32_t r : src.rows) dst.work.rows.push_back(static_cast<int32_t>(r + token));
        dst.work.weights.insert(dst.work.weights.end(), src.weights.begin(), src.weights.end());
        for (const int32_t s : src.slots) dst.work.slots.push_back(static_cast<int32_t>(s + b.slot_offset[m]));
        dst.work.kernel_rows = std::max<int64_t>(dst.work.kernel_rows, static_cast<int64_t>(src.rows.size()));
        ++dst.callers;
      }
      token += w.num_tokens;
    }
    for (auto& [id, merged] : experts) {
      if (merged.callers == 1) merged.work.kernel_rows = 0;  // its own count: as without merging
      work.experts.push_back(std::move(merged.work));
    }
    work.x = b.x.data();
    work.x_bf16 = bf16_rows ? b.x_bf16.data() : nullptr;
    work.request_id = b.members[0]->call.work->request_id;
    if (b.members.size() > 1) absl::StrAppend(&work.request_id, " +", b.members.size() - 1, " merged");
    b.slots.assign(work.num_slots * d_model, 0.f);
  }

  void Send(const std::shared_ptr<Batch>& b) {
    bool gone = false;
    {
      common::MutexLock lock(&mu);
      gone = b->cancelled || stopping;
    }
    if (gone) return Complete(b, absl::CancelledError("every caller of the merged call is gone"));
    // A replica that cannot keep merged rows' bits may have joined since the
    // callers were queued: then each goes on its own (Complete's retry).
    if (b->members.size() > 1 && !std::all_of(b->members.begin(), b->members.end(),
                                              [this](const auto& e) { return backend->Mergeable(*e->call.work); })) {
      return Complete(b, absl::AbortedError("the experts' nodes changed: sent caller by caller"));
    }
    // A caller alone is sent as it is: its own work, slots and stats (kept
    // alive by its entry, which the batch holds).
    const bool alone = b->members.size() == 1;
    if (!alone) Assemble(*b);
    const BatchCall& first = b->members[0]->call;
    const LayerWork& work = alone ? *first.work : b->work;
    // A caller sent again alone after a merged call that was sent and failed
    // keeps the wait it had, and is counted once in the metrics (with the
    // merged call); one whose merged call never went out is counted now.
    const bool counted = b->solo && b->members[0]->call.info->callers > 0;
    if (callers_seen != nullptr && !counted) {
      callers_seen->Observe(static_cast<double>(b->members.size()));
      tokens_seen->Observe(static_cast<double>(work.num_tokens));
    }
    for (const auto& e : b->members) {
      const int64_t queued = counted ? e->call.info->queue_nanos : absl::ToInt64Nanoseconds(b->sent - e->arrival);
      *e->call.info = {queued, static_cast<int64_t>(b->members.size()), work.num_tokens};
      if (queue_seen != nullptr && !counted) queue_seen->Observe(queued * 1e-9);
    }
    backend->ComputeAsync(work, alone ? first.slots : b->slots.data(), *b->control, alone ? first.stats : &b->stats,
                          [self = shared_from_this(), b](absl::Status s) { self->Complete(b, s); });
  }

  // Sends a caller of a failed merged call on its own.
  void SendAlone(const std::shared_ptr<Entry>& e) {
    auto b = std::make_shared<Batch>(batches);
    b->layer = e->call.work->layer;
    b->solo = true;
    b->sent = absl::Now();
    b->members.push_back(e);
    b->control = std::make_unique<CallControl>(e->deadline);
    {
      common::MutexLock lock(&mu);
      if (e->finished) return;  // answered meanwhile (cancelled, past its deadline)
      e->batch = b;
    }
    Launch(b, false);
  }

  // Sends `b` on this thread where that cannot hold a caller's thread: an
  // asynchronous backend only sends, and `own_thread` is a Submit whose
  // caller would run its own call anyway; else on the runner thread.
  void Launch(const std::shared_ptr<Batch>& b, bool own_thread) {
    if (own_thread || backend->asynchronous()) return Send(b);
    common::MutexLock lock(&mu);
    to_run.push_back(b);
    run_wake.Signal();
  }

  void Complete(const std::shared_ptr<Batch>& b, const absl::Status& status) {
    std::vector<std::shared_ptr<Entry>> live;
    std::shared_ptr<Batch> next;
    bool retry = false;
    {
      common::MutexLock lock(&mu);
      // A merged call that failed is sent again caller by caller: a failure
      // one caller causes (its rows refused, an expert only it needs without
      // a node) is then its own.
      retry = !status.ok() && b->members.size() > 1 && !stopping;
      for (const auto& e : b->members) {
        if (e->finished) continue;
        if (!retry) {
          e->finished = true;
          live_entries.erase(e);
        }
        live.push_back(e);
      }
      if (!b->solo) {
        Layer& l = layers[b->layer];
        l.in_flight.erase(l.in_flight.find(b->sent));
        const absl::Time now = absl::Now();
        const absl::Duration took = now - b->sent;
        l.typical = l.typical == absl::ZeroDuration() ? took : (3 * l.typical + took) / 4;
        if (l.in_flight.empty() || Stalled(l, now)) {  // (calls still out hang: they do not count)
          // The callers still there come back with their next calls; so do the ones queued meanwhile.
          l.expected = std::max<size_t>(1, live.size() + l.queue.size());
          l.idle_since = now;
        }
        if (!stopping) next = TakeIfReady(b->layer, now);
        if (next == nullptr && !l.queue.empty()) wake.Signal();  // the window of the queue starts to count
      }
    }
    if (next != nullptr) Launch(next, false);
    if (retry) {
      for (const std::shared_ptr<Entry>& e : live) SendAlone(e);
      return;
    }
    for (size_t i = 0; i < live.size(); ++i) {
      Entry& e = *live[i];
      e.call.control->RemoveHook(e.hook);
      if (status.ok() && b->members.size() > 1) {
        const size_t m = std::find(b->members.begin(), b->members.end(), live[i]) - b->members.begin();
        const int64_t values = e.call.work->num_slots * d_model;
        std::copy_n(b->slots.data() + b->slot_offset[m] * d_model, values, e.call.slots);
        *e.call.stats = b->stats;
      }
      e.call.done(status);
    }
  }

  // The batcher's thread: windows that end, callers cancelled or past their deadline.
  void Watch() {
    const std::shared_ptr<State> self = shared_from_this();  // alive even if the batcher is destroyed by a `done`
    mu.Lock();
    while (!stopping) {
      const absl::Time now = absl::Now();
      std::vector<std::pair<std::shared_ptr<Entry>, absl::Status>> drops;
      std::vector<std::shared_ptr<Batch>> cancels;
      absl::Time wake_at = absl::InfiniteFuture();
      for (const std::shared_ptr<Entry>& e : live_entries) {
        if (e->call.control->cancelled()) {
          drops.push_back({e, absl::CancelledError(
                                  absl::StrCat("layer ", e->call.work->layer, ": request cancelled by the client"))});
        } else if (now >= e->deadline) {
          drops.push_back({e, absl::DeadlineExceededError(absl::StrCat(
                                  "layer ", e->call.work->layer, ": deadline exceeded while ",
                                  e->taken ? "its call to the nodes ran, merged with" : "queued to be merged with",
                                  " other calls of the layer"))});
        } else {
          wake_at = std::min(wake_at, e->deadline);
        }
      }
      for (auto& [e, status] : drops) {
        e->finished = true;
        live_entries.erase(e);
        if (!e->taken) {
          Layer& l = layers[e->call.work->layer];
          l.queue.erase(std::find(l.queue.begin(), l.queue.end(), e));
          l.tokens -= e->tokens;
        } else if (std::shared_ptr<Batch> b = e->batch.lock();
                   b != nullptr && !b->cancelled &&
                   std::all_of(b->members.begin(), b->members.end(), [](const auto& m) { return m->finished; })) {
          b->cancelled = true;
          cancels.push_back(std::move(b));
        }
      }
      std::vector<std::shared_ptr<Batch>> launches;
      for (size_t layer = 0; layer < layers.size(); ++layer) {
        if (std::shared_ptr<Batch> b = TakeIfReady(static_cast<int32_t>(layer), now)) launches.push_back(std::move(b));
        const Layer& l = layers[layer];
        // The queue's next chance to go: its window's end, or while calls are
        // out the stall's end (then, if it is still short of callers, its window's).
        if (!l.queue.empty()) {
          const absl::Time stall_end = l.in_flight.empty() ? absl::InfinitePast() : StallEnd(l);
          wake_at = std::min(wake_at, now < stall_end ? stall_end : l.WindowEnd(options.window));
        }
      }
      if (drops.empty() && launches.empty()) {
        // At most a second: a far deadline must not overflow the clock's wait.
        wake.WaitWithTimeout(&mu, std::clamp(wake_at - absl::Now(), absl::ZeroDuration(), absl::Seconds(1)));
        continue;
      }
      mu.Unlock();
      // A merged call whose callers are all gone holds no one; cancel it before anyone's `done`.
      for (const std::shared_ptr<Batch>& b : cancels) b->control->Cancel();
      for (const std::shared_ptr<Batch>& b : launches) Launch(b, false);
      for (auto& [e, status] : drops) {
        e->call.control->RemoveHook(e->hook);
        e->call.done(status);
      }
      drops.clear();
      launches.clear();
      cancels.clear();
      mu.Lock();
    }
    mu.Unlock();
  }

  // Sends the merged calls of a synchronous backend, one at a time.
  void Run() {
    const std::shared_ptr<State> self = shared_from_this();
    mu.Lock();
    while (true) {
      while (!stopping && to_run.empty()) run_wake.Wait(&mu);
      if (to_run.empty()) break;
      std::shared_ptr<Batch> b = std::move(to_run.front());
      to_run.pop_front();
      mu.Unlock();
      Send(b);
      b.reset();
      mu.Lock();
    }
    mu.Unlock();
  }

  ExpertBackend* const backend;
  const int64_t d_model;
  const BatchOptions options;
  common::Histogram* callers_seen = nullptr;
  common::Histogram* tokens_seen = nullptr;
  common::Histogram* queue_seen = nullptr;
  // Merged calls alive (Batch); shared with them, which may outlive the state.
  const std::shared_ptr<std::atomic<int64_t>> batches = std::make_shared<std::atomic<int64_t>>(0);

  common::Mutex mu;
  common::CondVar wake;      // the watcher: a queue, a caller's state or `stopping` changed
  common::CondVar run_wake;  // the runner: to_run grew or `stopping`
  std::vector<Layer> layers ABSL_GUARDED_BY(mu);
  std::set<std::shared_ptr<Entry>> live_entries ABSL_GUARDED_BY(mu);  // submitted, not yet answered
  std::deque<std::shared_ptr<Batch>> to_run ABSL_GUARDED_BY(mu);
  bool stopping ABSL_GUARDED_BY(mu) = false;
  std::thread watcher;
  std::thread runner;
};

LayerBatcher::LayerBatcher(ExpertBackend* backend, int64_t n_layers, int64_t d_model, const BatchOptions& options)
    : state_(std::make_shared<State>(backend, n_layers, d_model, options)) {
  state_->watcher = std::thread([s = state_.get()] { s->Watch(); });
  if (!backend->asynchronous()) state_->runner = std::thread([s = state_.get()] { s->Run(); });
}

LayerBatcher::~LayerBatcher() {
  {
    common::MutexLock lock(&state_->mu);
    state_->stopping = true;
    state_->wake.SignalAll();
    state_->run_wake.SignalAll();
  }
  // The last caller's `done` may destroy the batcher on one of its own
  // threads: that thread then leaves its loop by itself (it holds the state).
  for (std::thread* t : {&state_->watcher, &state_->runner}) {
    if (!t->joinable()) continue;
    if (t->get_id() == std::this_thread::get_id()) {
      t->detach();
    } else {
      t->join();
    }
  }
}

bool LayerBatcher::Accepts(const LayerWork& work) const {
  return work.num_tokens <= state_->options.max_tokens && !work.experts.empty() && state_->backend->Mergeable(work);
}

bool LayerBatcher::idle() const { return state_->batches->load(std::memory_order_acquire) == 0; }

int64_t LayerBatcher::queued() const {
  common::MutexLock lock(&state_->mu);
  int64_t n = 0;
  for (const State::Layer& l : state_->layers) n += static_cast<int64_t>(l.queue.size());
  return n;
}

void LayerBatcher::Submit(BatchCall call) {
  auto e = std::make_shared<Entry>();
  e->call = std::move(call);
  e->arrival = absl::Now();
  e->deadline = e->call.control->deadline();
  e->tokens = e->call.work->num_tokens;
  if (e->call.control->cancelled()) return e->call.done(absl::CancelledError("cancelled before it was queued"));
  // The hook only wakes the watcher, which answers the caller; it may run here, at once.
  e->hook = e->call.control->AddHook([weak = std::weak_ptr<State>(state_)] {
    if (const std::shared_ptr<State> s = weak.lock()) {
      common::MutexLock lock(&s->mu);
      s->wake.Signal();
    }
  });
  State& s = *state_;
  std::shared_ptr<Batch> batch;
  {
    common::MutexLock lock(&s.mu);
    State::Layer& l = s.layers[e->call.work->layer];
    s.live_entries.insert(e);
    l.queue.push_back(e);
    l.tokens += e->tokens;
    batch = s.TakeIfReady(e->call.work->layer, e->arrival);
    // The watcher: the queue's window, or a cancellation it could not see before the entry was live.
    if (batch == nullptr || e->call.control->cancelled()) s.wake.Signal();
  }
  // On this thread only if the batch carries this caller: the queue may go
  // without it (it would pass batch_max_tokens), and a caller's thread must
  // not compute only other callers' work.
  if (batch != nullptr) {
    s.Launch(batch, std::find(batch->members.begin(), batch->members.end(), e) != batch->members.end());
  }
}

}  // namespace router_node
}  // namespace colibri
