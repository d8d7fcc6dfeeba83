#include "tools/router_bench.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "clients/cpp/client.h"
#include "clients/cpp/tensor.h"
#include "colibri/v1/router.grpc.pb.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "router_node/engine.h"
#include "router_node/forward_request.h"

namespace colibri {
namespace tools {
namespace {

namespace v1 = colibri::v1;
using Clock = std::chrono::steady_clock;

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

// CPU time of every thread of a process, in seconds (nanosecond counters of
// /proc/PID/task/*/schedstat: threads that exited are not counted, which for
// the router's fixed thread set does not matter); -1 if unreadable.
double CpuSeconds(int pid) {
  std::error_code ec;
  double total = 0;
  bool any = false;
  for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream in(task.path() / "schedstat");
    double nanos = 0;
    if (in >> nanos) {
      total += nanos * 1e-9;
      any = true;
    }
  }
  return any ? total : -1;
}

int64_t Timing(const v1::ForwardResponse& r, const std::string& stage) {
  for (const v1::Timing& t : r.timings()) {
    if (t.stage() == stage) return t.nanos();
  }
  return 0;
}

// One row's figures the distributed path's targets are judged on (µs, bytes).
struct RowFigures {
  int64_t tokens = 0;
  double engine_p50 = 0, router_p50 = 0, router_p99 = 0;
  double direct_p50 = -1;  // < 0: no proxyless client
  double bytes = 0, minimum = 0;
};

// The targets of docs/PERFORMANCE.md ("Against the targets for the
// distributed path") judged from this run, one line each: the target, what
// was measured, met or not. `rtt` is the empty round trip at the calls'
// spacing; without the engine nothing "added" can be judged.
void PrintTargets(const std::vector<RowFigures>& rows, double rtt, bool engine, std::ostream& out) {
  out << absl::StrFormat(
      "# the distributed path's targets (docs/PERFORMANCE.md; set for T=1 on the small bf16 layer, T=128 on the "
      "Mixtral-shaped one, bytes with --bf16 and partial sums), from this run (round trip p50 %.0f us):\n",
      rtt);
  auto line = [&](const std::string& target, const std::string& measured, bool met) {
    out << absl::StrFormat("#   %-50s %-28s %s\n", target, measured, met ? "met" : "not met");
  };
  for (const RowFigures& r : rows) {
    const double added = r.router_p50 - r.engine_p50;
    if (r.tokens == 1 && engine) {
      line("T=1 added p50 <= 2 x round trip + 50 us", absl::StrFormat("%.0f vs %.0f us", added, 2 * rtt + 50),
           added <= 2 * rtt + 50);
      if (r.direct_p50 >= 0) {
        const double direct = r.direct_p50 - r.engine_p50;
        line("T=1 proxyless added p50 <= round trip + 50 us", absl::StrFormat("%.0f vs %.0f us", direct, rtt + 50),
             direct <= rtt + 50);
      }
    }
    if (r.tokens == 1) {
      line("T=1 router p99 <= 2 x p50", absl::StrFormat("%.0f vs %.0f us", r.router_p99, 2 * r.router_p50),
           r.router_p99 <= 2 * r.router_p50);
    }
    if (r.tokens == 128 && engine && r.engine_p50 > 0) {
      const double share = 100.0 * added / r.engine_p50;
      line("T=128 added <= 3% of the layer", absl::StrFormat("%.1f%%", share), share <= 3.0);
    }
    if (r.minimum > 0) {
      line(absl::StrFormat("T=%d node bytes <= 1.1 x the minimum", r.tokens),
           absl::StrFormat("x%.2f", r.bytes / r.minimum), r.bytes <= 1.1 * r.minimum);
    }
  }
}

// The slowest node call and that node's own compute time.
std::pair<int64_t, int64_t> SlowestNode(const v1::ForwardResponse& r) {
  std::pair<int64_t, int64_t> slowest = {0, 0};
  for (const v1::Timing& t : r.timings()) {
    if (t.stage().rfind("node:", 0) == 0 && t.nanos() >= slowest.first) {
      slowest = {t.nanos(), Timing(r, "node_compute:" + t.stage().substr(5))};
    }
  }
  return slowest;
}

}  // namespace

absl::Status RunRouterBench(const RouterBenchOptions& o, std::ostream& out) {
  if (o.routing == common::RoutingMode::kClient) {
    return absl::InvalidArgumentError("--routing must be lut or gate (the benchmark has no caller's routes)");
  }
  std::unique_ptr<Engine> engine;
  if (o.local_threads >= 0) {
    Engine::Options options;
    options.threads = o.local_threads;
    // Records need the weights in memory, not paged: locked, like the nodes'.
    options.lock_memory = o.q8_records;
    options.q8_records = o.q8_records;
    COLIBRI_ASSIGN_OR_RETURN(engine, Engine::Open(o.model_dir, options));
  }
  auto stub = v1::Router::NewStub(grpc::CreateChannel(o.router, grpc::InsecureChannelCredentials()));
  v1::GetModelInfoResponse info;
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const grpc::Status s = stub->GetModelInfo(&context, v1::GetModelInfoRequest(), &info);
    if (!s.ok()) return absl::UnavailableError(absl::StrCat("router ", o.router, ": ", s.error_message()));
  }
  if (engine != nullptr && info.model_id() != engine->router().model_id()) {
    return absl::FailedPreconditionError("the router serves another model than --model");
  }
  // The floor of one gRPC hop on this machine: an empty call's round trip,
  // back to back and after the calls' pause.
  auto ping = [&](int64_t gap_us) {
    std::vector<double> us;
    for (int i = 0; i < 200; ++i) {
      if (gap_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
      grpc::ClientContext context;
      v1::GetModelInfoResponse unused;
      const auto start = Clock::now();
      if (!stub->GetModelInfo(&context, v1::GetModelInfoRequest(), &unused).ok()) break;
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    }
    return us;
  };
  const std::vector<double> ping_us = ping(0);
  const std::vector<double> spaced_ping_us = ping(o.gap_us);
  std::unique_ptr<client::Client> direct;
  if (!o.direct_nodes.empty()) {
    client::ClientOptions options;
    options.direct.model_dir = o.model_dir;
    options.direct.nodes = o.direct_nodes;
    options.direct.node_stream_max_bytes = o.node_stream_max_bytes;
    COLIBRI_ASSIGN_OR_RETURN(direct, client::Client::Connect(options));
    for (int i = 0; i < 200; ++i) {  // its first health round may not have reached every node yet
      absl::StatusOr<v1::GetClusterStatusResponse> status = direct->ClusterStatus();
      if (status.ok() && status->serving()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  // --stream: one session for the whole run, its requests answered in order
  // (a stream's deadline is the whole session's: a bound, not a per-call one).
  grpc::ClientContext session_context;
  session_context.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  std::unique_ptr<grpc::ClientReaderWriter<v1::ForwardRequest, v1::ForwardStreamResponse>> session;
  if (o.stream) session = stub->ForwardStream(&session_context);
  const int64_t d_model = info.d_model();
  out << "# colibri-bench router: " << o.router << " (" << info.backend() << ", " << info.weight_type() << ", d_model "
      << d_model << ", d_ff " << info.d_ff() << ", " << info.n_experts() << " experts, top-" << info.top_k()
      << ") vs the in-process engine; layer " << o.layer << ", " << common::RoutingModeName(o.routing) << " routing, "
      << (o.bf16 ? "bf16" : "f32") << " in and out, " << o.repeat << " calls per row " << o.gap_us
      << " us apart, router calls " << (o.stream ? "over one ForwardStream" : "unary") << ", times in microseconds\n";
  out << "# an empty gRPC round trip to the router (GetModelInfo): p50 "
      << static_cast<int64_t>(Percentile(ping_us, 0.5)) << " us, p99 "
      << static_cast<int64_t>(Percentile(ping_us, 0.99)) << " us back to back; p50 "
      << static_cast<int64_t>(Percentile(spaced_ping_us, 0.5)) << " us, p99 "
      << static_cast<int64_t>(Percentile(spaced_ping_us, 0.99)) << " us " << o.gap_us << " us apart\n";
  out << "# T | engine p50 | engine p99 | router p50 | router p99 | added p50 | added % | slowest node call | "
         "its compute | route+aggregate | router overhead in dispatch | router CPU/call | node bytes/call | "
         "minimum | identical"
      << (direct != nullptr ? " | proxyless p50 | proxyless p99 | proxyless added p50 | proxyless identical" : "")
      << "\n";
  std::mt19937_64 rng(o.seed);
  std::vector<RowFigures> figures;
  for (const int64_t T : o.tokens) {
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<float> x(T * d_model);
    for (float& v : x) v = normal(rng);
    std::vector<int32_t> ids(T);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % info.vocab_size());
    std::string hidden(reinterpret_cast<const char*>(x.data()), x.size() * 4);
    if (o.bf16) {
      hidden.resize(x.size() * 2);
      for (size_t i = 0; i < x.size(); ++i) {
        const uint16_t h = common::FloatToBf16(x[i]);
        std::memcpy(&hidden[2 * i], &h, 2);
      }
    }
    const int64_t element = o.bf16 ? 2 : 4;
    v1::ForwardRequest request;
    request.set_layer(o.layer);
    request.mutable_token_ids()->Add(ids.begin(), ids.end());
    request.mutable_hidden()->set_dtype(o.bf16 ? v1::DATA_TYPE_BF16 : v1::DATA_TYPE_F32);
    request.mutable_hidden()->add_shape(T);
    request.mutable_hidden()->add_shape(d_model);
    request.mutable_hidden()->set_data(hidden);
    request.set_output_dtype(o.bf16 ? v1::DATA_TYPE_BF16 : v1::DATA_TYPE_F32);
    request.set_routing(router_node::ToProtoRoutingMode(o.routing));
    request.set_return_timings(true);
    router_node::ForwardInput in;
    in.layer = o.layer;
    in.token_ids = ids;
    in.hidden = hidden.data();
    in.hidden_bytes = static_cast<int64_t>(hidden.size());
    in.hidden_dtype = o.bf16 ? common::DType::kBF16 : common::DType::kF32;
    in.output_dtype = in.hidden_dtype;
    in.num_tokens = T;
    in.cols = d_model;
    in.routing = o.routing;

    client::ForwardArgs args;  // the same call for the proxyless client
    args.layer = o.layer;
    args.token_ids = ids;
    args.hidden = x;
    args.send_as = o.bf16 ? client::WireType::kBF16 : client::WireType::kF32;
    args.output = args.send_as;
    args.routing = o.routing == common::RoutingMode::kGate ? client::Routing::kGate : client::Routing::kLut;
    bool direct_identical = true;
    std::vector<double> local_us, remote_us, own_us, overhead_us, node_us, compute_us, bytes, minimum, direct_us;
    std::string local_bytes, remote_bytes;
    double cpu_start = 0;
    for (int i = 0; i < o.warmup + o.repeat; ++i) {
      const bool timed = i >= o.warmup;
      // Calls are spaced so that neither side's idle workers (which spin
      // ~200 us after a job) still hold the CPUs when the other side starts.
      std::this_thread::sleep_for(std::chrono::microseconds(o.gap_us));
      if (i == o.warmup && o.router_pid > 0) cpu_start = CpuSeconds(o.router_pid);
      if (engine != nullptr) {
        const auto start = Clock::now();
        absl::StatusOr<router_node::ForwardOutput> r = engine->Forward(in);
        if (!r.ok()) return r.status();
        if (timed) local_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
        local_bytes = std::move(r->output);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(o.gap_us));
      v1::ForwardResponse response;
      const auto start = Clock::now();
      if (session != nullptr) {
        v1::ForwardStreamResponse reply;
        if (!session->Write(request) || !session->Read(&reply)) {
          return absl::UnavailableError("ForwardStream: the stream ended");
        }
        if (reply.code() != 0) return absl::UnavailableError(absl::StrCat("ForwardStream: ", reply.message()));
        response = std::move(*reply.mutable_response());
      } else {
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
        const grpc::Status s = stub->Forward(&context, request, &response);
        if (!s.ok()) return absl::UnavailableError(absl::StrCat("Forward: ", s.error_message()));
      }
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
      if (!timed) {
        // The proxyless client warms up too: its first calls open its node channels.
        if (direct != nullptr) {
          absl::StatusOr<client::ForwardResult> r = direct->Forward(args);
          if (!r.ok()) return r.status();
        }
        continue;
      }
      remote_us.push_back(us);
      own_us.push_back((Timing(response, "route") + Timing(response, "aggregate")) / 1e3);
      const auto [node, compute] = SlowestNode(response);
      overhead_us.push_back((Timing(response, "dispatch") - node) / 1e3);
      node_us.push_back(node / 1e3);
      compute_us.push_back(compute / 1e3);
      double sent = 0, least = 0;
      for (const v1::Timing& t : response.timings()) {
        if (t.stage().rfind("node:", 0) != 0) continue;
        sent += static_cast<double>(t.bytes_sent() + t.bytes_received());
        if (t.detail().find(" retry") == std::string::npos && t.detail().find(" hedge") == std::string::npos) {
          least += static_cast<double>(t.rows() * d_model * 2 * element);  // its rows in, and back as one sum each
        }
      }
      bytes.push_back(sent);
      minimum.push_back(least);
      if (direct != nullptr) {
        std::this_thread::sleep_for(std::chrono::microseconds(o.gap_us));
        const auto direct_start = Clock::now();
        absl::StatusOr<client::ForwardResult> r = direct->Forward(args);
        direct_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - direct_start).count());
        if (!r.ok()) return r.status();
        absl::StatusOr<std::vector<float>> routed = client::Unpack(response.output());
        direct_identical = direct_identical && routed.ok() && *routed == r->output;
      }
      remote_bytes = response.output().data();
    }
    // Includes the router's health checks during the run (a few per second).
    const double cpu = o.router_pid > 0 ? CpuSeconds(o.router_pid) - cpu_start : 0;
    const double l50 = Percentile(local_us, 0.5), r50 = Percentile(remote_us, 0.5);
    char line[512];
    std::snprintf(line, sizeof(line),
                  "%lld | %.0f | %.0f | %.0f | %.0f | %.0f | %.1f%% | %.0f | %.0f | %.0f | %.0f | %s | %.0f | %.0f "
                  "(x%.2f) | %s",
                  static_cast<long long>(T), l50, Percentile(local_us, 0.99), r50, Percentile(remote_us, 0.99),
                  r50 - l50, l50 > 0 ? 100.0 * (r50 - l50) / l50 : 0.0, Percentile(node_us, 0.5),
                  Percentile(compute_us, 0.5), Percentile(own_us, 0.5), Percentile(overhead_us, 0.5),
                  o.router_pid > 0 ? absl::StrCat(static_cast<int64_t>(cpu / o.repeat * 1e6)).c_str() : "-",
                  Percentile(bytes, 0.5), Percentile(minimum, 0.5),
                  Percentile(minimum, 0.5) > 0 ? Percentile(bytes, 0.5) / Percentile(minimum, 0.5) : 0.0,
                  engine == nullptr ? "-" : (local_bytes == remote_bytes ? "yes" : "NO"));
    out << line;
    figures.push_back({T, l50, r50, Percentile(remote_us, 0.99), -1, Percentile(bytes, 0.5), Percentile(minimum, 0.5)});
    if (direct != nullptr) {
      const double d50 = Percentile(direct_us, 0.5);
      figures.back().direct_p50 = d50;
      std::snprintf(line, sizeof(line), " | %.0f | %.0f | %.0f | %s", d50, Percentile(direct_us, 0.99), d50 - l50,
                    direct_identical ? "yes" : "NO");
      out << line;
    }
    out << "\n" << std::flush;
  }
  PrintTargets(figures, Percentile(o.gap_us > 0 ? spaced_ping_us : ping_us, 0.5), engine != nullptr, out);
  if (session != nullptr) {
    session->WritesDone();
    const grpc::Status s = session->Finish();
    if (!s.ok()) return absl::UnavailableError(absl::StrCat("ForwardStream: ", s.error_message()));
  }
  return absl::OkStatus();
}

}  // namespace tools
}  // namespace colibri
