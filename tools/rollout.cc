#include "tools/rollout.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <set>

#include "absl/strings/str_cat.h"
#include "colibri/v1/expert_node.grpc.pb.h"
#include "colibri/v1/router.grpc.pb.h"
#include "common/status_macros.h"
#include "expert_node/shard_spec.h"
#include "runtime/grpc_credentials.h"
#include "tools/placement.h"

namespace colibri {
namespace tools {
namespace {

absl::StatusOr<std::shared_ptr<grpc::Channel>> Channel(const RolloutOptions& o, const std::string& address) {
  grpc::ChannelArguments args;
  COLIBRI_ASSIGN_OR_RETURN(auto credentials,
                           runtime::ChannelCredentialsFromFiles(o.tls_ca_file, o.tls_cert_file, o.tls_key_file,
                                                                o.tls_server_name, "RolloutOptions::", &args));
  return grpc::CreateCustomChannel(address, credentials, args);
}

std::string Describe(const grpc::Status& s) {
  return absl::StrCat(s.error_message(), " (code ", static_cast<int>(s.error_code()), ")");
}

// One Reload call to a node's admin endpoint.
grpc::Status Reload(const RolloutOptions& o, const std::string& node, const v1::ReloadRequest& request,
                    v1::ReloadResponse* response) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = Channel(o, node);
  if (!channel.ok()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(channel.status().message()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + o.timeout));
  return v1::ExpertNode::NewStub(*channel)->Reload(&context, request, response);
}

// The model the router serves: its GetModelInfo, tried for up to 10 s (a
// router busy switching, or a connection being re-made, answers late).
absl::StatusOr<std::string> RouterModel(const RolloutOptions& o) {
  COLIBRI_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, Channel(o, o.router));
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  grpc::Status s;
  do {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    v1::GetModelInfoResponse info;
    s = v1::Router::NewStub(channel)->GetModelInfo(&context, {}, &info);
    if (s.ok()) return info.model_id();
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE && s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      return absl::FailedPreconditionError(
          absl::StrCat("router ", o.router, ": GetModelInfo: ", Describe(s),
                       s.error_code() == grpc::StatusCode::UNIMPLEMENTED
                           ? " (not an admin endpoint that serves it: a router older than this tool?)"
                           : ""));
    }
    absl::SleepFor(absl::Milliseconds(200));
  } while (absl::Now() < give_up);
  return absl::UnavailableError(absl::StrCat("router ", o.router, ": GetModelInfo: ", Describe(s)));
}

absl::StatusOr<v1::GetNodeInfoResponse> NodeInfo(const RolloutOptions& o, const std::string& node) {
  COLIBRI_ASSIGN_OR_RETURN(auto channel, Channel(o, node));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + o.timeout));
  v1::GetNodeInfoResponse info;
  const grpc::Status s = v1::ExpertNode::NewStub(channel)->GetNodeInfo(&context, {}, &info);
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("node ", node, ": GetNodeInfo: ", Describe(s)));
  return info;
}

// The models a node serves (GetNodeInfo.model_ids), or empty if it does not answer.
std::vector<std::string> NodeModels(const RolloutOptions& o, const std::string& node) {
  const absl::StatusOr<v1::GetNodeInfoResponse> info = NodeInfo(o, node);
  if (!info.ok()) return {};
  return {info->model_ids().begin(), info->model_ids().end()};
}

// Each (node, model) pair: the node drops the model it staged, making the
// one it served before current again. What failed, named; OK if all dropped.
absl::Status RollBack(const RolloutOptions& o, const std::vector<std::pair<std::string, std::string>>& staged,
                      std::ostream& log) {
  std::string errors;
  for (const auto& [node, model_id] : staged) {
    RolloutOptions one = o;
    one.nodes = {node};
    if (absl::Status s = DropOnNodes(one, model_id, log); !s.ok()) {
      absl::StrAppend(&errors, errors.empty() ? "" : "; ", s.message());
    }
  }
  if (errors.empty()) return absl::OkStatus();
  return absl::InternalError(errors);
}

// The error of a failed step after its roll-back: what failed, and what the
// cluster serves now.
absl::Status RolledBack(const absl::Status& failed, const absl::Status& rollback) {
  return absl::Status(failed.code(), rollback.ok() ? absl::StrCat(failed.message(),
                                                                  "; rolled back: the nodes serve the previous "
                                                                  "model as before")
                                                   : absl::StrCat(failed.message(),
                                                                  "; roll-back incomplete, these nodes still serve "
                                                                  "both models (drop the new one there): ",
                                                                  rollback.message()));
}

absl::Status StageOn(const RolloutOptions& o, std::ostream& log, std::string* model_id,
                     std::vector<std::pair<std::string, std::string>>* staged) {
  if (o.nodes.empty()) return absl::InvalidArgumentError("no expert nodes given (RolloutOptions::nodes)");
  std::string new_id;
  for (const std::string& node : o.nodes) {
    v1::ReloadRequest request;
    request.set_model_dir(o.model_dir);
    request.set_keep_previous(true);
    v1::ReloadResponse response;
    // What the node serves before: a roll-back drops only what it did not
    // (a model it served already, staged again, stays; the router may be
    // serving it).
    const absl::StatusOr<v1::GetNodeInfoResponse> info = NodeInfo(o, node);
    if (!info.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("stage: ", info.status().message()));
    }
    const std::vector<std::string> before(info->model_ids().begin(), info->model_ids().end());
    const auto is_new = [&before](const std::string& id) {
      return std::find(before.begin(), before.end(), id) == before.end();
    };
    const grpc::Status s = Reload(o, node, request, &response);
    if (!s.ok()) {
      // A node whose load outlives the deadline sees its caller gone and
      // does not install it; but one may have swapped just before its answer
      // was lost: what it serves now that it did not is rolled back too.
      for (const std::string& id : NodeModels(o, node)) {
        if (is_new(id)) staged->emplace_back(node, id);
      }
      return absl::FailedPreconditionError(
          absl::StrCat("stage: node ", node, " could not load ", o.model_dir, ": ", Describe(s)));
    }
    if (is_new(response.model_id())) staged->emplace_back(node, response.model_id());
    if (!new_id.empty() && response.model_id() != new_id) {
      return absl::FailedPreconditionError(absl::StrCat("stage: node ", node, " loaded model ", response.model_id(),
                                                        " from ", o.model_dir, ", the others ", new_id));
    }
    new_id = response.model_id();
    log << "stage: node " << node << " serves " << new_id << " beside the previous model (weights version "
        << response.weights_version() << ")\n";
  }
  *model_id = new_id;
  return absl::OkStatus();
}

}  // namespace

absl::Status StageOnNodes(const RolloutOptions& o, std::ostream& log, std::string* model_id) {
  std::vector<std::pair<std::string, std::string>> staged;
  absl::Status s = StageOn(o, log, model_id, &staged);
  if (s.ok() || staged.empty()) return s;
  return RolledBack(s, RollBack(o, staged, log));
}

namespace {

// Router.LoadModel of o.model_dir: the switch (or, when the router serves it
// already, a wait for its old versions to be released).
absl::Status LoadModelOnRouter(const RolloutOptions& o, v1::LoadModelResponse* response) {
  if (o.router.empty()) return absl::InvalidArgumentError("no router given (RolloutOptions::router)");
  COLIBRI_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, Channel(o, o.router));
  v1::LoadModelRequest request;
  request.set_model_dir(o.model_dir);
  request.set_timeout_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(o.timeout)));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + 2 * o.timeout + absl::Seconds(5)));
  const grpc::Status s = v1::Router::NewStub(channel)->LoadModel(&context, request, response);
  if (!s.ok()) return absl::FailedPreconditionError(absl::StrCat("switch: router ", o.router, ": ", Describe(s)));
  return absl::OkStatus();
}

// Until the router has released every old version (LoadModel again, with
// the model it serves now: each call waits up to o.timeout for their
// requests), at most 5 more times; a call that finds another load running
// or the router unreachable counts as one and is tried again 1 s later.
absl::Status AwaitReleased(const RolloutOptions& o, bool released, std::ostream& log) {
  std::string last;
  for (int i = 0; !released && i < 5; ++i) {
    log << "switch: requests of an old version still run on router " << o.router << "; waiting\n";
    v1::LoadModelResponse response;
    if (absl::Status s = LoadModelOnRouter(o, &response); !s.ok()) {
      last = std::string(s.message());
      absl::SleepFor(absl::Seconds(1));
      continue;
    }
    released = response.previous_released();
  }
  if (released) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat(
      "router ", o.router, " serves the new model, but requests of an old version still ran after 5 more waits of ",
      absl::FormatDuration(o.timeout), last.empty() ? "" : absl::StrCat(" (last: ", last, ")"),
      ": the old model stays on the nodes; drop it there once they have ended"));
}

}  // namespace

absl::Status SwitchRouter(const RolloutOptions& o, std::ostream& log, std::string* previous_model_id) {
  v1::LoadModelResponse response;
  COLIBRI_RETURN_IF_ERROR(LoadModelOnRouter(o, &response));
  if (response.model_id() == response.previous_model_id()) {
    log << "switch: router " << o.router << " already serves " << response.model_id() << "\n";
  } else {
    log << "switch: router " << o.router << " serves " << response.model_id() << " (was "
        << response.previous_model_id() << ")\n";
  }
  *previous_model_id = response.previous_model_id();
  // Done only when no request runs on an old version any more: the next step drops it.
  return AwaitReleased(o, response.previous_released(), log);
}

absl::Status DropOnNodes(const RolloutOptions& o, const std::string& model_id, std::ostream& log) {
  if (o.nodes.empty()) return absl::InvalidArgumentError("no expert nodes given (RolloutOptions::nodes)");
  std::string errors;
  for (const std::string& node : o.nodes) {
    v1::ReloadRequest request;
    request.set_drop_model_id(model_id);
    v1::ReloadResponse response;
    const grpc::Status s = Reload(o, node, request, &response);
    if (s.ok()) {
      log << "drop: node " << node << " released model " << model_id << "\n";
    } else {
      absl::StrAppend(&errors, errors.empty() ? "" : "; ", "node ", node, ": ", Describe(s));
    }
  }
  if (errors.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("drop: ", model_id, " is still loaded: ", errors));
}

absl::Status Rollout(const RolloutOptions& o, std::ostream& log) {
  if (o.router.empty()) return absl::InvalidArgumentError("no router given (RolloutOptions::router)");
  if (o.nodes.empty()) return absl::InvalidArgumentError("no expert nodes given (RolloutOptions::nodes)");
  // The router's model before anything changes: what the nodes go back to, and drop at the end.
  COLIBRI_ASSIGN_OR_RETURN(const std::string old_id, RouterModel(o));
  std::string new_id;
  std::vector<std::pair<std::string, std::string>> staged;
  if (absl::Status s = StageOn(o, log, &new_id, &staged); !s.ok()) {
    return staged.empty() ? s : RolledBack(s, RollBack(o, staged, log));
  }
  if (old_id == new_id) {
    log << "the router already serves " << new_id << "\n";
    return absl::OkStatus();
  }
  v1::LoadModelResponse switched;
  if (absl::Status s = LoadModelOnRouter(o, &switched); s.ok()) {
    log << "switch: router " << o.router << " serves " << switched.model_id() << " (was "
        << switched.previous_model_id() << ")\n";
  } else {
    // The call failed, but the switch may have happened (a connection lost
    // after it): ask. Roll back only from a router known to serve the old
    // version; nodes serving both versions are right for either.
    const absl::StatusOr<std::string> serving = RouterModel(o);
    if (!serving.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat(s.message(), "; the router's model is unknown (", serving.status().message(),
                                       "): every node serves both ", old_id, " and ", new_id,
                                       "; once the router answers, drop the one it does not serve"));
    }
    if (*serving != new_id) return RolledBack(s, RollBack(o, staged, log));
    log << "switch: the call failed (" << s.message() << ") but router " << o.router << " serves " << new_id << "\n";
    switched.set_previous_released(false);  // not known: asked below
  }
  // The old version leaves the nodes only once no request of the router runs on it.
  COLIBRI_RETURN_IF_ERROR(AwaitReleased(o, switched.previous_released(), log));
  COLIBRI_RETURN_IF_ERROR(DropOnNodes(o, old_id, log));
  log << "rolled out " << new_id << " (replacing " << old_id << ")\n";
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::vector<double>>> FetchExpertLoad(const RolloutOptions& o, int64_t n_layers,
                                                                 int64_t n_experts, int64_t n_shared) {
  COLIBRI_ASSIGN_OR_RETURN(auto channel, Channel(o, o.router));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + o.timeout));
  v1::GetClusterStatusResponse status;
  const grpc::Status s = v1::Router::NewStub(channel)->GetClusterStatus(&context, {}, &status);
  if (!s.ok()) {
    return absl::UnavailableError(absl::StrCat("GetClusterStatus on the router ", o.router, ": ", Describe(s)));
  }
  std::vector<std::vector<double>> load(n_layers, std::vector<double>(n_experts, 0.0));
  const int64_t per_layer = n_experts + n_shared;
  if (status.experts_size() != n_layers * per_layer) {
    return absl::FailedPreconditionError(absl::StrCat("the router ", o.router, " reports ", status.experts_size(),
                                                      " (layer, expert) pairs; the model has ", n_layers, " x ",
                                                      per_layer, ": it serves another model"));
  }
  for (const v1::ExpertLoad& e : status.experts()) {
    if (e.layer() < 0 || e.layer() >= n_layers || e.expert() < 0 || e.expert() >= per_layer) {
      return absl::FailedPreconditionError(absl::StrCat("the router ", o.router, " reports layer ", e.layer(),
                                                        " expert ", e.expert(), ": not this model's shape"));
    }
    if (e.expert() < n_experts) load[e.layer()][e.expert()] = static_cast<double>(e.tokens());
  }
  return load;
}

namespace {

using Pairs = std::set<std::pair<int64_t, int64_t>>;

// Node n's shard becomes `target`.
absl::Status ReloadShard(const RolloutOptions& o, const char* step, size_t n, Pairs* owned, const Pairs& target,
                         std::ostream& log) {
  if (*owned == target) return absl::OkStatus();
  v1::ReloadRequest request;
  request.set_experts(ShardSpecText({target.begin(), target.end()}));
  v1::ReloadResponse response;
  const grpc::Status s = Reload(o, o.nodes[n], request, &response);
  if (!s.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(step, ": node ", o.nodes[n], " could not load '", request.experts(), "': ", Describe(s)));
  }
  *owned = target;
  log << step << ": node " << o.nodes[n] << " serves " << request.experts() << "\n";
  return absl::OkStatus();
}

using Counts = std::map<std::pair<int64_t, int64_t>, int>;  // (layer, expert) -> live copies

Counts CopiesOf(const std::vector<Pairs>& shards) {
  Counts copies;
  for (const Pairs& shard : shards) {
    for (const auto& pair : shard) ++copies[pair];
  }
  return copies;
}

// The live copies of every (layer, expert) the router (o.router) counts.
absl::StatusOr<Counts> RouterCounts(const RolloutOptions& o) {
  COLIBRI_ASSIGN_OR_RETURN(auto channel, Channel(o, o.router));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::GetClusterStatusResponse status;
  const grpc::Status s = v1::Router::NewStub(channel)->GetClusterStatus(&context, {}, &status);
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("router ", o.router, ": ", Describe(s)));
  Counts counts;
  for (const v1::ExpertLoad& e : status.experts()) counts[{e.layer(), e.expert()}] = e.live_replicas();
  return counts;
}

// Polls the router until `unmet` finds nothing to say of its counts (or
// o.timeout: DEADLINE_EXCEEDED with what it last said); without a router,
// waits `settle`.
absl::Status AwaitRouter(const RolloutOptions& o, absl::Duration settle,
                         const std::function<std::string(const Counts&)>& unmet, std::ostream& log) {
  if (o.router.empty()) {
    absl::SleepFor(settle);
    return absl::OkStatus();
  }
  const absl::Time until = absl::Now() + o.timeout;
  std::string missing;
  do {
    COLIBRI_ASSIGN_OR_RETURN(const Counts counts, RouterCounts(o));
    missing = unmet(counts);
    if (missing.empty()) {
      log << "router " << o.router << " sees the change\n";
      return absl::OkStatus();
    }
    absl::SleepFor(absl::Milliseconds(100));
  } while (absl::Now() < until);
  return absl::DeadlineExceededError(absl::StrCat("router ", o.router, " does not see the change within ",
                                                  absl::FormatDuration(o.timeout), ": ", missing));
}

std::string Name(const std::pair<int64_t, int64_t>& pair) {
  return absl::StrCat("layer ", pair.first, " expert ", pair.second);
}

}  // namespace

absl::Status ApplyPlacement(const RolloutOptions& o, const std::vector<std::string>& specs, absl::Duration settle,
                            std::ostream& log) {
  if (o.nodes.empty() || o.nodes.size() != specs.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the plan has ", specs.size(), " shards and ", o.nodes.size(),
                                                   " node endpoints were given (RolloutOptions::nodes): one each"));
  }
  if (const std::set<std::string> distinct(o.nodes.begin(), o.nodes.end()); distinct.size() != o.nodes.size()) {
    return absl::InvalidArgumentError(
        "a node endpoint is given twice (RolloutOptions::nodes): each node takes one shard of the plan");
  }
  std::vector<Pairs> owned(o.nodes.size()), target(o.nodes.size()), grown(o.nodes.size());
  int64_t n_layers = 0, n_experts = 0;  // the model's, as the first node reports it
  for (size_t n = 0; n < o.nodes.size(); ++n) {
    COLIBRI_ASSIGN_OR_RETURN(v1::GetNodeInfoResponse info, NodeInfo(o, o.nodes[n]));
    // A shard reload is a plain reload: it would release a staged version.
    if (info.model_ids_size() > 1) {
      return absl::FailedPreconditionError(absl::StrCat("node ", o.nodes[n], " serves two models (", info.model_ids(0),
                                                        ", ", info.model_ids(1),
                                                        "): a roll-out is in progress; finish it first"));
    }
    if (n == 0) {
      n_layers = info.n_layers();
      n_experts = info.n_experts() + info.n_shared_experts();
    } else if (info.n_layers() != n_layers || info.n_experts() + info.n_shared_experts() != n_experts) {
      return absl::FailedPreconditionError(absl::StrCat("node ", o.nodes[n], " serves ", info.n_layers(), " x ",
                                                        info.n_experts() + info.n_shared_experts(), " experts, node ",
                                                        o.nodes[0], " ", n_layers, " x ", n_experts));
    }
    for (const v1::OwnedExperts& layer : info.owned()) {
      for (const int32_t e : layer.experts()) owned[n].insert({layer.layer(), e});
    }
    absl::StatusOr<expert_node::ShardSpec> spec = expert_node::ShardSpec::Parse(specs[n]);
    if (!spec.ok()) return absl::InvalidArgumentError(absl::StrCat("shard ", n, ": ", spec.status().message()));
    absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> pairs =
        spec->Resolve(info.n_layers(), info.n_experts() + info.n_shared_experts());
    if (!pairs.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard ", n, " for node ", o.nodes[n], ": ", pairs.status().message()));
    }
    target[n] = Pairs(pairs->begin(), pairs->end());
    grown[n] = owned[n];
    grown[n].insert(target[n].begin(), target[n].end());
  }
  // Every expert keeps a copy: the plan must place each one somewhere.
  const Counts planned = CopiesOf(target);
  for (int64_t layer = 0; layer < n_layers; ++layer) {
    for (int64_t e = 0; e < n_experts; ++e) {
      if (planned.count({layer, e}) == 0) {
        return absl::InvalidArgumentError(absl::StrCat("the plan places ", Name({layer, e}),
                                                       " on no node: applying it would leave the expert unserved "
                                                       "(a plan made for another model?)"));
      }
    }
  }
  std::string grown_nodes;  // those whose shard changed, for the error of a later failure
  for (size_t n = 0; n < o.nodes.size(); ++n) {
    const bool changes = owned[n] != grown[n];
    if (absl::Status s = ReloadShard(o, "grow", n, &owned[n], grown[n], log); !s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat(s.message(), grown_nodes.empty() ? "; no node changed"
                                                                  : absl::StrCat("; grown already, serving their old "
                                                                                 "and new experts: ",
                                                                                 grown_nodes)));
    }
    if (changes) absl::StrAppend(&grown_nodes, grown_nodes.empty() ? "" : ", ", o.nodes[n]);
  }
  const Counts grown_copies = CopiesOf(grown);
  COLIBRI_RETURN_IF_ERROR(AwaitRouter(
      o, settle,
      [&](const Counts& live) -> std::string {
        for (const auto& [pair, copies] : grown_copies) {
          const auto it = live.find(pair);
          const int have = it == live.end() ? 0 : it->second;
          if (have < copies) return absl::StrCat(Name(pair), " has ", have, " of ", copies, " live copies");
        }
        return "";
      },
      log));
  // One node at a time, each shrink seen by the router before the next: a
  // call planned on the stale map is retried on a copy that still has it.
  for (size_t n = 0; n < o.nodes.size(); ++n) {
    if (owned[n] == target[n]) continue;
    // Each dropped expert's copies before the shrink: as the router counts
    // them (other nodes may hold it too) or as the nodes do (the router may
    // not count node n just now), whichever is more.
    Counts before;
    if (!o.router.empty()) {
      COLIBRI_ASSIGN_OR_RETURN(before, RouterCounts(o));
    }
    const Counts held = CopiesOf(owned);
    Pairs dropped;
    for (const auto& pair : owned[n]) {
      if (target[n].count(pair) > 0) continue;
      dropped.insert(pair);
      before[pair] = std::max(before[pair], held.at(pair));
    }
    // A node may have died since it grew: what node n drops must be owned by
    // another node that answers now.
    Pairs elsewhere;
    for (size_t m = 0; m < o.nodes.size(); ++m) {
      if (m == n) continue;
      const absl::StatusOr<v1::GetNodeInfoResponse> info = NodeInfo(o, o.nodes[m]);
      if (!info.ok()) continue;
      for (const v1::OwnedExperts& layer : info->owned()) {
        for (const int32_t e : layer.experts()) elsewhere.insert({layer.layer(), e});
      }
    }
    for (const auto& pair : dropped) {
      if (elsewhere.count(pair) == 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "shrink: node ", o.nodes[n], " would drop ", Name(pair),
            ", which no other node that answers now owns: stopped before it, the node keeps its old and new experts; "
            "bring the other nodes back and run apply-plan again"));
      }
    }
    COLIBRI_RETURN_IF_ERROR(ReloadShard(o, "shrink", n, &owned[n], target[n], log));
    COLIBRI_RETURN_IF_ERROR(AwaitRouter(
        o, settle,
        [&](const Counts& live) -> std::string {
          for (const auto& pair : dropped) {
            const auto it = live.find(pair);
            if (it == live.end()) return absl::StrCat("the router does not list ", Name(pair), " (another model?)");
            if (it->second >= before.at(pair))
              return absl::StrCat(Name(pair), " still has ", it->second, " live copies");
          }
          return "";
        },
        log));
  }
  log << "placement applied to " << o.nodes.size() << " nodes\n";
  return absl::OkStatus();
}

}  // namespace tools
}  // namespace colibri
