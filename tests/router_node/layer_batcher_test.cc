// Merging concurrent calls of one layer (router_node/layer_batcher.h): each
// caller's answer is the bytes it gets alone, whatever it was merged with
// (other token counts, routing modes, dtypes, client routes), and a caller
// cancelled or past its deadline is answered at once without failing or
// holding the others. A gated backend holds the first call so that the next
// ones queue behind it; nothing here depends on timing.
//
// Runs with the built-in kernel profile (COLIBRI_KERNEL_PROFILE=off, set
// before anything selects kernels): bf16 experts then have no row threshold
// but AMX tiles' 16 rows, which no caller meant to merge reaches (at most 5
// tokens; the one of 65 is over the batch limit on purpose), so each is
// mergeable on any CPU. kernel_rows itself is tested in
// expert_executor_test.cc with thresholds that merged calls cross.

#include "router_node/layer_batcher.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/half.h"
#include "common/model_dir.h"
#include "expert_node/expert_store.h"
#include "kernels/thread_pool.h"
#include "router_node/local_backend.h"
#include "router_node/router.h"
#include "tests/test_util.h"

namespace colibri {
namespace router_node {
namespace {

using colibri::testing::TempDir;
using common::DType;

const bool kBuiltInProfile = [] { return setenv("COLIBRI_KERNEL_PROFILE", "off", 1) == 0; }();

// The local backend, except that while armed the next call waits in
// Compute until Release; it records the largest kernel_rows it was given.
class GatedBackend final : public ExpertBackend {
 public:
  explicit GatedBackend(ExpertBackend* inner) : inner_(inner) {}

  absl::Status Compute(const LayerWork& work, float* contributions, CallControl& control,
                       BackendStats* stats) override {
    bool hold = false;
    {
      common::MutexLock lock(&mu_);
      hold = armed_;
      armed_ = false;
      ++calls_;
      computed_.push_back({std::this_thread::get_id(), work.num_tokens});
      for (const ExpertWork& w : work.experts) max_kernel_rows_ = std::max(max_kernel_rows_, w.kernel_rows);
      if (hold) holding_ = true;
    }
    if (hold) {
      common::MutexLock lock(&mu_);
      while (!released_) cv_.Wait(&mu_);
      released_ = false;
      holding_ = false;
    }
    if (work.num_tokens > refuse_over_tokens_) {
      return absl::InvalidArgumentError(absl::StrCat(work.num_tokens, " tokens: more than this backend takes"));
    }
    return inner_->Compute(work, contributions, control, stats);
  }
  bool Mergeable(const LayerWork& work) const override { return inner_->Mergeable(work); }
  std::string kind() const override { return "gated"; }
  // As a remote backend says (one that only sends work, and may have calls
  // in flight side by side); ComputeAsync still computes on its caller's thread.
  bool asynchronous() const override { return asynchronous_; }
  void SetAsynchronous() { asynchronous_ = true; }

  void Arm() {
    common::MutexLock lock(&mu_);
    armed_ = true;
  }
  bool holding() {
    common::MutexLock lock(&mu_);
    return holding_;
  }
  void Release() {
    common::MutexLock lock(&mu_);
    released_ = true;
    cv_.SignalAll();
  }
  // Calls of more tokens fail with INVALID_ARGUMENT.
  void RefuseOver(int64_t tokens) { refuse_over_tokens_ = tokens; }
  // The thread and token count of each call computed.
  std::vector<std::pair<std::thread::id, int64_t>> computed() {
    common::MutexLock lock(&mu_);
    return computed_;
  }
  int64_t max_kernel_rows() {
    common::MutexLock lock(&mu_);
    return max_kernel_rows_;
  }

 private:
  ExpertBackend* const inner_;
  common::Mutex mu_;
  common::CondVar cv_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  bool holding_ ABSL_GUARDED_BY(mu_) = false;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t max_kernel_rows_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::pair<std::thread::id, int64_t>> computed_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> refuse_over_tokens_{1 << 30};
  std::atomic<bool> asynchronous_{false};
};

// Polls `condition` every millisecond for up to 20 s (a correctness wait,
// not a timing check: it fails only if the condition never holds).
template <typename F>
bool Eventually(F condition) {
  for (int i = 0; i < 20000; ++i) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return condition();
}

// One caller's request; owns what its ForwardInput points to.
struct Request {
  ForwardInput in;
  std::vector<int32_t> ids;
  std::string hidden;
  std::vector<int32_t> expert_ids;
  std::vector<float> weights;
};

Request MakeRequest(const common::Manifest& m, int32_t layer, int64_t tokens, common::RoutingMode routing,
                    DType hidden_dtype, DType output_dtype, uint32_t seed) {
  Request r;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int64_t values = tokens * m.d_model;
  r.hidden.resize(values * (hidden_dtype == DType::kF32 ? 4 : 2));
  for (int64_t i = 0; i < values; ++i) {
    const float v = normal(rng);
    if (hidden_dtype == DType::kF32) {
      std::memcpy(&r.hidden[4 * i], &v, 4);
    } else {
      const uint16_t h = common::FloatToBf16(v);
      std::memcpy(&r.hidden[2 * i], &h, 2);
    }
  }
  for (int64_t t = 0; t < tokens; ++t) r.ids.push_back(static_cast<int32_t>(rng() % m.vocab_size));
  if (routing == common::RoutingMode::kClient) {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < m.top_k; ++j) {
        r.expert_ids.push_back(static_cast<int32_t>((t + 3 * j + seed) % m.n_experts));
        r.weights.push_back(0.25f + 0.5f * static_cast<float>(j));
      }
    }
  }
  r.in.layer = layer;
  r.in.token_ids = r.ids;
  r.in.hidden = r.hidden.data();
  r.in.hidden_bytes = static_cast<int64_t>(r.hidden.size());
  r.in.hidden_dtype = hidden_dtype;
  r.in.num_tokens = tokens;
  r.in.cols = m.d_model;
  r.in.routing = routing;
  r.in.client_top_k = routing == common::RoutingMode::kClient ? m.top_k : 0;
  r.in.client_expert_ids = r.expert_ids;
  r.in.client_weights = r.weights;
  r.in.output_dtype = output_dtype;
  r.in.request_id = "caller-" + std::to_string(seed);
  return r;
}

struct Fixture {
  TempDir dir;
  std::string model_dir = dir / "model";
  std::ostringstream log;  // the store's: it must outlive it (its weights are locked on another thread)
  std::unique_ptr<expert_node::ExpertStore> store;
  std::unique_ptr<kernels::ThreadPool> pool;
  std::unique_ptr<LocalBackend> local;
  std::unique_ptr<GatedBackend> gated;
  std::unique_ptr<Router> plain;   // no merging
  std::unique_ptr<Router> merged;  // merging, on the gated backend

  // stall_after: an hour unless a test says (a held call must hold the queue, however slow the machine).
  explicit Fixture(absl::Duration window = absl::Milliseconds(20), int64_t max_tokens = 65536,
                   absl::Duration stall_after = absl::Hours(1), int64_t batch_max_tokens = 64) {
    colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), model_dir, DType::kBF16);
    auto s = expert_node::ExpertStore::Create(model_dir, expert_node::StoreOptions{}, &log);
    REQUIRE(s.ok());
    store = std::move(s).value();
    auto p = kernels::ThreadPool::Create({2, -1, false});
    REQUIRE(p.ok());
    pool = std::move(p).value();
    local = std::make_unique<LocalBackend>(store.get(), pool.get());
    gated = std::make_unique<GatedBackend>(local.get());
    auto r = Router::Create(model_dir, local.get(), RouterOptions{});
    REQUIRE(r.ok());
    plain = std::move(r).value();
    RouterOptions options;
    options.max_tokens = max_tokens;
    options.batching.window = window;
    options.batching.max_tokens = batch_max_tokens;
    options.batching.stall_after = stall_after;
    auto b = Router::Create(model_dir, gated.get(), options);
    REQUIRE(b.ok());
    merged = std::move(b).value();
  }
  const common::Manifest& manifest() const { return plain->manifest(); }

  std::string Alone(const Request& r) {
    CallControl control;
    absl::StatusOr<ForwardOutput> out = plain->Forward(r.in, control);
    REQUIRE(out.ok());
    return out->output;
  }
};

// A Forward on its own thread.
struct Caller {
  CallControl control;
  absl::StatusOr<ForwardOutput> result = absl::UnknownError("not run");
  common::Notification finished;
  std::thread thread;

  explicit Caller(absl::Time deadline = absl::InfiniteFuture()) : control(deadline) {}
  void Start(Router& router, const ForwardInput& in) {
    thread = std::thread([this, &router, &in] {
      result = router.Forward(in, control);
      finished.Notify();
    });
  }
  bool done() { return finished.HasBeenNotified(); }
  ~Caller() {
    if (thread.joinable()) thread.join();
  }
};

// Callers of `requests` on the merging router: the first held in the
// backend until all the others have queued behind it, then released.
std::vector<std::unique_ptr<Caller>> StartBehindFirst(Fixture& f, const std::vector<Request>& requests) {
  f.gated->Arm();
  std::vector<std::unique_ptr<Caller>> callers;
  for (size_t i = 0; i < requests.size(); ++i) {
    callers.push_back(std::make_unique<Caller>());
    callers[i]->Start(*f.merged, requests[i].in);
    if (i == 0) REQUIRE(Eventually([&] { return f.gated->holding(); }));
  }
  const int64_t behind = static_cast<int64_t>(requests.size()) - 1;
  REQUIRE(Eventually([&] { return f.merged->queued_calls() == behind; }));
  f.gated->Release();
  return callers;
}

TEST_CASE("callers merged into one layer call each get exactly their own answer") {
  Fixture f;
  const common::Manifest& m = f.manifest();
  using common::RoutingMode;
  std::vector<Request> requests;
  requests.push_back(MakeRequest(m, 1, 1, RoutingMode::kLut, DType::kF32, DType::kF32, 1));  // held in the backend
  requests.push_back(MakeRequest(m, 1, 3, RoutingMode::kGate, DType::kBF16, DType::kBF16, 2));
  requests.push_back(MakeRequest(m, 1, 2, RoutingMode::kClient, DType::kF32, DType::kF32, 3));
  requests.push_back(MakeRequest(m, 1, 5, RoutingMode::kLut, DType::kBF16, DType::kF32, 4));
  requests.push_back(MakeRequest(m, 1, 1, RoutingMode::kGate, DType::kF32, DType::kBF16, 5));
  std::vector<std::string> alone;
  for (const Request& r : requests) alone.push_back(f.Alone(r));

  std::vector<std::unique_ptr<Caller>> callers = StartBehindFirst(f, requests);
  for (size_t i = 0; i < callers.size(); ++i) {
    CAPTURE(i);
    callers[i]->finished.WaitForNotification();
    REQUIRE(callers[i]->result.ok());
    CHECK(callers[i]->result->output == alone[i]);
    CHECK(callers[i]->result->timings.merged_callers == (i == 0 ? 1 : 4));
    CHECK(callers[i]->result->timings.merged_tokens == (i == 0 ? 1 : 11));
  }
  CHECK(f.gated->max_kernel_rows() > 0);  // an expert had rows of several callers
  // The queue span is in the caller's timings.
  bool queue_span = false;
  for (const TimingSpan& s : TimingSpans(*callers[1]->result)) queue_span |= s.stage == "queue";
  CHECK(queue_span);
}

TEST_CASE("a merged caller cancelled or past its deadline is answered at once and the others are not failed") {
  Fixture f;
  const common::Manifest& m = f.manifest();
  using common::RoutingMode;
  const Request first = MakeRequest(m, 0, 2, RoutingMode::kLut, DType::kF32, DType::kF32, 11);
  const Request queued_cancelled = MakeRequest(m, 0, 1, RoutingMode::kLut, DType::kF32, DType::kF32, 12);
  const Request queued_late = MakeRequest(m, 0, 1, RoutingMode::kGate, DType::kF32, DType::kF32, 13);
  const Request flight_cancelled = MakeRequest(m, 0, 3, RoutingMode::kLut, DType::kF32, DType::kF32, 14);
  const Request survivor = MakeRequest(m, 0, 2, RoutingMode::kGate, DType::kBF16, DType::kBF16, 15);

  // `first` is held in the backend; three callers queue behind it.
  f.gated->Arm();
  Caller c0;
  c0.Start(*f.merged, first.in);
  REQUIRE(Eventually([&] { return f.gated->holding(); }));
  Caller c1, c3, c4;
  Caller c2(absl::Now() + absl::Milliseconds(50));
  c1.Start(*f.merged, queued_cancelled.in);
  c2.Start(*f.merged, queued_late.in);
  c3.Start(*f.merged, flight_cancelled.in);
  c4.Start(*f.merged, survivor.in);
  REQUIRE(Eventually([&] { return f.merged->queued_calls() == 4; }));

  // While `first` is still held: a cancelled caller and one past its deadline are answered.
  c1.control.Cancel();
  REQUIRE(Eventually([&] { return c1.done() && c2.done(); }));
  CHECK(f.gated->holding());
  CHECK(c1.result.status().code() == absl::StatusCode::kCancelled);
  CHECK(c2.result.status().code() == absl::StatusCode::kDeadlineExceeded);

  // The next merged call (c3 and c4) is held too; cancelling c3 answers it at once.
  f.gated->Arm();
  f.gated->Release();
  c0.finished.WaitForNotification();
  REQUIRE(c0.result.ok());
  CHECK(c0.result->output == f.Alone(first));
  REQUIRE(Eventually([&] { return f.gated->holding(); }));
  c3.control.Cancel();
  REQUIRE(Eventually([&] { return c3.done(); }));
  CHECK(f.gated->holding());
  CHECK(c3.result.status().code() == absl::StatusCode::kCancelled);
  f.gated->Release();
  c4.finished.WaitForNotification();
  REQUIRE(c4.result.ok());
  CHECK(c4.result->output == f.Alone(survivor));
  CHECK(c4.result->timings.merged_callers == 2);
}

TEST_CASE("a merged call its callers left uses the backend and holds their ForwardInput::hold until it ends") {
  Fixture f;
  const Request first = MakeRequest(f.manifest(), 0, 2, common::RoutingMode::kLut, DType::kF32, DType::kF32, 21);
  Request next = MakeRequest(f.manifest(), 0, 1, common::RoutingMode::kLut, DType::kF32, DType::kF32, 22);
  auto hold = std::make_shared<int>(0);  // a server's memory reservation, say
  const std::weak_ptr<int> held = hold;
  next.in.hold = std::move(hold);
  CHECK_FALSE(f.merged->backend_in_use());
  // `first` is held in the backend on its own thread; `next` queues behind
  // it, then goes from the batcher's thread and is held there in turn.
  f.gated->Arm();
  Caller c0, c1;
  c0.Start(*f.merged, first.in);
  REQUIRE(Eventually([&] { return f.gated->holding(); }));
  c1.Start(*f.merged, next.in);
  REQUIRE(Eventually([&] { return f.merged->queued_calls() == 1; }));
  f.gated->Arm();
  f.gated->Release();
  c0.finished.WaitForNotification();
  REQUIRE(c0.result.ok());
  REQUIRE(Eventually([&] { return f.gated->holding(); }));
  c1.control.Cancel();
  REQUIRE(Eventually([&] { return c1.done(); }));
  CHECK(c1.result.status().code() == absl::StatusCode::kCancelled);
  next.in.hold.reset();
  // Every caller is answered, but the backend still computes `next`: it
  // must not be destroyed yet, and what `next` holds is held.
  CHECK(f.gated->holding());
  CHECK(f.merged->backend_in_use());
  CHECK_FALSE(held.expired());
  f.gated->Release();
  CHECK(Eventually([&] { return !f.merged->backend_in_use(); }));
  CHECK(held.expired());
}

TEST_CASE("a merged call that fails is sent again caller by caller: each failure is the caller's own") {
  Fixture f;
  const common::Manifest& m = f.manifest();
  using common::RoutingMode;
  const Request first = MakeRequest(m, 0, 1, RoutingMode::kLut, DType::kF32, DType::kF32, 41);
  const Request small_a = MakeRequest(m, 0, 2, RoutingMode::kGate, DType::kBF16, DType::kBF16, 42);
  const Request small_b = MakeRequest(m, 0, 3, RoutingMode::kClient, DType::kF32, DType::kF32, 43);
  const Request big = MakeRequest(m, 0, 5, RoutingMode::kLut, DType::kF32, DType::kF32, 44);
  f.gated->RefuseOver(3);  // the merged call (10 tokens) and `big` alone are refused
  f.gated->Arm();
  Caller c0, c1, c2, c3;
  c0.Start(*f.merged, first.in);
  REQUIRE(Eventually([&] { return f.gated->holding(); }));
  c1.Start(*f.merged, small_a.in);
  c2.Start(*f.merged, small_b.in);
  c3.Start(*f.merged, big.in);
  REQUIRE(Eventually([&] { return f.merged->queued_calls() == 3; }));
  f.gated->Release();
  for (Caller* c : {&c0, &c1, &c2, &c3}) c->finished.WaitForNotification();
  REQUIRE(c0.result.ok());
  REQUIRE(c1.result.ok());
  REQUIRE(c2.result.ok());
  CHECK(c1.result->output == f.Alone(small_a));
  CHECK(c2.result->output == f.Alone(small_b));
  CHECK(c1.result->timings.merged_callers == 1);  // its answer came from its own call
  CHECK(c3.result.status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("a lone caller is not held for the window, and a caller over max_tokens is not merged") {
  Fixture f(absl::Hours(1));  // a wait for the window would never end
  const common::Manifest& m = f.manifest();
  for (int i = 0; i < 3; ++i) {
    const Request r = MakeRequest(m, 0, 2, common::RoutingMode::kLut, DType::kF32, DType::kF32, 20 + i);
    CallControl control;
    absl::StatusOr<ForwardOutput> out = f.merged->Forward(r.in, control);
    REQUIRE(out.ok());
    CHECK(out->output == f.Alone(r));
    CHECK(out->timings.merged_callers == 1);
  }
  const Request big = MakeRequest(m, 0, 65, common::RoutingMode::kLut, DType::kF32, DType::kF32, 30);
  CallControl control;
  absl::StatusOr<ForwardOutput> out = f.merged->Forward(big.in, control);
  REQUIRE(out.ok());
  CHECK(out->output == f.Alone(big));
  CHECK(out->timings.merged_callers == 0);  // sent on its own, not through the batcher
}

TEST_CASE("a caller whose arrival sends the queue without it does not compute the others' call") {
  // The queue goes by its size only; a merged call takes at most 4 tokens.
  Fixture f(absl::Hours(1), 65536, absl::Hours(1), /*batch_max_tokens=*/4);
  const common::Manifest& m = f.manifest();
  using common::RoutingMode;
  std::vector<Request> requests;
  requests.push_back(MakeRequest(m, 0, 1, RoutingMode::kLut, DType::kF32, DType::kF32, 61));  // held
  requests.push_back(MakeRequest(m, 0, 2, RoutingMode::kLut, DType::kF32, DType::kF32, 62));
  requests.push_back(MakeRequest(m, 0, 1, RoutingMode::kGate, DType::kF32, DType::kF32, 63));
  // The first call's end leaves the two behind it (3 tokens) waiting for a
  // third caller (three were active); one of 4 tokens fills the queue past
  // batching.max_tokens, so the queue goes without it, and then it goes
  // alone. (Few tokens: a caller with an expert's rows at a kernel threshold
  // is not merged at all.)
  std::vector<std::unique_ptr<Caller>> callers = StartBehindFirst(f, requests);
  callers[0]->finished.WaitForNotification();
  REQUIRE(callers[0]->result.ok());
  REQUIRE(f.merged->queued_calls() == 2);
  const Request full = MakeRequest(m, 0, 4, RoutingMode::kLut, DType::kF32, DType::kF32, 64);
  Caller last;
  last.Start(*f.merged, full.in);
  for (size_t i = 1; i < callers.size(); ++i) {
    callers[i]->finished.WaitForNotification();
    REQUIRE(callers[i]->result.ok());
    CHECK(callers[i]->result->output == f.Alone(requests[i]));
    CHECK(callers[i]->result->timings.merged_callers == 2);
  }
  last.finished.WaitForNotification();
  REQUIRE(last.result.ok());
  CHECK(last.result->output == f.Alone(full));
  CHECK(last.result->timings.merged_callers == 1);
  // The merged call of the two (3 tokens) ran off the last caller's thread.
  bool merged_seen = false;
  for (const auto& [thread, tokens] : f.gated->computed()) {
    if (tokens != 3) continue;
    merged_seen = true;
    CHECK(thread != last.thread.get_id());
  }
  CHECK(merged_seen);
}

TEST_CASE("a merged call out for stall_after no longer holds its layer's queue back") {
  Fixture f(absl::Milliseconds(20), 65536, /*stall_after=*/absl::Milliseconds(50));
  f.gated->SetAsynchronous();  // calls side by side, as with nodes
  const common::Manifest& m = f.manifest();
  const Request first = MakeRequest(m, 0, 2, common::RoutingMode::kLut, DType::kF32, DType::kF32, 71);
  const Request next = MakeRequest(m, 0, 1, common::RoutingMode::kGate, DType::kF32, DType::kF32, 72);
  f.gated->Arm();
  Caller c0, c1;
  c0.Start(*f.merged, first.in);
  REQUIRE(Eventually([&] { return f.gated->holding(); }));  // a node that hangs, say
  c1.Start(*f.merged, next.in);
  const bool served = Eventually([&] { return c1.done(); });  // beside the held call
  CHECK(f.gated->holding());
  if (!served) f.gated->Release();  // then c1 goes after it, and the test ends
  REQUIRE(served);
  REQUIRE(c1.result.ok());
  CHECK(c1.result->output == f.Alone(next));
  f.gated->Release();
  c0.finished.WaitForNotification();
  REQUIRE(c0.result.ok());
  CHECK(c0.result->output == f.Alone(first));
}

TEST_CASE("the stall threshold follows the layer's merged call time, between stall_after and 4 x stall_after") {
  const absl::Duration half = absl::Milliseconds(500);
  CHECK(StallThreshold(half, absl::ZeroDuration()) == half);    // no call has ended yet
  CHECK(StallThreshold(half, absl::Milliseconds(20)) == half);  // fast calls: a hang shows in 500 ms
  CHECK(StallThreshold(half, absl::Milliseconds(300)) == absl::Milliseconds(1200));  // a busy node is not hung
  CHECK(StallThreshold(half, absl::Seconds(5)) == absl::Seconds(2));  // hung calls in the average: still 2 s
}

TEST_CASE("the in-process backend serves its callers in the order they came") {
  Fixture f;
  const int64_t d = f.manifest().d_model;
  // Callers that each come straight back for their next call, more of them
  // than CPUs: with a plain mutex the one that just finished takes it again
  // and the others wait for many calls; in turn, a call waits for about one
  // call of each other caller. Judged on the 95th percentile of the calls
  // others completed while one call was out (a caller preempted outside the
  // line on a loaded machine sees many, now and then, in either case).
  constexpr int kCallers = 6, kCalls = 150;
  std::atomic<int> completed{0};
  std::atomic<int> failed{0};
  common::Mutex mu;
  std::vector<int> waits;  // guarded by mu
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&] {
      std::vector<float> x(d, 0.5f), out(2 * d);
      LayerWork w;
      w.x = x.data();
      w.num_tokens = 1;
      w.num_slots = 2;
      w.experts = {{0, {0}, {0.5f}, {0}}, {1, {0}, {0.5f}, {1}}};
      std::vector<int> mine;
      for (int i = 0; i < kCalls; ++i) {
        const int before = completed;
        CallControl control;
        if (!f.local->Compute(w, out.data(), control, nullptr).ok()) ++failed;  // (Catch asserts on this thread only)
        mine.push_back(completed++ - before);
      }
      common::MutexLock lock(&mu);
      waits.insert(waits.end(), mine.begin(), mine.end());
    });
  }
  for (std::thread& t : callers) t.join();
  CHECK(failed == 0);
  std::sort(waits.begin(), waits.end());
  const int p95 = waits[waits.size() * 95 / 100];
  CAPTURE(p95, waits.back());
  CHECK(p95 <= 3 * kCallers);  // in turn ~5; a plain mutex 27 and more (max 45-430)
}

TEST_CASE("a merged call never holds more tokens than one Forward may") {
  Fixture f(absl::Milliseconds(20), /*max_tokens=*/4);  // batching.max_tokens is 64
  const common::Manifest& m = f.manifest();
  std::vector<Request> requests;
  for (uint32_t i = 0; i < 4; ++i) {
    requests.push_back(MakeRequest(m, 0, i == 0 ? 1 : 2, common::RoutingMode::kLut, DType::kF32, DType::kF32, 50 + i));
  }
  std::vector<std::unique_ptr<Caller>> callers = StartBehindFirst(f, requests);
  int merged = 0;
  for (size_t i = 0; i < callers.size(); ++i) {
    CAPTURE(i);
    callers[i]->finished.WaitForNotification();
    REQUIRE(callers[i]->result.ok());
    CHECK(callers[i]->result->output == f.Alone(requests[i]));
    CHECK(callers[i]->result->timings.merged_tokens <= 4);
    merged += callers[i]->result->timings.merged_callers == 2 ? 1 : 0;
  }
  CHECK(merged == 2);  // two of the three queued callers (2 + 2 tokens) shared a call, the third went on its own
}

}  // namespace
}  // namespace router_node
}  // namespace colibri
