#include "router_node/remote_backend.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/time/clock.h"
#include "colibri/v1/expert_node.grpc.pb.h"
#include "common/grpc_credentials.h"
#include "common/status_macros.h"

namespace colibri {
namespace router_node {

namespace v1 = colibri::v1;

struct RemoteBackend::Node {
  std::string address;
  std::unique_ptr<v1::ExpertNode::Stub> stub;
  std::atomic<int> in_flight{0};
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> failed{0};

  std::mutex mu;
  bool live ABSL_GUARDED_BY(mu) = false;
  std::string last_error ABSL_GUARDED_BY(mu) = "not checked yet";
  std::vector<std::pair<int64_t, int64_t>> owned ABSL_GUARDED_BY(mu);
  uint64_t weights_version ABSL_GUARDED_BY(mu) = 0;
};

struct RemoteBackend::Topology {
  std::vector<std::shared_ptr<Node>> nodes;
  std::shared_ptr<const ShardMap> map;
};

namespace {

int64_t NanosSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

// Addresses of a cluster file: one host:port per line; blank lines and '#' comments ignored.
absl::StatusOr<std::vector<std::string>> ReadClusterFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cluster file ", path, ": cannot open"));
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view s = line;
    s = s.substr(0, s.find('#'));
    s = absl::StripAsciiWhitespace(s);
    if (!s.empty()) out.emplace_back(s);
  }
  return out;
}

int64_t MtimeNanos(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return -1;
  return int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
}

bool Retriable(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::CANCELLED:  // not by us (checked first): e.g. the node shutting down
      return true;
    default:
      return false;
  }
}

}  // namespace

// One Compute call in flight.
struct RemoteBackend::Call {
  int node = 0;
  bool hedge = false;  // sent because the planned call was slow
  bool done = false;   // guarded by the layer's Tracker::mu
  std::string address;
  NodeCall plan;
  grpc::ClientContext context;
  v1::ComputeRequest request;
  v1::ComputeResponse response;
  grpc::Status status;
  int64_t start_nanos = 0;
  int64_t end_nanos = 0;
};

namespace {

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
  v1::Tensor* t = req.mutable_rows();
  t->set_dtype(v1::DATA_TYPE_F32);
  t->add_shape(static_cast<int64_t>(rows.size()));
  t->add_shape(d_model);
  std::string* data = t->mutable_data();
  data->resize(rows.size() * d_model * sizeof(float));
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(&(*data)[i * d_model * sizeof(float)], work.x + rows[i] * d_model, d_model * sizeof(float));
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
    return absl::InternalError(absl::StrCat("node ", call.address, ": reply for layer ", work.layer,
                                            " is not [", expected, ", ", d_model, "] f32"));
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

absl::StatusOr<std::unique_ptr<RemoteBackend>> RemoteBackend::Create(const RemoteOptions& options) {
  if (options.addresses.empty() == options.cluster_file.empty()) {
    return absl::InvalidArgumentError("give the expert nodes either as addresses (--experts_at) or a cluster file");
  }
  if (options.n_layers < 1 || options.n_experts < 1 || options.d_model < 1) {
    return absl::InvalidArgumentError("RemoteOptions: model shape not set");
  }
  std::unique_ptr<RemoteBackend> b(new RemoteBackend(options));
  COLIBRI_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                           common::ChannelCredentialsFromFiles(options.tls_ca_file, options.tls_cert_file,
                                                               options.tls_key_file, "--node_tls"));
  b->credentials_ = credentials;
  std::vector<std::string> addresses = options.addresses;
  if (!options.cluster_file.empty()) {
    COLIBRI_ASSIGN_OR_RETURN(addresses, ReadClusterFile(options.cluster_file));
  }
  {
    std::lock_guard<std::mutex> lock(b->mu_);
    b->cluster_file_mtime_ = options.cluster_file.empty() ? -1 : MtimeNanos(options.cluster_file);
    COLIBRI_RETURN_IF_ERROR(b->SetAddresses(addresses));
  }
  b->HealthRound();
  b->watcher_ = std::thread([raw = b.get()] {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(raw->mu_);
        raw->stop_cv_.wait_for(lock, absl::ToChronoMilliseconds(raw->options_.health_interval),
                               [raw] { return raw->stopping_; });
        if (raw->stopping_) return;
      }
      raw->HealthRound();
    }
  });
  return b;
}

RemoteBackend::~RemoteBackend() { Stop(); }

void RemoteBackend::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (watcher_.joinable()) watcher_.join();
  std::lock_guard<std::mutex> lock(mu_);
  listener_ = nullptr;
}

absl::Status RemoteBackend::SetAddresses(const std::vector<std::string>& addresses) {
  std::map<std::string, std::shared_ptr<Node>> existing;
  if (topology_ != nullptr) {
    for (const auto& n : topology_->nodes) existing[n->address] = n;
  }
  auto topo = std::make_shared<Topology>();
  std::set<std::string> seen;
  for (const std::string& a : addresses) {
    if (a.empty() || a.find(':') == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("expert node address '", a, "' is not host:port"));
    }
    if (!seen.insert(a).second) continue;
    if (auto it = existing.find(a); it != existing.end()) {
      topo->nodes.push_back(it->second);
      continue;
    }
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(options_.max_message_bytes, INT32_MAX)));
    args.SetMaxSendMessageSize(static_cast<int>(std::min<int64_t>(options_.max_message_bytes, INT32_MAX)));
    // A node that comes back is reconnected within a second, not after minutes of backoff.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    if (!options_.tls_server_name.empty()) args.SetSslTargetNameOverride(options_.tls_server_name);
    auto node = std::make_shared<Node>();
    node->address = a;
    node->stub = v1::ExpertNode::NewStub(grpc::CreateCustomChannel(
        a, std::static_pointer_cast<grpc::ChannelCredentials>(credentials_), args));
    topo->nodes.push_back(std::move(node));
  }
  if (topo->nodes.empty()) return absl::InvalidArgumentError("no expert node addresses");
  topology_ = std::move(topo);
  Rebuild();
  return absl::OkStatus();
}

void RemoteBackend::Rebuild() {
  std::vector<NodeState> states;
  for (const auto& n : topology_->nodes) {
    std::lock_guard<std::mutex> lock(n->mu);
    states.push_back({n->address, n->live, n->last_error, n->owned});
  }
  auto topo = std::make_shared<Topology>(*topology_);
  topo->map = std::make_shared<const ShardMap>(options_.n_layers, options_.n_experts, std::move(states));
  topology_ = std::move(topo);
}

std::shared_ptr<const RemoteBackend::Topology> RemoteBackend::topology() const {
  std::lock_guard<std::mutex> lock(mu_);
  return topology_;
}

std::shared_ptr<const ShardMap> RemoteBackend::map() const { return topology()->map; }

bool RemoteBackend::serving() const { return !map()->FirstUncovered().has_value(); }

void RemoteBackend::SetServingListener(std::function<void(bool)> listener) {
  std::lock_guard<std::mutex> lock(mu_);
  listener_ = std::move(listener);
  last_serving_ = !topology_->map->FirstUncovered().has_value();
  if (listener_) listener_(last_serving_);
}

void RemoteBackend::CheckNow() { HealthRound(); }

void RemoteBackend::HealthRound() {
  std::lock_guard<std::mutex> round(health_mu_);
  if (!options_.cluster_file.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t mtime = MtimeNanos(options_.cluster_file);
    if (mtime != cluster_file_mtime_) {
      cluster_file_mtime_ = mtime;
      absl::StatusOr<std::vector<std::string>> addresses = ReadClusterFile(options_.cluster_file);
      absl::Status s = addresses.ok() ? SetAddresses(*addresses) : addresses.status();
      if (!s.ok() && options_.log != nullptr) {
        *options_.log << "colibri-router: cluster file not applied, keeping the nodes: " << s.message() << std::endl;
      }
    }
  }
  const std::shared_ptr<const Topology> topo = topology();
  struct Probe {
    grpc::ClientContext context;
    v1::GetNodeInfoResponse response;
    grpc::Status status;
  };
  std::vector<Probe> probes(topo->nodes.size());
  absl::BlockingCounter done(static_cast<int>(probes.size()));
  v1::GetNodeInfoRequest request;
  for (size_t i = 0; i < probes.size(); ++i) {
    probes[i].context.set_deadline(absl::ToChronoTime(absl::Now() + options_.health_timeout));
    topo->nodes[i]->stub->async()->GetNodeInfo(&probes[i].context, &request, &probes[i].response,
                                               [&probes, &done, i](grpc::Status s) {
                                                 probes[i].status = std::move(s);
                                                 done.DecrementCount();
                                               });
  }
  done.Wait();
  int live = 0;
  for (size_t i = 0; i < probes.size(); ++i) {
    Node& node = *topo->nodes[i];
    const v1::GetNodeInfoResponse& info = probes[i].response;
    std::string error;
    if (!probes[i].status.ok()) {
      error = absl::StrCat("health check: ", probes[i].status.error_message(), " (code ",
                           static_cast<int>(probes[i].status.error_code()), ")");
    } else if (info.state() != v1::LOAD_STATE_READY) {
      error = absl::StrCat("not ready (", v1::LoadState_Name(info.state()), ")");
    } else if (info.model_id() != options_.model_id) {
      error = absl::StrCat("serves model ", info.model_id(), ", the router serves ", options_.model_id);
    } else if (info.d_model() != options_.d_model || info.n_layers() != options_.n_layers ||
               info.n_experts() != options_.n_experts) {
      error = "model shape differs from the router's";
    }
    std::lock_guard<std::mutex> lock(node.mu);
    const bool was_live = node.live;
    node.live = error.empty();
    node.last_error = error;
    if (node.live) {
      ++live;
      node.owned.clear();
      for (const v1::OwnedExperts& o : info.owned()) {
        for (const int32_t e : o.experts()) node.owned.emplace_back(o.layer(), e);
      }
      node.weights_version = info.weights_version();
    }
    if (was_live != node.live && options_.log != nullptr) {
      *options_.log << "colibri-router: node " << node.address << (node.live ? " is live" : " is down: ")
                    << error << std::endl;
    }
  }
  if (options_.metrics != nullptr) {
    options_.metrics->GetGauge("colibri_router_live_nodes", "Expert nodes that passed their last health check.")
        ->Set(live);
  }
  std::function<void(bool)> notify;
  bool serving = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Rebuild();
    serving = !topology_->map->FirstUncovered().has_value();
    if (serving != last_serving_ && listener_) notify = listener_;
    last_serving_ = serving;
  }
  if (notify) notify(serving);
}

void RemoteBackend::MarkDown(const std::shared_ptr<Node>& node, const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(node->mu);
    if (!node->live) return;
    node->live = false;
    node->last_error = error;
  }
  if (options_.log != nullptr) *options_.log << "colibri-router: node " << node->address << " is down: " << error << std::endl;
  if (options_.metrics != nullptr) {
    options_.metrics->GetCounter("colibri_router_failovers_total", "Nodes taken out of the map after a failed call.")
        ->Add();
  }
  std::lock_guard<std::mutex> lock(mu_);
  Rebuild();
}

std::vector<NodeStatusView> RemoteBackend::Nodes() const {
  std::vector<NodeStatusView> out;
  for (const auto& n : topology()->nodes) {
    NodeStatusView v;
    v.address = n->address;
    v.in_flight = n->in_flight.load();
    v.calls = n->calls.load();
    v.failed_calls = n->failed.load();
    std::lock_guard<std::mutex> lock(n->mu);
    v.live = n->live;
    v.last_error = n->last_error;
    v.owned = n->owned;
    v.weights_version = n->weights_version;
    out.push_back(std::move(v));
  }
  return out;
}

// Completion of a layer's node calls: callbacks mark calls done under mu, the
// dispatching thread waits on conditions over them.
struct RemoteBackend::Tracker {
  std::mutex mu;
  std::condition_variable cv;  // notified (under mu) whenever a call finishes
  // Waits until `ready()` (evaluated under mu) or `until`; true if ready.
  bool WaitUntil(const std::function<bool()>& ready, absl::Time until) {
    std::unique_lock<std::mutex> lock(mu);
    if (until == absl::InfiniteFuture()) {
      cv.wait(lock, ready);
      return true;
    }
    return cv.wait_until(lock, absl::ToChronoTime(until), ready);
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
    absl::StatusOr<std::vector<NodeCall>> plan = PlanNodeCalls(*topo->map, work.layer, work.experts, pending, load,
                                                               excluded);
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
        std::lock_guard<std::mutex> lock(tracker.mu);
        calls.push_back(std::move(call));
      }
      node.stub->async()->Compute(&raw->context, &raw->request, &raw->response,
                                  [raw, &node, &tracker, start](grpc::Status s) {
                                    node.in_flight.fetch_sub(1, std::memory_order_relaxed);
                                    std::lock_guard<std::mutex> lock(tracker.mu);
                                    raw->status = std::move(s);
                                    raw->end_nanos = NanosSince(start);
                                    raw->done = true;
                                    tracker.cv.notify_all();  // under mu: the waiter may free the tracker after
                                  });
      return raw;
    };
    for (NodeCall& nc : *plan) races.push_back({issue(std::move(nc), false), {}});
    const int hook = control.AddHook([&calls, &tracker] {
      std::lock_guard<std::mutex> lock(tracker.mu);
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
        std::lock_guard<std::mutex> lock(tracker.mu);
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
          std::lock_guard<std::mutex> lock(tracker.mu);
          races[i].hedges = std::move(hedges);
        }
        hedges_.fetch_add(1, std::memory_order_relaxed);
        if (options_.metrics != nullptr) {
          options_.metrics->GetCounter("colibri_router_hedges_total", "Node calls hedged on another replica.")->Add();
        }
      }
      tracker.WaitUntil(all_settled, absl::InfiniteFuture());
    }
    control.RemoveHook(hook);
    // The losers of settled races are not needed: cancel, and wait until
    // every callback has run (they point into this frame).
    {
      std::lock_guard<std::mutex> lock(tracker.mu);
      for (auto& c : calls) {
        if (!c->done) c->context.TryCancel();
      }
    }
    tracker.WaitUntil([&] {
      for (const auto& c : calls) {
        if (!c->done) return false;
      }
      return true;
    }, absl::InfiniteFuture());

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
          options_.metrics->GetCounter("colibri_router_hedge_wins_total", "Hedged calls answered by the hedge.")->Add();
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
      const std::string what = absl::StrCat("node ", c.address, ": ", c.status.error_message(), " (code ",
                                            static_cast<int>(code), ")");
      if (control.cancelled()) {
        if (error.ok()) error = absl::CancelledError("request cancelled by the client");
      } else if (absl::Now() >= control.deadline() ||
                 (client_deadline && code == grpc::StatusCode::DEADLINE_EXCEEDED)) {
        if (error.ok()) {
          error = absl::DeadlineExceededError(absl::StrCat("layer ", work.layer, ": deadline exceeded waiting for ", what));
        }
      } else if (Retriable(code)) {
        if (code != grpc::StatusCode::RESOURCE_EXHAUSTED) MarkDown(topo->nodes[c.node], what);
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
                                                 ": failed on every replica tried (", first_failure, "; retry failed on ",
                                                 retry_failure, ")"));
    }
    std::sort(failed.begin(), failed.end());
    pending = std::move(failed);
    retries_.fetch_add(1, std::memory_order_relaxed);
    if (stats != nullptr) ++stats->retries;
    if (options_.metrics != nullptr) {
      options_.metrics->GetCounter("colibri_router_retries_total", "Node calls retried on another replica.")->Add();
    }
  }
  return absl::InternalError("unreachable");
}

void RemoteBackend::Record(const Call& c, int attempt, BackendStats* stats) {
  if (stats != nullptr) {
    NodeCallRecord r;
    r.node = c.address;
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
        ->Add();
    options_.metrics
        ->GetHistogram("colibri_router_node_seconds", "Duration of Compute calls to each expert node.",
                       {{"node", c.address}}, common::LatencyBuckets())
        ->Observe((c.end_nanos - c.start_nanos) * 1e-9);
  }
}

}  // namespace router_node
}  // namespace colibri
