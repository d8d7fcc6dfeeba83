#include "router_node/node_stream.h"

#include <grpc/support/time.h>
#include <grpcpp/alarm.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "common/mutex.h"
#include "runtime/grpc_status.h"

namespace colibri {
namespace router_node {

namespace v1 = colibri::v1;

// The channel keeps its calls' deadlines on the monotonic clock: converted
// once from the context's wall-clock deadline when a call is sent, as gRPC
// does for a unary call, so a step of the wall clock moves no deadline.
using SteadyTime = std::chrono::steady_clock::time_point;
constexpr SteadyTime kNoDeadline = SteadyTime::max();

struct StreamNodeChannel::State {
  State(const std::shared_ptr<grpc::Channel>& channel, int64_t max_bytes)
      : unary(channel), stub(v1::ExpertNode::NewStub(channel)), max_stream_bytes(max_bytes) {}

  // A call sent on a stream and not ended yet.
  struct Pending {
    grpc::ClientContext* context = nullptr;
    const v1::ComputeRequest* request = nullptr;
    v1::ComputeResponse* response = nullptr;
    Done done;
    Stream* stream = nullptr;  // the stream it was sent on (alive while the call is pending)
    SteadyTime deadline;
  };

  // Takes a call out of `pending`: the one who does ends it.
  std::optional<Pending> Take(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = pending.find(id);
    if (it == pending.end()) return std::nullopt;
    std::optional<Pending> p(std::move(it->second));
    pending.erase(it);
    return p;
  }

  GrpcNodeChannel unary;
  const std::unique_ptr<v1::ExpertNode::Stub> stub;
  const int64_t max_stream_bytes;

  common::Mutex mu;
  std::map<uint64_t, Pending> pending ABSL_GUARDED_BY(mu);
  Stream* stream ABSL_GUARDED_BY(mu) = nullptr;  // the open stream, if any; holds a reference to it
  bool refused ABSL_GUARDED_BY(mu) = false;      // the node has no ComputeStream: unary calls only
  uint64_t next_id ABSL_GUARDED_BY(mu) = 1;
  // One alarm, for the soonest deadline of the pending calls: a gRPC alarm
  // per call would cost a hand-over to gRPC's executor thread per call when
  // cancelled. `armed` is the deadline it is set for (max: none), and
  // `generation` names the latest one set; an older one that fires does nothing.
  std::unique_ptr<grpc::Alarm> alarm ABSL_GUARDED_BY(mu);
  SteadyTime armed ABSL_GUARDED_BY(mu) = kNoDeadline;
  uint64_t generation ABSL_GUARDED_BY(mu) = 0;
};

// How long a stream whose read failed waits for its status before it is cancelled.
constexpr auto kCancelAfterFailedRead = std::chrono::milliseconds(200);

// One ComputeStream. Writes come from any thread, one at a time (a queue
// behind the one in progress). A hold keeps the stream open for them until
// it has ended (a read or write failed) with no write in progress. Deleted
// when gRPC (OnDone), the State (its `stream` pointer) and a cancel alarm
// set by a failed read (its callback) have all let go.
class StreamNodeChannel::Stream final
    : public grpc::ClientBidiReactor<v1::ComputeStreamRequest, v1::ComputeStreamResponse> {
 public:
  // Binds the call; Start() starts it. REQUIRES: the State's lock held.
  explicit Stream(std::shared_ptr<State> state) : state_(std::move(state)) {
    state_->stub->async()->ComputeStream(&context_, this);
  }

  void Start() {
    StartRead(&incoming_);
    AddHold();
    StartCall();
  }

  // Queues a message (a call's, with its deadline, or a cancel); returns it
  // when the caller is to write it now (outside the lock, with Write). A
  // stream that has ended drops it. REQUIRES, here and in Drop: the State's
  // lock held (a comment: the analysis cannot see that the caller's State is
  // this stream's).
  v1::ComputeStreamRequest* Enqueue(std::unique_ptr<v1::ComputeStreamRequest> message,
                                    SteadyTime deadline) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (ended_) return nullptr;
    if (writing_ != nullptr) {
      queued_.push_back({std::move(message), deadline});
      return nullptr;
    }
    return StartWriting({std::move(message), deadline});
  }
  // Takes a call's message out of the queue if it has not been written: true
  // when it was there (the node never hears of the call).
  bool Drop(uint64_t call_id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    auto it = std::find_if(queued_.begin(), queued_.end(), [call_id](const Outgoing& o) {
      return o.message->call_id() == call_id && !o.message->cancel();
    });
    if (it == queued_.end()) return false;
    queued_.erase(it);
    return true;
  }
  void Write(v1::ComputeStreamRequest* message) { StartWrite(message); }

  void Cancel() { context_.TryCancel(); }
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  void OnWriteDone(bool ok) override {
    v1::ComputeStreamRequest* next = nullptr;
    bool release = false;
    bool unref = false;
    {
      common::MutexLock lock(&state_->mu);
      writing_.reset();
      if (!ok) unref = EndLocked();
      if (!ended_ && !queued_.empty()) {
        next = StartWriting(std::move(queued_.front()));
        queued_.pop_front();
      } else {
        release = ReleaseLocked();
      }
    }
    if (next != nullptr) StartWrite(next);
    if (release) RemoveHold();
    if (unref) Unref();  // not the last: gRPC's reference stays until OnDone
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // The read fails when the stream ends, and when a reply could not be
      // parsed, which does not end the RPC: then it must be cancelled, so
      // that OnDone follows and ends the calls on it. Not at once: a cancel
      // would overtake the status of a stream that is ending (a node without
      // ComputeStream answers UNIMPLEMENTED, which turns its calls into unary
      // ones), so the cancel waits a moment for OnDone, which stops it.
      bool release = false;
      bool unref = false;
      {
        common::MutexLock lock(&state_->mu);
        cancel_armed_ = true;
        refs_.fetch_add(1, std::memory_order_relaxed);  // the alarm's
        cancel_alarm_.Set(std::chrono::system_clock::now() + kCancelAfterFailedRead, [this](bool fired) {
          if (fired) context_.TryCancel();
          Unref();
        });
        unref = EndLocked();
        if (writing_ == nullptr) release = ReleaseLocked();
      }
      if (release) RemoveHold();
      if (unref) Unref();
      return;
    }
    v1::ComputeStreamResponse reply;
    reply.Swap(&incoming_);
    StartRead(&incoming_);
    std::optional<State::Pending> call;
    {
      common::MutexLock lock(&state_->mu);
      call = state_->Take(reply.call_id());
    }
    if (!call.has_value()) return;  // ended already: its deadline passed, or it was cancelled
    if (reply.code() != 0) {
      call->done(grpc::Status(runtime::StatusCodeFromWire(reply.code()), reply.message()));
      return;
    }
    call->response->Swap(reply.mutable_response());
    call->done(grpc::Status::OK);
  }

  void OnDone(const grpc::Status& status) override {
    std::vector<State::Pending> orphans;
    bool refused = false;
    bool unref = false;
    bool stop_alarm = false;
    {
      common::MutexLock lock(&state_->mu);
      stop_alarm = cancel_armed_;
      unref = EndLocked();
      if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED) state_->refused = true;
      refused = state_->refused;
      for (auto it = state_->pending.begin(); it != state_->pending.end();) {
        if (it->second.stream == this) {
          orphans.push_back(std::move(it->second));
          it = state_->pending.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (State::Pending& call : orphans) {
      if (refused) {
        state_->unary.Compute(call.context, call.request, call.response, std::move(call.done));
      } else {
        call.done(grpc::Status(
            grpc::StatusCode::UNAVAILABLE,
            absl::StrCat("the stream to the expert node ended before the answer (", status.error_message(), ")")));
      }
    }
    if (stop_alarm) cancel_alarm_.Cancel();  // its callback drops its reference
    if (unref) Unref();
    Unref();  // gRPC's
  }

 private:
  // A message waiting to be written, and the deadline of its call (max: none).
  struct Outgoing {
    std::unique_ptr<v1::ComputeStreamRequest> message;
    SteadyTime deadline;
  };

  // The message to write now, its timeout counted from now: the node counts
  // it from when it reads the message, so time spent queued here is not added.
  v1::ComputeStreamRequest* StartWriting(Outgoing o) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (o.deadline != kNoDeadline) {
      const int64_t left =
          std::chrono::duration_cast<std::chrono::microseconds>(o.deadline - std::chrono::steady_clock::now()).count();
      o.message->set_timeout_micros(std::max<int64_t>(1, left));
    }
    writing_ = std::move(o.message);
    return writing_.get();
  }

  // Marks the stream ended (no more writes) and detaches it from the State;
  // true when the caller is to drop the State's reference.
  bool EndLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    ended_ = true;
    queued_.clear();
    if (state_->stream != this) return false;
    state_->stream = nullptr;
    return true;
  }
  // True the first time it is called after the stream ended with no write in progress.
  bool ReleaseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    if (!ended_ || writing_ != nullptr || released_) return false;
    released_ = true;
    return true;
  }

  const std::shared_ptr<State> state_;
  grpc::ClientContext context_;
  v1::ComputeStreamResponse incoming_;  // touched only by the read reactions, one at a time
  std::atomic<int> refs_{2};            // gRPC's and the State's, + cancel_alarm_'s while it is set
  std::unique_ptr<v1::ComputeStreamRequest> writing_ ABSL_GUARDED_BY(state_->mu);
  std::deque<Outgoing> queued_ ABSL_GUARDED_BY(state_->mu);
  bool ended_ ABSL_GUARDED_BY(state_->mu) = false;
  bool released_ ABSL_GUARDED_BY(state_->mu) = false;
  grpc::Alarm cancel_alarm_;                               // OnReadDone(false)'s cancel, set at most once
  bool cancel_armed_ ABSL_GUARDED_BY(state_->mu) = false;  // cancel_alarm_ is set
};

namespace {

// Ends a pending call with `status` and tells the node to drop it.
void EndCall(const std::shared_ptr<StreamNodeChannel::State>& state, std::optional<uint64_t> id,
             grpc::ClientContext* context, const grpc::Status& status) {
  std::optional<StreamNodeChannel::State::Pending> call;
  StreamNodeChannel::Stream* stream = nullptr;
  v1::ComputeStreamRequest* to_write = nullptr;
  {
    common::MutexLock lock(&state->mu);
    if (!id.has_value()) {
      for (const auto& [pending_id, p] : state->pending) {
        if (p.context == context) id = pending_id;
      }
    }
    if (id.has_value()) call = state->Take(*id);
    if (call.has_value() && !call->stream->Drop(*id)) {  // sent (or being sent): the node is told
      auto cancel = std::make_unique<v1::ComputeStreamRequest>();
      cancel->set_call_id(*id);
      cancel->set_cancel(true);
      stream = call->stream;  // alive: the call was pending on it
      to_write = stream->Enqueue(std::move(cancel), kNoDeadline);
    }
  }
  if (!call.has_value()) {
    if (context != nullptr) state->unary.Cancel(context);  // a unary call, or one that has ended
    return;
  }
  if (to_write != nullptr) stream->Write(to_write);  // the write's hold keeps the stream
  call->done(status);
}

void OnAlarm(const std::shared_ptr<StreamNodeChannel::State>& state, uint64_t generation);

// Sets the alarm for `deadline` as generation `generation`, unless a later
// generation has been set meanwhile. Outside the lock: setting and
// destroying an alarm may run gRPC code that ends in its callback.
void Arm(const std::shared_ptr<StreamNodeChannel::State>& state, SteadyTime deadline, uint64_t generation) {
  const int64_t left =
      std::chrono::duration_cast<std::chrono::microseconds>(deadline - std::chrono::steady_clock::now()).count();
  const gpr_timespec when =
      gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_micros(std::max<int64_t>(0, left), GPR_TIMESPAN));
  auto alarm = std::make_unique<grpc::Alarm>();
  alarm->Set(when, [weak = std::weak_ptr<StreamNodeChannel::State>(state), generation](bool fired) {
    if (!fired) return;  // replaced by a sooner one, or the channel is gone
    if (std::shared_ptr<StreamNodeChannel::State> s = weak.lock()) OnAlarm(s, generation);
  });
  {
    common::MutexLock lock(&state->mu);
    if (state->generation == generation) std::swap(alarm, state->alarm);
  }
  // `alarm` (a replaced or outdated one) is destroyed here, cancelled if it had not fired.
}

// The soonest deadline has come: ends the calls past theirs
// DEADLINE_EXCEEDED and sets the alarm for the next.
void OnAlarm(const std::shared_ptr<StreamNodeChannel::State>& state, uint64_t generation) {
  // gRPC's monotonic clock is not std::chrono's: a call due within the next
  // millisecond is taken as due, so the alarm never fires in a loop.
  const SteadyTime due = std::chrono::steady_clock::now() + std::chrono::milliseconds(1);
  std::vector<uint64_t> expired;
  std::optional<uint64_t> next_generation;
  SteadyTime next = kNoDeadline;
  {
    common::MutexLock lock(&state->mu);
    if (generation != state->generation) return;  // a sooner alarm is set
    for (const auto& [id, p] : state->pending) {
      if (p.deadline <= due) {
        expired.push_back(id);
      } else {
        next = std::min(next, p.deadline);
      }
    }
    state->armed = next;
    if (next != kNoDeadline) next_generation = ++state->generation;
  }
  if (next_generation.has_value()) Arm(state, next, *next_generation);
  for (uint64_t id : expired) {
    EndCall(state, id, nullptr, grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "Deadline Exceeded"));
  }
}

}  // namespace

StreamNodeChannel::StreamNodeChannel(std::shared_ptr<grpc::Channel> channel, int64_t max_stream_bytes)
    : state_(std::make_shared<State>(channel, max_stream_bytes)) {}

StreamNodeChannel::~StreamNodeChannel() {
  Stream* stream = nullptr;
  {
    common::MutexLock lock(&state_->mu);
    std::swap(stream, state_->stream);
  }
  if (stream != nullptr) {
    stream->Cancel();
    stream->Unref();
  }
}

void StreamNodeChannel::Compute(grpc::ClientContext* context, const v1::ComputeRequest* request,
                                v1::ComputeResponse* response, Done done) {
  State& st = *state_;
  if (static_cast<int64_t>(request->ByteSizeLong()) > st.max_stream_bytes) {
    st.unary.Compute(context, request, response, std::move(done));
    return;
  }
  SteadyTime deadline = kNoDeadline;
  if (context->deadline() != std::chrono::system_clock::time_point::max()) {
    const auto left = context->deadline() - std::chrono::system_clock::now();
    if (left <= std::chrono::system_clock::duration::zero()) {
      done(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "the deadline passed before the call was sent"));
      return;
    }
    // Capped at ten years: a far deadline does not overflow the clock.
    constexpr auto kFar = std::chrono::hours(24 * 365 * 10);
    deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                      std::min<std::chrono::nanoseconds>(left, kFar));
  }
  auto message = std::make_unique<v1::ComputeStreamRequest>();
  *message->mutable_request() = *request;
  Stream* stream = nullptr;
  Stream* started = nullptr;
  v1::ComputeStreamRequest* to_write = nullptr;
  uint64_t id = 0;
  std::optional<uint64_t> arm;
  {
    common::MutexLock lock(&st.mu);
    if (!st.refused) {
      if (st.stream == nullptr) st.stream = started = new Stream(state_);
      stream = st.stream;
      id = st.next_id++;
      message->set_call_id(id);
      st.pending.emplace(id, State::Pending{context, request, response, std::move(done), stream, deadline});
      to_write = stream->Enqueue(std::move(message), deadline);
      if (deadline < st.armed) {
        st.armed = deadline;
        arm = ++st.generation;
      }
    }
  }
  if (stream == nullptr) {  // the node refused streams
    st.unary.Compute(context, request, response, std::move(done));
    return;
  }
  if (started != nullptr) started->Start();
  if (to_write != nullptr) stream->Write(to_write);
  if (arm.has_value()) Arm(state_, deadline, *arm);
}

void StreamNodeChannel::ResetBackoff() { state_->unary.ResetBackoff(); }

void StreamNodeChannel::GetNodeInfo(grpc::ClientContext* context, const v1::GetNodeInfoRequest* request,
                                    v1::GetNodeInfoResponse* response, Done done) {
  state_->unary.GetNodeInfo(context, request, response, std::move(done));
}

void StreamNodeChannel::Cancel(grpc::ClientContext* context) {
  EndCall(state_, std::nullopt, context, grpc::Status(grpc::StatusCode::CANCELLED, "Cancelled"));
}

}  // namespace router_node
}  // namespace colibri
