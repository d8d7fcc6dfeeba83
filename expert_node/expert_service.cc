#include "expert_node/expert_service.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/sigbus_guard.h"
#include "expert_node/compute_call.h"
#include "expert_node/compute_request.h"
#include "expert_node/reload_request.h"
#include "kernels/dispatch.h"
#include "kernels/expert_executor.h"
#include "runtime/grpc_admin.h"
#include "runtime/grpc_raw.h"
#include "runtime/grpc_status.h"

namespace colibri {
namespace expert_node {
namespace {

namespace v1 = colibri::v1;

void FillOutput(const ComputeOutput& out, int64_t d_model, v1::DataType dtype, v1::Tensor* t) {
  t->add_shape(static_cast<int64_t>(out.output.size()) / d_model);
  t->add_shape(d_model);
  if (dtype == v1::DATA_TYPE_BF16) {
    t->set_dtype(v1::DATA_TYPE_BF16);
    std::string* data = t->mutable_data();
    data->resize(out.output.size() * 2);
    for (size_t i = 0; i < out.output.size(); ++i) {
      const uint16_t h = common::FloatToBf16(out.output[i]);
      std::memcpy(&(*data)[2 * i], &h, 2);
    }
    return;
  }
  t->set_dtype(v1::DATA_TYPE_F32);
  t->mutable_data()->assign(reinterpret_cast<const char*>(out.output.data()), out.output.size() * 4);
}

// From the request alone: nothing in it is trusted beyond what gRPC received.
int64_t ComputeFootprint(const v1::ComputeRequest& r, int64_t d_model) {
  const int64_t rows_bytes = static_cast<int64_t>(r.rows().data().size());
  const int64_t values = rows_bytes / (r.rows().dtype() == v1::DATA_TYPE_F32 ? 4 : 2);
  int64_t indices = 0;
  for (const v1::ExpertWork& w : r.experts()) indices += w.row_indices_size();
  // Grouped output computes one row per entry, then folds them into num_output_rows.
  const int64_t output_rows = r.per_expert_output()     ? indices
                              : r.num_output_rows() > 0 ? indices + std::min<int64_t>(r.num_output_rows(), indices)
                                                        : values / std::max<int64_t>(d_model, 1);
  return ExpertService::Footprint(rows_bytes, values, indices, output_rows, d_model);
}

}  // namespace

int64_t ExpertService::Footprint(int64_t rows_bytes, int64_t values, int64_t indices, int64_t output_rows,
                                 int64_t d_model) {
  return rows_bytes + values * 4 + indices * 16 + output_rows * d_model * 4 * 2;
}

ExpertService::ExpertService(ExpertStore* store, ComputeEngine* engine, Options options)
    : store_(store),
      engine_(engine),
      options_(std::move(options)),
      budget_(options_.max_inflight_bytes, "the node's --max_inflight_bytes") {
  store_->SetLockListener([this](const WeightSet& set) {  // once the background locking ends
    if (store_->IsCurrent(set)) SetLockedGauge(set);
  });
  UpdateWeightGauges();  // after: a locking that ends in between is not missed
  compute_thread_ = std::thread([this] { ComputeLoop(); });
}

ExpertService::~ExpertService() {
  store_->SetLockListener(nullptr);
  {
    common::MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  compute_thread_.join();
  if (reload_thread_.joinable()) reload_thread_.join();
}

void ExpertService::CountCall(const char* method, const grpc::Status& status) {
  if (options_.metrics == nullptr) return;
  options_.metrics
      ->GetCounter("colibri_expert_calls_total", "Calls by method and status code.",
                   {{"method", method}, {"code", std::to_string(static_cast<int>(status.error_code()))}})
      ->Increment();
}

void ExpertService::Finish(grpc::ServerUnaryReactor* reactor, const char* method, const grpc::Status& status) {
  CountCall(method, status);
  reactor->Finish(status);
}

void ExpertService::Answer(ComputeCall& call, grpc::Status status) {
  // The engine abandons a call for either reason alike: a caller that did
  // not cancel learns that its deadline (a stream message's timeout) passed.
  if (status.error_code() == grpc::StatusCode::CANCELLED && !call.cancelled() &&
      std::chrono::system_clock::now() >= call.deadline) {
    status = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          "the call's deadline passed during compute; it was abandoned");
  }
  CountCall("Compute", status);  // stream messages too: they are Compute calls
  call.answer(status, std::move(call.reservation));
}

absl::Status ExpertService::ReloadNow(const std::string& model_dir, const std::optional<ShardSpec>& shard,
                                      bool keep_previous, const std::function<bool()>& abandon) {
  const absl::Status s = store_->Reload(model_dir, shard, keep_previous, abandon);
  if (s.code() == absl::StatusCode::kAborted) return s;  // another reload ran: its outcome stands
  {
    common::MutexLock lock(&mu_);
    last_reload_error_ = s.ok() ? "" : std::string(s.message());
  }
  if (options_.metrics != nullptr) {
    options_.metrics
        ->GetCounter("colibri_expert_reloads_total", "Reloads by result.", {{"result", s.ok() ? "ok" : "failed"}})
        ->Increment();
  }
  UpdateWeightGauges();
  return s;
}

void ExpertService::SetLockedGauge(const WeightSet& set) {
  if (options_.metrics == nullptr) return;
  options_.metrics->GetGauge("colibri_expert_locked_bytes", "Bytes of weights locked in RAM.")
      ->Set(set.locked() ? static_cast<double>(set.bytes()) : 0.0);
}

void ExpertService::UpdateWeightGauges() {
  if (options_.metrics == nullptr) return;
  const std::shared_ptr<const WeightSet> set = store_->Current();
  options_.metrics->GetGauge("colibri_expert_weights_version", "Version of the weights being served.")
      ->Set(static_cast<double>(set->version()));
  SetLockedGauge(*set);
  options_.metrics->GetGauge("colibri_expert_owned_experts", "(layer, expert) pairs this node owns.")
      ->Set(static_cast<double>(set->owned().size()));
}

void ExpertService::ObservePaging(const ProcessIo& before) {
  const ProcessIo now = SampleProcessIo();
  common::MetricsRegistry& m = *options_.metrics;
  // Process-wide counts over the call's span: the node computes one call at a
  // time, but the background prefetches of queued calls read meanwhile.
  m.GetHistogram("colibri_expert_call_major_faults",
                 "Page faults that read from storage while a Compute call ran (paged residency).", {},
                 {0, 1, 10, 100, 1000, 10000, 100000})
      ->Observe(static_cast<double>(now.major_faults - before.major_faults));
  m.GetCounter("colibri_expert_page_faults_total", "Page faults while Compute calls ran (paged residency).",
               {{"kind", "major"}})
      ->Increment(static_cast<double>(now.major_faults - before.major_faults));
  m.GetCounter("colibri_expert_page_faults_total", "Page faults while Compute calls ran (paged residency).",
               {{"kind", "minor"}})
      ->Increment(static_cast<double>(now.minor_faults - before.minor_faults));
  if (now.read_bytes >= 0) {
    common::Gauge* read = m.GetGauge("colibri_expert_storage_read_bytes",
                                     "Bytes this process has read from storage (/proc/self/io read_bytes).");
    read->Set(static_cast<double>(now.read_bytes));
  }
  const PagedWeights::Stats stats = options_.paged->stats();
  m.GetGauge("colibri_expert_paged_kept_bytes", "Bytes of expert files kept under the memory budget.")
      ->Set(static_cast<double>(stats.kept_bytes));
  m.GetGauge("colibri_expert_paged_prefetches", "Experts asked to be read in so far.")
      ->Set(static_cast<double>(stats.prefetches));
  m.GetGauge("colibri_expert_paged_evictions", "Experts evicted over the memory budget so far.")
      ->Set(static_cast<double>(stats.evictions));
}

void ExpertService::ComputeLoop() {
  common::SigbusGuard::UnblockHere();  // compute reads mapped weights
  for (;;) {
    std::vector<std::shared_ptr<ComputeCall>> jobs;
    bool run = false;
    {
      common::MutexLock lock(&mu_);
      while (!stopping_ && (queue_.empty() || busy_)) cv_.Wait(&mu_);
      if (queue_.empty()) return;  // stopping and drained
      jobs.push_back(std::move(queue_.front()));
      queue_.pop_front();
      run = !stopping_;
      busy_ = true;
      // Queued calls of the same layer and model that have not started join it, up to kMergeRows entries.
      const ComputeCall& first = *jobs[0];
      if (run && options_.merge_calls && first.mergeable && first.prepared == nullptr) {
        int64_t entries = first.entries, rows = first.rows;
        for (auto it = queue_.begin(); it != queue_.end() && jobs.size() < kMergeCalls;) {
          const ComputeCall& c = **it;
          if (c.mergeable && c.prepared == nullptr && c.request->layer() == first.request->layer() &&
              c.request->model_id() == first.request->model_id() && entries + c.entries <= kMergeRows &&
              rows + c.rows <= kMergeRows) {
            entries += c.entries;
            rows += c.rows;
            jobs.push_back(std::move(*it));
            it = queue_.erase(it);
          } else {
            ++it;
          }
        }
      }
      QueueChanged();
    }
    std::vector<std::shared_ptr<ComputeCall>> unfinished;
    if (jobs.size() > 1) {
      RunTogether(jobs);
    } else if (!Step(*jobs[0], run)) {
      unfinished.push_back(std::move(jobs[0]));
    }
    common::MutexLock lock(&mu_);
    busy_ = false;
    // Round robin: an unfinished call's next slice after every other call's.
    for (auto& call : unfinished) queue_.push_back(std::move(call));
    QueueChanged();
  }
}

void ExpertService::QueueChanged() {
  if (options_.metrics == nullptr) return;
  options_.metrics->GetGauge("colibri_expert_queued_calls", "Compute calls waiting for the compute thread.")
      ->Set(static_cast<double>(queue_.size()));
}

std::optional<grpc::Status> ExpertService::GaveUp(const ComputeCall& call) {
  if (call.cancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled before compute");
  if (call.deadline < std::chrono::system_clock::now()) {
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline passed while queued");
  }
  return std::nullopt;
}

int ExpertService::AnswerAbandoned() {
  std::vector<std::pair<std::shared_ptr<ComputeCall>, grpc::Status>> abandoned;
  {
    common::MutexLock lock(&mu_);
    for (auto it = queue_.begin(); it != queue_.end();) {
      std::optional<grpc::Status> why = (*it)->prepared == nullptr ? GaveUp(**it) : std::nullopt;
      if (why.has_value()) {
        abandoned.emplace_back(std::move(*it), *std::move(why));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    if (!abandoned.empty()) QueueChanged();
  }
  for (auto& [call, why] : abandoned) {  // outside mu_: answering calls into gRPC
    // Their room is free at once: the answer is a status, and gRPC frees the
    // request with it.
    call->reservation = common::MemoryBudget::Reservation();
    Answer(*call, why);
  }
  return static_cast<int>(abandoned.size());
}

bool ExpertService::Start(ComputeCall& call) {
  if (std::optional<grpc::Status> why = GaveUp(call); why.has_value()) {
    Answer(call, *why);
    return false;
  }
  if (options_.inject_delay_ms > 0 && ++computes_ % std::max(1, options_.inject_delay_every) == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(options_.inject_delay_ms));
  }
  call.queue_nanos =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - call.queued).count();
  if (options_.paged != nullptr) call.io = SampleProcessIo();
  ComputeInput& input = call.input;
  input.check_finite = options_.check_finite;
  // The set held while its manifest is read: a reload may release it meanwhile.
  const std::shared_ptr<const WeightSet> set = store_->Current();
  const common::Manifest& manifest = set->model().manifest();
  if (absl::Status s =
          ParseComputeRequest(*call.request, manifest.d_model, manifest.total_experts(), engine_->limits(), &input);
      !s.ok()) {
    Answer(call, runtime::ToGrpcStatus(s));
    return false;
  }
  // Checked between blocks while computing: a cancelled call or one past its
  // deadline frees the pool within one block, not at the end of the call.
  input.should_stop = [cancelled = call.cancelled, deadline = call.deadline] {
    return cancelled() || deadline < std::chrono::system_clock::now();
  };
  absl::StatusOr<std::unique_ptr<PreparedCall>> prepared = engine_->Prepare(input);
  if (!prepared.ok()) {
    Answer(call, runtime::ToGrpcStatus(prepared.status()));
    return false;
  }
  call.prepared = *std::move(prepared);
  return true;
}

bool ExpertService::Step(ComputeCall& call, bool run) {
  if (!run) {
    Answer(call, grpc::Status(grpc::StatusCode::UNAVAILABLE, "expert node is shutting down"));
    return true;
  }
  if (call.prepared == nullptr && !Start(call)) return true;
  absl::StatusOr<bool> done = engine_->RunSlice(*call.prepared, kSliceRows);
  if (!done.ok()) {
    Answer(call, runtime::ToGrpcStatus(done.status()));
    return true;
  }
  if (!*done) return false;  // the next slice after the other calls' turns
  Complete(call, true);
  return true;
}

void ExpertService::RunTogether(std::vector<std::shared_ptr<ComputeCall>>& jobs) {
  std::vector<ComputeCall*> started;
  std::vector<PreparedCall*> prepared;
  for (const std::shared_ptr<ComputeCall>& job : jobs) {
    ComputeCall& c = *job;
    if (!Start(c)) continue;
    if (!prepared.empty() && c.prepared->set != prepared[0]->set) {  // a reload between the two: on its own
      while (!Step(c, true)) {
      }
      continue;
    }
    started.push_back(&c);
    prepared.push_back(c.prepared.get());
  }
  if (started.size() == 1) {  // the others were answered at their start
    while (!Step(*started[0], true)) {
    }
    return;
  }
  if (started.empty()) return;
  const std::vector<absl::Status> status = engine_->RunMerged(prepared);
  // The pass's metrics before anyone is answered (as Complete does): a caller
  // that reads them after its answer sees its call counted.
  if (common::MetricsRegistry* m = options_.metrics; m != nullptr) {
    m->GetCounter("colibri_expert_merged_calls_total", "Compute calls that shared one pass with others.")
        ->Increment(static_cast<double>(started.size()));
    // The pass read each expert once, however many calls asked for it.
    std::set<std::pair<int64_t, int64_t>> experts;
    for (const ComputeCall* c : started) {
      for (const ExpertWork& w : c->input.experts) {
        if (!w.row_indices.empty()) experts.insert({c->input.layer, w.expert});
      }
    }
    AddWeightBytes(*prepared[0]->set, experts);
    if (options_.paged != nullptr) ObservePaging(started[0]->io);  // once: the calls' intervals overlap
  }
  for (size_t i = 0; i < started.size(); ++i) {
    // The pass went on for the others: a caller that gave up during it is
    // answered as a call alone would be (CANCELLED, DEADLINE_EXCEEDED).
    if (status[i].ok() && started[i]->input.should_stop()) {
      Answer(*started[i],
             grpc::Status(grpc::StatusCode::CANCELLED, "cancelled during compute"));  // or past its deadline
    } else if (status[i].ok()) {
      Complete(*started[i], false);
    } else {
      Answer(*started[i], runtime::ToGrpcStatus(status[i]));
    }
  }
}

void ExpertService::AddWeightBytes(const WeightSet& set, const std::set<std::pair<int64_t, int64_t>>& experts) {
  std::map<int64_t, double> bytes;  // per layer
  for (const auto& [layer, expert] : experts) {
    if (auto e = set.Find(layer, expert); e.ok()) {
      for (const common::MatrixView* m : {&(*e)->w1, &(*e)->w3, &(*e)->w2}) {  // weights, scales, zero points
        bytes[layer] += static_cast<double>(m->layout.data_bytes + m->layout.scale_bytes + m->layout.zero_bytes);
      }
    }
  }
  // Divided by colibri_expert_rows_total: the weight bytes read per token.
  for (const auto& [layer, b] : bytes) {
    options_.metrics
        ->GetCounter("colibri_expert_weight_bytes_total", "Bytes of expert weights the Compute passes ran over.",
                     {{"layer", std::to_string(layer)}})
        ->Increment(b);
  }
}

void ExpertService::Complete(ComputeCall& call, bool own_pass) {
  const ComputeInput& input = call.input;
  // The call's own weight set's width: a reload since its first step may have changed the model.
  const int64_t call_d_model = call.prepared->set->model().manifest().d_model;
  const ComputeOutput out = ComputeEngine::Finish(*call.prepared);
  v1::ComputeResponse* response = call.response;
  FillOutput(out, call_d_model, call.output_dtype, response->mutable_output());
  if (common::MetricsRegistry* m = options_.metrics; m != nullptr) {
    const common::Labels layer = {{"layer", std::to_string(input.layer)}};
    m->GetHistogram("colibri_expert_compute_seconds",
                    "Kernel time of a Compute call (of calls merged into one pass, the pass's time each).", layer,
                    common::LatencyBuckets())
        ->Observe(out.compute_nanos * 1e-9);
    m->GetHistogram("colibri_expert_queue_seconds", "Time a Compute call waited for the compute thread.", {},
                    common::LatencyBuckets())
        ->Observe(call.queue_nanos * 1e-9);
    m->GetCounter("colibri_expert_rows_total", "Token rows received.", layer)->Increment(input.num_rows);
    std::set<std::pair<int64_t, int64_t>> experts;
    for (const ExpertWork& w : input.experts) {
      m->GetCounter("colibri_expert_expert_rows_total", "Rows computed per (layer, expert).",
                    {{"layer", std::to_string(input.layer)}, {"expert", std::to_string(w.expert)}})
          ->Increment(static_cast<double>(w.row_indices.size()));
      if (!w.row_indices.empty()) experts.insert({input.layer, w.expert});
    }
    m->GetCounter("colibri_expert_bytes_out_total", "Bytes of output tensors sent.")
        ->Increment(static_cast<double>(response->output().data().size()));
    if (own_pass) {
      AddWeightBytes(*call.prepared->set, experts);
      if (options_.paged != nullptr) ObservePaging(call.io);
    }
  }
  response->set_weights_version(out.weights_version);
  v1::StageTiming* q = response->add_timings();
  q->set_stage("queue");
  q->set_nanos(call.queue_nanos);
  v1::StageTiming* c = response->add_timings();
  c->set_stage("compute");
  c->set_nanos(out.compute_nanos);
  Answer(call, grpc::Status::OK);
}

namespace {

// A unary Compute: holds the parsed request and the response, and keeps
// the call's memory reservation until gRPC is done with the answer (sent,
// or the call cancelled).
class ComputeReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit ComputeReactor(grpc::ByteBuffer* raw_response) : raw_response_(raw_response) {}

  void Answer(grpc::Status status, common::MemoryBudget::Reservation held) {
    held_ = std::move(held);
    if (status.ok()) status = runtime::ToGrpcStatus(runtime::SerializeRaw(response, raw_response_));
    response = v1::ComputeResponse();  // held once, serialized
    Finish(status);
  }
  void OnDone() override { delete this; }

  v1::ComputeRequest request;
  v1::ComputeResponse response;

 private:
  grpc::ByteBuffer* const raw_response_;
  common::MemoryBudget::Reservation held_;
};

}  // namespace

grpc::ServerUnaryReactor* ExpertService::Compute(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                                 grpc::ByteBuffer* response) {
  auto* reactor = new ComputeReactor(response);
  // gRPC's buffer, in the call's arena: ours to clear once parsed.
  if (absl::Status parsed = runtime::ParseRaw(const_cast<grpc::ByteBuffer*>(request), &reactor->request);
      !parsed.ok()) {
    CountCall("Compute", runtime::ToGrpcStatus(parsed));
    reactor->Answer(runtime::ToGrpcStatus(parsed), {});
    return reactor;
  }
  auto call = std::make_shared<ComputeCall>();
  call->request = &reactor->request;
  call->response = &reactor->response;
  call->deadline = context->deadline();
  call->cancelled = [context] { return context->IsCancelled(); };
  call->answer = [reactor](const grpc::Status& status, common::MemoryBudget::Reservation held) {
    reactor->Answer(status, std::move(held));
  };
  Admit(std::move(call));
  return reactor;
}

void ExpertService::Admit(std::shared_ptr<ComputeCall> call) {
  const v1::ComputeRequest* request = call->request;
  if (options_.metrics != nullptr) {
    options_.metrics->GetCounter("colibri_expert_bytes_in_total", "Bytes of row tensors received.")
        ->Increment(static_cast<double>(request->rows().data().size()));
  }
  const v1::DataType output_dtype = request->output_dtype();
  if (output_dtype != v1::DATA_TYPE_UNSPECIFIED && output_dtype != v1::DATA_TYPE_F32 &&
      output_dtype != v1::DATA_TYPE_BF16) {
    Answer(*call, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                               absl::StrCat("output_dtype ", static_cast<int>(output_dtype), " (",
                                            v1::DataType_Name(output_dtype), ") is not f32 or bf16")));
    return;
  }
  // A call whose caller is gone takes no room either (Start would answer it so anyway).
  if (call->cancelled()) {
    Answer(*call, grpc::Status(grpc::StatusCode::CANCELLED, "cancelled before compute"));
    return;
  }
  if (call->deadline < std::chrono::system_clock::now()) {
    Answer(*call, grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline passed before the call was queued"));
    return;
  }
  // The sizes here, so that a refused request takes no room in the budget
  // or the queue and is never merged; parsing (and bf16 conversion) happens
  // on the compute thread, not on gRPC's.
  const std::shared_ptr<const WeightSet> set = store_->Current();  // held: a reload may release it
  const common::Manifest& manifest = set->model().manifest();
  if (absl::Status s = CheckComputeSizes(*request, manifest.d_model, manifest.total_experts(), engine_->limits());
      !s.ok()) {
    Answer(*call, runtime::ToGrpcStatus(s));
    return;
  }
  const int64_t footprint = ComputeFootprint(*request, manifest.d_model);
  absl::StatusOr<common::MemoryBudget::Reservation> reservation = budget_.Reserve(footprint, "this Compute call");
  // Queued calls whose callers gave up hold their room until their turn:
  // they give it up now, and the call tries once more.
  if (!reservation.ok() && AnswerAbandoned() > 0) reservation = budget_.Reserve(footprint, "this Compute call");
  if (!reservation.ok()) {
    Answer(*call, runtime::ToGrpcStatus(reservation.status()));
    return;
  }
  call->output_dtype = output_dtype;
  call->reservation = *std::move(reservation);
  for (const v1::ExpertWork& w : request->experts()) call->entries += w.row_indices_size();
  call->rows = request->rows().shape(0);  // CheckComputeSizes: [R >= 0, d_model]
  call->mergeable = (request->per_expert_output() || request->num_output_rows() > 0) && call->entries <= kSliceRows;
  // Paged weights: the call's experts are read ahead once it is let in, while
  // the calls ahead of it run — only experts with rows, of the model the call
  // names. A refused call (a node shutting down, a full queue) reads nothing.
  std::vector<int64_t> read_ahead;
  std::shared_ptr<const WeightSet> target;
  std::shared_ptr<const WeightSet> paged_before;  // released after the locks if Acquire replaces it
  if (options_.paged != nullptr) {
    for (const v1::ExpertWork& w : request->experts()) {
      if (w.row_indices_size() > 0) read_ahead.push_back(w.expert());
    }
    if (!read_ahead.empty()) target = store_->ForModel(request->model_id());
  }
  std::optional<grpc::Status> refused;
  {
    common::MutexLock lock(&mu_);
    refused = QueueRefusalLocked();
    if (!refused.has_value() && target != nullptr) {
      paged_before = options_.paged->set();  // under mu_, as every Acquire: exactly the set it may replace
      call->pin = options_.paged->Acquire(target, request->layer(), read_ahead);  // queues the reads; no I/O here
    }
    if (!refused.has_value()) {
      if (!queue_.empty() || busy_ || call->entries > kSliceRows) {
        queue_.push_back(std::move(call));
        QueueChanged();
        cv_.Signal();
        return;
      }
      busy_ = true;
    }
  }
  if (refused.has_value()) {  // answered outside mu_: answering calls into gRPC
    Answer(*call, *refused);
    return;
  }
  // Idle node, one-slice call: run it here.
  const bool finished = Step(*call, true);
  common::MutexLock lock(&mu_);
  busy_ = false;
  if (!finished) {
    queue_.push_back(std::move(call));
    QueueChanged();
  }
  if (!queue_.empty()) cv_.Signal();
}

std::optional<grpc::Status> ExpertService::QueueRefusalLocked() {
  if (stopping_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "expert node is shutting down");
  // Calls whose callers gave up wait only to be answered CANCELLED (at once,
  // when their turn comes): they do not take the room of live calls.
  if (static_cast<int64_t>(queue_.size()) < options_.max_queued_calls) return std::nullopt;
  const auto now = std::chrono::system_clock::now();
  const int64_t live = std::count_if(queue_.begin(), queue_.end(), [now](const std::shared_ptr<ComputeCall>& c) {
    return !c->cancelled() && c->deadline >= now;
  });
  if (live < options_.max_queued_calls) return std::nullopt;
  return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      absl::StrCat("compute queue full (", options_.max_queued_calls, " calls)"));
}

grpc::ServerUnaryReactor* ExpertService::GetNodeInfo(grpc::CallbackServerContext* context,
                                                     const v1::GetNodeInfoRequest*, v1::GetNodeInfoResponse* response) {
  return NodeInfo(context, response, runtime::PeerIsNamed(*context, options_.admin_identities));
}

grpc::ServerUnaryReactor* ExpertService::Reload(grpc::CallbackServerContext* context, const v1::ReloadRequest* request,
                                                v1::ReloadResponse* response) {
  return ReloadAs(context, request, response, runtime::PeerIsNamed(*context, options_.admin_identities));
}

grpc::ServerUnaryReactor* AdminService::GetNodeInfo(grpc::CallbackServerContext* context, const v1::GetNodeInfoRequest*,
                                                    v1::GetNodeInfoResponse* response) {
  return service_->NodeInfo(context, response, /*admin=*/true);
}

grpc::ServerUnaryReactor* AdminService::Reload(grpc::CallbackServerContext* context, const v1::ReloadRequest* request,
                                               v1::ReloadResponse* response) {
  return service_->ReloadAs(context, request, response, /*admin=*/true);
}

grpc::ServerUnaryReactor* ExpertService::NodeInfo(grpc::CallbackServerContext* context,
                                                  v1::GetNodeInfoResponse* response, bool admin) {
  const auto [set, previous] = store_->CurrentAndPrevious();
  const common::Manifest& m = set->model().manifest();
  response->set_model_id(set->model().model_id());
  response->add_model_ids(set->model().model_id());
  if (previous != nullptr) response->add_model_ids(previous->model().model_id());
  if (admin) response->set_model_dir(store_->model_dir());
  v1::OwnedExperts* owned = nullptr;
  for (const auto& [layer, expert] : set->owned()) {
    // An expert whose weight file shrank under the node fails its calls (DATA_LOSS) until a
    // reload: not offered, so that routers send its rows to intact replicas meanwhile.
    if (const auto weights = set->Find(layer, expert);
        weights.ok() && (*weights)->file != nullptr && (*weights)->file->faulted()) {
      continue;
    }
    if (owned == nullptr || owned->layer() != layer) {
      owned = response->add_owned();
      owned->set_layer(static_cast<int32_t>(layer));
    }
    owned->add_experts(static_cast<int32_t>(expert));
  }
  response->set_weight_type(common::DTypeName(m.weight_type));
  response->set_d_model(static_cast<int32_t>(m.d_model));
  response->set_d_ff(static_cast<int32_t>(m.d_ff));
  response->set_n_layers(static_cast<int32_t>(m.n_layers));
  response->set_n_experts(static_cast<int32_t>(m.n_experts));
  response->set_top_k(static_cast<int32_t>(m.top_k));
  response->set_n_shared_experts(static_cast<int32_t>(m.n_shared_experts));
  response->set_numa_node(options_.numa_node);
  response->set_threads(options_.threads);
  response->set_kernel_isa(options_.kernel_isa);
  response->set_kernel_profile(options_.kernel_profile);
  // The engine runs with the default ExecutorOptions: the kernel profile's thresholds (0: none, sent as -1),
  // those for records where the set has them.
  const int64_t limit = kernels::RowSplitLimit({}, kernels::SelectedKernels(), m.weight_type, set->q8_records());
  response->set_row_split_limit(limit > 0 ? limit : -1);
  response->set_max_rows(engine_->limits().max_rows);
  response->set_max_row_indices(engine_->limits().max_row_indices);
  response->set_reads_kernel_rows(true);
  response->set_state(v1::LOAD_STATE_READY);
  response->set_weights_version(set->version());
  response->set_weights_locked(set->locked());
  {
    // Reload errors name paths and files: only admins see them; others learn that the last reload failed.
    common::MutexLock lock(&mu_);
    if (!last_reload_error_.empty()) {
      response->set_last_reload_error(admin ? last_reload_error_ : "the last reload failed (details: admin callers)");
    }
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  Finish(reactor, "GetNodeInfo", grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* ExpertService::ReloadAs(grpc::CallbackServerContext* context,
                                                  const v1::ReloadRequest* request, v1::ReloadResponse* response,
                                                  bool admin) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!admin) {
    Finish(reactor, "Reload",
           grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        "Reload is an admin call: make it on the node's admin listener (colibri-expert "
                        "--admin_listen) or with a client certificate named in --admin_identities"));
    return reactor;
  }
  ReloadInput input;
  if (absl::Status s = ParseReloadRequest(*request, options_.model_root, &input); !s.ok()) {
    Finish(reactor, "Reload", runtime::ToGrpcStatus(s));
    return reactor;
  }
  grpc::Status refused;  // decided under mu_, answered after it: Finish runs no code of ours under the lock
  {
    common::MutexLock lock(&mu_);
    if (stopping_) {
      refused = grpc::Status(grpc::StatusCode::UNAVAILABLE, "expert node is shutting down");
    } else if (reload_running_) {
      refused = grpc::Status(grpc::StatusCode::ABORTED, "another reload is in progress");
    } else {
      // The previous reload thread has cleared reload_running_ and takes mu_ no more: joining is quick.
      if (reload_thread_.joinable()) reload_thread_.join();
      reload_running_ = true;
      // Loading takes seconds: never on a gRPC thread, never on the compute thread.
      reload_thread_ = std::thread([this, context, reactor, response, input] {
        absl::Status s;
        if (input.drop_model_id.empty()) {
          // A caller gone (its deadline passed, its connection lost) before the
          // swap leaves the node as it was: it would not know to undo it.
          s = ReloadNow(input.model_dir, input.shard, input.keep_previous,
                        [context] { return context->IsCancelled(); });
        } else {
          s = store_->Drop(input.drop_model_id);
          UpdateWeightGauges();
        }
        {
          common::MutexLock guard(&mu_);
          reload_running_ = false;
        }
        if (s.ok()) {
          const std::shared_ptr<const WeightSet> set = store_->Current();
          response->set_weights_version(set->version());
          response->set_model_id(set->model().model_id());
        }
        Finish(reactor, "Reload", runtime::ToGrpcStatus(s));
      });
    }
  }
  if (!refused.ok()) Finish(reactor, "Reload", refused);
  return reactor;
}

}  // namespace expert_node
}  // namespace colibri
