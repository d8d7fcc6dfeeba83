// RemoteBackend's layer calls against scripted fake nodes and a manual clock
// (tests/router_node/fake_node.h): retry on another replica for every
// retryable code, refusal of the others, hedging, the client's deadline vs
// the node timeout, cancellation of every call in flight, a reply of the
// wrong shape. No process, socket or sleep: time moves when the test says.

#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <optional>
#include <sstream>
#include <thread>

#include "router_node/remote_backend.h"
#include "tests/router_node/fake_node.h"

namespace colibri {
namespace router_node {
namespace {

using colibri::testing::FakeClock;
using colibri::testing::FakeNode;
using Reply = FakeNode::Reply;
namespace v1 = colibri::v1;

constexpr int kDModel = 4;
constexpr int kExperts = 4;

// Nodes named n0, n1, … with markers 1, 2, … owning the experts given, and a
// backend over them with a 100 ms node timeout (and `hedge_after` if set).
// Per-expert replies unless told: every slot then names the node that computed it.
struct Cluster {
  explicit Cluster(const std::vector<std::vector<int>>& owned, absl::Duration hedge_after = absl::ZeroDuration(),
                   NodeReplies replies = NodeReplies::kPerExpert, absl::Duration recheck_after = absl::Hours(1)) {
    RemoteOptions o;
    for (size_t i = 0; i < owned.size(); ++i) {
      o.addresses.push_back("n" + std::to_string(i) + ":1");
      nodes.push_back(std::make_unique<FakeNode>(&clock, static_cast<int>(i) + 1, owned[i], "m", kDModel, kExperts));
    }
    o.model_id = "m";
    o.n_layers = 1;
    o.n_experts = kExperts;
    o.d_model = kDModel;
    o.node_timeout = absl::Milliseconds(100);
    o.hedge_after = hedge_after;
    o.replies = replies;
    // The map changes only through failed calls (unless the test asks for rechecks).
    o.health_interval = absl::Hours(1);
    o.recheck_after = recheck_after;
    o.clock = &clock;
    o.log = &log;
    o.connect = [this](const std::string& address) { return nodes[address[1] - '0']->Channel(); };
    auto b = RemoteBackend::Create(o);
    REQUIRE(b.ok());
    backend = std::move(*b);
  }
  bool live(int node) const { return backend->Nodes()[node].live; }
  // The node reports these size limits (and enforces them) from now on; the map knows them at once.
  void Limit(int node, int64_t max_rows, int64_t max_row_indices) {
    nodes[node]->SetLimits(max_rows, max_row_indices);
    backend->CheckNow();
  }

  FakeClock clock;
  std::ostringstream log;
  std::vector<std::unique_ptr<FakeNode>> nodes;
  std::unique_ptr<RemoteBackend> backend;
};

// Two tokens, top-2: token 0 → experts 0, 1; token 1 → experts 2, 3.
struct Layer {
  Layer() {
    work.x = x.data();
    work.num_tokens = 2;
    work.num_slots = 4;
    for (int e = 0; e < kExperts; ++e) work.experts.push_back({e, {e / 2}, {1.f}, {e}});
  }
  // Who answered slot s: the marker of the node (value / 100).
  int answered_by(int slot) const { return static_cast<int>(out[slot * kDModel]) / 100; }

  std::vector<float> x = std::vector<float>(2 * kDModel, 1.f);
  LayerWork work;
  std::vector<float> out = std::vector<float>(4 * kDModel, -1.f);
  BackendStats stats;
};

// A layer call in flight: its result once `done`.
struct Pending {
  void Start(Cluster& c, Layer& l, absl::Time deadline = absl::InfiniteFuture()) {
    control = std::make_unique<CallControl>(deadline);
    c.backend->ComputeAsync(l.work, l.out.data(), *control, &l.stats, [this](absl::Status s) { result = s; });
  }
  std::unique_ptr<CallControl> control;
  std::optional<absl::Status> result;
};

// The health watcher runs on the real clock: waits (bounded) for what it does.
bool WaitFor(const std::function<bool()>& done) {
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (!done() && absl::Now() < give_up) std::this_thread::yield();
  return done();
}

// A layer call that must end without the clock moving: its result.
absl::Status Run(Cluster& c, Layer& l) {
  Pending p;
  p.Start(c, l);
  REQUIRE(p.result.has_value());
  return *p.result;
}

TEST_CASE("a call failing with a retryable code is retried once on another replica", "[remote_dispatch]") {
  const grpc::StatusCode code =
      GENERATE(grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::DEADLINE_EXCEEDED, grpc::StatusCode::RESOURCE_EXHAUSTED,
               grpc::StatusCode::ABORTED, grpc::StatusCode::FAILED_PRECONDITION, grpc::StatusCode::CANCELLED,
               grpc::StatusCode::DATA_LOSS);
  CAPTURE(code);
  Cluster c({{0, 1, 2, 3}, {0, 1, 2, 3}});
  c.nodes[0]->Script({{FakeNode::kFail, code}});
  Layer l;
  const absl::Status result = Run(c, l);
  REQUIRE(result.ok());
  for (int s = 0; s < 4; ++s) CHECK(l.answered_by(s) == 2);
  CHECK(l.stats.retries == 1);
  REQUIRE(l.stats.calls.size() == 2);
  CHECK(l.stats.calls[0].attempt == 0);
  CHECK(l.stats.calls[1].attempt == 1);
  CHECK(c.backend->retries() == 1);
  // Busy is not broken, nor is a node whose shard changed: those stay in the map.
  CHECK(c.live(0) == (code == grpc::StatusCode::RESOURCE_EXHAUSTED || code == grpc::StatusCode::FAILED_PRECONDITION));
}

TEST_CASE("a node that answered RESOURCE_EXHAUSTED is a last resort for the next layer calls, for recheck_after",
          "[remote_dispatch]") {
  Cluster c({{0, 1, 2, 3}, {0, 1, 2, 3}}, absl::ZeroDuration(), NodeReplies::kPerExpert, absl::Milliseconds(50));
  c.nodes[0]->Script({{FakeNode::kFail, grpc::StatusCode::RESOURCE_EXHAUSTED}});
  Layer first;
  REQUIRE(Run(c, first).ok());
  CHECK(first.stats.retries == 1);
  // Idle, it would look the least busy; the replica takes every first try meanwhile.
  for (int i = 0; i < 4; ++i) {
    Layer l;
    REQUIRE(Run(c, l).ok());
    CHECK(l.stats.retries == 0);
    for (int s = 0; s < 4; ++s) CHECK(l.answered_by(s) == 2);
  }
  CHECK(c.live(0));  // busy, not broken
  c.clock.Advance(absl::Milliseconds(50));
  int by_first = 0;
  for (int i = 0; i < 4; ++i) {
    Layer l;
    REQUIRE(Run(c, l).ok());
    by_first += l.answered_by(0) == 1;
  }
  CHECK(by_first > 0);  // back among the candidates
}

TEST_CASE("a hedge avoids a node whose call of the layer already failed", "[remote_dispatch]") {
  // The first plan (rotation 0: the lowest index among equals) sends experts 0-1 to n0 and
  // 2-3 to n1. n1 fails at once, n0 hangs: the hedge for n0's work goes to n2, not to n1,
  // idle and the lowest index, whose failure is classified only when the attempt settles.
  Cluster c({{0, 1}, {0, 1, 2, 3}, {0, 1, 2, 3}}, absl::Milliseconds(1));
  c.nodes[0]->Script({{FakeNode::kHang}});
  c.nodes[1]->Script({{FakeNode::kFail, grpc::StatusCode::UNAVAILABLE}});
  Layer l;
  Pending p;
  p.Start(c, l);
  REQUIRE_FALSE(p.result.has_value());
  c.clock.Advance(absl::Milliseconds(1));  // hedge_after
  REQUIRE(p.result.has_value());
  REQUIRE(p.result->ok());
  for (int s = 0; s < 4; ++s) CHECK(l.answered_by(s) == 3);
}

TEST_CASE("after FAILED_PRECONDITION the retry avoids the node only where another copy serves the expert",
          "[remote_dispatch]") {
  // Node 0 owns every expert, node 1 experts 0 and 1; node 0's first answer says its shard changed.
  Cluster c({{0, 1, 2, 3}, {0, 1}});
  c.nodes[0]->Script({{FakeNode::kFail, grpc::StatusCode::FAILED_PRECONDITION}});
  Layer l;
  REQUIRE(Run(c, l).ok());
  CHECK(l.answered_by(0) == 2);  // moved to node 1
  CHECK(l.answered_by(1) == 2);
  CHECK(l.answered_by(2) == 1);  // no other copy: node 0 again
  CHECK(l.answered_by(3) == 1);
  CHECK(l.stats.retries == 1);
  CHECK(c.live(0));
}

TEST_CASE("other codes from a node are INTERNAL errors naming it, not retried", "[remote_dispatch]") {
  const grpc::StatusCode code =
      GENERATE(grpc::StatusCode::INVALID_ARGUMENT, grpc::StatusCode::INTERNAL, grpc::StatusCode::NOT_FOUND);
  Cluster c({{0, 1, 2, 3}, {0, 1, 2, 3}});
  c.nodes[0]->Script({{FakeNode::kFail, code}});
  Layer l;
  const absl::Status result = Run(c, l);
  CHECK(result.code() == absl::StatusCode::kInternal);
  CHECK_THAT(std::string(result.message()), Catch::Contains("node-0") && Catch::Contains("scripted failure"));
  CHECK(c.nodes[1]->calls() == 0);
  CHECK(c.live(0));
}

TEST_CASE("a retry that fails too, or has no replica left, is UNAVAILABLE saying what was tried", "[remote_dispatch]") {
  SECTION("the retry fails") {
    Cluster c({{0, 1, 2, 3}, {0, 1, 2, 3}});
    c.nodes[0]->Script({{FakeNode::kFail, grpc::StatusCode::UNAVAILABLE}});
    c.nodes[1]->Script({{FakeNode::kFail, grpc::StatusCode::ABORTED}});
    Layer l;
    const absl::Status result = Run(c, l);
    CHECK(result.code() == absl::StatusCode::kUnavailable);
    CHECK_THAT(std::string(result.message()), Catch::Contains("failed on every replica tried") &&
                                                  Catch::Contains("node-0") && Catch::Contains("node-1"));
  }
  SECTION("no other replica") {
    Cluster c({{0, 1, 2, 3}});
    c.nodes[0]->Script({{FakeNode::kFail, grpc::StatusCode::UNAVAILABLE}});
    Layer l;
    const absl::Status result = Run(c, l);
    CHECK(result.code() == absl::StatusCode::kUnavailable);
    CHECK_THAT(std::string(result.message()), Catch::Contains("first try failed on node-0"));
  }
}

TEST_CASE("a layer whose every replica was busy is RESOURCE_EXHAUSTED, UNAVAILABLE if one was not just busy",
          "[remote_dispatch]") {
  const bool both_busy = GENERATE(true, false);
  CAPTURE(both_busy);
  Cluster c({{0, 1, 2, 3}, {0, 1, 2, 3}});
  c.nodes[0]->Script({{FakeNode::kFail, grpc::StatusCode::RESOURCE_EXHAUSTED}});
  c.nodes[1]->Script(
      {{FakeNode::kFail, both_busy ? grpc::StatusCode::RESOURCE_EXHAUSTED : grpc::StatusCode::UNAVAILABLE}});
  Layer l;
  const absl::Status result = Run(c, l);
  CHECK(result.code() == (both_busy ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kUnavailable));
  CHECK_THAT(std::string(result.message()), Catch::Contains("failed on every replica tried"));
}

TEST_CASE("a node a failed call took out is still tried where it is the last replica, until a probe says it is down",
          "[remote_dispatch]") {
  Cluster c({{0, 1, 2, 3}});
  c.nodes[0]->Script({{FakeNode::kFail, grpc::StatusCode::DEADLINE_EXCEEDED}});
  Layer first;
  CHECK(Run(c, first).code() == absl::StatusCode::kUnavailable);
  CHECK(!c.live(0));
  // Only slow (the call outlived the node timeout): the next request is
  // served by it, not failed until the next health round.
  Layer second;
  REQUIRE(Run(c, second).ok());
  for (int s = 0; s < 4; ++s) CHECK(second.answered_by(s) == 1);
  CHECK(!c.live(0));  // the probe decides
  // A probe finds it down: no more calls go to it.
  c.nodes[0]->FailInfo(grpc::StatusCode::UNAVAILABLE);
  c.backend->CheckNow();
  const int calls = c.nodes[0]->calls();
  Layer third;
  const absl::Status result = Run(c, third);
  CHECK(result.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(result.message()), Catch::Contains("no live expert node serves it (node-0: down)"));
  CHECK(c.nodes[0]->calls() == calls);
}

TEST_CASE("a node a failed call took out is not tried while a live replica serves its experts", "[remote_dispatch]") {
  Cluster c({{0, 1, 2, 3}, {0, 1, 2, 3}});
  c.nodes[0]->Script({{FakeNode::kFail, grpc::StatusCode::UNAVAILABLE}});
  Layer first;
  REQUIRE(Run(c, first).ok());
  const int calls = c.nodes[0]->calls();
  for (int i = 0; i < 4; ++i) {
    Layer l;
    REQUIRE(Run(c, l).ok());
    for (int s = 0; s < 4; ++s) CHECK(l.answered_by(s) == 2);
  }
  CHECK(c.nodes[0]->calls() == calls);
}

TEST_CASE("only the failed node's experts are retried", "[remote_dispatch]") {
  // n0 owns 0-1, n1 owns 2-3, n2 owns everything (a spare).
  Cluster c({{0, 1}, {2, 3}, {0, 1, 2, 3}});
  c.nodes[1]->Script({{FakeNode::kFail, grpc::StatusCode::UNAVAILABLE}});
  Layer l;
  const absl::Status result = Run(c, l);
  REQUIRE(result.ok());
  CHECK(l.answered_by(0) == 1);
  CHECK(l.answered_by(1) == 1);
  CHECK(l.answered_by(2) == 3);
  CHECK(l.answered_by(3) == 3);
  CHECK(c.nodes[0]->calls() == 1);
}

TEST_CASE("hedging: a slow call's work also goes to another replica and the first answer wins", "[remote_dispatch]") {
  Cluster c({{0, 1, 2, 3}, {0, 1, 2, 3}}, absl::Milliseconds(10));
  SECTION("the hedge answers first") {
    c.nodes[0]->Script({{FakeNode::kHang}});
    Layer l;
    Pending p;
    p.Start(c, l);
    c.clock.Advance(absl::Milliseconds(9));
    CHECK(!p.result.has_value());
    CHECK(c.nodes[1]->calls() == 0);
    c.clock.Advance(absl::Milliseconds(1));  // hedge_after: n1 gets the work and answers
    REQUIRE(p.result.has_value());
    REQUIRE(p.result->ok());
    for (int s = 0; s < 4; ++s) CHECK(l.answered_by(s) == 2);
    CHECK(c.nodes[0]->cancelled() == 1);  // the slow call is not left running
    CHECK(c.nodes[0]->hanging() == 0);
    CHECK(c.backend->hedges() == 1);
    CHECK(c.backend->hedge_wins() == 1);
    CHECK(c.live(0));  // slow is not down
    REQUIRE(l.stats.calls.size() == 2);
    CHECK(l.stats.calls[1].hedge);
  }
  SECTION("both slow: the planned call answers first") {
    c.nodes[0]->Script({{FakeNode::kHang}});
    c.nodes[1]->Script({{FakeNode::kHang}});
    Layer l;
    Pending p;
    p.Start(c, l);
    c.clock.Advance(absl::Milliseconds(10));
    CHECK(c.nodes[1]->hanging() == 1);
    CHECK(!p.result.has_value());
    c.nodes[0]->ReleaseAll();
    REQUIRE(p.result.has_value());
    REQUIRE(p.result->ok());
    for (int s = 0; s < 4; ++s) CHECK(l.answered_by(s) == 1);
    CHECK(c.nodes[1]->cancelled() == 1);
    CHECK(c.backend->hedge_wins() == 0);
  }
  SECTION("both slow past the node timeout: both are out, the retry goes elsewhere") {
    Cluster c3({{0, 1, 2, 3}, {0, 1, 2, 3}, {0, 1, 2, 3}}, absl::Milliseconds(10));
    c3.nodes[0]->Script({{FakeNode::kHang}});
    c3.nodes[1]->Script({{FakeNode::kHang}});
    Layer l;
    Pending p;
    p.Start(c3, l);
    c3.clock.Advance(absl::Milliseconds(10));
    CHECK(!p.result.has_value());
    c3.clock.Advance(absl::Milliseconds(90));  // the node timeout of both calls
    REQUIRE(p.result.has_value());
    REQUIRE(p.result->ok());
    for (int s = 0; s < 4; ++s) CHECK(l.answered_by(s) == 3);
    CHECK(!c3.live(0));
    CHECK(l.stats.retries == 1);
  }
  SECTION("no other replica: no hedge, the slow call is awaited") {
    Cluster c1({{0, 1, 2, 3}}, absl::Milliseconds(10));
    c1.nodes[0]->Script({{FakeNode::kHang}});
    Layer l;
    Pending p;
    p.Start(c1, l);
    c1.clock.Advance(absl::Milliseconds(50));
    CHECK(!p.result.has_value());
    c1.nodes[0]->ReleaseAll();
    REQUIRE(p.result.has_value());
    CHECK(p.result->ok());
    CHECK(c1.backend->hedges() == 0);
  }
}

TEST_CASE("a race won by its hedge cancels its slow call at once, not when the other races end", "[remote_dispatch]") {
  // n0 and n2 hold experts 0-1, n1 and n3 experts 2-3.
  Cluster c({{0, 1}, {2, 3}, {0, 1}, {2, 3}}, absl::Milliseconds(10));
  c.nodes[0]->Script({{FakeNode::kHang}});
  c.nodes[1]->Script({{FakeNode::kHang}});
  c.nodes[3]->Script({{FakeNode::kHang}});
  Layer l;
  Pending p;
  p.Start(c, l);
  c.clock.Advance(absl::Milliseconds(10));  // hedges: n2 answers for n0, n3 hangs like n1
  CHECK(!p.result.has_value());
  CHECK(c.nodes[0]->cancelled() == 1);  // its race is won
  CHECK(c.nodes[1]->cancelled() == 0);  // its race is still open
  c.nodes[1]->ReleaseAll();
  REQUIRE(p.result.has_value());
  REQUIRE(p.result->ok());
  for (int s : {0, 1}) CHECK(l.answered_by(s) == 3);
  for (int s : {2, 3}) CHECK(l.answered_by(s) == 2);
  CHECK(c.nodes[3]->cancelled() == 1);
}

TEST_CASE("a health probe sent before a call took its node out does not bring the node back", "[remote_dispatch]") {
  Cluster c({{0, 1, 2, 3}, {0, 1, 2, 3}});
  c.nodes[0]->HoldInfo();
  std::thread round([&] { c.backend->CheckNow(); });
  while (c.nodes[0]->held_info() == 0) std::this_thread::yield();
  c.nodes[0]->Script({{FakeNode::kFail, grpc::StatusCode::UNAVAILABLE}});
  Layer l;
  REQUIRE(Run(c, l).ok());  // n0 failed and is out; the retry answered
  CHECK(!c.live(0));
  c.nodes[0]->ReleaseInfo();  // the probe, sent before the failure, says "live"
  round.join();
  CHECK(!c.live(0));
  c.backend->CheckNow();  // a probe sent after it decides
  CHECK(c.live(0));
}

TEST_CASE("a live node is taken out by its second late health probe in a row, not its first", "[remote_dispatch]") {
  Cluster c({{0, 1, 2, 3}, {0, 1, 2, 3}});
  c.nodes[0]->FailInfo(grpc::StatusCode::DEADLINE_EXCEEDED);
  c.backend->CheckNow();
  CHECK(c.live(0));  // one late answer: a loaded host
  c.backend->CheckNow();
  CHECK(!c.live(0));  // two in a row
  c.nodes[0]->FailInfo(grpc::StatusCode::OK);
  c.backend->CheckNow();
  CHECK(c.live(0));
  // A late probe, an answer, a late probe: never two in a row.
  c.nodes[0]->FailInfo(grpc::StatusCode::DEADLINE_EXCEEDED);
  c.backend->CheckNow();
  c.nodes[0]->FailInfo(grpc::StatusCode::OK);
  c.backend->CheckNow();
  c.nodes[0]->FailInfo(grpc::StatusCode::DEADLINE_EXCEEDED);
  c.backend->CheckNow();
  CHECK(c.live(0));
  // A refused connection is no late answer: out at once.
  c.nodes[1]->FailInfo(grpc::StatusCode::UNAVAILABLE);
  c.backend->CheckNow();
  CHECK(!c.live(1));
}

TEST_CASE("a call failing on a node already out does not void the probe that brings it back", "[remote_dispatch]") {
  // n0 alone holds experts 2 and 3: both layer calls below send it work.
  Cluster c({{0, 1, 2, 3}, {0, 1}});
  c.nodes[0]->Script({{FakeNode::kHang}, {FakeNode::kHang}});
  Layer first, second;
  Pending p1, p2;
  p1.Start(c, first);
  c.clock.Advance(absl::Milliseconds(50));
  p2.Start(c, second);
  c.clock.Advance(absl::Milliseconds(50));  // the first call's node timeout: n0 is out
  REQUIRE(p1.result.has_value());
  REQUIRE(!c.live(0));
  c.nodes[0]->HoldInfo();
  struct Release {
    FakeNode* node;
    ~Release() { node->ReleaseInfo(); }
  } release{c.nodes[0].get()};
  std::thread round([&] { c.backend->CheckNow(); });
  while (c.nodes[0]->held_info() == 0) std::this_thread::yield();
  c.clock.Advance(absl::Milliseconds(50));  // the second call's node timeout, n0 being out already
  REQUIRE(p2.result.has_value());
  c.nodes[0]->ReleaseInfo();  // the probe, sent after n0 went out, says "live"
  round.join();
  CHECK(c.live(0));
}

TEST_CASE("a hedge that answered stays a candidate for the retry of its race", "[remote_dispatch]") {
  // n0 holds every expert and takes the layer's one call; n1 holds experts
  // 0-1, n2 and n3 experts 2-3.
  Cluster c({{0, 1, 2, 3}, {0, 1}, {2, 3}, {2, 3}}, absl::Milliseconds(10));
  c.nodes[0]->Script({{FakeNode::kHang}});
  c.nodes[2]->Script({{FakeNode::kFail, grpc::StatusCode::UNAVAILABLE}});
  c.nodes[3]->Script({{FakeNode::kFail, grpc::StatusCode::UNAVAILABLE}});
  Layer l;
  Pending p;
  p.Start(c, l);
  c.clock.Advance(absl::Milliseconds(10));  // hedges: n1 answers for experts 0-1, n2 or n3 fails 2-3
  CHECK(c.nodes[1]->calls() == 1);
  CHECK(!p.result.has_value());
  c.clock.Advance(absl::Milliseconds(90));  // n0's node timeout: the race is lost, the retry planned
  REQUIRE(p.result.has_value());
  // Experts 0-1 went back to n1 (it answered); 2-3 to the node not tried yet, which failed too.
  CHECK(c.nodes[1]->calls() == 2);
  CHECK(c.nodes[2]->calls() + c.nodes[3]->calls() == 2);
  CHECK(p.result->code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(p.result->message()), Catch::Contains("failed on every replica tried"));
  CHECK(c.live(1));
}

TEST_CASE("a node a failed call took out is probed again at once and is back when it answers", "[remote_dispatch]") {
  Cluster c({{0, 1, 2, 3}, {0, 1, 2, 3}}, absl::ZeroDuration(), NodeReplies::kPerExpert, absl::Milliseconds(1));
  c.nodes[0]->HoldInfo();
  // Whatever fails below, the held probe is answered before the backend
  // stops: its watcher waits for it.
  struct Release {
    FakeNode* node;
    ~Release() { node->ReleaseInfo(); }
  } release{c.nodes[0].get()};
  c.nodes[0]->Script({{FakeNode::kFail, grpc::StatusCode::DEADLINE_EXCEEDED}});
  Layer l;
  REQUIRE(Run(c, l).ok());  // n0 timed out and is out; the retry answered
  // A round starts long before the hour's interval: its probe reaches n0.
  REQUIRE(WaitFor([&] { return c.nodes[0]->held_info() > 0; }));
  CHECK(!c.live(0));
  c.nodes[0]->ReleaseInfo();  // n0 answers: it was only slow
  REQUIRE(WaitFor([&] { return c.live(0); }));
}

TEST_CASE("a layer call that finds no node for an expert has the nodes probed again at once", "[remote_dispatch]") {
  Cluster c({{0, 1, 2, 3}}, absl::ZeroDuration(), NodeReplies::kPerExpert, absl::Milliseconds(1));
  c.nodes[0]->FailInfo(grpc::StatusCode::UNAVAILABLE);
  c.backend->CheckNow();
  REQUIRE(!c.live(0));  // down by its probe: not even a fallback
  const int resets = c.nodes[0]->backoff_resets();
  c.backend->CheckNow();
  CHECK(c.nodes[0]->backoff_resets() == resets + 1);  // a node out is reconnected at once before its probe
  // The node is back; only the next round (an hour away) would find it, but
  // a layer call that fails for want of it asks for one now.
  c.nodes[0]->FailInfo(grpc::StatusCode::OK);
  c.nodes[0]->HoldInfo();
  struct Release {
    FakeNode* node;
    ~Release() { node->ReleaseInfo(); }
  } release{c.nodes[0].get()};
  Layer l;
  const absl::Status failed = Run(c, l);
  CHECK(failed.code() == absl::StatusCode::kUnavailable);
  REQUIRE(WaitFor([&] { return c.nodes[0]->held_info() > 0; }));
  c.nodes[0]->ReleaseInfo();
  REQUIRE(WaitFor([&] { return c.live(0); }));
  Layer again;
  CHECK(Run(c, again).ok());
}

TEST_CASE("the router warns once when its live nodes report different kernel choices", "[remote_dispatch]") {
  Cluster c({{0, 1, 2, 3}, {0, 1, 2, 3}, {0, 1, 2, 3}});
  auto warnings = [&] {
    const std::string text = c.log.str();
    int n = 0;
    for (size_t at = text.find("run different kernels"); at != std::string::npos;
         at = text.find("run different kernels", at + 1)) {
      ++n;
    }
    return n;
  };
  CHECK(warnings() == 0);  // all alike
  c.nodes[2]->SetKernelProfile("isa other");
  c.backend->CheckNow();
  CHECK(warnings() == 1);
  CHECK_THAT(c.log.str(), Catch::Contains("n2:1: isa other; n0:1, n1:1: isa test"));
  CHECK(c.backend->Nodes()[2].kernel_profile == "isa other");
  c.backend->CheckNow();  // the same difference: not again
  CHECK(warnings() == 1);
  c.nodes[2]->SetKernelProfile("");  // a node that does not say is not compared
  c.backend->CheckNow();
  CHECK_THAT(c.log.str(), Catch::Contains("the same kernels again"));
  CHECK(warnings() == 1);
}

TEST_CASE("the client's deadline ends the layer, while a node timeout is the node's fault", "[remote_dispatch]") {
  Cluster c({{0, 1, 2, 3}, {0, 1, 2, 3}});
  SECTION("client deadline sooner than the node timeout: DEADLINE_EXCEEDED, no node taken out") {
    c.nodes[0]->Script({{FakeNode::kHang}});
    Layer l;
    Pending p;
    p.Start(c, l, c.clock.Now() + absl::Milliseconds(50));
    c.clock.Advance(absl::Milliseconds(49));
    CHECK(!p.result.has_value());
    c.clock.Advance(absl::Milliseconds(1));
    REQUIRE(p.result.has_value());
    CHECK(p.result->code() == absl::StatusCode::kDeadlineExceeded);
    CHECK(c.live(0));
    CHECK(c.nodes[1]->calls() == 0);
  }
  SECTION("node timeout first: the node is out and the work retried") {
    c.nodes[0]->Script({{FakeNode::kHang}});
    Layer l;
    Pending p;
    p.Start(c, l, c.clock.Now() + absl::Seconds(1));
    c.clock.Advance(absl::Milliseconds(100));
    REQUIRE(p.result.has_value());
    REQUIRE(p.result->ok());
    CHECK(l.answered_by(0) == 2);
    CHECK(!c.live(0));
  }
  SECTION("the retry runs into the client's deadline") {
    c.nodes[0]->Script({{FakeNode::kHang}});
    c.nodes[1]->Script({{FakeNode::kHang}});
    Layer l;
    Pending p;
    p.Start(c, l, c.clock.Now() + absl::Milliseconds(150));
    c.clock.Advance(absl::Milliseconds(100));  // n0's node timeout: retried on n1, whose deadline is the client's
    CHECK(!p.result.has_value());
    c.clock.Advance(absl::Milliseconds(50));
    REQUIRE(p.result.has_value());
    CHECK(p.result->code() == absl::StatusCode::kDeadlineExceeded);
    CHECK(!c.live(0));
    CHECK(c.live(1));
  }
}

TEST_CASE("cancelling the request cancels every node call in flight", "[remote_dispatch]") {
  Cluster c({{0, 1}, {2, 3}}, absl::Milliseconds(10));
  c.nodes[0]->Script({{FakeNode::kHang}});
  c.nodes[1]->Script({{FakeNode::kHang}});
  Layer l;
  Pending p;
  p.Start(c, l);
  CHECK(c.nodes[0]->hanging() == 1);
  CHECK(c.nodes[1]->hanging() == 1);
  p.control->Cancel();
  REQUIRE(p.result.has_value());
  CHECK(p.result->code() == absl::StatusCode::kCancelled);
  CHECK(c.nodes[0]->cancelled() == 1);
  CHECK(c.nodes[1]->cancelled() == 1);
  CHECK(c.live(0));
  CHECK(c.live(1));
  c.clock.Advance(absl::Seconds(1));  // no hedge timer or retry after the end
  CHECK(c.nodes[0]->calls() == 1);
  CHECK(c.nodes[1]->calls() == 1);
}

TEST_CASE("a request cancelled before it starts sends nothing", "[remote_dispatch]") {
  Cluster c({{0, 1, 2, 3}});
  Layer l;
  Pending p;
  p.control = std::make_unique<CallControl>();
  p.control->Cancel();
  c.backend->ComputeAsync(l.work, l.out.data(), *p.control, &l.stats, [&](absl::Status s) { p.result = s; });
  REQUIRE(p.result.has_value());
  CHECK(p.result->code() == absl::StatusCode::kCancelled);
  CHECK(c.nodes[0]->calls() == 0);
}

TEST_CASE("a reply of the wrong shape is INTERNAL naming the node", "[remote_dispatch]") {
  Cluster c({{0, 1, 2, 3}, {0, 1, 2, 3}});
  c.nodes[0]->Script({{FakeNode::kWrongShape}});
  Layer l;
  const absl::Status result = Run(c, l);
  CHECK(result.code() == absl::StatusCode::kInternal);
  CHECK_THAT(std::string(result.message()), Catch::Contains("node-0: reply for layer 0 is not [4, 4] f32"));
}

TEST_CASE("grouped replies: a group's sum lands in its first slot and -0.0 in the others", "[remote_dispatch]") {
  // Token 0 → experts 0 (rank 0), 1 (rank 1); token 1 → experts 3 (rank 0), 2 (rank 1).
  auto layer = [] {
    auto l = std::make_unique<Layer>();
    l->work.experts = {{0, {0}, {1.f}, {0}}, {1, {0}, {1.f}, {1}}, {2, {1}, {1.f}, {3}}, {3, {1}, {1.f}, {2}}};
    return l;
  };
  auto value = [](const Layer& l, int slot) { return l.out[slot * kDModel]; };
  auto negative_zero = [](const Layer& l, int slot) {
    return l.out[slot * kDModel] == 0.f && std::signbit(l.out[slot * kDModel]);
  };
  SECTION("exact: the node holding ranks 0..m of a token sums them; other entries stay single") {
    Cluster c({{0, 1, 3}, {2}}, absl::ZeroDuration(), NodeReplies::kExact);
    auto l = layer();
    Pending p;
    p.Start(c, *l);
    REQUIRE(p.result.has_value());
    REQUIRE(p.result->ok());
    CHECK(value(*l, 0) == 100 + 101);  // n0: experts 0 and 1 of token 0, summed
    CHECK(negative_zero(*l, 1));
    CHECK(value(*l, 2) == 103);  // token 1 rank 0 on n0 ...
    CHECK(value(*l, 3) == 202);  // ... rank 1 on n1
  }
  SECTION("exact: a node without rank 0 of a token returns each entry") {
    Cluster c({{1, 2}, {0, 3}}, absl::ZeroDuration(), NodeReplies::kExact);
    auto l = layer();
    Pending p;
    p.Start(c, *l);
    REQUIRE(p.result.has_value());
    REQUIRE(p.result->ok());
    CHECK(value(*l, 0) == 200);  // expert 0 on n1 (rank 0 alone)
    CHECK(value(*l, 1) == 101);
    CHECK(value(*l, 2) == 203);
    CHECK(value(*l, 3) == 102);
  }
  SECTION("partial: one row per token and node, bf16 when the client rounds and the token is whole") {
    Cluster c({{0, 1, 2, 3}}, absl::ZeroDuration(), NodeReplies::kPartial);
    auto l = layer();
    l->work.bf16_output = true;
    Pending p;
    p.Start(c, *l);
    REQUIRE(p.result.has_value());
    REQUIRE(p.result->ok());
    CHECK(value(*l, 0) == 201);
    CHECK(negative_zero(*l, 1));
    CHECK(value(*l, 2) == 205);
    CHECK(negative_zero(*l, 3));
    REQUIRE(l->stats.calls.size() == 1);
  }
}

TEST_CASE("a node call over the node's size limits goes as several calls within them, by experts",
          "[remote_dispatch]") {
  // The fake node refuses a call over its limits with RESOURCE_EXHAUSTED, as a real one does.
  auto check_calls = [](FakeNode& node, size_t calls, int64_t max_rows, int64_t max_indices) {
    const std::vector<v1::ComputeRequest> requests = node.requests();
    CHECK(requests.size() == calls);
    for (const v1::ComputeRequest& r : requests) {
      int64_t indices = 0;
      for (const v1::ExpertWork& w : r.experts()) indices += w.row_indices_size();
      CHECK(r.rows().shape(0) <= max_rows);
      CHECK((r.per_expert_output() ? indices : r.num_output_rows()) <= max_rows);
      CHECK(indices <= max_indices);
    }
  };
  SECTION("per-expert replies over max_rows") {
    Cluster c({{0, 1, 2, 3}});
    c.Limit(0, 2, 0);
    Layer l;
    REQUIRE(Run(c, l).ok());
    for (int s = 0; s < 4; ++s) CHECK(l.answered_by(s) == 1);
    check_calls(*c.nodes[0], 4, 1, 1);  // 4 reply rows over 2: pieces within half of it, an expert each
    CHECK(c.live(0));
  }
  SECTION("row indices over max_row_indices") {
    Cluster c({{0, 1, 2, 3}});
    c.Limit(0, 0, 3);
    Layer l;
    REQUIRE(Run(c, l).ok());
    check_calls(*c.nodes[0], 4, 1, 1);
  }
  SECTION("exact replies: rows over max_rows, each token's route still summed on the node") {
    Cluster c({{0, 1, 2, 3}}, absl::ZeroDuration(), NodeReplies::kExact);
    c.Limit(0, 1, 0);
    Layer l;
    REQUIRE(Run(c, l).ok());
    check_calls(*c.nodes[0], 2, 1, 2);  // a token's two experts in one piece: 1 row, 1 reply row
    CHECK(l.out[0] == 100 + 101);
    CHECK(std::signbit(l.out[1 * kDModel]));
    CHECK(l.out[2 * kDModel] == 102 + 103);
  }
  SECTION("one call at a time") {
    Cluster c({{0, 1, 2, 3}});
    c.Limit(0, 2, 0);
    c.nodes[0]->Script({{FakeNode::kHang}});
    Layer l;
    Pending p;
    p.Start(c, l);
    CHECK(c.nodes[0]->calls() == 1);
    CHECK(!p.result.has_value());
    SECTION("the next is sent when the one before has ended") {
      c.nodes[0]->ReleaseAll();
      REQUIRE(p.result.has_value());
      CHECK(p.result->ok());
      CHECK(c.nodes[0]->calls() == 4);
    }
    SECTION("a cancelled layer sends no more of them") {
      p.control->Cancel();
      REQUIRE(p.result.has_value());
      CHECK(p.result->code() == absl::StatusCode::kCancelled);
      CHECK(c.nodes[0]->calls() == 1);
      CHECK(c.nodes[0]->cancelled() == 1);
    }
  }
  SECTION("hedging: only a call sent is late, not those waiting behind it") {
    Cluster c({{0, 1, 2, 3}, {0, 1, 2, 3}}, absl::Milliseconds(10));
    c.Limit(0, 2, 0);
    c.Limit(1, 2, 0);
    c.nodes[0]->Script({{FakeNode::kHang}});  // n0 gets the layer's four calls, one at a time
    c.nodes[1]->Script({{FakeNode::kHang}});
    Layer l;
    Pending p;
    p.Start(c, l);
    REQUIRE(c.nodes[0]->calls() == 1);
    c.clock.Advance(absl::Milliseconds(10));
    CHECK(c.nodes[1]->calls() == 1);  // the hanging call's expert went to n1 as well; the others wait
    CHECK(!p.result.has_value());
    // n1 answers: the hanging call is cancelled, and n0's other calls follow it, unhedged.
    c.nodes[1]->ReleaseAll();
    REQUIRE(p.result.has_value());
    CHECK(p.result->ok());
    CHECK(c.nodes[1]->calls() == 1);
    CHECK(c.nodes[0]->calls() == 4);
    CHECK(c.nodes[0]->cancelled() == 1);
    CHECK(l.answered_by(0) == 2);
    for (int s = 1; s < 4; ++s) CHECK(l.answered_by(s) == 1);
  }
  SECTION("a call refused RESOURCE_EXHAUSTED right after the one before it is retried on the same node") {
    Cluster c({{0, 1, 2, 3}});
    c.Limit(0, 2, 0);
    c.nodes[0]->Script({{FakeNode::kAnswer}, {FakeNode::kFail, grpc::StatusCode::RESOURCE_EXHAUSTED}});
    Layer l;
    REQUIRE(Run(c, l).ok());
    // Two sent, the second refused (the two behind it end with it), then those three again.
    CHECK(c.nodes[0]->calls() == 5);
    CHECK(l.stats.retries == 1);
    for (int s = 0; s < 4; ++s) CHECK(l.answered_by(s) == 1);
  }
  SECTION("a piece that fails ends the pieces behind it: one node timeout, then the retry elsewhere") {
    Cluster c({{0, 1, 2, 3}, {0, 1, 2, 3}});
    c.Limit(0, 2, 0);  // n0 gets the layer's four calls, one at a time
    c.nodes[0]->Script({{FakeNode::kHang}, {FakeNode::kHang}, {FakeNode::kHang}, {FakeNode::kHang}});
    Layer l;
    Pending p;
    p.Start(c, l);
    REQUIRE(c.nodes[0]->calls() == 1);
    c.clock.Advance(absl::Milliseconds(100));  // the node timeout, once
    REQUIRE(p.result.has_value());
    CHECK(p.result->ok());
    CHECK(c.nodes[0]->calls() == 1);  // the three behind it were never sent
    CHECK(!c.live(0));
    CHECK(l.stats.retries == 1);
    CHECK(l.stats.calls.size() == 2);  // n0's one call and the retry on n1; unsent calls are no node calls
    CHECK(c.backend->Nodes()[0].calls == 1);
    CHECK(c.backend->Nodes()[0].failed_calls == 1);
    for (int s = 0; s < 4; ++s) CHECK(l.answered_by(s) == 2);
  }
  SECTION("a piece refused FAILED_PRECONDITION (the node is alive) does not stop the pieces behind it") {
    Cluster c({{0, 1, 2, 3}});
    c.Limit(0, 2, 0);
    c.nodes[0]->Script({{FakeNode::kFail, grpc::StatusCode::FAILED_PRECONDITION}});
    Layer l;
    REQUIRE(Run(c, l).ok());
    CHECK(c.nodes[0]->calls() == 5);  // the four, then the refused one's expert again (nothing else serves it)
    CHECK(l.stats.retries == 1);
  }
  SECTION("a node that reports no limits gets one call") {
    Cluster c({{0, 1, 2, 3}});
    Layer l;
    REQUIRE(Run(c, l).ok());
    check_calls(*c.nodes[0], 1, 4, 4);
  }
}

TEST_CASE("an expert with more rows than a node takes in one call goes in runs, each choosing the whole's kernel",
          "[remote_dispatch]") {
  // The node takes 4 rows a call: runs of at most 2 (half), here 1, 2 and 2
  // rows; together 5 rows, over 4, so they go in pieces within 2 rows.
  Cluster c({{0, 1, 2, 3}});
  c.Limit(0, 4, 0);
  // Five tokens, top-1, all to expert 0.
  std::vector<float> x(5 * kDModel, 1.f), out(5 * kDModel, -1.f);
  LayerWork work;
  work.x = x.data();
  work.num_tokens = 5;
  work.num_slots = 5;
  work.experts = {{0, {0, 1, 2, 3, 4}, {1.f, 1.f, 1.f, 1.f, 1.f}, {0, 1, 2, 3, 4}}};
  CallControl control;
  BackendStats stats;
  REQUIRE(c.backend->Compute(work, out.data(), control, &stats).ok());
  std::vector<int> rows;
  for (const v1::ComputeRequest& r : c.nodes[0]->requests()) {
    REQUIRE(r.experts_size() == 1);
    CHECK(r.experts(0).kernel_rows() == 5);
    rows.push_back(r.experts(0).row_indices_size());
  }
  CHECK(rows == std::vector<int>{1, 2, 2});
  for (int t = 0; t < 5; ++t) CHECK(out[t * kDModel] == 100);
}

TEST_CASE("the blocking Compute returns what the layer call ended with", "[remote_dispatch]") {
  Cluster c({{0, 1, 2, 3}, {0, 1, 2, 3}});
  c.nodes[0]->Script({{FakeNode::kFail, grpc::StatusCode::UNAVAILABLE}});
  Layer l;
  CallControl control;
  REQUIRE(c.backend->Compute(l.work, l.out.data(), control, &l.stats).ok());
  CHECK(l.answered_by(3) == 2);
}

}  // namespace
}  // namespace router_node
}  // namespace colibri
