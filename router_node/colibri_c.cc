// The C API (router_node/colibri.h) over colibri::Engine, or over the
// router's core with a RemoteBackend (proxyless, colibri_connect): both are a
// router_node::Router, which every forward call goes through.
//
// Each entry point runs its body inside Guarded(), which clears the thread's
// error, turns a non-OK absl::Status into its colibri_status (same numbers)
// plus a message, and turns any exception into RESOURCE_EXHAUSTED
// (std::bad_alloc) or INTERNAL, so nothing C++ crosses the boundary. The
// message buffer is a fixed thread-local array: recording an error never
// allocates and never throws.

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "common/mutex.h"
#include "common/status_macros.h"
#include "router_node/colibri.h"
#include "router_node/engine.h"
#include "router_node/remote_backend.h"
#include "router_node/remote_router.h"
#include "runtime/flags.h"

struct colibri_engine {
  std::unique_ptr<colibri::Engine> engine;    // colibri_init
  colibri::router_node::RemoteRouter remote;  // colibri_connect
  colibri::router_node::Router* router;       // the one of the two
  absl::Duration call_timeout;                // > 0: each forward call's deadline
};

// The fields of colibri_direct_options after struct_size, in order, and
// whether the first `size` bytes of one hold all of `field`: a caller's
// struct (or a size given to colibri_direct_options_init) may be shorter
// than this library's, and only whole fields are read or written.
#define COLIBRI_DIRECT_FIELDS(X)                                                                           \
  X(nodes)                                                                                                 \
  X(cluster_file)                                                                                          \
  X(node_timeout_ms) X(hedge_after_ms) X(node_replies) X(max_tokens) X(call_timeout_ms) X(batch_window_us) \
      X(batch_max_tokens) X(tls_ca_file) X(tls_cert_file) X(tls_key_file) X(tls_server_name)
#define COLIBRI_COVERS(field, size) \
  (offsetof(colibri_direct_options, field) + sizeof(colibri_direct_options::field) <= (size))

namespace colibri {
namespace {

// The C codes are absl's canonical codes, number for number.
#define COLIBRI_SAME_CODE(c_code, absl_code) \
  static_assert(static_cast<int>(c_code) == static_cast<int>(absl::StatusCode::absl_code), #c_code)
COLIBRI_SAME_CODE(COLIBRI_OK, kOk);
COLIBRI_SAME_CODE(COLIBRI_CANCELLED, kCancelled);
COLIBRI_SAME_CODE(COLIBRI_UNKNOWN, kUnknown);
COLIBRI_SAME_CODE(COLIBRI_INVALID_ARGUMENT, kInvalidArgument);
COLIBRI_SAME_CODE(COLIBRI_DEADLINE_EXCEEDED, kDeadlineExceeded);
COLIBRI_SAME_CODE(COLIBRI_NOT_FOUND, kNotFound);
COLIBRI_SAME_CODE(COLIBRI_ALREADY_EXISTS, kAlreadyExists);
COLIBRI_SAME_CODE(COLIBRI_PERMISSION_DENIED, kPermissionDenied);
COLIBRI_SAME_CODE(COLIBRI_RESOURCE_EXHAUSTED, kResourceExhausted);
COLIBRI_SAME_CODE(COLIBRI_FAILED_PRECONDITION, kFailedPrecondition);
COLIBRI_SAME_CODE(COLIBRI_ABORTED, kAborted);
COLIBRI_SAME_CODE(COLIBRI_OUT_OF_RANGE, kOutOfRange);
COLIBRI_SAME_CODE(COLIBRI_UNIMPLEMENTED, kUnimplemented);
COLIBRI_SAME_CODE(COLIBRI_INTERNAL, kInternal);
COLIBRI_SAME_CODE(COLIBRI_UNAVAILABLE, kUnavailable);
COLIBRI_SAME_CODE(COLIBRI_DATA_LOSS, kDataLoss);
COLIBRI_SAME_CODE(COLIBRI_UNAUTHENTICATED, kUnauthenticated);
#undef COLIBRI_SAME_CODE

// This thread's last error, NUL-terminated; "" after a successful call.
thread_local char last_error[1024];

// Copies `text` into dst[0..capacity), cut to fit, NUL-terminated.
void CopyTruncated(absl::string_view text, char* dst, size_t capacity) {
  const size_t n = std::min(text.size(), capacity - 1);
  std::memcpy(dst, text.data(), n);
  dst[n] = '\0';
}

colibri_status Fail(colibri_status code, absl::string_view prefix, absl::string_view text) noexcept {
  CopyTruncated(prefix, last_error, sizeof(last_error));
  const size_t used = std::strlen(last_error);
  CopyTruncated(text, last_error + used, sizeof(last_error) - used);
  return code;
}

colibri_status Fail(const absl::Status& status) noexcept {
  const int code = static_cast<int>(status.code());
  const colibri_status c_code =
      code > 0 && code <= COLIBRI_UNAUTHENTICATED ? static_cast<colibri_status>(code) : COLIBRI_UNKNOWN;
  return Fail(c_code, "", status.message());
}

// Runs `body` (returning absl::Status) with the error protocol above.
template <typename Body>
colibri_status Guarded(Body&& body) noexcept {
  last_error[0] = '\0';
  try {
    const absl::Status status = body();
    return status.ok() ? COLIBRI_OK : Fail(status);
  } catch (const std::bad_alloc&) {
    return Fail(COLIBRI_RESOURCE_EXHAUSTED, "out of memory", "");
  } catch (const std::exception& e) {
    return Fail(COLIBRI_INTERNAL, "internal error: ", e.what());
  } catch (...) {
    return Fail(COLIBRI_INTERNAL, "internal error: unknown exception", "");
  }
}

absl::Status NotNull(const void* pointer, absl::string_view name) {
  if (pointer != nullptr) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(name, " is NULL"));
}

// The engines colibri_init and colibri_connect returned that colibri_free has
// not freed, with the calls in progress on each: a handle that is not one
// (freed already, or never returned) is refused rather than used, and
// colibri_free waits for the calls on its engine to return.
class LiveEngines {
 public:
  void Add(const colibri_engine* engine) {
    common::MutexLock lock(&mu_);
    engines_[engine] = State();
  }
  // Counts a call on `engine`; false if it is not live or is being freed.
  bool Enter(const colibri_engine* engine) {
    common::MutexLock lock(&mu_);
    const auto it = engines_.find(engine);
    if (it == engines_.end() || it->second.freeing) return false;
    ++it->second.calls;
    return true;
  }
  void Leave(const colibri_engine* engine) {
    common::MutexLock lock(&mu_);
    --engines_[engine].calls;
    left_.SignalAll();
  }
  // Refuses new calls on `engine`, waits for those in progress and forgets
  // it; false if it is not live or another thread is freeing it.
  bool Remove(const colibri_engine* engine) {
    common::MutexLock lock(&mu_);
    const auto it = engines_.find(engine);
    if (it == engines_.end() || it->second.freeing) return false;
    it->second.freeing = true;
    while (it->second.calls > 0) left_.Wait(&mu_);
    engines_.erase(it);
    return true;
  }

 private:
  struct State {
    int64_t calls = 0;
    bool freeing = false;
  };
  common::Mutex mu_;
  common::CondVar left_;
  std::map<const colibri_engine*, State> engines_ ABSL_GUARDED_BY(mu_);
};

LiveEngines& Live() {
  static LiveEngines* live = new LiveEngines();  // never destroyed: engines may be freed at exit
  return *live;
}

// One call on an engine, counted from construction to destruction if the
// handle is live; status() says why not otherwise.
class EngineCall {
 public:
  explicit EngineCall(const colibri_engine* engine)
      : engine_(engine), live_(engine != nullptr && Live().Enter(engine)) {}
  ~EngineCall() {
    if (live_) Live().Leave(engine_);
  }
  EngineCall(const EngineCall&) = delete;
  EngineCall& operator=(const EngineCall&) = delete;
  absl::Status status() const {
    if (live_) return absl::OkStatus();
    if (engine_ == nullptr) return absl::InvalidArgumentError("engine is NULL");
    return absl::InvalidArgumentError(
        "engine is not a live engine: freed by colibri_free, or not returned by colibri_init or colibri_connect");
  }

 private:
  const colibri_engine* const engine_;
  const bool live_;
};

// The caller's options over the defaults; a field the caller's struct_size
// does not cover keeps its default.
absl::StatusOr<Engine::Options> ToEngineOptions(const colibri_options* given) {
  colibri_options o;
  colibri_options_init(&o);
  if (given != nullptr) {
    if (given->struct_size == 0) {
      return absl::InvalidArgumentError("options.struct_size is 0: fill the options with colibri_options_init first");
    }
// True if the caller's struct_size covers all of `field`.
#define COLIBRI_GIVEN(field) (offsetof(colibri_options, field) + sizeof(given->field) <= given->struct_size)
    if (COLIBRI_GIVEN(threads)) o.threads = given->threads;
    if (COLIBRI_GIVEN(numa_node)) o.numa_node = given->numa_node;
    if (COLIBRI_GIVEN(lock_memory)) o.lock_memory = given->lock_memory;
    if (COLIBRI_GIVEN(verify_checksums)) o.verify_checksums = given->verify_checksums;
    if (COLIBRI_GIVEN(max_tokens)) o.max_tokens = given->max_tokens;
#undef COLIBRI_GIVEN
  }
  if (o.threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.threads ", o.threads, " is negative (0: one per allowed CPU)"));
  }
  if (o.numa_node < -1) {
    return absl::InvalidArgumentError(absl::StrCat("options.numa_node ", o.numa_node, " is below -1 (-1: none)"));
  }
  Engine::Options options;
  options.threads = o.threads;
  options.numa_node = o.numa_node;
  options.lock_memory = o.lock_memory != 0;
  options.verify_checksums = o.verify_checksums != 0;
  options.max_tokens = o.max_tokens;
  return options;
}

std::string OrEmpty(const char* text) { return text == nullptr ? std::string() : std::string(text); }

absl::Status InRange(int64_t value, int64_t lo, int64_t hi, absl::string_view field) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("options.", field, " ", value, " is outside [", lo, ", ", hi, "]"));
}

// The library options named in the core's errors, and the C fields that set them:
// colibri_init's, and colibri_connect's.
const runtime::OptionFlags kInitFields = {
    {"RouterOptions::max_tokens", "options.max_tokens"},
    {"ThreadPool::Options::numa_node", "options.numa_node"},
    {"Engine::Options::lock_memory, hugepages and numa_node", "options.lock_memory and options.numa_node"},
};
const runtime::OptionFlags kDirectFields = {
    {"RemoteOptions::addresses", "options.nodes"},
    {"RemoteOptions::cluster_file", "options.cluster_file"},
    {"RemoteOptions::tls_ca_file", "options.tls_ca_file"},
    {"RemoteOptions::tls_cert_file", "options.tls_cert_file"},
    {"RemoteOptions::tls_key_file", "options.tls_key_file"},
    {"RemoteOptions::tls_server_name", "options.tls_server_name"},
    {"RouterOptions::max_tokens", "options.max_tokens"},
    {"BatchOptions::max_tokens", "options.batch_max_tokens"},
};

// The router's core over nodes as `given` says (the defaults where its
// struct_size does not reach), for the model in `model_path`.
absl::Status ConnectDirect(const char* model_path, const colibri_direct_options* given, colibri_engine* engine) {
  colibri_direct_options o;
  colibri_direct_options_init(&o, sizeof(o));
  if (given != nullptr) {
    if (given->struct_size == 0) {
      return absl::InvalidArgumentError(
          "options.struct_size is 0: fill the options with colibri_direct_options_init first");
    }
#define COLIBRI_TAKE(field) \
  if (COLIBRI_COVERS(field, given->struct_size)) o.field = given->field;
    COLIBRI_DIRECT_FIELDS(COLIBRI_TAKE)
#undef COLIBRI_TAKE
  }
  router_node::RemoteOptions remote;
  // Addresses trimmed; empty entries ("a,,b", a trailing comma) skipped.
  for (absl::string_view a : absl::StrSplit(o.nodes == nullptr ? "" : o.nodes, ',')) {
    a = absl::StripAsciiWhitespace(a);
    if (!a.empty()) remote.addresses.emplace_back(a);
  }
  remote.cluster_file = OrEmpty(o.cluster_file);
  if (remote.addresses.empty() == remote.cluster_file.empty()) {
    return absl::InvalidArgumentError("give exactly one of options.nodes (host:port,...) and options.cluster_file");
  }
  constexpr int64_t kHourMs = 3600 * 1000;
  COLIBRI_RETURN_IF_ERROR(InRange(o.node_timeout_ms, 1, kHourMs, "node_timeout_ms"));
  COLIBRI_RETURN_IF_ERROR(InRange(o.hedge_after_ms, 0, kHourMs, "hedge_after_ms"));
  COLIBRI_RETURN_IF_ERROR(InRange(o.call_timeout_ms, 0, 24 * kHourMs, "call_timeout_ms"));
  COLIBRI_RETURN_IF_ERROR(InRange(o.max_tokens, 1, int64_t{1} << 24, "max_tokens"));
  COLIBRI_RETURN_IF_ERROR(InRange(o.batch_window_us, 0, 1000 * 1000, "batch_window_us"));
  COLIBRI_RETURN_IF_ERROR(InRange(o.batch_max_tokens, 1, int64_t{1} << 24, "batch_max_tokens"));
  remote.node_timeout = absl::Milliseconds(o.node_timeout_ms);
  remote.hedge_after = absl::Milliseconds(o.hedge_after_ms);
  switch (o.node_replies) {
    case COLIBRI_NODE_REPLIES_EXACT: remote.replies = router_node::NodeReplies::kExact; break;
    case COLIBRI_NODE_REPLIES_PARTIAL: remote.replies = router_node::NodeReplies::kPartial; break;
    case COLIBRI_NODE_REPLIES_PER_EXPERT: remote.replies = router_node::NodeReplies::kPerExpert; break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("options.node_replies ", o.node_replies, " is not EXACT (1), PARTIAL (2) or PER_EXPERT (3)"));
  }
  remote.tls_ca_file = OrEmpty(o.tls_ca_file);
  remote.tls_cert_file = OrEmpty(o.tls_cert_file);
  remote.tls_key_file = OrEmpty(o.tls_key_file);
  remote.tls_server_name = OrEmpty(o.tls_server_name);
  router_node::RouterOptions router;
  router.max_tokens = o.max_tokens;
  router.batching.window = absl::Microseconds(o.batch_window_us);
  router.batching.max_tokens = o.batch_max_tokens;
  absl::StatusOr<router_node::RemoteRouter> core = router_node::MakeRemoteRouter(model_path, std::move(remote), router);
  if (!core.ok()) return runtime::NameFlags(core.status(), kDirectFields);
  engine->remote = std::move(*core);
  engine->router = engine->remote.router.get();
  engine->call_timeout = absl::Milliseconds(o.call_timeout_ms);
  return absl::OkStatus();
}

// One forward call on either kind of engine.
absl::StatusOr<router_node::ForwardOutput> RunForward(colibri_engine* engine, const router_node::ForwardInput& in) {
  router_node::CallControl control(engine->call_timeout > absl::ZeroDuration() ? absl::Now() + engine->call_timeout
                                                                               : absl::InfiniteFuture());
  absl::StatusOr<router_node::ForwardOutput> out = engine->router->Forward(in, control);
  // The caller is its own operator: an unreachable expert names its nodes and why.
  if (!out.ok()) return router_node::WithNodeProblems(out.status(), engine->router->backend());
  return out;
}

// Checks shared by both forward calls. After it, n_tokens * d_model and
// n_tokens * top_k fit easily (max_tokens <= 2^24, d_model <= 2^20).
absl::Status CheckBatch(const colibri_engine* engine, int64_t n_tokens) {
  if (n_tokens < 0) return absl::InvalidArgumentError(absl::StrCat("n_tokens ", n_tokens, " is negative"));
  const int64_t max_tokens = engine->router->max_tokens();
  if (n_tokens > max_tokens) {
    return absl::ResourceExhaustedError(
        absl::StrCat("n_tokens ", n_tokens, " exceeds the limit of ", max_tokens, " (options.max_tokens)"));
  }
  return absl::OkStatus();
}

// Stands in for a pointer the caller may leave NULL when n_tokens is 0, so
// the engine never sees (or memcpy's with) a null pointer.
float nothing_f32[1];
int32_t nothing_i32[1];

absl::StatusOr<common::RoutingMode> ToRoutingMode(int32_t routing) {
  switch (routing) {
    case COLIBRI_ROUTING_LUT: return common::RoutingMode::kLut;
    case COLIBRI_ROUTING_GATE: return common::RoutingMode::kGate;
    case COLIBRI_ROUTING_CLIENT: return common::RoutingMode::kClient;
  }
  return absl::InvalidArgumentError(absl::StrCat("routing ", routing, " is not LUT (1), GATE (2) or CLIENT (3)"));
}

}  // namespace
}  // namespace colibri

using colibri::Guarded;
using colibri::NotNull;

extern "C" {

int colibri_abi_version(void) { return COLIBRI_ABI_VERSION; }

void colibri_options_init(colibri_options* options) {
  if (options == nullptr) return;
  options->struct_size = sizeof(colibri_options);
  options->threads = 0;
  options->numa_node = -1;
  options->lock_memory = 0;
  options->verify_checksums = 1;
  options->max_tokens = 65536;
}

colibri_status colibri_init(const char* model_path, const colibri_options* options, colibri_engine** out) {
  if (out != nullptr) *out = nullptr;
  return Guarded([&]() -> absl::Status {
    COLIBRI_RETURN_IF_ERROR(NotNull(out, "out"));
    COLIBRI_RETURN_IF_ERROR(NotNull(model_path, "model_path"));
    COLIBRI_ASSIGN_OR_RETURN(const colibri::Engine::Options engine_options, colibri::ToEngineOptions(options));
    absl::StatusOr<std::unique_ptr<colibri::Engine>> opened = colibri::Engine::Open(model_path, engine_options);
    if (!opened.ok()) return colibri::runtime::NameFlags(opened.status(), colibri::kInitFields);
    std::unique_ptr<colibri::Engine> engine = *std::move(opened);
    colibri::router_node::Router* router = &engine->router();
    *out = new colibri_engine{std::move(engine), {}, router, absl::ZeroDuration()};
    colibri::Live().Add(*out);
    return absl::OkStatus();
  });
}

void colibri_direct_options_init(colibri_direct_options* options, uint32_t size) {
  if (options == nullptr) return;
  colibri_direct_options o;
  std::memset(&o, 0, sizeof(o));
  o.struct_size = static_cast<uint32_t>(std::min<size_t>(size, sizeof(o)));
  o.node_timeout_ms = 5000;
  o.node_replies = COLIBRI_NODE_REPLIES_EXACT;
  o.max_tokens = 65536;
  o.batch_window_us = 5000;
  o.batch_max_tokens = 256;
  if (COLIBRI_COVERS(struct_size, size)) options->struct_size = o.struct_size;
#define COLIBRI_PUT(field) \
  if (COLIBRI_COVERS(field, size)) options->field = o.field;
  COLIBRI_DIRECT_FIELDS(COLIBRI_PUT)
#undef COLIBRI_PUT
}

colibri_status colibri_connect(const char* model_path, const colibri_direct_options* options, colibri_engine** out) {
  if (out != nullptr) *out = nullptr;
  return Guarded([&]() -> absl::Status {
    COLIBRI_RETURN_IF_ERROR(NotNull(out, "out"));
    COLIBRI_RETURN_IF_ERROR(NotNull(model_path, "model_path"));
    auto engine = std::make_unique<colibri_engine>();
    COLIBRI_RETURN_IF_ERROR(colibri::ConnectDirect(model_path, options, engine.get()));
    *out = engine.release();
    colibri::Live().Add(*out);
    return absl::OkStatus();
  });
}

// The LUT case of colibri_forward.
colibri_status colibri_forward_batch(colibri_engine* engine, int32_t layer, const int32_t* token_ids, int64_t n_tokens,
                                     const float* hidden_in, float* hidden_out) {
  return colibri_forward(engine, layer, COLIBRI_ROUTING_LUT, token_ids, n_tokens, hidden_in, nullptr, nullptr,
                         hidden_out, nullptr, nullptr);
}

colibri_status colibri_forward(colibri_engine* engine, int32_t layer, int32_t routing, const int32_t* token_ids,
                               int64_t n_tokens, const float* hidden_in, const int32_t* route_experts,
                               const float* route_weights, float* hidden_out, int32_t* routes_out_experts,
                               float* routes_out_weights) {
  return Guarded([&]() -> absl::Status {
    namespace rn = colibri::router_node;
    const colibri::EngineCall call(engine);
    COLIBRI_RETURN_IF_ERROR(call.status());
    COLIBRI_RETURN_IF_ERROR(colibri::CheckBatch(engine, n_tokens));
    COLIBRI_ASSIGN_OR_RETURN(const colibri::common::RoutingMode mode, colibri::ToRoutingMode(routing));
    if (n_tokens == 0) {
      token_ids = route_experts = colibri::nothing_i32;
      hidden_in = route_weights = hidden_out = colibri::nothing_f32;
    }
    COLIBRI_RETURN_IF_ERROR(NotNull(hidden_in, "hidden_in"));
    COLIBRI_RETURN_IF_ERROR(NotNull(hidden_out, "hidden_out"));
    if (mode == colibri::common::RoutingMode::kLut) COLIBRI_RETURN_IF_ERROR(NotNull(token_ids, "token_ids"));
    if (mode == colibri::common::RoutingMode::kClient) {
      COLIBRI_RETURN_IF_ERROR(NotNull(route_experts, "route_experts"));
      COLIBRI_RETURN_IF_ERROR(NotNull(route_weights, "route_weights"));
    }

    const colibri::common::Manifest& m = engine->router->manifest();
    const size_t tokens = static_cast<size_t>(n_tokens);
    const size_t values = tokens * static_cast<size_t>(m.d_model);
    const size_t slots = tokens * static_cast<size_t>(m.top_k);
    rn::ForwardInput in;
    in.layer = layer;
    in.routing = mode;
    if (mode == colibri::common::RoutingMode::kLut) in.token_ids = absl::MakeConstSpan(token_ids, tokens);
    in.hidden = hidden_in;
    in.hidden_bytes = static_cast<int64_t>(values * sizeof(float));
    in.hidden_dtype = colibri::common::DType::kF32;
    in.num_tokens = n_tokens;
    in.cols = m.d_model;
    if (mode == colibri::common::RoutingMode::kClient) {
      in.client_top_k = m.top_k;
      in.client_expert_ids = absl::MakeConstSpan(route_experts, slots);
      in.client_weights = absl::MakeConstSpan(route_weights, slots);
    }
    in.output_dtype = colibri::common::DType::kF32;
    COLIBRI_ASSIGN_OR_RETURN(const rn::ForwardOutput result, colibri::RunForward(engine, in));
    if (result.output.size() != values * sizeof(float) || result.routes.expert_ids.size() != slots ||
        result.routes.weights.size() != slots) {
      return absl::InternalError(absl::StrCat("forward returned ", result.output.size(), " output bytes and ",
                                              result.routes.expert_ids.size(), " routes; expected ",
                                              values * sizeof(float), " and ", slots));
    }
    if (tokens == 0) return absl::OkStatus();
    std::memcpy(hidden_out, result.output.data(), result.output.size());
    if (routes_out_experts != nullptr) {
      std::memcpy(routes_out_experts, result.routes.expert_ids.data(), slots * sizeof(int32_t));
    }
    if (routes_out_weights != nullptr) {
      std::memcpy(routes_out_weights, result.routes.weights.data(), slots * sizeof(float));
    }
    return absl::OkStatus();
  });
}

colibri_status colibri_get_model_info(const colibri_engine* engine, colibri_model_info* out) {
  return Guarded([&]() -> absl::Status {
    const colibri::EngineCall call(engine);
    COLIBRI_RETURN_IF_ERROR(call.status());
    COLIBRI_RETURN_IF_ERROR(NotNull(out, "out"));
    const colibri::router_node::Router& router = *engine->router;
    const colibri::common::Manifest& m = router.manifest();
    colibri_model_info info;
    std::memset(&info, 0, sizeof(info));
    info.d_model = m.d_model;
    info.d_ff = m.d_ff;
    info.n_layers = m.n_layers;
    info.n_experts = m.n_experts;
    info.top_k = m.top_k;
    info.vocab_size = m.vocab_size;
    colibri::CopyTruncated(colibri::common::DTypeName(m.weight_type), info.weight_type, sizeof(info.weight_type));
    colibri::CopyTruncated(router.model_id(), info.model_id, sizeof(info.model_id));
    *out = info;
    return absl::OkStatus();
  });
}

colibri_status colibri_get_shared_experts(const colibri_engine* engine, int64_t* count, int64_t* d_ff) {
  return Guarded([&]() -> absl::Status {
    const colibri::EngineCall call(engine);
    COLIBRI_RETURN_IF_ERROR(call.status());
    COLIBRI_RETURN_IF_ERROR(NotNull(count, "count"));
    COLIBRI_RETURN_IF_ERROR(NotNull(d_ff, "d_ff"));
    const colibri::common::Manifest& m = engine->router->manifest();
    *count = m.n_shared_experts;
    *d_ff = m.shared_d_ff;
    return absl::OkStatus();
  });
}

const char* colibri_last_error(const colibri_engine* /*engine*/) { return colibri::last_error; }

void colibri_free(colibri_engine* engine) {
  // NULL, freed already (or being freed) or not an engine: nothing to free.
  if (engine == nullptr || !colibri::Live().Remove(engine)) return;
  // A merged call whose callers gave up (call_timeout_ms) may still use the nodes' backend.
  if (engine->remote.router != nullptr) colibri::router_node::AwaitIdle(engine->remote);
  delete engine;
}

}  // extern "C"
