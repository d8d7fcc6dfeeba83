#ifndef COLIBRI_EXPERT_NODE_RELOAD_REQUEST_H_
#define COLIBRI_EXPERT_NODE_RELOAD_REQUEST_H_

// ExpertNode.Reload's request as what the store reloads: the model directory
// confined to the node's model root and made canonical (what was checked is
// what loads), and the shard spec parsed. Transport code (includes the
// generated proto); a pure function of the request, the root and the file
// system.

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "colibri/v1/expert_node.pb.h"
#include "expert_node/shard_spec.h"

namespace colibri {
namespace expert_node {

struct ReloadInput {
  std::string model_dir;           // canonical; empty: the current directory
  std::optional<ShardSpec> shard;  // unset: the current shard
  bool keep_previous = false;      // keep serving the replaced model to calls naming it
  std::string drop_model_id;       // non-empty: stop serving this model instead of loading
};

// FAILED_PRECONDITION for a model_dir without a `model_root`;
// PERMISSION_DENIED for one that does not resolve to an existing directory
// inside it (one answer for "outside" and "does not exist", so the caller
// learns nothing about what exists outside the root); NOT_FOUND for one that
// is not a directory; INVALID_ARGUMENT for experts that do not parse, or
// drop_model_id together with anything else.
absl::Status ParseReloadRequest(const colibri::v1::ReloadRequest& request, const std::string& model_root,
                                ReloadInput* input);

}  // namespace expert_node
}  // namespace colibri

#endif  // COLIBRI_EXPERT_NODE_RELOAD_REQUEST_H_
