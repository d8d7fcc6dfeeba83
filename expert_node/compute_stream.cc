// ExpertNode.ComputeStream: Compute calls as messages on one stream. Each
// message read becomes a ComputeCall admitted like a unary call (the same
// checks, queue, merging and inline run); its answer is queued for writing,
// one write at a time, in the order the calls finish. An answer keeps its
// call's memory reservation until it has been written, and reading pauses
// while kMaxQueuedReplies answers or kMaxQueuedReplyBytes of them wait to be
// written (a caller that does not read cannot make the node hold its answers
// without bound, nor take the whole budget with one stream). The stream finishes
// when reading has ended — the caller half-closed, the stream broke, the
// node is shutting down (CloseStreams), or a message did not parse (the
// stream then ends INVALID_ARGUMENT) —, every call read has been answered,
// and the last write is done. Messages travel raw (runtime/grpc_raw.h).

#include <algorithm>
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
#include "runtime/grpc_raw.h"
#include "runtime/grpc_status.h"

namespace colibri {
namespace expert_node {
namespace v1 = colibri::v1;

namespace {
constexpr size_t kMaxQueuedReplies = 64;
constexpr int64_t kMaxQueuedReplyBytes = int64_t{64} << 20;
// Longer timeouts are the stream's deadline (and never overflow the clock).
constexpr int64_t kMaxTimeoutMicros = int64_t{24} * 3600 * 1000000;
}  // namespace

class ExpertService::StreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  StreamReactor(ExpertService* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context), incoming_(std::make_shared<Message>()) {}

  // Starts the first read (after the service has registered the stream).
  void Begin() { StartRead(&raw_incoming_); }

  void OnReadDone(bool ok) override {
    if (!ok) {  // half-closed by the caller, or broken: no more calls
      EndReading();
      return;
    }
    if (absl::Status parsed = runtime::ParseRaw(&raw_incoming_, &incoming_->request); !parsed.ok()) {
      service_->CountCall("Compute", runtime::ToGrpcStatus(parsed));
      {
        common::MutexLock lock(&mu_);
        end_status_ = runtime::ToGrpcStatus(parsed);
      }
      EndReading();  // a call_id cannot be read from it: the stream ends once the calls before it are answered
      return;
    }
    std::shared_ptr<Message> message = std::move(incoming_);
    incoming_ = std::make_shared<Message>();
    const uint64_t id = message->request.call_id();
    bool read_on = true;
    bool duplicate = false;  // an id in flight: answered at once, not admitted
    {
      common::MutexLock lock(&mu_);
      if (reading_ended_) return;  // closing: the caller retries calls left unanswered
      if (message->request.cancel()) {
        if (auto it = in_flight_.find(id); it != in_flight_.end()) {
          it->second->cancelled.store(true, std::memory_order_relaxed);
        }
      } else {
        ++holds_;
        duplicate = !in_flight_.emplace(id, message).second;
      }
      read_paused_ = TooManyQueued();
      read_on = !read_paused_;
      if (read_on) ++holds_;  // until the next read has started: a Close meanwhile cannot finish the stream
    }
    // The next message may arrive while this one computes on this thread.
    if (read_on) {
      StartRead(&raw_incoming_);
      Release();
    }
    if (message->request.cancel()) return;
    if (duplicate) {
      return Answered(*message,
                      grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                   absl::StrCat("call_id ", id, " is already in flight on this stream")),
                      {});
    }
    auto call = std::make_shared<ComputeCall>();
    call->request = &message->request.request();
    call->response = message->reply.mutable_response();
    const int64_t timeout = message->request.timeout_micros();
    call->deadline = timeout > 0 && timeout <= kMaxTimeoutMicros
                         ? std::chrono::system_clock::now() + std::chrono::microseconds(timeout)
                         : context_->deadline();
    call->cancelled = [message, context = context_] {
      return message->cancelled.load(std::memory_order_relaxed) || context->IsCancelled();
    };
    call->answer = [this, message](const grpc::Status& status, common::MemoryBudget::Reservation held) {
      Answered(*message, status, std::move(held));
    };
    service_->Admit(std::move(call));
  }

  void OnWriteDone(bool ok) override {
    grpc::ByteBuffer* next = nullptr;
    bool resume = false;
    {
      common::MutexLock lock(&mu_);
      writing_.reset();  // and its reservation
      if (!ok) {         // the caller is gone: answers have nowhere to go
        broken_ = true;
        pending_writes_.clear();
        pending_bytes_ = 0;
      }
      if (!pending_writes_.empty()) {
        writing_ = std::move(pending_writes_.front());
        pending_writes_.pop_front();
        pending_bytes_ -= writing_->bytes;
        next = &writing_->raw;
      }
      if (read_paused_ && !reading_ended_ && !TooManyQueued()) {
        read_paused_ = false;
        resume = true;
      }
    }
    if (resume) StartRead(&raw_incoming_);
    if (next != nullptr) {
      StartWrite(next);
      return;
    }
    Release();  // the writes' hold
  }

  void OnDone() override {
    service_->streams_.Remove(this);
    delete this;
  }

  // Reads no more calls: those in flight are answered, then the stream
  // finishes. For the node's shutdown (ExpertService::CloseStreams).
  void Close() { EndReading(); }

 private:
  // A call as read, and its answer.
  struct Message {
    v1::ComputeStreamRequest request;
    v1::ComputeStreamResponse reply;
    std::atomic<bool> cancelled{false};
  };
  // An answer to write, serialized, with its call's reservation (released once written).
  struct Outgoing {
    grpc::ByteBuffer raw;
    common::MemoryBudget::Reservation held;
    int64_t bytes = 0;  // the output's
  };

  bool TooManyQueued() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return pending_writes_.size() >= kMaxQueuedReplies || pending_bytes_ >= kMaxQueuedReplyBytes;
  }

  // Drops the read loop's hold, once.
  void EndReading() {
    {
      common::MutexLock lock(&mu_);
      if (reading_ended_) return;
      reading_ended_ = true;
    }
    Release();
  }

  // A call's answer: queued for writing (or written now when no write is in
  // progress), then the call's hold is released.
  void Answered(Message& message, const grpc::Status& status, common::MemoryBudget::Reservation held) {
    auto out = std::make_unique<Outgoing>();
    {
      v1::ComputeStreamResponse reply;
      reply.Swap(&message.reply);
      reply.set_call_id(message.request.call_id());
      reply.set_code(static_cast<int32_t>(status.error_code()));
      if (!status.ok()) {
        reply.set_message(status.error_message());
        reply.clear_response();
      }
      out->bytes = static_cast<int64_t>(reply.response().output().data().size());
      if (absl::Status s = runtime::SerializeRaw(reply, &out->raw); !s.ok()) {
        v1::ComputeStreamResponse failed;
        failed.set_call_id(message.request.call_id());
        failed.set_code(static_cast<int32_t>(s.code()));
        failed.set_message(std::string(s.message()));
        (void)runtime::SerializeRaw(failed, &out->raw);
      }
    }
    out->held = std::move(held);
    grpc::ByteBuffer* start = nullptr;
    {
      common::MutexLock lock(&mu_);
      if (auto it = in_flight_.find(message.request.call_id());
          it != in_flight_.end() && it->second.get() == &message) {
        in_flight_.erase(it);
      }
      if (!broken_) {
        if (writing_ == nullptr) {
          writing_ = std::move(out);
          start = &writing_->raw;
          ++holds_;  // the writes', released by OnWriteDone when none is left
        } else {
          pending_bytes_ += out->bytes;
          pending_writes_.push_back(std::move(out));
        }
      }
    }
    if (start != nullptr) StartWrite(start);
    Release();  // the call's
  }

  // Drops a hold: the read loop's, a call's, or the writes'. The last finishes the stream.
  void Release() {
    grpc::Status status;
    {
      common::MutexLock lock(&mu_);
      if (--holds_ > 0) return;
      status = end_status_;
    }
    Finish(status);
  }

  ExpertService* const service_;
  grpc::CallbackServerContext* const context_;
  grpc::ByteBuffer raw_incoming_;      // read into, then parsed into incoming_
  std::shared_ptr<Message> incoming_;  // touched only by the read reactions, one at a time
  common::Mutex mu_;
  int holds_ ABSL_GUARDED_BY(mu_) = 1;  // the read loop, + each call in flight, + the writes
  bool reading_ended_ ABSL_GUARDED_BY(mu_) = false;
  bool read_paused_ ABSL_GUARDED_BY(mu_) = false;  // no read outstanding: too many answers queued
  std::map<uint64_t, std::shared_ptr<Message>> in_flight_ ABSL_GUARDED_BY(mu_);
  // The reply being written (set until OnWriteDone), and those waiting for it.
  std::unique_ptr<Outgoing> writing_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<Outgoing>> pending_writes_ ABSL_GUARDED_BY(mu_);
  int64_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // their outputs' bytes
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status end_status_ ABSL_GUARDED_BY(mu_);  // OK, or why reading ended early
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ExpertService::ComputeStream(
    grpc::CallbackServerContext* context) {
  auto* reactor = new StreamReactor(this, context);
  // After Begin (or Close) the stream may finish and be deleted at any time: nothing touches it after.
  if (streams_.Add(reactor)) {
    reactor->Begin();
  } else {
    reactor->Close();  // the node is shutting down: finished without reading
  }
  return reactor;
}

void ExpertService::CloseStreams() { streams_.CloseAll(); }

}  // namespace expert_node
}  // namespace colibri
