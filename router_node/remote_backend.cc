#include "router_node/remote_backend.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/host_port.h"
#include "common/log_line.h"
#include "common/small_file.h"
#include "common/status_macros.h"
#include "router_node/node_stream.h"
#include "router_node/remote_backend_internal.h"
#include "runtime/grpc_credentials.h"
#include "runtime/grpc_services.h"

// The node set, health checks and the shard map. One layer's node calls are
// in remote_dispatch.cc.

namespace colibri {
namespace router_node {

struct RemoteBackend::ChannelSetup {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  grpc::ChannelArguments args;
};

namespace {

absl::StatusOr<std::vector<std::string>> ReadClusterFile(const std::string& path) {
  absl::StatusOr<std::string> text = common::ReadSmallFile(path);
  if (!text.ok()) return absl::Status(text.status().code(), absl::StrCat("cluster file ", text.status().message()));
  std::vector<std::string> out;
  for (absl::string_view s : absl::StrSplit(*text, '\n')) {
    s = s.substr(0, s.find('#'));
    s = absl::StripAsciiWhitespace(s);
    if (!s.empty()) out.emplace_back(s);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("cluster file ", path, " lists no address"));
  return out;
}

// What a read of the cluster file found, to tell a change: its address list,
// or its error.
std::string ClusterFileSeen(const absl::StatusOr<std::vector<std::string>>& addresses) {
  return addresses.ok() ? absl::StrJoin(*addresses, "\n") : std::string(addresses.status().message());
}

}  // namespace

absl::StatusOr<std::unique_ptr<RemoteBackend>> RemoteBackend::Create(const RemoteOptions& options) {
  if (options.addresses.empty() == options.cluster_file.empty()) {
    return absl::InvalidArgumentError(
        "give the expert nodes either as RemoteOptions::addresses or as RemoteOptions::cluster_file");
  }
  if (options.n_layers < 1 || options.n_experts < 1 || options.d_model < 1) {
    return absl::InvalidArgumentError("RemoteOptions: model shape not set");
  }
  for (const auto& [name, duration] :
       {std::pair{"node_timeout", options.node_timeout}, std::pair{"health_interval", options.health_interval},
        std::pair{"health_timeout", options.health_timeout}}) {
    if (duration <= absl::ZeroDuration()) {  // 0 would take every node out at its first call or check
      return absl::InvalidArgumentError(
          absl::StrCat("RemoteOptions::", name, " ", absl::FormatDuration(duration), " must be positive"));
    }
  }
  COLIBRI_RETURN_IF_ERROR(runtime::ValidateKeepalive(options.keepalive, "RemoteOptions::"));
  // A message over the size limit breaks a whole stream (every call on it),
  // where it fails one unary call: stream calls stay far below the limit
  // (a reply can be top_k rows per token, in f32, for a bf16 request).
  // gRPC's limit is an int: larger ones are clamped to it.
  const int64_t message_limit = std::min<int64_t>(options.max_message_bytes, INT32_MAX);
  if (options.node_stream_max_bytes > message_limit / 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("RemoteOptions::node_stream_max_bytes ", options.node_stream_max_bytes, " is over 1/32 of the ",
                     message_limit, "-byte message limit (replies on a stream must stay well under it)"));
  }
  std::unique_ptr<RemoteBackend> b(new RemoteBackend(options));
  b->publish_.store(options.publish);
  auto setup = std::make_shared<ChannelSetup>();
  grpc::ChannelArguments& args = setup->args;
  args.SetMaxReceiveMessageSize(static_cast<int>(message_limit));
  args.SetMaxSendMessageSize(static_cast<int>(message_limit));
  runtime::ApplyChannelReconnect(&args);                     // a node that comes back is reconnected within a second
  runtime::ApplyChannelKeepalive(&args, options.keepalive);  // a node gone silent is noticed and reconnected
  COLIBRI_ASSIGN_OR_RETURN(setup->credentials, runtime::ChannelCredentialsFromFiles(
                                                   options.tls_ca_file, options.tls_cert_file, options.tls_key_file,
                                                   options.tls_server_name, "RemoteOptions::", &args));
  b->channel_setup_ = std::move(setup);
  std::vector<std::string> addresses = options.addresses;
  if (!options.cluster_file.empty()) {
    COLIBRI_ASSIGN_OR_RETURN(addresses, ReadClusterFile(options.cluster_file));
  }
  {
    common::MutexLock lock(&b->mu_);
    b->cluster_file_seen_ = ClusterFileSeen(addresses);
    COLIBRI_RETURN_IF_ERROR(b->SetAddresses(addresses));
  }
  b->HealthRound();
  b->watcher_ = std::thread([raw = b.get()] {
    absl::Time last_round = absl::Now();
    for (;;) {
      {
        common::MutexLock lock(&raw->mu_);
        const absl::Time next_round = last_round + raw->options_.health_interval;
        while (!raw->stopping_) {
          // A node a failed call took out is probed again soon after (MarkDown
          // sets recheck_), not at the next round.
          const absl::Time due =
              raw->recheck_ ? std::min(next_round, last_round + raw->options_.recheck_after) : next_round;
          const absl::Duration left = due - absl::Now();
          if (left <= absl::ZeroDuration() || raw->stop_cv_.WaitWithTimeout(&raw->mu_, left)) break;
        }
        if (raw->stopping_) return;
        raw->recheck_ = false;
      }
      last_round = absl::Now();
      raw->HealthRound();
    }
  });
  return b;
}

RemoteBackend::~RemoteBackend() {
  Stop();
  // Node calls cancelled after their layer was answered may still be ending:
  // their callbacks count them in this backend's metrics.
  common::MutexLock lock(&calls_mu_);
  while (outstanding_calls_ > 0) calls_cv_.Wait(&calls_mu_);
}

void RemoteBackend::CallStarted() {
  common::MutexLock lock(&calls_mu_);
  ++outstanding_calls_;
}

void RemoteBackend::Stop() {
  {
    common::MutexLock lock(&mu_);
    stopping_ = true;
  }
  stop_cv_.SignalAll();
  if (watcher_.joinable()) watcher_.join();
  common::MutexLock round(&health_mu_);  // a CheckNow round may be about to call the listener
  common::MutexLock lock(&mu_);
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
    COLIBRI_RETURN_IF_ERROR(common::CheckHostPort(a, "expert node address"));
    if (!seen.insert(a).second) continue;
    if (auto it = existing.find(a); it != existing.end()) {
      topo->nodes.push_back(it->second);
      continue;
    }
    auto node = std::make_shared<Node>();
    node->address = a;
    node->channel = options_.connect ? options_.connect(a) : Connect(a);
    topo->nodes.push_back(std::move(node));
  }
  if (topo->nodes.empty()) return absl::InvalidArgumentError("no expert node addresses");
  topology_ = std::move(topo);
  Rebuild();
  return absl::OkStatus();
}

std::unique_ptr<NodeChannel> RemoteBackend::Connect(const std::string& address) const {
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(address, channel_setup_->credentials, channel_setup_->args);
  if (options_.node_stream_max_bytes > 0) {
    return std::make_unique<StreamNodeChannel>(std::move(channel), options_.node_stream_max_bytes);
  }
  return std::make_unique<GrpcNodeChannel>(std::move(channel));
}

void RemoteBackend::Rebuild() {
  std::vector<NodeState> states;
  for (const auto& n : topology_->nodes) {
    common::MutexLock lock(&n->mu);
    states.push_back({n->address, n->live, n->last_error, n->owned, n->row_split_limit, n->reads_kernel_rows,
                      n->suspect, n->max_rows, n->max_row_indices});
  }
  auto topo = std::make_shared<Topology>(*topology_);
  topo->map = std::make_shared<const ShardMap>(options_.n_layers, options_.n_experts + options_.n_shared_experts,
                                               std::move(states));
  topology_ = std::move(topo);
}

std::shared_ptr<const RemoteBackend::Topology> RemoteBackend::topology() const {
  common::MutexLock lock(&mu_);
  return topology_;
}

std::shared_ptr<const ShardMap> RemoteBackend::map() const { return topology()->map; }

bool RemoteBackend::Mergeable(const LayerWork& work) const {
  const std::shared_ptr<const Topology> topo = topology();
  const ShardMap& map = *topo->map;
  for (const ExpertWork& w : work.experts) {
    if (work.layer >= options_.n_layers || w.expert >= options_.n_experts + options_.n_shared_experts) return false;
    const std::vector<int>& replicas = map.replicas(work.layer, w.expert);
    if (replicas.empty()) return false;
    for (const int n : replicas) {
      const NodeState& node = map.nodes()[n];
      if (!node.reads_kernel_rows || !BelowRowSplitLimit(node, static_cast<int64_t>(w.rows.size()))) return false;
    }
  }
  return true;
}

bool RemoteBackend::serving() const { return !map()->FirstUncovered().has_value(); }

void RemoteBackend::SetServingListener(std::function<void(bool)> listener) {
  common::MutexLock round(&health_mu_);  // no round's notice between this one's state and its call
  bool serving = false;
  {
    common::MutexLock lock(&mu_);
    listener_ = listener;
    last_serving_ = serving = !topology_->map->FirstUncovered().has_value();
  }
  if (listener) listener(serving);  // outside mu_: it may ask the backend
}

void RemoteBackend::CheckNow() { HealthRound(); }

void RemoteBackend::HealthRound() {
  common::MutexLock round(&health_mu_);
  if (!options_.cluster_file.empty()) {
    // Read every round, outside mu_ (which every layer call takes), and
    // applied when what it says changed: a file rewritten in place, seen
    // half written, is applied again once whole, whatever its mtime says.
    absl::StatusOr<std::vector<std::string>> addresses = ReadClusterFile(options_.cluster_file);
    std::string seen = ClusterFileSeen(addresses);
    absl::Status applied;
    {
      common::MutexLock lock(&mu_);
      if (seen != cluster_file_seen_) {
        cluster_file_seen_ = std::move(seen);
        applied = addresses.ok() ? SetAddresses(*addresses) : addresses.status();
      }
    }
    if (!applied.ok()) {  // logged outside the locks: a blocked log cannot stall layer calls
      common::LogLine(options_.log,
                      absl::StrCat("WARNING: cluster file not applied, keeping the nodes: ", applied.message()));
    }
  }
  const std::shared_ptr<const Topology> topo = topology();
  struct Probe {
    grpc::ClientContext context;
    v1::GetNodeInfoResponse response;
    grpc::Status status;
  };
  std::vector<Probe> probes(topo->nodes.size());
  std::vector<uint64_t> downs(topo->nodes.size());  // each node's MarkDown count as its probe left
  for (size_t i = 0; i < downs.size(); ++i) {
    common::MutexLock lock(&topo->nodes[i]->mu);
    downs[i] = topo->nodes[i]->downs;
  }
  // Answered probes, counted under a std::mutex (visible to ThreadSanitizer, unlike Abseil's).
  common::Mutex done_mu;
  common::CondVar done_cv;
  size_t answered = 0;
  v1::GetNodeInfoRequest request;
  for (size_t i = 0; i < probes.size(); ++i) {
    bool live;
    {
      common::MutexLock lock(&topo->nodes[i]->mu);
      live = topo->nodes[i]->live;
    }
    // A node out of the map may be back: its channel connects now, not when its backoff ends.
    if (!live) topo->nodes[i]->channel->ResetBackoff();
    probes[i].context.set_deadline(absl::ToChronoTime(clock_->Now() + options_.health_timeout));
    topo->nodes[i]->channel->GetNodeInfo(&probes[i].context, &request, &probes[i].response, [&, i](grpc::Status s) {
      probes[i].status = std::move(s);
      common::MutexLock lock(&done_mu);
      ++answered;
      done_cv.SignalAll();
    });
  }
  {
    common::MutexLock lock(&done_mu);
    while (answered < probes.size()) done_cv.Wait(&done_mu);
  }
  int live = 0;
  std::vector<std::string> changes;  // logged after the loop, outside node.mu
  for (size_t i = 0; i < probes.size(); ++i) {
    Node& node = *topo->nodes[i];
    const v1::GetNodeInfoResponse& info = probes[i].response;
    std::string error;
    if (probes[i].status.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
      error =
          absl::StrCat("health check: it does not serve colibri.v1.ExpertNode (a router, or another server?) (code ",
                       static_cast<int>(grpc::StatusCode::UNIMPLEMENTED), ")");
    } else if (!probes[i].status.ok()) {
      error = absl::StrCat("health check: ", probes[i].status.error_message(), " (code ",
                           static_cast<int>(probes[i].status.error_code()), ")");
    } else if (info.state() != v1::LOAD_STATE_READY) {
      error = absl::StrCat("not ready (", v1::LoadState_Name(info.state()), ")");
    } else if (info.model_id() != options_.model_id && std::find(info.model_ids().begin(), info.model_ids().end(),
                                                                 options_.model_id) == info.model_ids().end()) {
      // A node in the middle of a roll-out serves two models (model_ids): either may be this router's.
      error = absl::StrCat("serves model ", info.model_id(), ", the router serves ", options_.model_id);
    } else if (info.d_model() != options_.d_model || info.n_layers() != options_.n_layers ||
               info.n_experts() != options_.n_experts) {
      error = "model shape differs from the router's";
    }
    common::MutexLock lock(&node.mu);
    // A call found the node down after its probe left: the probe's "live" is
    // older news, so it waits for the next round.
    if (error.empty() && node.downs != downs[i]) continue;
    // A live node whose probe only ran out of time (a loaded host answers
    // late) stays in for this round: a second late probe in a row takes it
    // out, as does any call that fails on it meanwhile.
    const bool late = probes[i].status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    node.late_probes = late ? node.late_probes + 1 : 0;
    if (late && node.live && node.late_probes < 2) {
      ++live;
      continue;
    }
    const bool was_live = node.live;
    node.live = error.empty();
    node.suspect = false;  // the probe has decided
    node.last_error = error;
    if (node.live) {
      ++live;
      node.owned.clear();
      for (const v1::OwnedExperts& o : info.owned()) {
        for (const int32_t e : o.experts()) node.owned.emplace_back(o.layer(), e);
      }
      node.weights_version = info.weights_version();
      node.row_split_limit = info.row_split_limit();
      node.reads_kernel_rows = info.reads_kernel_rows();
      node.max_rows = info.max_rows();
      node.max_row_indices = info.max_row_indices();
      node.kernel_profile = info.kernel_profile();
    }
    if (was_live != node.live) {
      changes.push_back(absl::StrCat(node.live ? "" : "WARNING: ", "node ", node.address,
                                     node.live ? " is live" : " is down: ", absl::CEscape(error)));
    }
  }
  if (publish_.load()) {
    for (const std::string& change : changes) common::LogLine(options_.log, change);
    PublishState(*topo, live);
  }
  std::function<void(bool)> notify;
  bool serving = false;
  {
    common::MutexLock lock(&mu_);
    Rebuild();
    serving = !topology_->map->FirstUncovered().has_value();
    if (serving != last_serving_ && listener_) notify = listener_;
    last_serving_ = serving;
  }
  if (notify) notify(serving);
}

void RemoteBackend::Publish() {
  publish_.store(true);
  const std::shared_ptr<const Topology> topo = topology();
  int live = 0;
  std::vector<std::string> down;
  for (const std::shared_ptr<Node>& node : topo->nodes) {
    common::MutexLock lock(&node->mu);
    if (node->live) {
      ++live;
    } else {
      down.push_back(absl::StrCat(node->address, ": ", absl::CEscape(node->last_error)));
    }
  }
  if (!down.empty()) common::LogLine(options_.log, "WARNING: nodes not live: " + absl::StrJoin(down, "; "));
  PublishState(*topo, live);
}

void RemoteBackend::PublishState(const Topology& topo, int live) {
  if (options_.metrics != nullptr) {
    options_.metrics->GetGauge("colibri_router_live_nodes", "Expert nodes that passed their last health check.")
        ->Set(live);
  }
  CompareKernels(topo);
}

void RemoteBackend::CompareKernels(const Topology& topo) {
  // Live nodes by the kernel choices they reported (a node that reports none is left out).
  std::map<std::string, std::vector<std::string>> nodes_by_choices;
  for (const std::shared_ptr<Node>& node : topo.nodes) {
    common::MutexLock lock(&node->mu);
    if (node->live && !node->kernel_profile.empty()) {
      nodes_by_choices[node->kernel_profile].push_back(node->address);
    }
  }
  if (options_.metrics != nullptr) {
    options_.metrics
        ->GetGauge("colibri_router_kernel_profiles",
                   "Distinct kernel choices among the live nodes: above 1, replicas may differ in the last bits.")
        ->Set(static_cast<double>(nodes_by_choices.size()));
  }
  std::string differing;
  if (nodes_by_choices.size() > 1) {
    for (const auto& [choices, addresses] : nodes_by_choices) {
      absl::StrAppend(&differing, differing.empty() ? " " : "; ", absl::StrJoin(addresses, ", "), ": ", choices);
    }
  }
  {
    common::MutexLock lock(&mu_);
    if (differing == kernels_warned_) return;
    kernels_warned_ = differing;
  }
  if (differing.empty()) {
    common::LogLine(options_.log, "the live nodes run the same kernels again");
  } else {
    common::LogLine(options_.log,
                    absl::StrCat("WARNING: the live nodes run different kernels, so replicas of an expert may answer "
                                 "with different last bits (point the nodes at one kernel profile: "
                                 "COLIBRI_KERNEL_PROFILE, docs/KERNELS.md):",
                                 absl::CEscape(differing)));
  }
}

void RemoteBackend::MarkDown(const std::shared_ptr<Node>& node, const std::string& error) {
  {
    common::MutexLock lock(&node->mu);
    // Only a live node's fall voids the probes out (HealthRound): a call sent
    // before the node was taken out and failing since is no newer news than
    // a probe, and voiding probes for it would keep a node that was only slow
    // out for as long as such calls keep timing out.
    if (!node->live) return;
    ++node->downs;
    node->live = false;
    node->suspect = true;
    node->last_error = error;
  }
  // The node's own words, escaped: a newline in them must not start a log line of its own.
  common::LogLine(options_.log, absl::StrCat("WARNING: node ", node->address, " is down: ", absl::CEscape(error)));
  if (options_.metrics != nullptr) {
    options_.metrics->GetCounter("colibri_router_failovers_total", "Nodes taken out of the map after a failed call.")
        ->Increment();
  }
  common::MutexLock lock(&mu_);
  Rebuild();
  recheck_ = true;
  stop_cv_.SignalAll();
}

void RemoteBackend::Recheck() {
  common::MutexLock lock(&mu_);
  recheck_ = true;
  stop_cv_.SignalAll();
}

std::vector<NodeStatusView> RemoteBackend::Nodes() const {
  std::vector<NodeStatusView> out;
  // Held for the loop: a health round may replace the topology meanwhile.
  const std::shared_ptr<const Topology> topo = topology();
  for (const auto& n : topo->nodes) {
    NodeStatusView v;
    v.address = n->address;
    v.in_flight = n->in_flight.load();
    v.calls = n->calls.load();
    v.failed_calls = n->failed.load();
    common::MutexLock lock(&n->mu);
    v.live = n->live;
    v.last_error = n->last_error;
    v.owned = n->owned;
    v.weights_version = n->weights_version;
    v.kernel_profile = n->kernel_profile;
    out.push_back(std::move(v));
  }
  return out;
}

absl::Status WithNodeProblems(const absl::Status& status, ExpertBackend& backend) {
  const auto* remote = dynamic_cast<const RemoteBackend*>(&backend);
  if (status.code() != absl::StatusCode::kUnavailable || remote == nullptr) return status;
  std::string problems;
  for (const NodeStatusView& n : remote->Nodes()) {
    if (n.live) continue;
    absl::StrAppend(&problems, problems.empty() ? "; nodes not live: " : "; ", n.address, ": ",
                    n.last_error.empty() ? "down" : n.last_error);
  }
  return problems.empty() ? status : absl::Status(status.code(), absl::StrCat(status.message(), problems));
}

}  // namespace router_node
}  // namespace colibri
