#include "router_node/router.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/mutex.h"
#include "common/status_macros.h"

namespace colibri {
namespace router_node {
namespace {

int64_t NanosSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

int64_t ElementBytes(common::DType t) {
  switch (t) {
    case common::DType::kF32: return 4;
    case common::DType::kBF16:
    case common::DType::kF16: return 2;
    default: return 0;
  }
}

// hidden [T][d_model] of f32/bf16/f16 -> f32 (both 16-bit types widen exactly).
void ToF32(const ForwardInput& in, float* x) {
  const int64_t n = in.num_tokens * in.cols;
  const auto* bytes = static_cast<const uint8_t*>(in.hidden);
  if (in.hidden_dtype == common::DType::kF32) {
    if (n > 0) std::memcpy(x, bytes, n * 4);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, bytes + 2 * i, 2);
    x[i] = in.hidden_dtype == common::DType::kBF16 ? common::Bf16ToFloat(h) : common::F16ToFloat(h);
  }
}

void FromF32(const std::vector<float>& y, common::DType dtype, std::string* out) {
  if (dtype == common::DType::kF32) {
    out->assign(reinterpret_cast<const char*>(y.data()), y.size() * 4);
    return;
  }
  out->resize(y.size() * 2);
  for (size_t i = 0; i < y.size(); ++i) {
    const uint16_t h = dtype == common::DType::kBF16 ? common::FloatToBf16(y[i]) : common::FloatToF16(y[i]);
    std::memcpy(&(*out)[2 * i], &h, 2);
  }
}

absl::Status CheckClientRoutes(const ForwardInput& in, const common::Manifest& m) {
  if (in.client_top_k != m.top_k) {
    return absl::InvalidArgumentError(absl::StrCat("routes.top_k = ", in.client_top_k, " must equal the model's top_k ",
                                                   m.top_k,
                                                   in.client_top_k == 0 && in.client_expert_ids.empty()
                                                       ? " (routing CLIENT needs the request's routes: none given)"
                                                       : ""));
  }
  const int64_t slots = in.num_tokens * m.top_k;
  if (static_cast<int64_t>(in.client_expert_ids.size()) != slots) {
    return absl::InvalidArgumentError(absl::StrCat("routes.expert_ids has ", in.client_expert_ids.size(),
                                                   " entries; must be tokens x top_k = ", slots));
  }
  if (static_cast<int64_t>(in.client_weights.size()) != slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("routes.weights has ", in.client_weights.size(), " entries; must be tokens x top_k = ", slots));
  }
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t e = in.client_expert_ids[s];
    if (e < 0 || e >= m.n_experts) {
      return absl::InvalidArgumentError(
          absl::StrCat("routes.expert_ids[", s, "] = ", e, " is outside [0, ", m.n_experts, ")"));
    }
    for (int64_t j = s - s % m.top_k; j < s; ++j) {
      if (in.client_expert_ids[j] == e) {
        return absl::InvalidArgumentError(
            absl::StrCat("routes.expert_ids[", s, "] = ", e, ": expert repeated for token ", s / m.top_k));
      }
    }
    // Non-negative, as every family's gate makes them and a model's lookup table must hold them.
    if (!std::isfinite(in.client_weights[s]) || in.client_weights[s] < 0.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat("routes.weights[", s, "] = ", in.client_weights[s], " is not a finite number >= 0"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<TimingSpan> TimingSpans(const ForwardOutput& out) {
  const StageTimings& t = out.timings;
  std::vector<TimingSpan> spans = {{"route", 0, t.route_nanos, ""},
                                   {"dispatch", t.route_nanos, t.dispatch_nanos, ""},
                                   {"aggregate", t.route_nanos + t.dispatch_nanos, t.aggregate_nanos, ""},
                                   {"total", 0, t.total_nanos, ""}};
  if (t.merged_callers > 1 || t.queue_nanos > 0) {  // merged, or waited for others (a lone call sent at once: 0)
    spans.push_back({"queue", t.route_nanos, t.queue_nanos,
                     absl::StrCat("callers ", t.merged_callers, " tokens ", t.merged_tokens)});
  }
  // Node calls are timed from the start of the backend's call: after the queue.
  const int64_t sent = t.route_nanos + t.queue_nanos;
  // A merged call's node calls carry the other callers' tokens too: which
  // experts they went to (with LUT routing, a function of their token ids)
  // is theirs, so a merged caller sees only the calls' sizes.
  const bool merged = t.merged_callers > 1;
  for (const NodeCallRecord& c : out.backend.calls) {
    const std::string detail = absl::StrCat(merged ? "merged call" : absl::StrCat("experts ", c.experts_list), " rows ",
                                            c.rows, c.attempt > 0 ? " retry" : "", c.hedge ? " hedge" : "");
    spans.push_back({absl::StrCat("node:", c.node), sent + c.start_nanos, c.end_nanos - c.start_nanos, detail, c.rows,
                     c.bytes_sent, c.bytes_received});
    spans.push_back({absl::StrCat("node_compute:", c.node), sent + c.end_nanos - c.node_compute_nanos,
                     c.node_compute_nanos, detail});
  }
  return spans;
}

Router::Router(std::unique_ptr<common::ModelDir> model, ExpertBackend* backend, const RouterOptions& options)
    : model_(std::move(model)), backend_(backend), options_(options) {}

absl::StatusOr<std::unique_ptr<Router>> Router::Create(const std::string& model_dir, ExpertBackend* backend,
                                                       const RouterOptions& options) {
  if (options.max_tokens < 1 || options.max_tokens > (int64_t{1} << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("RouterOptions::max_tokens ", options.max_tokens, " must be in [1, 2^24]"));
  }
  COLIBRI_ASSIGN_OR_RETURN(std::unique_ptr<common::ModelDir> model, common::ModelDir::Open(model_dir));
  std::unique_ptr<Router> r(new Router(std::move(model), backend, options));
  const common::Manifest& m = r->manifest();
  for (int64_t layer = 0; layer < m.n_layers; ++layer) {
    COLIBRI_ASSIGN_OR_RETURN(std::unique_ptr<common::LayerRouting> routing,
                             r->model_->LoadRouting(layer, options.verify_checksums));
    r->routing_.push_back(std::move(routing));
  }
  const int64_t pairs = m.n_layers * m.total_experts();  // shared experts counted too
  r->tokens_ = std::make_unique<std::atomic<int64_t>[]>(pairs);
  for (int64_t i = 0; i < pairs; ++i) r->tokens_[i].store(0, std::memory_order_relaxed);
  if (options.metrics != nullptr) {
    for (int64_t i = 0; i < pairs; ++i) {
      r->token_counters_.push_back(options.metrics->GetCounter(
          "colibri_router_expert_tokens_total", "Token rows routed to each (layer, expert).",
          {{"layer", std::to_string(i / m.total_experts())}, {"expert", std::to_string(i % m.total_experts())}}));
    }
  }
  if (options.batching.window > absl::ZeroDuration()) {
    if (options.batching.max_tokens < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("BatchOptions::max_tokens ", options.batching.max_tokens, " must be >= 1"));
    }
    BatchOptions batching = options.batching;
    batching.max_tokens = std::min(batching.max_tokens, options.max_tokens);
    batching.metrics = options.metrics;
    r->batcher_ = std::make_unique<LayerBatcher>(backend, m.n_layers, m.d_model, batching);
  }
  return r;
}

int64_t Router::tokens_routed(int64_t layer, int64_t expert) const {
  const common::Manifest& m = manifest();
  if (layer < 0 || layer >= m.n_layers || expert < 0 || expert >= m.total_experts()) return 0;
  return tokens_[layer * m.total_experts() + expert].load(std::memory_order_relaxed);
}

void Router::CountRoutes(int32_t layer, const common::Routes& routes) {
  const int64_t base = layer * manifest().total_experts();
  for (const int32_t e : routes.expert_ids) {
    tokens_[base + e].fetch_add(1, std::memory_order_relaxed);
    if (!token_counters_.empty()) token_counters_[base + e]->Increment();
  }
}

absl::StatusOr<common::Routes> Router::Route(const ForwardInput& in, const float* x) const {
  const common::Manifest& m = manifest();
  const common::LayerRouting& table = *routing_[in.layer];
  switch (in.routing) {
    case common::RoutingMode::kLut:
      if (static_cast<int64_t>(in.token_ids.size()) != in.num_tokens) {
        return absl::InvalidArgumentError(absl::StrCat("token_ids has ", in.token_ids.size(),
                                                       " ids; lut routing needs one per token (", in.num_tokens, ")"));
      }
      return common::RouteByLut(table.lut_ids, table.lut_weights, m.vocab_size, m.top_k, in.token_ids);
    case common::RoutingMode::kGate:
      return common::RouteByGateSpec(m.routing, table.gate, table.bias, m.n_experts, m.d_model, m.top_k,
                                     m.norm_topk_prob, x, in.num_tokens);
    case common::RoutingMode::kClient: {
      COLIBRI_RETURN_IF_ERROR(CheckClientRoutes(in, m));
      common::Routes routes;
      routes.top_k = m.top_k;
      routes.expert_ids.assign(in.client_expert_ids.begin(), in.client_expert_ids.end());
      routes.weights.assign(in.client_weights.begin(), in.client_weights.end());
      return routes;
    }
  }
  return absl::InvalidArgumentError("routing: unknown mode");
}

struct Router::Pending {
  std::chrono::steady_clock::time_point start;
  std::chrono::steady_clock::time_point dispatch;
  std::vector<float> x;  // the hidden states in f32
  ForwardOutput out;
  common::Routes with_shared;    // the routes with the shared experts, if the model has any
  const common::Routes* routes;  // the routes computed: out.routes or with_shared
  LayerWork work;
  std::vector<float> slots;  // [num_slots][d_model]
  BatchInfo batch;           // when merged with other callers
  // Merged calls: the client's bf16 rows, copied (the caller may be answered
  // — and its request freed — while the merged call still reads them).
  std::vector<uint16_t> x_bf16;
  std::shared_ptr<void> hold;  // ForwardInput::hold
};

absl::Status Router::CheckShape(const ForwardInput& in) const {
  const common::Manifest& m = manifest();
  if (in.layer < 0 || in.layer >= m.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", in.layer, " is outside [0, ", m.n_layers, ")"));
  }
  const int64_t element = ElementBytes(in.hidden_dtype);
  if (element == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden.dtype ", common::DTypeName(in.hidden_dtype), " is not supported (f32, bf16 or f16)"));
  }
  if (ElementBytes(in.output_dtype) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("output_dtype ", common::DTypeName(in.output_dtype), " is not supported (f32, bf16 or f16)"));
  }
  if (in.cols != m.d_model || in.num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden.shape [", in.num_tokens, ", ", in.cols, "] must be [T, ", m.d_model, "] (d_model)"));
  }
  // Before the token limit: a shape its data does not fill is malformed, not too large.
  // Divided, not multiplied: num_tokens is not bounded yet.
  const int64_t row_bytes = m.d_model * element;
  if (in.hidden_bytes % row_bytes != 0 || in.hidden_bytes / row_bytes != in.num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("hidden.data has ", in.hidden_bytes, " bytes, not the ", row_bytes,
                                                   " per row × ", in.num_tokens, " rows of [", in.num_tokens, ", ",
                                                   m.d_model, "] ", common::DTypeName(in.hidden_dtype)));
  }
  if (in.num_tokens > options_.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("hidden.shape: ", in.num_tokens, " tokens exceed the limit of ",
                                                     options_.max_tokens, " (RouterOptions::max_tokens)"));
  }
  if (in.request_id.size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_id is ", in.request_id.size(), " bytes; at most ", kMaxRequestIdBytes));
  }
  return absl::OkStatus();
}

absl::Status Router::Prepare(const ForwardInput& in, Pending* p) const {
  p->start = std::chrono::steady_clock::now();
  COLIBRI_RETURN_IF_ERROR(CheckShape(in));
  const common::Manifest& m = manifest();
  p->x.resize(in.num_tokens * m.d_model);
  ToF32(in, p->x.data());
  // Every mode: a NaN or Inf would make the gate's (or a shared expert's
  // gate's) weights NaN, and nodes refuse non-finite inputs.
  for (int64_t i = 0; i < in.num_tokens * m.d_model; ++i) {
    if (!std::isfinite(p->x[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("hidden[", i / m.d_model, "][", i % m.d_model, "] = ", p->x[i], " is not finite"));
    }
  }

  ForwardOutput& out = p->out;
  out.output_dtype = in.output_dtype;
  COLIBRI_ASSIGN_OR_RETURN(out.routes, Route(in, p->x.data()));
  // Every token's shared experts follow its routed ones (out.routes keeps
  // the routed ones only: they are what a client sends and gets back).
  if (m.n_shared_experts > 0) {
    p->with_shared = common::AppendSharedExperts(out.routes, m.n_experts, m.n_shared_experts,
                                                 routing_[in.layer]->shared_gate, m.d_model, p->x.data());
  }
  p->routes = m.n_shared_experts > 0 ? &p->with_shared : &out.routes;
  const common::Routes& routes = *p->routes;
  const int64_t width = routes.top_k;  // slots per token
  out.timings.route_nanos = NanosSince(p->start);

  // Plan: each (token, rank) is a slot; group slots by expert, ascending.
  LayerWork& work = p->work;
  work.layer = in.layer;
  work.x = p->x.data();
  if (in.hidden_dtype == common::DType::kBF16) work.x_bf16 = static_cast<const uint16_t*>(in.hidden);
  work.num_tokens = in.num_tokens;
  work.num_slots = in.num_tokens * width;
  work.bf16_output = in.output_dtype == common::DType::kBF16;
  work.request_id = in.request_id;
  std::vector<int32_t> index(m.total_experts(), -1);  // expert -> position in work.experts
  std::vector<int32_t> order;
  for (const int32_t e : routes.expert_ids) {
    if (index[e] < 0) {
      index[e] = 0;
      order.push_back(e);
    }
  }
  std::sort(order.begin(), order.end());
  for (size_t i = 0; i < order.size(); ++i) index[order[i]] = static_cast<int32_t>(i);
  work.experts.resize(order.size());
  for (size_t i = 0; i < order.size(); ++i) work.experts[i].expert = order[i];
  for (int64_t s = 0; s < work.num_slots; ++s) {
    ExpertWork& w = work.experts[index[routes.expert_ids[s]]];
    w.rows.push_back(static_cast<int32_t>(s / width));
    w.weights.push_back(routes.weights[s]);
    w.slots.push_back(static_cast<int32_t>(s));
  }
  p->slots.assign(work.num_slots * m.d_model, 0.f);
  return absl::OkStatus();
}

ForwardOutput Router::Aggregate(Pending& p) {
  ForwardOutput& out = p.out;
  out.timings.dispatch_nanos = NanosSince(p.dispatch);
  out.timings.queue_nanos = p.batch.queue_nanos;
  out.timings.merged_callers = p.batch.callers;
  out.timings.merged_tokens = p.batch.tokens;
  // Each token's slots in route order, the shared experts last.
  const auto aggregate = std::chrono::steady_clock::now();
  const int64_t d_model = manifest().d_model;
  const int64_t width = p.routes->top_k;
  const int64_t num_tokens = p.work.num_tokens;
  std::vector<float> y(num_tokens * d_model);
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* dst = y.data() + t * d_model;
    const float* src = p.slots.data() + t * width * d_model;
    std::memcpy(dst, src, d_model * sizeof(float));
    for (int64_t j = 1; j < width; ++j) {
      const float* s = src + j * d_model;
      for (int64_t c = 0; c < d_model; ++c) dst[c] += s[c];
    }
  }
  FromF32(y, out.output_dtype, &out.output);
  CountRoutes(p.work.layer, *p.routes);
  requests_.fetch_add(1, std::memory_order_relaxed);
  out.timings.aggregate_nanos = NanosSince(aggregate);
  out.timings.total_nanos = NanosSince(p.start);
  return std::move(out);
}

void Router::ForwardAsync(const ForwardInput& in, CallControl& control,
                          std::function<void(absl::StatusOr<ForwardOutput>)> done) {
  auto p = std::make_shared<Pending>();
  p->hold = in.hold;
  absl::Status s = Prepare(in, p.get());
  if (!s.ok()) return done(std::move(s));
  p->dispatch = std::chrono::steady_clock::now();
  if (p->work.experts.empty()) return done(Aggregate(*p));
  if (batcher_ != nullptr && batcher_->Accepts(p->work)) {
    if (p->work.x_bf16 != nullptr) {
      p->x_bf16.assign(p->work.x_bf16, p->work.x_bf16 + in.num_tokens * in.cols);
      p->work.x_bf16 = p->x_bf16.data();
    }
    BatchCall call;
    call.work = &p->work;
    call.slots = p->slots.data();
    call.stats = &p->out.backend;
    call.info = &p->batch;
    call.control = &control;
    call.keep = p;
    call.done = [this, p, done = std::move(done)](absl::Status status) {
      if (!status.ok()) return done(std::move(status));
      done(Aggregate(*p));
    };
    return batcher_->Submit(std::move(call));
  }
  backend_->ComputeAsync(p->work, p->slots.data(), control, &p->out.backend,
                         [this, p, done = std::move(done)](absl::Status status) {
                           if (!status.ok()) return done(std::move(status));
                           done(Aggregate(*p));
                         });
}

absl::StatusOr<ForwardOutput> Router::Forward(const ForwardInput& in, CallControl& control) {
  common::Notification finished;
  absl::StatusOr<ForwardOutput> result;
  ForwardAsync(in, control, [&](absl::StatusOr<ForwardOutput> r) {
    result = std::move(r);
    finished.Notify();
  });
  finished.WaitForNotification();
  return result;
}

}  // namespace router_node
}  // namespace colibri
