#include "tools/load_bench.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "clients/cpp/client.h"
#include "common/model_dir.h"
#include "common/mutex.h"
#include "common/status_macros.h"
#include "kernels/reference_moe.h"
#include "router_node/engine.h"

namespace colibri {
namespace tools {
namespace {

using Clock = std::chrono::steady_clock;

// Forward through a router (stream or unary) or the in-process engine, with
// results in the client's types either way.
class Target {
 public:
  virtual ~Target() = default;
  virtual absl::StatusOr<client::ForwardResult> Forward(const client::ForwardArgs& args) = 0;
};

class RouterTarget final : public Target {
 public:
  RouterTarget(client::Client* client, std::unique_ptr<client::Session> session)
      : client_(client), session_(std::move(session)) {}
  absl::StatusOr<client::ForwardResult> Forward(const client::ForwardArgs& args) override {
    return session_ != nullptr ? session_->Forward(args) : client_->Forward(args);
  }

 private:
  client::Client* client_;
  std::unique_ptr<client::Session> session_;
};

// The client's name of a routing mode (lut or gate).
client::Routing ToClientRouting(common::RoutingMode mode) {
  return mode == common::RoutingMode::kGate ? client::Routing::kGate : client::Routing::kLut;
}

// Runs every call with `routing` (the run's mode, also in the args).
class EngineTarget final : public Target {
 public:
  EngineTarget(Engine* engine, common::RoutingMode routing) : engine_(engine), routing_(routing) {}
  absl::StatusOr<client::ForwardResult> Forward(const client::ForwardArgs& args) override {
    router_node::ForwardInput in;
    in.layer = args.layer;
    in.token_ids = args.token_ids;
    in.hidden = args.hidden.data();
    in.hidden_bytes = static_cast<int64_t>(args.hidden.size() * 4);
    in.cols = engine_->manifest().d_model;
    in.num_tokens = static_cast<int64_t>(args.hidden.size()) / in.cols;
    in.routing = args.routing == client::Routing::kClient ? common::RoutingMode::kClient : routing_;
    in.client_top_k = args.routes.top_k;
    in.client_expert_ids = args.routes.expert_ids;
    in.client_weights = args.routes.weights;
    COLIBRI_ASSIGN_OR_RETURN(router_node::ForwardOutput out, engine_->Forward(in));
    client::ForwardResult r;
    r.output.resize(out.output.size() / 4);
    std::memcpy(r.output.data(), out.output.data(), out.output.size());
    r.routes.top_k = static_cast<int32_t>(out.routes.top_k);
    r.routes.expert_ids = std::move(out.routes.expert_ids);
    r.routes.weights = std::move(out.routes.weights);
    for (router_node::TimingSpan& span : router_node::TimingSpans(out)) {
      r.timings.push_back({std::move(span.stage), span.start_nanos, span.nanos, std::move(span.detail)});
    }
    return r;
  }

 private:
  Engine* engine_;
  const common::RoutingMode routing_;
};

struct Model {
  int64_t d_model = 0, n_layers = 0, n_experts = 0, top_k = 0, vocab = 0;
  std::string weight_type, backend;
};

struct CallRecord {
  int client = 0;
  int32_t layer = 0;
  int64_t start_nanos = 0;  // from the start of the run
  int64_t nanos = 0;
  std::vector<client::Timing> timings;
  std::vector<int32_t> expert_ids;  // the routes used, [tokens * top_k]
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

int64_t Stage(const CallRecord& c, const std::string& name) {
  for (const client::Timing& t : c.timings) {
    if (t.stage == name) return t.nanos;
  }
  return 0;
}

// The slowest node call of a record and its compute time.
std::pair<int64_t, int64_t> SlowestNode(const CallRecord& c) {
  std::pair<int64_t, int64_t> best = {0, 0};
  for (const client::Timing& t : c.timings) {
    if (t.stage.rfind("node:", 0) == 0 && t.nanos >= best.first) {
      best = {t.nanos, Stage(c, "node_compute:" + t.stage.substr(5))};
    }
  }
  return best;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    if (static_cast<unsigned char>(ch) >= 0x20) out += ch;
  }
  return out + "\"";
}

// Chrome trace events (chrome://tracing, Perfetto): the client's calls, and
// inside each the router's stages, node calls and node compute. The router's
// clock is not the client's: its spans are centred in the client's call (the
// network time split evenly before and after).
absl::Status WriteTrace(const std::string& path, const std::vector<CallRecord>& calls, const std::string& target) {
  std::ofstream out(path);
  if (!out) return absl::InvalidArgumentError(absl::StrCat("--trace: cannot write ", path));
  std::map<std::string, int> pids = {{"client", 1}, {"router " + target, 2}};
  auto pid_of = [&](const std::string& process) {
    auto it = pids.find(process);
    if (it != pids.end()) return it->second;
    const int pid = static_cast<int>(pids.size()) + 1;
    pids[process] = pid;
    return pid;
  };
  std::vector<std::string> events;
  auto span = [&](int pid, int tid, const std::string& name, double ts_us, double dur_us, const std::string& args) {
    events.push_back(absl::StrFormat(R"({"ph":"X","pid":%d,"tid":%d,"name":%s,"ts":%.3f,"dur":%.3f,"args":{%s}})", pid,
                                     tid, JsonString(name), ts_us, std::max(dur_us, 0.001), args));
  };
  for (const CallRecord& c : calls) {
    const double start = c.start_nanos / 1e3;
    span(1, c.client, absl::StrCat("Forward layer ", c.layer), start, c.nanos / 1e3,
         absl::StrCat("\"layer\":", c.layer));
    const double router_start = start + (c.nanos - Stage(c, "total")) / 2e3;
    for (const client::Timing& t : c.timings) {
      if (t.stage == "total") continue;
      const bool node = t.stage.rfind("node:", 0) == 0;
      const bool compute = t.stage.rfind("node_compute:", 0) == 0;
      const std::string args = t.detail.empty() ? "" : absl::StrCat("\"detail\":", JsonString(t.detail));
      if (node || compute) {
        const std::string address = t.stage.substr(t.stage.find(':') + 1);
        span(pid_of("node " + address), c.client, compute ? "compute " + t.detail : "Compute call",
             router_start + t.start_nanos / 1e3, t.nanos / 1e3, args);
      } else {
        span(2, c.client, t.stage, router_start + t.start_nanos / 1e3, t.nanos / 1e3, args);
      }
    }
  }
  for (const auto& [name, pid] : pids) {
    events.push_back(
        absl::StrFormat(R"({"ph":"M","pid":%d,"name":"process_name","args":{"name":%s}})", pid, JsonString(name)));
  }
  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  for (size_t i = 0; i < events.size(); ++i) out << events[i] << (i + 1 < events.size() ? ",\n" : "\n");
  out << "]}\n";
  return out.good() ? absl::OkStatus() : absl::DataLossError(absl::StrCat("--trace: write to ", path, " failed"));
}

// Compares `tokens` random tokens per layer with the double-precision
// reference layer on the routes the target used.
absl::Status Check(Target& target, const std::string& model_dir, const Model& model, int64_t layers, int64_t tokens,
                   client::Routing routing, uint64_t seed, std::ostream& out, std::string* summary) {
  COLIBRI_ASSIGN_OR_RETURN(std::unique_ptr<common::ModelDir> dir, common::ModelDir::Open(model_dir));
  const common::DType type = dir->manifest().weight_type;
  const double tolerance = (type == common::DType::kF32 || type == common::DType::kF16) ? 1e-4 : 2e-2;
  std::mt19937_64 rng(seed ^ 0xc0ffee);
  std::normal_distribution<float> normal(0.f, 1.f);
  double worst = 0;
  for (int32_t layer = 0; layer < layers; ++layer) {
    std::vector<float> x(tokens * model.d_model);
    for (float& v : x) v = normal(rng);
    client::ForwardArgs args;
    args.layer = layer;
    for (int64_t t = 0; t < tokens; ++t) args.token_ids.push_back(static_cast<int32_t>(rng() % model.vocab));
    args.hidden = x;
    args.routing = routing;
    args.return_routes = true;
    COLIBRI_ASSIGN_OR_RETURN(client::ForwardResult r, target.Forward(args));
    common::Routes routes;
    routes.top_k = r.routes.top_k;
    routes.expert_ids = r.routes.expert_ids;
    routes.weights = r.routes.weights;
    if (routes.weights.empty()) {
      return absl::InternalError("--check: the target returned no routes");
    }
    const common::Manifest& manifest = dir->manifest();
    if (manifest.n_shared_experts > 0) {  // the target added them too, after the routes it returned
      COLIBRI_ASSIGN_OR_RETURN(std::unique_ptr<common::LayerRouting> table, dir->LoadRouting(layer, false));
      routes = common::AppendSharedExperts(routes, manifest.n_experts, manifest.n_shared_experts, table->shared_gate,
                                           manifest.d_model, x.data());
    }
    std::vector<std::unique_ptr<common::ExpertWeights>> owned;
    std::vector<const common::ExpertWeights*> experts;
    for (int64_t e = 0; e < manifest.total_experts(); ++e) {
      COLIBRI_ASSIGN_OR_RETURN(std::unique_ptr<common::ExpertWeights> w, dir->LoadExpert(layer, e, false));
      experts.push_back(w.get());
      owned.push_back(std::move(w));
    }
    std::vector<float> y(x.size());
    kernels::ReferenceMoeLayer(experts, routes, x.data(), model.d_model, y.data());
    double diff = 0, norm = 0;
    for (size_t i = 0; i < y.size(); ++i) {
      diff += (double(r.output[i]) - y[i]) * (double(r.output[i]) - y[i]);
      norm += double(y[i]) * y[i];
    }
    worst = std::max(worst, std::sqrt(diff / std::max(norm, 1e-30)));
  }
  *summary = absl::StrFormat(
      "%d tokens x %d layers vs the reference MoE layer: max relative L2 error %.2e "
      "(%s tolerance %.0e): %s",
      tokens, layers, worst, common::DTypeName(type), tolerance, worst <= tolerance ? "OK" : "FAILED");
  out << "check: " << *summary << "\n";
  if (worst > tolerance) return absl::FailedPreconditionError(absl::StrCat("--check failed: ", *summary));
  return absl::OkStatus();
}

// T tokens' routes: top_k distinct experts each, drawn with probability
// proportional to 1 / (e + 1)^s (LoadBenchOptions::zipf), weights 1/top_k.
client::Routes ZipfRoutes(int64_t tokens, int64_t n_experts, int64_t top_k, double s, std::mt19937_64& rng) {
  std::vector<double> p(n_experts);
  for (int64_t e = 0; e < n_experts; ++e) p[e] = 1.0 / std::pow(e + 1, s);
  client::Routes routes;
  routes.top_k = static_cast<int32_t>(top_k);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> left = p;
    for (int64_t j = 0; j < top_k; ++j) {
      std::discrete_distribution<int32_t> pick(left.begin(), left.end());
      const int32_t e = pick(rng);
      left[e] = 0;
      routes.expert_ids.push_back(e);
      routes.weights.push_back(1.0f / static_cast<float>(top_k));
    }
  }
  return routes;
}

}  // namespace

absl::Status RunLoadBench(const LoadBenchOptions& o, std::ostream& out) {
  if (o.routing == common::RoutingMode::kClient) {
    return absl::InvalidArgumentError("--routing must be lut or gate (the benchmark has no caller's routes)");
  }
  if (o.router.empty() == o.local_model.empty()) {
    return absl::InvalidArgumentError("give exactly one of --router HOST:PORT and --local MODEL_DIR");
  }
  if (o.zipf < 0 || (o.zipf > 0 && o.check_tokens > 0)) {
    return absl::InvalidArgumentError("--zipf must be >= 0, and is not for --check (whose reference routes itself)");
  }
  if (o.batch_size < 1 || o.seq_len < 1 || o.concurrency < 1 || o.layers < 0) {
    return absl::InvalidArgumentError("--batch_size, --seq_len and --concurrency must be >= 1, --layers >= 0");
  }
  if (!o.trace_path.empty() && o.trace_calls < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--trace_calls must be >= 1 with --trace, not ", o.trace_calls));
  }
  if (o.check_tokens > 0 && o.model_dir.empty() && o.local_model.empty()) {
    return absl::InvalidArgumentError("--check needs --model DIR (the router's model)");
  }
  // The target(s) and the model.
  Model model;
  std::unique_ptr<client::Client> client;
  std::unique_ptr<Engine> engine;
  std::string target_name;
  if (!o.router.empty()) {
    client::ClientOptions co;
    co.target = o.router;
    if (o.deadline_ms > 0) co.timeout = absl::Milliseconds(o.deadline_ms);
    COLIBRI_ASSIGN_OR_RETURN(client, client::Client::Connect(co));
    const auto& m = client->model();
    model = {m.d_model(), m.n_layers(), m.n_experts(), m.top_k(), m.vocab_size(), m.weight_type(), m.backend()};
    target_name = o.router;
  } else {
    Engine::Options eo;
    eo.threads = o.local_threads;
    eo.batch_window = absl::Microseconds(o.local_batch_window_us);
    COLIBRI_ASSIGN_OR_RETURN(engine, Engine::Open(o.local_model, eo));
    const common::Manifest& m = engine->manifest();
    model = {m.d_model, m.n_layers, m.n_experts, m.top_k, m.vocab_size, common::DTypeName(m.weight_type), "in-process"};
    target_name = "in-process";
  }
  const int64_t layers = o.layers == 0 ? model.n_layers : std::min(o.layers, model.n_layers);
  const client::Routing routing = ToClientRouting(o.routing);
  std::vector<std::unique_ptr<Target>> targets;
  for (int c = 0; c < o.concurrency; ++c) {
    if (engine != nullptr) {
      targets.push_back(std::make_unique<EngineTarget>(engine.get(), o.routing));
    } else {
      std::unique_ptr<client::Session> session;
      if (!o.unary && o.deadline_ms <= 0) {
        COLIBRI_ASSIGN_OR_RETURN(session, client->OpenSession());
      }
      targets.push_back(std::make_unique<RouterTarget>(client.get(), std::move(session)));
    }
  }

  // The run: every client makes its warm-up calls (whole steps), then waits
  // until all have; the measured window starts then (t0), with every client
  // warm, and lasts `duration` (or until the last sequence ends). Tokens and
  // calls count when they end inside it, so neither warm-up nor the tail of
  // calls still out at its end is counted, in time or in work.
  const auto run_start = Clock::now();
  const bool timed_run = o.duration_seconds > 0;
  common::Mutex mu;  // guards records, failure and the warm-up barrier (locals: not annotatable)
  common::CondVar warm_cv;
  int warming = o.concurrency;  // clients not yet warm
  Clock::time_point t0{}, t_end{};
  std::atomic<int64_t> window_end_nanos{std::numeric_limits<int64_t>::max()};  // since run_start
  std::vector<CallRecord> records;
  absl::Status failure;
  std::atomic<int64_t> calls_done{0}, tokens_done{0}, calls_in_window{0}, abandoned{0};
  std::atomic<bool> stop{false};
  std::atomic<int> running{o.concurrency};
  const auto since_start = [&](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t - run_start).count();
  };
  // A client warm (or leaving): the last one starts the window.
  // A timed run waits for the warm-ups at most `duration`: a client whose
  // calls keep failing (abandoned at --deadline_ms) must not hold the others.
  const auto warm_limit = timed_run
                              ? run_start + std::chrono::microseconds(static_cast<int64_t>(o.duration_seconds * 1e6))
                              : Clock::time_point::max();
  const auto start_window = [&] {  // with mu held
    warming = 0;
    t0 = Clock::now();
    if (timed_run) window_end_nanos = since_start(t0) + static_cast<int64_t>(o.duration_seconds * 1e9);
    warm_cv.SignalAll();
  };
  const auto arrive = [&] {
    common::MutexLock lock(&mu);
    if (warming <= 0) return;  // the window started without this client
    if (--warming == 0) start_window();
    while (warming > 0 && !stop) {
      if (Clock::now() >= warm_limit) {
        start_window();
        break;
      }
      warm_cv.WaitWithTimeout(&mu, absl::Milliseconds(100));
    }
  };
  std::vector<std::thread> threads;
  for (int c = 0; c < o.concurrency; ++c) {
    threads.emplace_back([&, c] {
      std::mt19937_64 rng(o.seed + 1000003ull * c);
      std::normal_distribution<float> normal(0.f, 1.f);
      std::vector<CallRecord> mine;
      int calls = 0;
      bool warm = false;
      Clock::time_point last_end{};
      for (int64_t seq = 0; !stop && (timed_run || seq < o.repeat); ++seq) {
        for (int64_t step = 0; step < o.seq_len && !stop; ++step) {
          if (!warm && calls >= o.warmup) {
            warm = true;
            arrive();
            if (stop) break;
          }
          int32_t finished = 0;  // layers of this step answered
          client::ForwardArgs args;
          std::vector<float> hidden(o.batch_size * model.d_model);
          for (float& v : hidden) v = normal(rng);
          for (int64_t t = 0; t < o.batch_size; ++t)
            args.token_ids.push_back(static_cast<int32_t>(rng() % model.vocab));
          args.routing = routing;
          if (o.zipf > 0) {
            args.routing = client::Routing::kClient;
            args.routes = ZipfRoutes(o.batch_size, model.n_experts, model.top_k, o.zipf, rng);
          }
          args.return_routes = true;
          args.return_timings = true;
          for (int32_t layer = 0; layer < layers && !stop; ++layer) {
            args.layer = layer;
            args.hidden = hidden;
            args.request_id = absl::StrCat("c", c, "-", calls);
            const auto start = Clock::now();
            absl::StatusOr<client::ForwardResult> r = targets[c]->Forward(args);
            const auto end = Clock::now();
            if (!r.ok() && o.deadline_ms > 0 &&
                (r.status().code() == absl::StatusCode::kDeadlineExceeded ||
                 r.status().code() == absl::StatusCode::kCancelled)) {
              ++abandoned;
              ++calls;  // toward the warm-up too: a client whose calls all time out still arrives
              if (since_start(Clock::now()) >= window_end_nanos) stop = true;
              break;  // this step's hidden state is gone: start the next step
            }
            if (!r.ok()) {
              common::MutexLock lock(&mu);
              if (failure.ok()) failure = r.status();
              stop = true;
              warm_cv.SignalAll();
              break;
            }
            for (size_t i = 0; i < hidden.size(); ++i) hidden[i] += r->output[i];  // residual
            ++finished;
            ++calls;
            if (warm) {
              CallRecord rec;
              rec.client = c;
              rec.layer = layer;
              rec.start_nanos = since_start(start);
              rec.nanos = std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count();
              rec.timings = std::move(r->timings);
              rec.expert_ids = std::move(r->routes.expert_ids);
              mine.push_back(std::move(rec));
              ++calls_done;
              if (since_start(end) <= window_end_nanos) ++calls_in_window;
            }
            if (since_start(Clock::now()) >= window_end_nanos) stop = true;
          }
          if (warm && finished == layers) {
            last_end = Clock::now();
            if (since_start(last_end) <= window_end_nanos) tokens_done += o.batch_size;
          }
        }
      }
      if (!warm) arrive();  // a client done before its warm-up ended holds no one back
      common::MutexLock lock(&mu);
      records.insert(records.end(), std::make_move_iterator(mine.begin()), std::make_move_iterator(mine.end()));
      t_end = std::max(t_end, last_end);
      --running;
    });
  }
  const bool show_progress = o.progress && !o.json && (o.duration_seconds >= 2 || isatty(STDERR_FILENO));
  while (show_progress && running.load() > 0) {
    for (int i = 0; i < 10 && running.load() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const double elapsed = std::chrono::duration<double>(Clock::now() - run_start).count();
    std::fprintf(stderr, "\r[%6.1f s] %lld layer calls, %.0f calls/s   ", elapsed,
                 static_cast<long long>(calls_done.load()), calls_done.load() / std::max(elapsed, 1e-9));
  }
  for (std::thread& t : threads) t.join();
  if (show_progress) std::fprintf(stderr, "\n");
  const double elapsed = std::chrono::duration<double>(Clock::now() - run_start).count();
  if (!failure.ok()) return failure;
  std::sort(records.begin(), records.end(),
            [](const CallRecord& a, const CallRecord& b) { return a.start_nanos < b.start_nanos; });

  // Statistics.
  std::vector<double> latency, route, dispatch, aggregate, slowest, compute, router_total;
  std::vector<int64_t> load(model.n_layers * model.n_experts, 0);
  for (const CallRecord& c : records) {
    latency.push_back(c.nanos / 1e3);
    route.push_back(Stage(c, "route") / 1e3);
    dispatch.push_back(Stage(c, "dispatch") / 1e3);
    aggregate.push_back(Stage(c, "aggregate") / 1e3);
    router_total.push_back(Stage(c, "total") / 1e3);
    const auto [node, node_compute] = SlowestNode(c);
    slowest.push_back(node / 1e3);
    compute.push_back(node_compute / 1e3);
    for (const int32_t e : c.expert_ids) {
      if (e >= 0 && e < model.n_experts) ++load[c.layer * model.n_experts + e];
    }
  }
  // The window: `duration` from t0, or t0 to the last step's end.
  const double window = timed_run ? o.duration_seconds : std::chrono::duration<double>(t_end - t0).count();
  const double tokens_per_s = window > 0 ? tokens_done.load() / window : 0;
  const double calls_per_s = window > 0 ? calls_in_window.load() / window : 0;
  std::string check_summary;
  absl::Status check = absl::OkStatus();
  if (o.check_tokens > 0) {
    const std::string dir = !o.model_dir.empty() ? o.model_dir : o.local_model;
    std::ostringstream ignored;
    check =
        Check(*targets[0], dir, model, layers, o.check_tokens, routing, o.seed, o.json ? ignored : out, &check_summary);
  }
  if (!o.trace_path.empty()) {
    std::vector<CallRecord> traced(records.begin(), records.begin() + std::min<int64_t>(records.size(), o.trace_calls));
    COLIBRI_RETURN_IF_ERROR(WriteTrace(o.trace_path, traced, target_name));
  }

  const std::string routing_name =
      o.zipf > 0 ? absl::StrFormat("client (zipf %.2f)", o.zipf) : std::string(common::RoutingModeName(o.routing));
  if (o.json) {
    std::string experts;
    for (size_t i = 0; i < load.size(); ++i) absl::StrAppend(&experts, i == 0 ? "" : ",", load[i]);
    out << absl::StrFormat(
        R"({"target":%s,"backend":%s,"weight_type":%s,"d_model":%d,"layers":%d,"experts":%d,"top_k":%d,)"
        R"("batch_size":%d,"seq_len":%d,"concurrency":%d,"routing":%s,"stream":%s,"seconds":%.3f,"calls":%d,)"
        R"("abandoned":%d,"tokens_per_s":%.3f,"calls_per_s":%.3f,"latency_us":{"p50":%.1f,"p90":%.1f,"p99":%.1f,"max":%.1f},)"
        R"("stages_p50_us":{"route":%.1f,"dispatch":%.1f,"slowest_node":%.1f,"node_compute":%.1f,"aggregate":%.1f,)"
        R"("router_total":%.1f},"tokens_per_expert":[%s],"check":%s,"trace":%s})",
        JsonString(target_name), JsonString(model.backend), JsonString(model.weight_type), model.d_model, layers,
        model.n_experts, model.top_k, o.batch_size, o.seq_len, o.concurrency, JsonString(routing_name),
        (o.unary || engine != nullptr || o.deadline_ms > 0) ? "false" : "true", elapsed,
        static_cast<int64_t>(records.size()), abandoned.load(), tokens_per_s, calls_per_s, Percentile(latency, 0.5),
        Percentile(latency, 0.9), Percentile(latency, 0.99), Percentile(latency, 1.0), Percentile(route, 0.5),
        Percentile(dispatch, 0.5), Percentile(slowest, 0.5), Percentile(compute, 0.5), Percentile(aggregate, 0.5),
        Percentile(router_total, 0.5), experts, JsonString(check_summary), JsonString(o.trace_path));
    out << "\n";
    return check;
  }
  out << absl::StrFormat("colibri-bench run: %s (%s, %s, d_model %d, %d layers, %d experts, top-%d)\n", target_name,
                         model.backend, model.weight_type, model.d_model, model.n_layers, model.n_experts, model.top_k);
  out << absl::StrFormat("workload: %d client(s) x %s, batch %d, seq_len %d, %d layers, %s routing, %.1f s\n",
                         o.concurrency,
                         engine != nullptr ? "in-process" : (o.unary || o.deadline_ms > 0 ? "unary" : "stream"),
                         o.batch_size, o.seq_len, layers, routing_name, elapsed);
  out << absl::StrFormat("throughput: %.1f tokens/s through %d layers (%.1f layer calls/s)\n", tokens_per_s, layers,
                         calls_per_s);
  if (o.deadline_ms > 0) {
    out << absl::StrFormat("abandoned (deadline %d ms passed, the client gave up): %d calls\n", o.deadline_ms,
                           abandoned.load());
  }
  out << absl::StrFormat("latency per layer call (us): p50 %.0f  p90 %.0f  p99 %.0f  max %.0f  (n=%d)\n",
                         Percentile(latency, 0.5), Percentile(latency, 0.9), Percentile(latency, 0.99),
                         Percentile(latency, 1.0), static_cast<int64_t>(latency.size()));
  out << absl::StrFormat(
      "stages p50 (us): route %.0f, dispatch %.0f (slowest node call %.0f, its compute %.0f), "
      "aggregate %.0f; router total %.0f, so transport to and from the router %.0f\n",
      Percentile(route, 0.5), Percentile(dispatch, 0.5), Percentile(slowest, 0.5), Percentile(compute, 0.5),
      Percentile(aggregate, 0.5), Percentile(router_total, 0.5),
      Percentile(latency, 0.5) - Percentile(router_total, 0.5));
  out << "expert load (share of routed token slots per layer; even would be "
      << absl::StrFormat("%.1f%%", 100.0 / model.n_experts) << "):\n";
  for (int64_t l = 0; l < layers; ++l) {
    int64_t layer_total = 0;
    for (int64_t e = 0; e < model.n_experts; ++e) layer_total += load[l * model.n_experts + e];
    std::string line = absl::StrFormat("  layer %d:", l);
    for (int64_t e = 0; e < model.n_experts && e < 16; ++e) {
      absl::StrAppendFormat(&line, " e%d %.1f%%", e,
                            100.0 * load[l * model.n_experts + e] / std::max<int64_t>(1, layer_total));
    }
    if (model.n_experts > 16) absl::StrAppend(&line, " ...");
    out << line << "\n";
    if (l == 7 && layers > 9) {
      out << "  (" << layers - 8 << " more layers; --json has them all)\n";
      break;
    }
  }
  if (!o.trace_path.empty()) {
    out << "trace: " << o.trace_path << " (" << std::min<int64_t>(records.size(), o.trace_calls)
        << " calls; open in chrome://tracing or https://ui.perfetto.dev)\n";
  }
  return check;
}

}  // namespace tools
}  // namespace colibri
