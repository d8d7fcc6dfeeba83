#include "expert_node/reload_request.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

namespace colibri {
namespace expert_node {
namespace {

// `path` made canonical, if it resolves inside `root` (also made canonical);
// empty otherwise (a missing path is outside). The one resolution is what is
// checked and what loads.
std::string CanonicalInsideRoot(const std::string& path, const std::string& root) {
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::canonical(path, ec);
  if (ec) return "";
  const std::filesystem::path r = std::filesystem::canonical(root, ec);
  if (ec) return "";
  auto [end, unused] = std::mismatch(r.begin(), r.end(), p.begin(), p.end());
  return end == r.end() ? p.string() : "";
}

}  // namespace

absl::Status ParseReloadRequest(const colibri::v1::ReloadRequest& request, const std::string& model_root,
                                ReloadInput* input) {
  input->keep_previous = request.keep_previous();
  input->drop_model_id = request.drop_model_id();
  if (!input->drop_model_id.empty()) {
    if (!request.model_dir().empty() || !request.experts().empty() || request.keep_previous()) {
      return absl::InvalidArgumentError("drop_model_id excludes model_dir, experts and keep_previous");
    }
    return absl::OkStatus();
  }
  const std::string& dir = request.model_dir();
  if (!dir.empty()) {
    if (model_root.empty()) {
      return absl::FailedPreconditionError(
          "loading another model directory is disabled on this node: start it with a model root "
          "(ServerOptions::model_root, colibri-expert --model_root)");
    }
    // One answer for a path outside the root, missing, or not a directory:
    // the root's contents are not to be probed.
    const std::string canonical = CanonicalInsideRoot(dir, model_root);
    std::error_code ec;
    if (canonical.empty() || !std::filesystem::is_directory(canonical, ec)) {
      return absl::PermissionDeniedError(
          "model_dir is not an existing directory inside the node's model root (ServerOptions::model_root)");
    }
    input->model_dir = canonical;
  }
  if (!request.experts().empty()) {
    absl::StatusOr<ShardSpec> parsed = ShardSpec::Parse(request.experts());
    if (!parsed.ok()) return parsed.status();
    input->shard = *std::move(parsed);
  }
  return absl::OkStatus();
}

}  // namespace expert_node
}  // namespace colibri
