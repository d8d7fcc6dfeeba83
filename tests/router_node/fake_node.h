#ifndef COLIBRI_TESTS_ROUTER_NODE_FAKE_NODE_H_
#define COLIBRI_TESTS_ROUTER_NODE_FAKE_NODE_H_

// In-process stand-ins for the remote backend's two seams: a clock that
// moves only when the test says, and an expert node whose replies the test
// scripts. Together they drive retries, hedging and deadlines without a
// process, a socket or a sleep.

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "router_node/node_channel.h"

namespace colibri {
namespace testing {

// Now() moves only in Advance, which runs the timers that come due, in time
// order, on the calling thread.
class FakeClock final : public common::Clock {
 public:
  absl::Time Now() override {
    common::MutexLock lock(&mu_);
    return now_;
  }

  std::unique_ptr<Timer> At(absl::Time at, std::function<void()> fn) override {
    common::MutexLock lock(&mu_);
    const int64_t id = next_id_++;
    timers_.emplace(std::make_pair(at, id), std::move(fn));
    return std::make_unique<Handle>(this, std::make_pair(at, id));
  }

  void Advance(absl::Duration d) {
    absl::Time until;
    {
      common::MutexLock lock(&mu_);
      until = now_ + d;
    }
    for (;;) {
      std::function<void()> fn;
      {
        common::MutexLock lock(&mu_);
        if (timers_.empty() || timers_.begin()->first.first > until) {
          now_ = until;
          return;
        }
        now_ = std::max(now_, timers_.begin()->first.first);
        fn = std::move(timers_.begin()->second);
        timers_.erase(timers_.begin());
      }
      fn();
    }
  }

 private:
  using Key = std::pair<absl::Time, int64_t>;
  class Handle final : public Timer {
   public:
    Handle(FakeClock* clock, Key key) : clock_(clock), key_(key) {}
    ~Handle() override {
      common::MutexLock lock(&clock_->mu_);
      clock_->timers_.erase(key_);
    }

   private:
    FakeClock* const clock_;
    const Key key_;
  };

  common::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_) = absl::FromUnixSeconds(1000000);
  std::map<Key, std::function<void()>> timers_ ABSL_GUARDED_BY(mu_);
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
};

// An expert node that owns experts of layer 0 and answers Compute calls as
// scripted: each call takes the next reply of the script (kAnswer once the
// script is empty). An answer has, for each requested expert and row,
// d_model values of `marker * 100 + expert`: tests read who answered which
// slot. A hanging call ends when cancelled (CANCELLED), when the clock passes
// its deadline (DEADLINE_EXCEEDED), or when the test releases it.
class FakeNode {
 public:
  enum Kind { kAnswer, kFail, kHang, kWrongShape };
  struct Reply {
    Kind kind = kAnswer;
    grpc::StatusCode code = grpc::StatusCode::OK;  // kFail
  };

  FakeNode(FakeClock* clock, int marker, std::vector<int> experts, std::string model_id, int d_model, int n_experts)
      : clock_(clock),
        marker_(marker),
        experts_(std::move(experts)),
        model_id_(std::move(model_id)),
        d_model_(d_model),
        n_experts_(n_experts) {}

  void Script(std::vector<Reply> replies) {
    common::MutexLock lock(&mu_);
    script_.assign(replies.begin(), replies.end());
  }
  int calls() {
    common::MutexLock lock(&mu_);
    return calls_;
  }
  int cancelled() {
    common::MutexLock lock(&mu_);
    return cancelled_;
  }
  int hanging() {
    common::MutexLock lock(&mu_);
    return static_cast<int>(hung_.size());
  }
  // Answers every hanging call (on this thread).
  void ReleaseAll() {
    std::vector<std::unique_ptr<Pending>> hung;
    {
      common::MutexLock lock(&mu_);
      for (auto& [context, p] : hung_) hung.push_back(std::move(p));
      hung_.clear();
    }
    for (auto& p : hung) {
      Answer(*p->request, p->response, false);
      p->done(grpc::Status::OK);
    }
  }

  // Holds the GetNodeInfo calls that come from now on, until ReleaseInfo
  // answers them (on its thread).
  void HoldInfo() {
    common::MutexLock lock(&mu_);
    hold_info_ = true;
  }
  // GetNodeInfo answers `code` from now on (OK: the node's info).
  void FailInfo(grpc::StatusCode code) {
    common::MutexLock lock(&mu_);
    info_code_ = code;
  }
  // The kernel choices GetNodeInfo reports from now on.
  void SetKernelProfile(std::string choices) {
    common::MutexLock lock(&mu_);
    kernel_profile_ = std::move(choices);
  }
  // The size limits GetNodeInfo reports from now on (0: none), which the
  // node's Compute enforces as a real node does: RESOURCE_EXHAUSTED beyond.
  void SetLimits(int64_t max_rows, int64_t max_row_indices) {
    common::MutexLock lock(&mu_);
    max_rows_ = max_rows;
    max_row_indices_ = max_row_indices;
  }
  // Every Compute request received, in order.
  std::vector<colibri::v1::ComputeRequest> requests() {
    common::MutexLock lock(&mu_);
    return requests_;
  }
  // Times the backend asked this node's channel to connect at once.
  int backoff_resets() {
    common::MutexLock lock(&mu_);
    return backoff_resets_;
  }
  int held_info() {
    common::MutexLock lock(&mu_);
    return static_cast<int>(held_info_.size());
  }
  void ReleaseInfo() {
    std::vector<std::pair<colibri::v1::GetNodeInfoResponse*, router_node::NodeChannel::Done>> held;
    {
      common::MutexLock lock(&mu_);
      hold_info_ = false;
      held.swap(held_info_);
    }
    for (auto& [response, done] : held) {
      Info(response);
      done(grpc::Status::OK);
    }
  }

  // A NodeChannel onto this node (the backend owns it; the node outlives it).
  std::unique_ptr<router_node::NodeChannel> Channel() { return std::make_unique<ChannelImpl>(this); }

 private:
  struct Pending {
    const colibri::v1::ComputeRequest* request;
    colibri::v1::ComputeResponse* response;
    router_node::NodeChannel::Done done;
    std::unique_ptr<common::Clock::Timer> deadline;
  };

  class ChannelImpl final : public router_node::NodeChannel {
   public:
    explicit ChannelImpl(FakeNode* node) : node_(node) {}
    void Compute(grpc::ClientContext* context, const colibri::v1::ComputeRequest* request,
                 colibri::v1::ComputeResponse* response, Done done) override {
      node_->Compute(context, request, response, std::move(done));
    }
    void GetNodeInfo(grpc::ClientContext*, const colibri::v1::GetNodeInfoRequest*,
                     colibri::v1::GetNodeInfoResponse* response, Done done) override {
      grpc::StatusCode code = grpc::StatusCode::OK;
      {
        common::MutexLock lock(&node_->mu_);
        if (node_->hold_info_) {
          node_->held_info_.emplace_back(response, std::move(done));
          return;
        }
        code = node_->info_code_;
      }
      if (code != grpc::StatusCode::OK) return done(grpc::Status(code, "scripted probe failure"));
      node_->Info(response);
      done(grpc::Status::OK);
    }
    void Cancel(grpc::ClientContext* context) override { node_->Cancel(context); }
    void ResetBackoff() override {
      common::MutexLock lock(&node_->mu_);
      ++node_->backoff_resets_;
    }

   private:
    FakeNode* const node_;
  };

  void Info(colibri::v1::GetNodeInfoResponse* r) {
    {
      common::MutexLock lock(&mu_);
      r->set_kernel_profile(kernel_profile_);
      r->set_max_rows(max_rows_);
      r->set_max_row_indices(max_row_indices_);
    }
    r->set_model_id(model_id_);
    r->set_state(colibri::v1::LOAD_STATE_READY);
    r->set_d_model(d_model_);
    r->set_n_layers(1);
    r->set_n_experts(n_experts_);
    colibri::v1::OwnedExperts* o = r->add_owned();
    o->set_layer(0);
    for (const int e : experts_) o->add_experts(e);
  }

  // Per entry (expert, row index) the value marker * 100 + expert; grouped
  // requests get each output row's entries summed (in any order: the values
  // are small integers, so every order gives the same float).
  void Answer(const colibri::v1::ComputeRequest& request, colibri::v1::ComputeResponse* response, bool wrong) const {
    std::vector<float> entries;
    std::vector<float> grouped(request.num_output_rows(), 0.f);
    for (const auto& w : request.experts()) {
      for (int i = 0; i < w.row_indices_size(); ++i) {
        const float v = static_cast<float>(marker_ * 100 + w.expert());
        entries.push_back(v);
        if (request.num_output_rows() > 0) grouped[w.output_rows(i)] += v;
      }
    }
    std::vector<float>& per_row = request.num_output_rows() > 0 ? grouped : entries;
    if (wrong) per_row.push_back(0.f);
    const bool bf16 = request.output_dtype() == colibri::v1::DATA_TYPE_BF16;
    colibri::v1::Tensor* t = response->mutable_output();
    t->set_dtype(bf16 ? colibri::v1::DATA_TYPE_BF16 : colibri::v1::DATA_TYPE_F32);
    t->add_shape(static_cast<int64_t>(per_row.size()));
    t->add_shape(d_model_);
    std::string* data = t->mutable_data();
    for (const float v : per_row) {
      for (int c = 0; c < d_model_; ++c) {
        uint32_t bits;
        std::memcpy(&bits, &v, 4);
        if (bf16) {
          const uint16_t h = static_cast<uint16_t>(bits >> 16);  // exact: the values are small integers
          data->append(reinterpret_cast<const char*>(&h), 2);
        } else {
          data->append(reinterpret_cast<const char*>(&bits), 4);
        }
      }
    }
  }

  void Compute(grpc::ClientContext* context, const colibri::v1::ComputeRequest* request,
               colibri::v1::ComputeResponse* response, router_node::NodeChannel::Done done) {
    Reply reply;
    {
      common::MutexLock lock(&mu_);
      ++calls_;
      requests_.push_back(*request);
      int64_t indices = 0;
      for (const auto& w : request->experts()) indices += w.row_indices_size();
      const int64_t reply_rows = request->per_expert_output() ? indices : request->num_output_rows();
      auto over = [](int64_t n, int64_t limit) { return limit > 0 && n > limit; };
      if (over(request->rows().shape(0), max_rows_) || over(reply_rows, max_rows_) || over(indices, max_row_indices_)) {
        reply = {kFail, grpc::StatusCode::RESOURCE_EXHAUSTED};
      } else if (!script_.empty()) {
        reply = script_.front();
        script_.pop_front();
      }
      if (cancel_early_.erase(context) > 0) {
        ++cancelled_;
        reply = {kFail, grpc::StatusCode::CANCELLED};
      } else if (reply.kind == kHang) {
        auto p = std::make_unique<Pending>();
        p->request = request;
        p->response = response;
        p->done = std::move(done);
        // The deadline timer fires inside FakeClock::Advance, after this returns.
        p->deadline = clock_->At(absl::FromChrono(context->deadline()), [this, context] {
          Finish(context, grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "Deadline Exceeded"));
        });
        hung_[context] = std::move(p);
        return;
      }
    }
    if (reply.kind == kFail) return done(grpc::Status(reply.code, "scripted failure"));
    Answer(*request, response, reply.kind == kWrongShape);
    done(grpc::Status::OK);
  }

  void Cancel(grpc::ClientContext* context) {
    {
      common::MutexLock lock(&mu_);
      if (hung_.count(context) == 0) {
        cancel_early_.insert(context);  // not started yet (or ended: then never looked up again)
        return;
      }
      ++cancelled_;
    }
    Finish(context, grpc::Status(grpc::StatusCode::CANCELLED, "Cancelled"));
  }

  // Ends a hanging call with `status`.
  void Finish(grpc::ClientContext* context, grpc::Status status) {
    std::unique_ptr<Pending> p;
    {
      common::MutexLock lock(&mu_);
      auto it = hung_.find(context);
      if (it == hung_.end()) return;
      p = std::move(it->second);
      hung_.erase(it);
    }
    router_node::NodeChannel::Done done = std::move(p->done);
    p.reset();  // its deadline timer too (this may be that timer's function: Clock allows it)
    done(std::move(status));
  }

  FakeClock* const clock_;
  const int marker_;
  const std::vector<int> experts_;
  const std::string model_id_;
  const int d_model_;
  const int n_experts_;

  common::Mutex mu_;
  std::deque<Reply> script_ ABSL_GUARDED_BY(mu_);
  std::map<grpc::ClientContext*, std::unique_ptr<Pending>> hung_ ABSL_GUARDED_BY(mu_);
  std::set<grpc::ClientContext*> cancel_early_ ABSL_GUARDED_BY(mu_);
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
  int cancelled_ ABSL_GUARDED_BY(mu_) = 0;
  bool hold_info_ ABSL_GUARDED_BY(mu_) = false;
  grpc::StatusCode info_code_ ABSL_GUARDED_BY(mu_) = grpc::StatusCode::OK;
  std::string kernel_profile_ ABSL_GUARDED_BY(mu_) = "isa test";
  int backoff_resets_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t max_rows_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t max_row_indices_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<colibri::v1::ComputeRequest> requests_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<colibri::v1::GetNodeInfoResponse*, router_node::NodeChannel::Done>> held_info_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace testing
}  // namespace colibri

#endif  // COLIBRI_TESTS_ROUTER_NODE_FAKE_NODE_H_
