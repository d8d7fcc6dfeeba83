#include "router_node/expert_backend.h"

namespace colibri {
namespace router_node {

bool CallControl::cancelled() const {
  common::MutexLock lock(&mu_);
  return cancelled_;
}

void CallControl::Cancel() {
  common::MutexLock lock(&mu_);
  if (cancelled_) return;
  cancelled_ = true;
  for (auto& [id, hook] : hooks_) hook();  // under mu_: RemoveHook waits for a running hook
}

int CallControl::AddHook(std::function<void()> hook) {
  common::MutexLock lock(&mu_);
  if (cancelled_) hook();
  const int id = next_id_++;
  hooks_.emplace(id, std::move(hook));
  return id;
}

void CallControl::RemoveHook(int id) {
  common::MutexLock lock(&mu_);
  hooks_.erase(id);
}

}  // namespace router_node
}  // namespace colibri
