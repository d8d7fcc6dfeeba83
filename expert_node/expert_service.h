#ifndef COLIBRI_EXPERT_NODE_EXPERT_SERVICE_H_
#define COLIBRI_EXPERT_NODE_EXPERT_SERVICE_H_

// Transport for the ExpertNode service (proto/colibri/v1/expert_node.proto):
// a Compute call is queued for the one compute thread, which parses,
// validates and computes it (never on gRPC's threads); Reload calls load on a
// thread of their own; each status is converted once and the reactor finished.
// Thread-safe.

#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "colibri/v1/expert_node.grpc.pb.h"
#include "common/metrics.h"
#include "common/mutex.h"
#include "expert_node/compute_engine.h"
#include "expert_node/expert_store.h"

namespace colibri {
namespace expert_node {

class ExpertService final : public colibri::v1::ExpertNode::CallbackService {
 public:
  struct Options {
    std::string model_root;  // Reload's model_dir must resolve inside it
    bool check_finite = false;
    int64_t max_queued_calls = 64;
    int threads = 0;
    std::string kernel_isa;
    int numa_node = -1;
    common::MetricsRegistry* metrics = nullptr;  // optional; must outlive the service
    int inject_delay_ms = 0;     // fault injection (tests, benchmarks): sleep this long before a Compute ...
    int inject_delay_every = 1;  // ... every this many calls (1: all)
  };

  // `store` and `engine` must outlive the service.
  ExpertService(ExpertStore* store, ComputeEngine* engine, Options options);
  ~ExpertService() override;  // finishes queued calls with UNAVAILABLE, joins threads

  grpc::ServerUnaryReactor* Compute(grpc::CallbackServerContext* context, const colibri::v1::ComputeRequest* request,
                                    colibri::v1::ComputeResponse* response) override;
  grpc::ServerUnaryReactor* GetNodeInfo(grpc::CallbackServerContext* context,
                                        const colibri::v1::GetNodeInfoRequest* request,
                                        colibri::v1::GetNodeInfoResponse* response) override;
  grpc::ServerUnaryReactor* Reload(grpc::CallbackServerContext* context, const colibri::v1::ReloadRequest* request,
                                   colibri::v1::ReloadResponse* response) override;

  // The reload both the RPC and SIGHUP use: reloads the store and records the
  // outcome (GetNodeInfo.last_reload_error, metrics). Blocks for the load.
  absl::Status ReloadNow(const std::string& model_dir, const std::optional<ShardSpec>& shard);

 private:
  void ComputeLoop();
  // Counts the call by method and status code, then finishes it.
  void Finish(grpc::ServerUnaryReactor* reactor, const char* method, const grpc::Status& status);
  void UpdateWeightGauges();

  ExpertStore* const store_;
  ComputeEngine* const engine_;
  const Options options_;

  common::Mutex mu_;
  common::CondVar cv_;  // signalled when queue_ grows or stopping_ is set
  std::deque<std::function<void(bool run)>> queue_ ABSL_GUARDED_BY(mu_);  // run=false: shutting down
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::string last_reload_error_ ABSL_GUARDED_BY(mu_);
  bool reload_running_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reload_thread_ ABSL_GUARDED_BY(mu_);  // the last reload's worker, joined before the next
  std::thread compute_thread_;
  int64_t computes_ = 0;  // compute thread only: calls run, for inject_delay_every
};

}  // namespace expert_node
}  // namespace colibri

#endif  // COLIBRI_EXPERT_NODE_EXPERT_SERVICE_H_
