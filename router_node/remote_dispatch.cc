// RemoteBackend::Compute: one layer's node calls — plan, send (all in
// flight at once), hedge slow calls, retry failed ones once on other
// replicas, scatter the per-expert rows to their slots. The node set and
// health checks are in remote_backend.cc.

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "router_node/remote_backend.h"
#include "router_node/remote_backend_internal.h"

namespace colibri {
namespace router_node {
namespace {

bool Retriable(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::CANCELLED:  // not by us (checked first): e.g. the node shutting down
    case grpc::StatusCode::DATA_LOSS:  // that node's weight file changed under it; a replica may be intact
      return true;
    default: return false;
  }
}

// Codes gRPC's client raises itself (connection failures, deadlines), whose
// messages name the peer's resolved address.
bool TransportCode(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED;
}

const char* TransportCodeText(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAVAILABLE ? "unavailable (not reachable, or shutting down)" : "deadline exceeded";
}

using Call = RemoteBackend::Call;

// The request of one node call: the distinct rows its experts need, each once,
// and per expert the positions of its rows in that list.
void BuildRequest(const LayerWork& work, int64_t d_model, const std::string& model_id, Call* call) {
  v1::ComputeRequest& req = call->request;
  req.set_layer(work.layer);
  req.set_model_id(model_id);
  req.set_request_id(work.request_id);
  req.set_output_dtype(v1::DATA_TYPE_F32);
  req.set_per_expert_output(true);
  std::vector<int32_t> position(work.num_tokens, -1);
  std::vector<int32_t> rows;
  for (const int w : call->plan.works) {
    for (const int32_t r : work.experts[w].rows) {
      if (position[r] < 0) {
        position[r] = static_cast<int32_t>(rows.size());
        rows.push_back(r);
      }
    }
  }
  // Rows in the client's dtype when it sent bf16 (the node widens them to the
  // same f32 values), else f32.
  v1::Tensor* t = req.mutable_rows();
  const bool bf16 = work.x_bf16 != nullptr;
  const size_t row_bytes = d_model * (bf16 ? sizeof(uint16_t) : sizeof(float));
  t->set_dtype(bf16 ? v1::DATA_TYPE_BF16 : v1::DATA_TYPE_F32);
  t->add_shape(static_cast<int64_t>(rows.size()));
  t->add_shape(d_model);
  std::string* data = t->mutable_data();
  data->resize(rows.size() * row_bytes);
  for (size_t i = 0; i < rows.size(); ++i) {
    const void* src = bf16 ? static_cast<const void*>(work.x_bf16 + rows[i] * d_model)
                           : static_cast<const void*>(work.x + rows[i] * d_model);
    std::memcpy(&(*data)[i * row_bytes], src, row_bytes);
  }
  for (const int w : call->plan.works) {
    const ExpertWork& src = work.experts[w];
    v1::ExpertWork* dst = req.add_experts();
    dst->set_expert(src.expert);
    dst->mutable_row_indices()->Reserve(static_cast<int>(src.rows.size()));
    for (const int32_t r : src.rows) dst->add_row_indices(position[r]);
    dst->mutable_weights()->Add(src.weights.begin(), src.weights.end());
  }
}

// Copies a reply's per-expert rows to their slots.
absl::Status ScatterReply(const LayerWork& work, int64_t d_model, const Call& call, float* contributions) {
  int64_t expected = 0;
  for (const int w : call.plan.works) expected += static_cast<int64_t>(work.experts[w].rows.size());
  const v1::Tensor& t = call.response.output();
  if (t.dtype() != v1::DATA_TYPE_F32 || t.shape_size() != 2 || t.shape(0) != expected || t.shape(1) != d_model ||
      static_cast<int64_t>(t.data().size()) != expected * d_model * 4) {
    return absl::InternalError(
        absl::StrCat(call.name, ": reply for layer ", work.layer, " is not [", expected, ", ", d_model, "] f32"));
  }
  const char* src = t.data().data();
  for (const int w : call.plan.works) {
    for (const int32_t slot : work.experts[w].slots) {
      std::memcpy(contributions + static_cast<int64_t>(slot) * d_model, src, d_model * sizeof(float));
      src += d_model * sizeof(float);
    }
  }
  return absl::OkStatus();
}

}  // namespace

struct RemoteBackend::Tracker {
  common::Mutex mu;
  common::CondVar cv;  // signalled (under mu) whenever a call finishes
  // Waits until `ready()` (evaluated under mu) or `until`; true if ready.
  bool WaitUntil(const std::function<bool()>& ready, absl::Time until) {
    common::MutexLock lock(&mu);
    while (!ready()) {
      if (until == absl::InfiniteFuture()) {
        cv.Wait(&mu);
        continue;
      }
      const absl::Duration left = until - absl::Now();
      if (left <= absl::ZeroDuration() || cv.WaitWithTimeout(&mu, left)) return ready();
    }
    return true;
  }
};

absl::Status RemoteBackend::Compute(const LayerWork& work, float* contributions, CallControl& control,
                                    BackendStats* stats) {
  const auto start = std::chrono::steady_clock::now();
  const std::shared_ptr<const Topology> topo = topology();
  std::vector<int> pending(work.experts.size());
  for (size_t i = 0; i < pending.size(); ++i) pending[i] = static_cast<int>(i);
  std::set<int> excluded;
  std::string first_failure;
  std::string retry_failure;
  Tracker tracker;
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::vector<int> load(topo->nodes.size());
    for (size_t n = 0; n < load.size(); ++n) load[n] = topo->nodes[n]->in_flight.load(std::memory_order_relaxed);
    absl::StatusOr<std::vector<NodeCall>> plan =
        PlanNodeCalls(*topo->map, work.layer, work.experts, pending, load, excluded);
    if (!plan.ok()) {
      return first_failure.empty() ? plan.status()
                                   : absl::UnavailableError(absl::StrCat(plan.status().message(), "; ", first_failure));
    }
    if (control.cancelled()) return absl::CancelledError("request cancelled by the client");
    const absl::Time deadline = std::min(control.deadline(), absl::Now() + options_.node_timeout);
    // When the client's deadline is the sooner one, a DEADLINE_EXCEEDED is the
    // client's — never a reason to take a node out (gRPC's clock may call it
    // a moment before absl::Now() reaches the deadline).
    const bool client_deadline = deadline == control.deadline();

    // Every call of this attempt; races: a planned call and the hedge calls
    // that may answer for its experts instead.
    std::vector<std::unique_ptr<Call>> calls;
    struct Race {
      Call* primary;
      std::vector<Call*> hedges;
    };
    std::vector<Race> races;
    auto issue = [&](NodeCall nc, bool hedge) {
      auto call = std::make_unique<Call>();
      call->node = nc.node;
      call->address = topo->nodes[nc.node]->address;
      call->name = absl::StrCat("node-", nc.node);
      call->plan = std::move(nc);
      call->hedge = hedge;
      BuildRequest(work, options_.d_model, options_.model_id, call.get());
      call->context.set_deadline(absl::ToChronoTime(deadline));
      Node& node = *topo->nodes[call->node];
      node.in_flight.fetch_add(1, std::memory_order_relaxed);
      node.calls.fetch_add(1, std::memory_order_relaxed);
      call->start_nanos = NanosSince(start);
      Call* raw = call.get();
      {
        common::MutexLock lock(&tracker.mu);
        calls.push_back(std::move(call));
      }
      node.stub->async()->Compute(&raw->context, &raw->request, &raw->response,
                                  [raw, &node, &tracker, start](grpc::Status s) {
                                    node.in_flight.fetch_sub(1, std::memory_order_relaxed);
                                    common::MutexLock lock(&tracker.mu);
                                    raw->status = std::move(s);
                                    raw->end_nanos = NanosSince(start);
                                    raw->done = true;
                                    tracker.cv.SignalAll();  // under mu: the waiter may free the tracker after
                                  });
      return raw;
    };
    for (NodeCall& nc : *plan) races.push_back({issue(std::move(nc), false), {}});
    const int hook = control.AddHook([&calls, &tracker] {
      common::MutexLock lock(&tracker.mu);
      for (auto& c : calls) c->context.TryCancel();
    });
    // A race is settled when its planned call succeeded, when all its hedges
    // did, or when everything in it has finished.
    auto settled = [](const Race& r) {
      bool hedges_done = true, hedges_ok = !r.hedges.empty();
      for (const Call* h : r.hedges) {
        hedges_done = hedges_done && h->done;
        hedges_ok = hedges_ok && h->done && h->status.ok();
      }
      return (r.primary->done && r.primary->status.ok()) || hedges_ok || (r.primary->done && hedges_done);
    };
    auto all_settled = [&] {
      for (const Race& r : races) {
        if (!settled(r)) return false;
      }
      return true;
    };
    const bool hedging = options_.hedge_after > absl::ZeroDuration() && attempt == 0;
    if (!tracker.WaitUntil(all_settled, hedging ? absl::Now() + options_.hedge_after : absl::InfiniteFuture())) {
      // Hedge: the work of every call still out goes to other replicas too.
      std::vector<std::pair<size_t, std::vector<int>>> slow;
      {
        common::MutexLock lock(&tracker.mu);
        for (size_t i = 0; i < races.size(); ++i) {
          if (!races[i].primary->done) slow.push_back({i, races[i].primary->plan.works});
        }
      }
      for (auto& [i, works] : slow) {
        std::set<int> avoid = excluded;
        avoid.insert(races[i].primary->node);
        absl::StatusOr<std::vector<NodeCall>> alternative =
            PlanNodeCalls(*topo->map, work.layer, work.experts, works, load, avoid);
        if (!alternative.ok()) continue;  // no other replica: wait for the slow one
        std::vector<Call*> hedges;
        for (NodeCall& nc : *alternative) hedges.push_back(issue(std::move(nc), true));
        {
          common::MutexLock lock(&tracker.mu);
          races[i].hedges = std::move(hedges);
        }
        hedges_.fetch_add(1, std::memory_order_relaxed);
        if (options_.metrics != nullptr) {
          options_.metrics->GetCounter("colibri_router_hedges_total", "Node calls hedged on another replica.")
              ->Increment();
        }
      }
      tracker.WaitUntil(all_settled, absl::InfiniteFuture());
    }
    control.RemoveHook(hook);
    // The losers of settled races are not needed: cancel, and wait until
    // every callback has run (they point into this frame).
    {
      common::MutexLock lock(&tracker.mu);
      for (auto& c : calls) {
        if (!c->done) c->context.TryCancel();
      }
    }
    tracker.WaitUntil(
        [&] {
          for (const auto& c : calls) {
            if (!c->done) return false;
          }
          return true;
        },
        absl::InfiniteFuture());

    std::vector<int> failed;
    absl::Status error;
    for (const auto& c : calls) Record(*c, attempt, stats);
    for (const Race& r : races) {
      std::vector<const Call*> winners;
      if (r.primary->status.ok()) {
        winners = {r.primary};
      } else if (!r.hedges.empty() &&
                 std::all_of(r.hedges.begin(), r.hedges.end(), [](const Call* h) { return h->status.ok(); })) {
        winners.assign(r.hedges.begin(), r.hedges.end());
        hedge_wins_.fetch_add(1, std::memory_order_relaxed);
        if (options_.metrics != nullptr) {
          options_.metrics->GetCounter("colibri_router_hedge_wins_total", "Hedged calls answered by the hedge.")
              ->Increment();
        }
      }
      if (!winners.empty()) {
        for (const Call* w : winners) {
          absl::Status s = ScatterReply(work, options_.d_model, *w, contributions);
          if (!s.ok() && error.ok()) error = s;
        }
        continue;
      }
      // Nothing in the race answered: classify the planned call's failure.
      const Call& c = *r.primary;
      topo->nodes[c.node]->failed.fetch_add(1, std::memory_order_relaxed);
      const grpc::StatusCode code = c.status.error_code();
      // `what` reaches the client: gRPC's own transport errors (UNAVAILABLE,
      // DEADLINE_EXCEEDED) name the node's resolved address, so for those the
      // client gets the code only; `detail` (the router's log, the admins'
      // GetClusterStatus) keeps the message.
      const std::string detail =
          absl::StrCat(c.name, ": ", c.status.error_message(), " (code ", static_cast<int>(code), ")");
      const std::string what = TransportCode(code) ? absl::StrCat(c.name, ": ", TransportCodeText(code), " (code ",
                                                                  static_cast<int>(code), ")")
                                                   : detail;
      if (control.cancelled()) {
        if (error.ok()) error = absl::CancelledError("request cancelled by the client");
      } else if (absl::Now() >= control.deadline() ||
                 (client_deadline && code == grpc::StatusCode::DEADLINE_EXCEEDED)) {
        if (error.ok()) {
          error =
              absl::DeadlineExceededError(absl::StrCat("layer ", work.layer, ": deadline exceeded waiting for ", what));
        }
      } else if (Retriable(code)) {
        if (code != grpc::StatusCode::RESOURCE_EXHAUSTED) MarkDown(topo->nodes[c.node], detail);
        excluded.insert(c.node);
        for (const Call* h : r.hedges) excluded.insert(h->node);
        failed.insert(failed.end(), c.plan.works.begin(), c.plan.works.end());
        if (first_failure.empty()) first_failure = absl::StrCat("first try failed on ", what);
        retry_failure = what;
      } else if (error.ok()) {
        error = absl::InternalError(absl::StrCat("layer ", work.layer, ": ", what));
      }
    }
    if (!error.ok()) return error;
    if (failed.empty()) return absl::OkStatus();
    if (attempt == 1) {
      std::string experts;
      for (const int w : failed) absl::StrAppend(&experts, experts.empty() ? "" : ",", work.experts[w].expert);
      return absl::UnavailableError(absl::StrCat("layer ", work.layer, " expert ", experts,
                                                 ": failed on every replica tried (", first_failure,
                                                 "; retry failed on ", retry_failure, ")"));
    }
    std::sort(failed.begin(), failed.end());
    pending = std::move(failed);
    retries_.fetch_add(1, std::memory_order_relaxed);
    if (stats != nullptr) ++stats->retries;
    if (options_.metrics != nullptr) {
      options_.metrics->GetCounter("colibri_router_retries_total", "Node calls retried on another replica.")
          ->Increment();
    }
  }
  return absl::InternalError("unreachable");
}

void RemoteBackend::Record(const Call& c, int attempt, BackendStats* stats) {
  if (stats != nullptr) {
    NodeCallRecord r;
    r.node = c.name;
    r.start_nanos = c.start_nanos;
    r.end_nanos = c.end_nanos;
    r.rows = c.request.rows().shape_size() > 0 ? c.request.rows().shape(0) : 0;
    r.experts = c.request.experts_size();
    for (const v1::ExpertWork& w : c.request.experts()) {
      absl::StrAppend(&r.experts_list, r.experts_list.empty() ? "" : ",", w.expert());
    }
    r.attempt = attempt;
    r.hedge = c.hedge;
    r.code = static_cast<absl::StatusCode>(c.status.error_code());
    for (const v1::StageTiming& t : c.response.timings()) {
      if (t.stage() == "compute") r.node_compute_nanos = t.nanos();
    }
    stats->calls.push_back(std::move(r));
  }
  if (options_.metrics != nullptr) {
    options_.metrics
        ->GetCounter("colibri_router_node_calls_total", "Compute calls to expert nodes by node and status code.",
                     {{"node", c.address}, {"code", std::to_string(static_cast<int>(c.status.error_code()))}})
        ->Increment();
    options_.metrics
        ->GetHistogram("colibri_router_node_seconds", "Duration of Compute calls to each expert node.",
                       {{"node", c.address}}, common::LatencyBuckets())
        ->Observe((c.end_nanos - c.start_nanos) * 1e-9);
  }
}

}  // namespace router_node
}  // namespace colibri
