// RemoteBackend::ComputeAsync: one layer's node calls — plan, send (all in
// flight at once, but for the pieces of a node's share over its size limits,
// which go one after another), hedge slow calls, retry failed ones once on other
// replicas, scatter the per-expert rows to their slots — as a Dispatch
// driven by what happens to it: node replies, the hedge timer, the client's
// cancellation, each on the thread that delivers it. Nothing waits; the
// layer's `done` runs on the thread of the reply that settles it. The node
// set and health checks are in remote_backend.cc.

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "common/mutex.h"
#include "router_node/remote_backend.h"
#include "router_node/remote_backend_internal.h"

namespace colibri {
namespace router_node {
namespace {

bool Retriable(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::CANCELLED:  // not by us (checked first): e.g. the node shutting down
    case grpc::StatusCode::DATA_LOSS:  // that node's weight file changed under it; a replica may be intact
      return true;
    default: return false;
  }
}

// Codes gRPC's client raises itself (connection failures, deadlines), whose
// messages name the peer's resolved address.
bool TransportCode(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED;
}

const char* TransportCodeText(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAVAILABLE ? "unavailable (not reachable, or shutting down)" : "deadline exceeded";
}

using Call = RemoteBackend::Call;

// The request of one node call: the distinct rows its experts need, each once,
// and per expert the positions of its rows in that list; with grouped
// replies, per entry its reply row and rank (docs/ROUTER.md, "Node replies").
void BuildRequest(const LayerWork& work, const std::vector<ExpertWork>& experts, int64_t d_model,
                  const std::string& model_id, NodeReplies replies, Call* call) {
  v1::ComputeRequest& req = call->request;
  req.set_layer(work.layer);
  req.set_model_id(model_id);
  req.set_request_id(work.request_id);
  std::vector<int32_t> position(work.num_tokens, -1);
  std::vector<int32_t> rows;
  // The request's entries: one per expert, of its works in the plan (parts
  // of one expert split among replicas may meet again on one node, in a retry).
  std::vector<std::vector<int>> entries;
  for (const int w : call->plan.works) {
    if (entries.empty() || experts[entries.back()[0]].expert != experts[w].expert) entries.emplace_back();
    entries.back().push_back(w);
    for (const int32_t r : experts[w].rows) {
      if (position[r] < 0) {
        position[r] = static_cast<int32_t>(rows.size());
        rows.push_back(r);
      }
    }
  }
  // Rows in the client's dtype when it sent bf16 (the node widens them to the
  // same f32 values), else f32.
  v1::Tensor* t = req.mutable_rows();
  const bool bf16 = work.x_bf16 != nullptr;
  const size_t row_bytes = d_model * (bf16 ? sizeof(uint16_t) : sizeof(float));
  t->set_dtype(bf16 ? v1::DATA_TYPE_BF16 : v1::DATA_TYPE_F32);
  t->add_shape(static_cast<int64_t>(rows.size()));
  t->add_shape(d_model);
  std::string* data = t->mutable_data();
  data->resize(rows.size() * row_bytes);
  for (size_t i = 0; i < rows.size(); ++i) {
    const void* src = bf16 ? static_cast<const void*>(work.x_bf16 + rows[i] * d_model)
                           : static_cast<const void*>(work.x + rows[i] * d_model);
    std::memcpy(&(*data)[i * row_bytes], src, row_bytes);
  }
  for (const std::vector<int>& entry : entries) {
    v1::ExpertWork* dst = req.add_experts();
    dst->set_expert(experts[entry[0]].expert);
    dst->set_kernel_rows(experts[entry[0]].kernel_rows);  // parts of one work: all the same
    for (const int w : entry) {
      const ExpertWork& src = experts[w];
      for (const int32_t r : src.rows) dst->add_row_indices(position[r]);
      dst->mutable_weights()->Add(src.weights.begin(), src.weights.end());
    }
  }

  // Reply groups. An entry is (expert, token) with its slot t * width + rank.
  call->group_slots.clear();
  call->group_start.assign(1, 0);
  if (replies == NodeReplies::kPerExpert) {
    req.set_per_expert_output(true);
    req.set_output_dtype(v1::DATA_TYPE_F32);
    for (const int w : call->plan.works) {
      for (const int32_t slot : experts[w].slots) {
        call->group_slots.push_back(slot);
        call->group_start.push_back(static_cast<int32_t>(call->group_slots.size()));
      }
    }
    return;
  }
  const int64_t width = work.num_slots / std::max<int64_t>(work.num_tokens, 1);
  // Per token of the call (by its row position), which ranks this call holds.
  std::vector<std::vector<char>> held(rows.size(), std::vector<char>(width, 0));
  for (const int w : call->plan.works) {
    for (const int32_t slot : experts[w].slots) held[position[slot / width]][slot % width] = 1;
  }
  // Per (row position, rank): the reply row of that entry.
  std::vector<std::vector<int32_t>> reply_row(rows.size(), std::vector<int32_t>(width, -1));
  bool complete = true;  // every group is a whole token's route
  int32_t next = 0;
  for (size_t p = 0; p < rows.size(); ++p) {
    int64_t prefix = 0;  // ranks 0..prefix-1 all held here
    while (prefix < width && held[p][prefix]) ++prefix;
    int64_t count = 0;
    for (int64_t j = 0; j < width; ++j) count += held[p][j];
    complete = complete && count == width;
    const int32_t shared = replies == NodeReplies::kPartial || prefix > 0 ? next++ : -1;
    for (int64_t j = 0; j < width; ++j) {
      if (!held[p][j]) continue;
      const bool in_group = replies == NodeReplies::kPartial || j < prefix;
      const int32_t o = in_group ? shared : next++;
      reply_row[p][j] = o;
    }
  }
  // Reply rows are numbered in token order, a token's group first: collect
  // each row's slots in rank order.
  std::vector<std::vector<int32_t>> slots_of(next);
  for (size_t p = 0; p < rows.size(); ++p) {
    for (int64_t j = 0; j < width; ++j) {
      if (reply_row[p][j] >= 0) slots_of[reply_row[p][j]].push_back(static_cast<int32_t>(rows[p] * width + j));
    }
  }
  for (const auto& g : slots_of) {
    call->group_slots.insert(call->group_slots.end(), g.begin(), g.end());
    call->group_start.push_back(static_cast<int32_t>(call->group_slots.size()));
  }
  req.set_num_output_rows(next);
  // A whole token's sum may come back rounded to the client's bf16: the
  // router's own rounding of it would give the same bits.
  req.set_output_dtype(complete && work.bf16_output ? v1::DATA_TYPE_BF16 : v1::DATA_TYPE_F32);
  for (int i = 0; i < req.experts_size(); ++i) {
    v1::ExpertWork* dst = req.mutable_experts(i);
    for (const int w : entries[i]) {
      for (const int32_t slot : experts[w].slots) {
        dst->add_output_rows(reply_row[position[slot / width]][slot % width]);
        dst->add_ranks(static_cast<int32_t>(slot % width));
      }
    }
  }
}

// What BuildRequest would make of a call of `works`, counted without copying
// rows: its distinct rows, its row indices and the rows of its reply.
struct CallSize {
  int64_t rows = 0;
  int64_t indices = 0;
  int64_t reply_rows = 0;
};
CallSize MeasureCall(const LayerWork& work, const std::vector<ExpertWork>& experts, const std::vector<int>& works,
                     NodeReplies replies) {
  const int64_t width = work.num_slots / std::max<int64_t>(work.num_tokens, 1);
  std::vector<char> held(work.num_slots, 0);  // per (token, rank): the call holds it
  std::vector<int32_t> tokens;                // distinct, in first-seen order
  CallSize size;
  for (const int w : works) {
    for (const int32_t slot : experts[w].slots) {
      const int32_t t = static_cast<int32_t>(slot / width);
      if (std::none_of(held.begin() + t * width, held.begin() + (t + 1) * width, [](char h) { return h != 0; })) {
        tokens.push_back(t);
      }
      held[slot] = 1;
    }
    size.indices += static_cast<int64_t>(experts[w].slots.size());
  }
  size.rows = static_cast<int64_t>(tokens.size());
  if (replies == NodeReplies::kPerExpert) {
    size.reply_rows = size.indices;
    return size;
  }
  for (const int32_t t : tokens) {  // as BuildRequest groups them
    const char* h = held.data() + t * width;
    int64_t prefix = 0, count = 0;
    while (prefix < width && h[prefix]) ++prefix;
    for (int64_t j = 0; j < width; ++j) count += h[j];
    size.reply_rows += replies == NodeReplies::kPartial ? 1 : (prefix > 0 ? 1 : 0) + count - prefix;
  }
  return size;
}

// Copies a reply's rows to their slots: each row to its group's first slot
// (widened from bf16 if it came so), -0.0 to the group's other slots.
absl::Status ScatterReply(const LayerWork& work, int64_t d_model, const Call& call, float* contributions) {
  const int64_t expected = static_cast<int64_t>(call.group_start.size()) - 1;
  const v1::DataType dtype = call.request.output_dtype() == v1::DATA_TYPE_BF16 ? v1::DATA_TYPE_BF16 : v1::DATA_TYPE_F32;
  const int64_t element = dtype == v1::DATA_TYPE_BF16 ? 2 : 4;
  const v1::Tensor& t = call.response.output();
  if (t.dtype() != dtype || t.shape_size() != 2 || t.shape(0) != expected || t.shape(1) != d_model ||
      static_cast<int64_t>(t.data().size()) != expected * d_model * element) {
    std::string shape;
    for (int i = 0; i < t.shape_size(); ++i) absl::StrAppend(&shape, i > 0 ? ", " : "", t.shape(i));
    return absl::InternalError(absl::StrCat(call.name, ": reply for layer ", work.layer, " is not [", expected, ", ",
                                            d_model, "] ", dtype == v1::DATA_TYPE_BF16 ? "bf16" : "f32", " but [",
                                            shape, "] ", v1::DataType_Name(t.dtype()), " in ", t.data().size(),
                                            " bytes"));
  }
  const char* src = t.data().data();
  for (int64_t o = 0; o < expected; ++o) {
    const int32_t* g = call.group_slots.data() + call.group_start[o];
    const int32_t n = call.group_start[o + 1] - call.group_start[o];
    float* dst = contributions + int64_t{g[0]} * d_model;
    if (element == 4) {
      std::memcpy(dst, src, d_model * sizeof(float));
    } else {
      for (int64_t c = 0; c < d_model; ++c) {
        uint16_t h;
        std::memcpy(&h, src + 2 * c, 2);
        dst[c] = common::Bf16ToFloat(h);
      }
    }
    src += d_model * element;
    for (int32_t i = 1; i < n; ++i) std::fill_n(contributions + int64_t{g[i]} * d_model, d_model, -0.0f);
  }
  return absl::OkStatus();
}

}  // namespace

class RemoteBackend::Dispatch : public std::enable_shared_from_this<Dispatch> {
 public:
  Dispatch(RemoteBackend* backend, const LayerWork& work, float* contributions, CallControl& control,
           BackendStats* stats, std::function<void(absl::Status)> done)
      : backend_(backend),
        options_(backend->options_),
        clock_(backend->clock_),
        topo_(backend->topology()),
        start_(std::chrono::steady_clock::now()),
        rotation_(backend->rotation_[work.layer].fetch_add(1, std::memory_order_relaxed)),
        work_(work),
        contributions_(contributions),
        control_(control),
        stats_(stats),
        done_(std::move(done)) {
    if (SplitAmongReplicas(*topo_->map, work.layer, work.experts, options_.row_split, &parts_)) {
      experts_ = &parts_;
      if (options_.metrics != nullptr) {
        options_.metrics
            ->GetCounter("colibri_router_split_layer_calls_total",
                         "Layer calls in which a replicated expert's rows were split among its copies.")
            ->Increment();
      }
    }
    // An expert with more rows than half of what a node that may serve it
    // takes in one call goes in runs (the split of a node's share by whole
    // works is NewCalls').
    if (std::vector<ExpertWork> cut; SplitOverNodeLimits(*topo_->map, work.layer, *experts_, &cut)) {
      parts_ = std::move(cut);
      experts_ = &parts_;
    }
    pending_.resize(experts_->size());
    for (size_t i = 0; i < pending_.size(); ++i) pending_[i] = static_cast<int>(i);
  }

  void Start() {
    hook_ = control_.AddHook([weak = weak_from_this()] {
      if (auto self = weak.lock()) self->CancelAll();
    });
    std::vector<Call*> to_start;
    absl::Status s;
    {
      common::MutexLock lock(&mu_);
      s = PlanAttempt(&to_start);
      if (!s.ok()) Decide();
    }
    if (!s.ok()) return Finish(s);
    Send(to_start);
  }

 private:
  // A planned call and the hedges that may answer for its experts instead.
  struct Race {
    Call* primary;
    std::vector<Call*> hedges;
  };

  // Plans pending_ on the live replicas not excluded and makes the attempt's
  // calls (returned in `to_start`; sent by the caller after unlocking).
  absl::Status PlanAttempt(std::vector<Call*>* to_start) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (control_.cancelled()) return absl::CancelledError("request cancelled by the client");
    absl::StatusOr<std::vector<NodeCall>> plan = PlanNodeCalls(*topo_->map, work_.layer, *experts_, pending_, Load(),
                                                               excluded_, LastResorts(attempt_ > 0), rotation_);
    if (!plan.ok()) {
      // The map knows no node for an expert: probe them soon, so that calls
      // find a node that came back without waiting a whole health interval.
      // (A retry's plan fails for the nodes this layer's calls failed on.)
      if (attempt_ == 0) backend_->Recheck();
      return first_failure_.empty() ? plan.status()
                                    : Failed(absl::StrCat(plan.status().message(), "; ", first_failure_));
    }
    const absl::Time now = clock_->Now();
    deadline_ = std::min(control_.deadline(), now + options_.node_timeout);
    races_.clear();
    for (NodeCall& nc : *plan) {
      const std::vector<Call*> calls = NewCalls(std::move(nc), false);
      for (Call* c : calls) races_.push_back({c, {}});
      to_start->push_back(calls.front());
    }
    if (attempt_ == 0 && options_.hedge_after > absl::ZeroDuration()) {
      hedge_timer_ = clock_->At(now + options_.hedge_after, [weak = weak_from_this()] {
        if (auto self = weak.lock()) self->Hedge();
      });
    }
    return absl::OkStatus();
  }

  // The nodes to plan on only where no other replica serves an expert: those
  // this layer avoids, those busy (Node::busy_until_nanos), and with `down` those
  // taken out since the layer's map was made (another call's failure; a
  // retry or hedge plans on the map the layer started with). A dead or busy
  // node answers at once, so by load alone it would look the least busy.
  std::set<int> LastResorts(bool down) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::set<int> out = avoided_;
    const int64_t now = absl::ToUnixNanos(clock_->Now());
    for (size_t n = 0; n < topo_->nodes.size(); ++n) {
      Node& node = *topo_->nodes[n];
      bool last_resort = node.busy_until_nanos.load(std::memory_order_relaxed) > now;
      if (down && !last_resort) {
        common::MutexLock lock(&node.mu);
        last_resort = !node.live;
      }
      if (last_resort) out.insert(static_cast<int>(n));
    }
    return out;
  }

  std::vector<int> Load() const {
    std::vector<int> load(topo_->nodes.size());
    for (size_t n = 0; n < load.size(); ++n) load[n] = topo_->nodes[n]->in_flight.load(std::memory_order_relaxed);
    return load;
  }

  // The calls of one node's share of the attempt: one, or, where its request
  // or reply would be over the node's size limits (GetNodeInfo's max_rows and
  // max_row_indices), pieces of its works (halves, halved again as need be)
  // each within half those limits (a single work is: SplitOverNodeLimits).
  // The pieces go one after another (Call::next), and two of half the
  // limits fit the node's default budget for calls in flight — room for one
  // call of max_rows rows to all their experts — together: the node frees a
  // call's room a moment after the router has its reply, so the next piece
  // may arrive before. Only the first call returned is to be sent.
  std::vector<Call*> NewCalls(NodeCall nc, bool hedge) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<Call*> calls = Pieces(std::move(nc), hedge, 1);
    for (size_t i = 0; i + 1 < calls.size(); ++i) {
      calls[i]->next = calls[i + 1];
      calls[i + 1]->chained = true;
    }
    return calls;
  }

  // The calls of `nc` within 1/share of the node's limits.
  std::vector<Call*> Pieces(NodeCall nc, bool hedge, int share) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (const std::vector<int>& works = nc.works; works.size() > 1 && OverNodeLimits(nc, share)) {
      const auto middle = works.begin() + works.size() / 2;
      std::vector<Call*> out = Pieces({nc.node, {works.begin(), middle}}, hedge, 2);
      for (Call* c : Pieces({nc.node, {middle, works.end()}}, hedge, 2)) out.push_back(c);
      return out;
    }
    auto call = std::make_unique<Call>();
    call->node = nc.node;
    call->node_ref = topo_->nodes[nc.node];
    call->address = call->node_ref->address;
    call->name = absl::StrCat("node-", nc.node);
    call->plan = std::move(nc);
    call->attempt = attempt_;
    call->hedge = hedge;
    BuildRequest(work_, *experts_, options_.d_model, options_.model_id, options_.replies, call.get());
    SetDeadline(call.get(), deadline_);
    call->bytes_sent = static_cast<int64_t>(call->request.ByteSizeLong());  // before gRPC reads it on another thread
    backend_->CallStarted();  // from here the backend waits for this call's callback before it is destroyed
    calls_.push_back(std::move(call));
    return {calls_.back().get()};
  }

  bool OverNodeLimits(const NodeCall& nc, int share) const {
    const NodeState& node = topo_->map->nodes()[nc.node];
    auto limit = [share](int64_t l) {
      return l > 0 ? std::max<int64_t>(l / share, 1) : std::numeric_limits<int64_t>::max();
    };
    const int64_t max_rows = limit(node.max_rows), max_indices = limit(node.max_row_indices);
    int64_t indices = 0;
    for (const int w : nc.works) indices += static_cast<int64_t>((*experts_)[w].rows.size());
    if (indices <= std::min(max_rows, max_indices)) return false;  // rows and reply rows are at most the indices
    const CallSize size = MeasureCall(work_, *experts_, nc.works, options_.replies);
    return size.rows > max_rows || size.reply_rows > max_rows || size.indices > max_indices;
  }

  // The attempt's deadline (its calls and their hedges share it), or for a
  // chained call min(client deadline, now + node timeout) when it is sent:
  // its node worked on the calls before it meanwhile.
  void SetDeadline(Call* call, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    call->context.set_deadline(absl::ToChronoTime(deadline));
    // When the client's deadline is the sooner one, a DEADLINE_EXCEEDED is
    // the client's — never a reason to take a node out (gRPC's clock may call
    // it a moment before Now() reaches the deadline).
    call->client_deadline = deadline == control_.deadline();
    call->start_nanos = NanosSince(start_);
  }

  // Sends calls made under the lock. Their callbacks keep this alive. A call
  // cancelled before it is sent ends CANCELLED unsent; one cancelled while
  // it is being sent is cancelled once sent (Call::send_state).
  void Send(const std::vector<Call*>& calls) {
    for (Call* c : calls) {
      Node& node = *c->node_ref;
      node.in_flight.fetch_add(1, std::memory_order_relaxed);
      int state = Call::kUnsent;
      if (!c->send_state.compare_exchange_strong(state, Call::kSending)) {
        OnReply(c, c->unsent_status);  // set before it was handed here, on this thread
        continue;
      }
      c->sent.store(true, std::memory_order_relaxed);
      node.calls.fetch_add(1, std::memory_order_relaxed);
      node.channel->Compute(&c->context, &c->request, &c->response,
                            [self = shared_from_this(), c](grpc::Status s) { self->OnReply(c, std::move(s)); });
      state = Call::kSending;
      if (!c->send_state.compare_exchange_strong(state, Call::kSent)) node.channel->Cancel(&c->context);
    }
  }

  void Cancel(const std::vector<Call*>& calls) {
    for (Call* c : calls) {
      if (c->send_state.exchange(Call::kCancelWanted) == Call::kSent) c->node_ref->channel->Cancel(&c->context);
    }
  }

  void OnReply(Call* call, grpc::Status status) {
    call->node_ref->in_flight.fetch_sub(1, std::memory_order_relaxed);
    std::vector<Call*> to_start, to_cancel;
    std::optional<absl::Status> result;
    Call* const next = call->next;
    {
      common::MutexLock lock(&mu_);
      call->status = std::move(status);
      call->end_nanos = NanosSince(start_);
      call->done = true;
      if (!decided_ && AllSettled()) {
        for (const auto& c : calls_) {
          if (!c->done) to_cancel.push_back(c.get());  // the losers of settled races
        }
        result = Settle(&to_start);
        if (result.has_value()) Decide();
      } else if (!decided_) {
        // The call's race may be settled before the others: its losers
        // (a slow primary, or the hedges it beat) are cancelled now, not
        // when the slowest race of the attempt ends.
        for (const Race& r : races_) {
          if (r.primary != call && std::find(r.hedges.begin(), r.hedges.end(), call) == r.hedges.end()) continue;
          if (!Settled(r)) break;
          if (!r.primary->done) to_cancel.push_back(r.primary);
          for (Call* h : r.hedges) {
            if (!h->done) to_cancel.push_back(h);
          }
          break;
        }
      }
      // The node's next call: sent when this one did not find its node gone,
      // hung or busy (or lost its race to another call) and the layer still
      // needs it. Otherwise it ends unsent (Send), as does each after it up
      // to one still needed — all of them, with this call's failure, when
      // its node is gone, hung or busy (the retry takes their works) — so
      // that every call made gets its callback, without recursing once per
      // call. Decided here, under the lock: a canceller may not have marked
      // them yet, and once the layer is decided its caller's control may be
      // gone.
      if (next != nullptr && !next->queued) {
        const bool node_failed = NodeGoneOrBusy(call->status.error_code()) && !WonByAnother(*call);
        for (Call* c = next; c != nullptr; c = c->next) {
          c->queued = true;
          to_start.push_back(c);
          if (!node_failed && Needed(*c)) {
            SetDeadline(c, std::min(control_.deadline(), clock_->Now() + options_.node_timeout));
            break;
          }
          c->send_state.store(Call::kCancelWanted);
          if (node_failed) {
            c->unsent_status = call->status;
            c->client_deadline = call->client_deadline;
          }
        }
      }
    }
    backend_->CallEnded(*call);
    Cancel(to_cancel);
    Send(to_start);
    if (result.has_value()) Finish(*result);
  }

  // A failure that the node's next calls would meet too: it is gone or
  // shutting down, it did not answer in time, or it has no room.
  static bool NodeGoneOrBusy(grpc::StatusCode code) {
    return code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED ||
           code == grpc::StatusCode::CANCELLED || code == grpc::StatusCode::RESOURCE_EXHAUSTED;
  }

  // The current attempt's race `c` runs in, or null (an earlier attempt's).
  const Race* RaceOf(const Call& c) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const Race& r : races_) {
      if (r.primary == &c || std::find(r.hedges.begin(), r.hedges.end(), &c) != r.hedges.end()) return &r;
    }
    return nullptr;
  }
  // Whether an unsent call still has work to do: its layer is undecided and
  // not cancelled, and its race — of the current attempt — is not settled.
  bool Needed(const Call& c) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (decided_ || control_.cancelled()) return false;
    const Race* r = RaceOf(c);
    return r != nullptr && !Settled(*r);
  }
  // Whether the other side of `c`'s race answered (`c` was cancelled for it).
  bool WonByAnother(const Call& c) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const Race* r = RaceOf(c);
    if (r == nullptr) return false;
    if (r->primary != &c) return r->primary->done && r->primary->status.ok();
    return !r->hedges.empty() &&
           std::all_of(r->hedges.begin(), r->hedges.end(), [](const Call* h) { return h->done && h->status.ok(); });
  }

  // A race is settled when its planned call succeeded, when all its hedges
  // did, or when everything in it has ended.
  static bool Settled(const Race& r) {
    bool hedges_done = true, hedges_ok = !r.hedges.empty();
    for (const Call* h : r.hedges) {
      hedges_done = hedges_done && h->done;
      hedges_ok = hedges_ok && h->done && h->status.ok();
    }
    return (r.primary->done && r.primary->status.ok()) || hedges_ok || (r.primary->done && hedges_done);
  }
  bool AllSettled() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return std::all_of(races_.begin(), races_.end(), Settled);
  }

  // The attempt's races are settled: scatter the answers and classify the
  // failures. The layer's result, or nullopt when a retry was planned (its
  // calls in `to_start`).
  std::optional<absl::Status> Settle(std::vector<Call*>* to_start) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    hedge_timer_.reset();
    std::vector<int> failed;
    absl::Status error;
    for (const Race& r : races_) {
      std::vector<const Call*> winners;
      // (A call still out has no status yet: its default one reads OK.)
      if (r.primary->done && r.primary->status.ok()) {
        winners = {r.primary};
      } else if (!r.hedges.empty() && std::all_of(r.hedges.begin(), r.hedges.end(),
                                                  [](const Call* h) { return h->done && h->status.ok(); })) {
        winners.assign(r.hedges.begin(), r.hedges.end());
        backend_->hedge_wins_.fetch_add(1, std::memory_order_relaxed);
        if (options_.metrics != nullptr) {
          options_.metrics->GetCounter("colibri_router_hedge_wins_total", "Hedged calls answered by the hedge.")
              ->Increment();
        }
      }
      if (!winners.empty()) {
        for (const Call* w : winners) {
          absl::Status s = ScatterReply(work_, options_.d_model, *w, contributions_);
          if (!s.ok() && error.ok()) error = s;
        }
        continue;
      }
      absl::Status s = Classify(r, &failed);
      if (!s.ok() && error.ok()) error = s;
    }
    if (!error.ok()) return error;
    if (failed.empty()) return absl::OkStatus();
    if (attempt_ == 1) {
      std::string experts;
      for (const int w : failed) absl::StrAppend(&experts, experts.empty() ? "" : ",", (*experts_)[w].expert);
      return Failed(absl::StrCat("layer ", work_.layer, " expert ", experts, ": failed on every replica tried (",
                                 first_failure_, "; retry failed on ", retry_failure_, ")"));
    }
    std::sort(failed.begin(), failed.end());
    pending_ = std::move(failed);
    attempt_ = 1;
    backend_->retries_.fetch_add(1, std::memory_order_relaxed);
    if (stats_ != nullptr) ++stats_->retries;
    if (options_.metrics != nullptr) {
      options_.metrics->GetCounter("colibri_router_retries_total", "Node calls retried on another replica.")
          ->Increment();
    }
    absl::Status s = PlanAttempt(to_start);
    if (!s.ok()) return s;
    return std::nullopt;
  }

  // The layer's error once its experts have no replica left to try:
  // RESOURCE_EXHAUSTED when every node that failed it was busy (a client
  // may back off and try again), else UNAVAILABLE.
  absl::Status Failed(const std::string& message) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return only_busy_ ? absl::ResourceExhaustedError(message) : absl::UnavailableError(message);
  }

  // Nothing in the race answered: why its planned call failed. OK with its
  // works added to `failed` when they may be retried elsewhere.
  absl::Status Classify(const Race& r, std::vector<int>* failed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const Call& c = *r.primary;
    const grpc::StatusCode code = c.status.error_code();
    // `what` reaches the client: gRPC's own transport errors (UNAVAILABLE,
    // DEADLINE_EXCEEDED) name the node's resolved address, so for those the
    // client gets the code only; `detail` (the router's log, the admins'
    // GetClusterStatus) keeps the message.
    const std::string detail =
        absl::StrCat(c.name, ": ", c.status.error_message(), " (code ", static_cast<int>(code), ")");
    const std::string what = TransportCode(code) ? absl::StrCat(c.name, ": ", TransportCodeText(code), " (code ",
                                                                static_cast<int>(code), ")")
                                                 : detail;
    if (control_.cancelled()) return absl::CancelledError("request cancelled by the client");
    if (clock_->Now() >= control_.deadline() || (c.client_deadline && code == grpc::StatusCode::DEADLINE_EXCEEDED)) {
      return absl::DeadlineExceededError(absl::StrCat("layer ", work_.layer, ": deadline exceeded waiting for ", what));
    }
    // The node's failure, not the client's (a call ended unsent with the
    // failure of the call before it is not one of the node's calls).
    if (c.sent.load(std::memory_order_relaxed)) c.node_ref->failed.fetch_add(1, std::memory_order_relaxed);
    if (!Retriable(code)) return absl::InternalError(absl::StrCat("layer ", work_.layer, ": ", what));
    // A node whose weights differ from the map (FAILED_PRECONDITION: it no
    // longer owns one of the call's experts, after a reload) is alive and
    // serves the others: the retry avoids it where another copy exists, and
    // the next health round brings the map up to date. A busy node
    // (RESOURCE_EXHAUSTED) is left out of this layer call; other failures
    // take the node out until a health check finds it live.
    only_busy_ = only_busy_ && code == grpc::StatusCode::RESOURCE_EXHAUSTED;
    // The same for RESOURCE_EXHAUSTED answering a call sent when this
    // layer's call before it on the node ended (or for the rest of that
    // chain, ended unsent with it): most likely that call's room not yet
    // freed, not a busy node.
    if (code == grpc::StatusCode::FAILED_PRECONDITION || (code == grpc::StatusCode::RESOURCE_EXHAUSTED && c.chained)) {
      avoided_.insert(c.node);
    } else {
      if (code == grpc::StatusCode::RESOURCE_EXHAUSTED) {  // other layers' first tries too, for a while
        c.node_ref->busy_until_nanos.store(absl::ToUnixNanos(clock_->Now() + options_.recheck_after),
                                           std::memory_order_relaxed);
      } else {
        backend_->MarkDown(c.node_ref, detail);
      }
      excluded_.insert(c.node);
    }
    // Every hedge has ended (Settled): those that failed are not tried again;
    // one that answered is a node that works, and may take the retry.
    for (const Call* h : r.hedges) {
      if (h->status.ok()) continue;
      excluded_.insert(h->node);
      only_busy_ = only_busy_ && h->status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
    }
    failed->insert(failed->end(), c.plan.works.begin(), c.plan.works.end());
    if (first_failure_.empty()) first_failure_ = absl::StrCat("first try failed on ", what);
    retry_failure_ = what;
    return absl::OkStatus();
  }

  // The hedge timer: the work of every planned call still out goes to
  // other replicas too.
  void Hedge() {
    std::vector<Call*> to_start;
    {
      common::MutexLock lock(&mu_);
      // A cancelled layer sends nothing more (its caller may be gone, and its rows with it).
      if (decided_ || attempt_ != 0 || control_.cancelled()) return;
      const std::vector<int> load = Load();
      // Nodes whose calls of this layer have failed already (their failure
      // is classified only once the attempt settles) are last resorts too.
      std::set<int> last_resorts = LastResorts(/*down=*/true);
      for (const Race& r : races_) {
        if (r.primary->done && !r.primary->status.ok()) last_resorts.insert(r.primary->node);
      }
      for (Race& r : races_) {
        // A call still waiting behind its node's earlier calls is not late.
        if (r.primary->done || !r.hedges.empty() || r.primary->send_state.load() == Call::kUnsent) continue;
        std::set<int> avoid = excluded_;
        avoid.insert(r.primary->node);
        absl::StatusOr<std::vector<NodeCall>> alternative =
            PlanNodeCalls(*topo_->map, work_.layer, *experts_, r.primary->plan.works, load, avoid, last_resorts,
                          rotation_, /*use_fallbacks=*/false);
        if (!alternative.ok()) continue;  // no other replica: wait for the slow one
        for (NodeCall& nc : *alternative) {
          const std::vector<Call*> calls = NewCalls(std::move(nc), true);
          r.hedges.insert(r.hedges.end(), calls.begin(), calls.end());
          to_start.push_back(calls.front());
        }
        backend_->hedges_.fetch_add(1, std::memory_order_relaxed);
        if (options_.metrics != nullptr) {
          options_.metrics->GetCounter("colibri_router_hedges_total", "Node calls hedged on another replica.")
              ->Increment();
        }
      }
    }
    Send(to_start);
  }

  void CancelAll() {
    std::vector<Call*> to_cancel;
    {
      common::MutexLock lock(&mu_);
      if (decided_) return;
      for (const auto& c : calls_) {
        if (!c->done) to_cancel.push_back(c.get());
      }
    }
    Cancel(to_cancel);
  }

  // The layer's result is known: record the calls (those still out as
  // cancelled) while `stats_` is valid. Late replies change nothing after.
  void Decide() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    decided_ = true;
    hedge_timer_.reset();
    if (stats_ == nullptr) return;
    const int64_t now = NanosSince(start_);
    for (const auto& c : calls_) {
      if (c->done && !c->sent.load(std::memory_order_relaxed)) continue;  // ended unsent: no node call
      NodeCallRecord r;
      r.node = c->name;
      r.start_nanos = c->start_nanos;
      r.end_nanos = c->done ? c->end_nanos : now;
      r.rows = c->request.rows().shape_size() > 0 ? c->request.rows().shape(0) : 0;
      r.experts = c->request.experts_size();
      for (const v1::ExpertWork& w : c->request.experts()) {
        absl::StrAppend(&r.experts_list, r.experts_list.empty() ? "" : ",", w.expert());
      }
      r.attempt = c->attempt;
      r.hedge = c->hedge;
      r.code = c->done ? static_cast<absl::StatusCode>(c->status.error_code()) : absl::StatusCode::kCancelled;
      r.bytes_sent = c->bytes_sent;
      if (c->done) {
        r.bytes_received = static_cast<int64_t>(c->response.ByteSizeLong());
        for (const v1::StageTiming& t : c->response.timings()) {
          if (t.stage() == "compute") r.node_compute_nanos = t.nanos();
        }
      }
      stats_->calls.push_back(std::move(r));
    }
  }

  // Outside the lock, once: unhook from the control and answer.
  void Finish(const absl::Status& status) {
    control_.RemoveHook(hook_);
    std::function<void(absl::Status)> done = std::move(done_);
    done(status);  // work_, contributions_, control_ and stats_ may be gone after this
  }

  RemoteBackend* const backend_;
  const RemoteOptions& options_;
  common::Clock* const clock_;
  const std::shared_ptr<const Topology> topo_;
  const std::chrono::steady_clock::time_point start_;
  const uint32_t rotation_;
  const LayerWork& work_;
  // The works planned: work_.experts, or parts_ when some were split among replicas.
  std::vector<ExpertWork> parts_;
  const std::vector<ExpertWork>* experts_ = &work_.experts;
  float* const contributions_;
  CallControl& control_;
  BackendStats* const stats_;
  std::function<void(absl::Status)> done_;
  int hook_ = -1;  // set by Start before any call is made

  common::Mutex mu_;
  bool decided_ ABSL_GUARDED_BY(mu_) = false;
  int attempt_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int> pending_ ABSL_GUARDED_BY(mu_);  // works of the next attempt
  std::set<int> excluded_ ABSL_GUARDED_BY(mu_);    // nodes that failed a call of this layer
  std::set<int> avoided_ ABSL_GUARDED_BY(mu_);     // ... with FAILED_PRECONDITION: used as a last resort
  absl::Time deadline_ ABSL_GUARDED_BY(mu_);       // of the current attempt's calls (chained ones: from their send)
  std::vector<std::unique_ptr<Call>> calls_ ABSL_GUARDED_BY(mu_);  // every call of every attempt
  std::vector<Race> races_ ABSL_GUARDED_BY(mu_);                   // the current attempt's
  std::unique_ptr<common::Clock::Timer> hedge_timer_ ABSL_GUARDED_BY(mu_);
  std::string first_failure_ ABSL_GUARDED_BY(mu_);
  std::string retry_failure_ ABSL_GUARDED_BY(mu_);
  bool only_busy_ ABSL_GUARDED_BY(mu_) = true;  // every failure classified was RESOURCE_EXHAUSTED
};

std::optional<NodeReplies> ParseNodeReplies(absl::string_view name) {
  if (name == "per_expert") return NodeReplies::kPerExpert;
  if (name == "exact") return NodeReplies::kExact;
  if (name == "partial") return NodeReplies::kPartial;
  return std::nullopt;
}

void RemoteBackend::ComputeAsync(const LayerWork& work, float* contributions, CallControl& control, BackendStats* stats,
                                 std::function<void(absl::Status)> done) {
  if (work.experts.empty()) return done(absl::OkStatus());
  std::make_shared<Dispatch>(this, work, contributions, control, stats, std::move(done))->Start();
}

absl::Status RemoteBackend::Compute(const LayerWork& work, float* contributions, CallControl& control,
                                    BackendStats* stats) {
  common::Notification finished;
  absl::Status result;
  ComputeAsync(work, contributions, control, stats, [&](absl::Status s) {
    result = std::move(s);
    finished.Notify();
  });
  finished.WaitForNotification();
  return result;
}

void RemoteBackend::CallEnded(const Call& c) {
  if (options_.metrics != nullptr && c.sent.load(std::memory_order_relaxed)) {
    options_.metrics
        ->GetCounter("colibri_router_node_calls_total", "Compute calls to expert nodes by node and status code.",
                     {{"node", c.address}, {"code", std::to_string(static_cast<int>(c.status.error_code()))}})
        ->Increment();
    options_.metrics
        ->GetHistogram("colibri_router_node_seconds", "Duration of Compute calls to each expert node.",
                       {{"node", c.address}}, common::LatencyBuckets())
        ->Observe((c.end_nanos - c.start_nanos) * 1e-9);
  }
  common::MutexLock lock(&calls_mu_);
  if (--outstanding_calls_ == 0) calls_cv_.SignalAll();
}

}  // namespace router_node
}  // namespace colibri
