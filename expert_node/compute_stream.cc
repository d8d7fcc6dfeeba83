// ExpertNode.ComputeStream: Compute calls as messages on one stream. Each
// message read becomes a ComputeCall admitted like a unary call (the same
// checks, queue, merging and inline run); its answer is queued for writing,
// one write at a time, in the order the calls finish. The stream finishes
// when the caller has half-closed (or the stream broke), every call read has
// been answered, and the last write is done.

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "common/mutex.h"
#include "expert_node/compute_call.h"
#include "expert_node/expert_service.h"

namespace colibri {
namespace expert_node {
namespace v1 = colibri::v1;

class ExpertService::StreamReactor final
    : public grpc::ServerBidiReactor<v1::ComputeStreamRequest, v1::ComputeStreamResponse> {
 public:
  StreamReactor(ExpertService* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context), incoming_(std::make_shared<Message>()) {
    StartRead(&incoming_->request);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // half-closed by the caller, or broken: no more calls
      Release();
      return;
    }
    std::shared_ptr<Message> message = std::move(incoming_);
    incoming_ = std::make_shared<Message>();
    if (message->request.cancel()) {
      CancelCall(message->request.call_id());
      StartRead(&incoming_->request);
      return;
    }
    auto call = std::make_shared<ComputeCall>();
    call->request = &message->request.request();
    call->response = message->reply.mutable_response();
    call->deadline =
        message->request.timeout_micros() > 0
            ? std::chrono::system_clock::now() + std::chrono::microseconds(message->request.timeout_micros())
            : context_->deadline();
    call->cancelled = [message, context = context_] {
      return message->cancelled.load(std::memory_order_relaxed) || context->IsCancelled();
    };
    call->answer = [this, message](const grpc::Status& status) { Answered(*message, status); };
    {
      common::MutexLock lock(&mu_);
      ++holds_;
      in_flight_[message->request.call_id()] = message;
    }
    // The next message may arrive while this one computes on this thread.
    StartRead(&incoming_->request);
    service_->Admit(std::move(call));
  }

  void OnWriteDone(bool ok) override {
    v1::ComputeStreamResponse* next = nullptr;
    {
      common::MutexLock lock(&mu_);
      writing_.reset();
      if (!ok) {  // the caller is gone: answers have nowhere to go
        broken_ = true;
        pending_writes_.clear();
      }
      if (!pending_writes_.empty()) {
        writing_ = std::move(pending_writes_.front());
        pending_writes_.pop_front();
        next = writing_.get();
      }
    }
    if (next != nullptr) {
      StartWrite(next);
      return;
    }
    Release();  // the writes' hold
  }

  void OnDone() override { delete this; }

 private:
  // A call as read, and its answer.
  struct Message {
    v1::ComputeStreamRequest request;
    v1::ComputeStreamResponse reply;
    std::atomic<bool> cancelled{false};
  };

  void CancelCall(uint64_t call_id) {
    common::MutexLock lock(&mu_);
    if (auto it = in_flight_.find(call_id); it != in_flight_.end()) {
      it->second->cancelled.store(true, std::memory_order_relaxed);
    }
  }

  // A call's answer: queued for writing (or written now when no write is in
  // progress), then the call's hold is released.
  void Answered(Message& message, const grpc::Status& status) {
    auto reply = std::make_unique<v1::ComputeStreamResponse>();
    reply->Swap(&message.reply);
    reply->set_call_id(message.request.call_id());
    reply->set_code(static_cast<int32_t>(status.error_code()));
    if (!status.ok()) {
      reply->set_message(status.error_message());
      reply->clear_response();
    }
    v1::ComputeStreamResponse* start = nullptr;
    {
      common::MutexLock lock(&mu_);
      in_flight_.erase(message.request.call_id());
      if (!broken_) {
        if (writing_ == nullptr) {
          writing_ = std::move(reply);
          start = writing_.get();
          ++holds_;  // the writes', released by OnWriteDone when none is left
        } else {
          pending_writes_.push_back(std::move(reply));
        }
      }
    }
    if (start != nullptr) StartWrite(start);
    Release();  // the call's
  }

  // Drops a hold: the read loop's, a call's, or the writes'. The last finishes the stream.
  void Release() {
    {
      common::MutexLock lock(&mu_);
      if (--holds_ > 0) return;
    }
    Finish(grpc::Status::OK);
  }

  ExpertService* const service_;
  grpc::CallbackServerContext* const context_;
  std::shared_ptr<Message> incoming_;  // touched only by the read reactions, one at a time
  common::Mutex mu_;
  int holds_ ABSL_GUARDED_BY(mu_) = 1;  // the read loop, + each call in flight, + the writes
  std::map<uint64_t, std::shared_ptr<Message>> in_flight_ ABSL_GUARDED_BY(mu_);
  // The reply being written (set until OnWriteDone), and those waiting for it.
  std::unique_ptr<v1::ComputeStreamResponse> writing_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<v1::ComputeStreamResponse>> pending_writes_ ABSL_GUARDED_BY(mu_);
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
};

grpc::ServerBidiReactor<v1::ComputeStreamRequest, v1::ComputeStreamResponse>* ExpertService::ComputeStream(
    grpc::CallbackServerContext* context) {
  return new StreamReactor(this, context);
}

}  // namespace expert_node
}  // namespace colibri
