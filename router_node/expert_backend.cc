#include "router_node/expert_backend.h"

#include <vector>

namespace colibri {
namespace router_node {

bool CallControl::cancelled() const {
  common::MutexLock lock(&mu_);
  return cancelled_;
}

void CallControl::Cancel() {
  std::vector<std::function<void()>> hooks;
  {
    common::MutexLock lock(&mu_);
    if (cancelled_) return;
    cancelled_ = true;
    running_ = std::this_thread::get_id();
    for (auto& [id, hook] : hooks_) hooks.push_back(hook);
  }
  for (auto& hook : hooks) hook();
  common::MutexLock lock(&mu_);
  running_ = std::thread::id();
  hooks_done_.SignalAll();
}

int CallControl::AddHook(std::function<void()> hook) {
  {
    common::MutexLock lock(&mu_);
    if (!cancelled_) {
      const int id = next_id_++;
      hooks_.emplace(id, std::move(hook));
      return id;
    }
  }
  hook();
  return -1;
}

void CallControl::RemoveHook(int id) {
  common::MutexLock lock(&mu_);
  hooks_.erase(id);
  while (running_ != std::thread::id() && running_ != std::this_thread::get_id()) hooks_done_.Wait(&mu_);
}

}  // namespace router_node
}  // namespace colibri
