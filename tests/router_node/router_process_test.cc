// colibri-router and colibri-expert as real processes on 127.0.0.1:0, called
// through the public Router service:
//  - a distributed router (2 nodes, experts split, one expert replicated)
//    answers byte for byte like a local router, in every routing mode;
//  - kill -9 of one of two replicas under load fails no request, and the node
//    is used again once it is back;
//  - with no replica left, requests fail UNAVAILABLE naming the layer and the
//    expert, health says NOT_SERVING, and both recover when the node returns;
//  - malformed requests get INVALID_ARGUMENT naming the field; ForwardStream
//    answers in order and survives a bad request.
// Every process is killed when its ProcessGuard goes out of scope.

#include <arpa/inet.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "colibri/v1/router.grpc.pb.h"
#include "common/half.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/integration/cluster.h"
#include "tests/test_util.h"

namespace colibri {
namespace router_node {
namespace {

using namespace colibri::testing;  // NOLINT: the cluster helpers
namespace v1 = colibri::v1;

TEST_CASE("a distributed router answers byte for byte like a local one, in every routing mode") {
  for (common::DType type : {common::DType::kBF16, common::DType::kInt4}) {
    Model model(type);
    Proc a = StartNode(model.path, "0-2");
    Proc b = StartNode(model.path, "2-3");  // expert 2 on both nodes
    Proc distributed = StartRouter({"--model=" + model.path, "--experts-at=" + Address(a.port) + "," + Address(b.port),
                                    "--admin_listen=127.0.0.1:0"});
    const int admin_port = distributed.process->ReadPort("admin on port ");
    Proc local = StartRouter({"--local=" + model.path, "--threads=1"});
    auto remote_stub = Connect(distributed.port);
    auto local_stub = Connect(local.port);

    CHECK(Health(distributed.port) == grpc::health::v1::HealthCheckResponse::SERVING);
    const v1::GetClusterStatusResponse status = Status(*remote_stub);
    REQUIRE(status.nodes_size() == 2);
    CHECK(status.nodes(0).live());
    CHECK(status.nodes(1).live());
    CHECK(status.serving());
    CHECK(status.experts(2).live_replicas() == 2);  // layer 0 expert 2
    CHECK(status.experts(3).live_replicas() == 1);
    // Node addresses only on the admin listener; the data port names nodes by index.
    CHECK(status.nodes(0).address() == "node-0");
    CHECK(status.nodes(1).address() == "node-1");
    const v1::GetClusterStatusResponse admin_status = Status(*Connect(admin_port));
    REQUIRE(admin_status.nodes_size() == 2);
    CHECK(admin_status.nodes(0).address() == Address(a.port));
    CHECK(admin_status.nodes(1).address() == Address(b.port));

    int compared = 0;
    for (int32_t layer = 0; layer < 2; ++layer) {
      for (const std::vector<int32_t>& ids :
           {std::vector<int32_t>{7}, std::vector<int32_t>{1, 2, 3, 4}, std::vector<int32_t>(37, 5)}) {
        std::vector<int32_t> varied = ids;
        for (size_t i = 0; i < varied.size(); ++i) varied[i] = (varied[i] + static_cast<int32_t>(i) * 13) % 64;
        for (v1::RoutingMode mode : {v1::ROUTING_MODE_LUT, v1::ROUTING_MODE_GATE}) {
          v1::ForwardRequest request = Request(layer, varied, 100 + compared, mode);
          v1::ForwardResponse remote, in_process;
          grpc::Status s = Call(*remote_stub, request, &remote);
          INFO(s.error_message());
          REQUIRE(s.ok());
          REQUIRE(Call(*local_stub, request, &in_process).ok());
          CHECK(remote.output().data() == in_process.output().data());
          CHECK(std::vector<int32_t>(remote.routes().expert_ids().begin(), remote.routes().expert_ids().end()) ==
                std::vector<int32_t>(in_process.routes().expert_ids().begin(), in_process.routes().expert_ids().end()));
          // bf16 hidden states travel to the nodes as bf16 and still give the local bytes.
          v1::ForwardRequest bf = request;
          bf.mutable_hidden()->set_dtype(v1::DATA_TYPE_BF16);
          std::string half(bf.hidden().data().size() / 2, '\0');
          for (size_t i = 0; i < half.size() / 2; ++i) {
            float f;
            std::memcpy(&f, request.hidden().data().data() + 4 * i, 4);
            const uint16_t h = common::FloatToBf16(f);
            std::memcpy(&half[2 * i], &h, 2);
          }
          bf.mutable_hidden()->set_data(half);
          v1::ForwardResponse remote_bf, local_bf;
          REQUIRE(Call(*remote_stub, bf, &remote_bf).ok());
          REQUIRE(Call(*local_stub, bf, &local_bf).ok());
          CHECK(remote_bf.output().data() == local_bf.output().data());
          // The same routes sent by the client give the same bytes again.
          request.set_routing(v1::ROUTING_MODE_CLIENT);
          *request.mutable_routes() = remote.routes();
          v1::ForwardResponse client;
          REQUIRE(Call(*remote_stub, request, &client).ok());
          CHECK(client.output().data() == remote.output().data());
          ++compared;
        }
      }
    }
    std::printf("distributed vs local (%s): %d requests, byte-identical\n", common::DTypeName(type).c_str(), compared);
    // Both nodes did work: the plan really split the layer.
    const v1::GetClusterStatusResponse after = Status(*remote_stub);
    CHECK(after.nodes(0).calls() > 0);
    CHECK(after.nodes(1).calls() > 0);
  }
}

// Relative L2 distance of two f32 outputs.
double RelativeL2(const std::string& a, const std::string& b) {
  REQUIRE(a.size() == b.size());
  std::vector<float> x(a.size() / 4), y(b.size() / 4);
  std::memcpy(x.data(), a.data(), a.size());
  std::memcpy(y.data(), b.data(), b.size());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    diff += (double{x[i]} - y[i]) * (double{x[i]} - y[i]);
    norm += double{y[i]} * y[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

TEST_CASE("node replies: exact and per_expert give the local bytes for any split, partial within rounding") {
  // Top-3 of 4: a token's route can start on one node and continue with two
  // experts on the other — the case partial sums cannot fold exactly.
  struct {
    TempDir dir;
    std::string path;
  } model;
  model.path = model.dir / "model";
  tools::SynthOptions synth = SmallSynth(model.dir / "ckpt");
  synth.top_k = 3;
  MakeModel(synth, model.path, common::DType::kBF16);
  Proc a = StartNode(model.path, "0-2");
  Proc b = StartNode(model.path, "2-3");
  Proc all = StartNode(model.path, "0-3");
  Proc local = StartRouter({"--local=" + model.path, "--threads=1"});
  auto local_stub = Connect(local.port);
  struct Setup {
    std::string replies;
    std::vector<int> nodes;
    bool exact;  // byte-identical to local expected
  };
  const std::vector<Setup> setups = {{"exact", {a.port, b.port}, true},
                                     {"per_expert", {a.port, b.port}, true},
                                     {"partial", {all.port}, true},  // every token's experts on one node
                                     {"partial", {a.port, b.port}, false}};
  for (const Setup& setup : setups) {
    std::string at;
    for (const int port : setup.nodes) at += (at.empty() ? "" : ",") + Address(port);
    Proc router = StartRouter({"--model=" + model.path, "--experts-at=" + at, "--node_replies=" + setup.replies});
    auto stub = Connect(router.port);
    int differ = 0;
    for (int i = 0; i < 12; ++i) {
      std::vector<int32_t> ids(1 + i * 5);
      for (size_t t = 0; t < ids.size(); ++t) ids[t] = static_cast<int32_t>((t * 11 + i * 3) % 64);
      for (const v1::DataType out : {v1::DATA_TYPE_F32, v1::DATA_TYPE_BF16}) {
        v1::ForwardRequest request =
            Request(i % 2, ids, 500 + i, i % 3 == 0 ? v1::ROUTING_MODE_LUT : v1::ROUTING_MODE_GATE);
        request.set_output_dtype(out);
        v1::ForwardResponse remote, in_process;
        const grpc::Status s = Call(*stub, request, &remote);
        INFO(setup.replies << " on " << at << ": " << s.error_message());
        REQUIRE(s.ok());
        REQUIRE(Call(*local_stub, request, &in_process).ok());
        if (setup.exact) {
          CHECK(remote.output().data() == in_process.output().data());
        } else if (out == v1::DATA_TYPE_F32) {
          differ += remote.output().data() != in_process.output().data();
          CHECK(RelativeL2(remote.output().data(), in_process.output().data()) < 1e-6);
        }
      }
    }
    std::printf(
        "node replies %s on %zu node(s): %s\n", setup.replies.c_str(), setup.nodes.size(),
        setup.exact ? "byte-identical" : absl::StrCat(differ, " of 12 f32 answers differ in the last bits").c_str());
  }
}

TEST_CASE("calls over a node's --max_rows go to it as several calls within it, with the local bytes") {
  // At --max_rows 8 the node's share goes in calls within 4 rows, and an
  // expert with more than 4 rows in runs of 4. int4's kernels compute row by
  // row, so the bytes stay the local ones; bf16's too unless the node's
  // profile runs oneDNN (then within rounding: docs/ROUTER.md).
  for (const common::DType type : {common::DType::kBF16, common::DType::kInt4}) {
    Model model(type);
    // A budget of its own: the default one, sized for calls of 8 rows, is a
    // few KB, and under a sanitizer the node frees a call's room long after
    // its reply (the pacing of such calls is remote_dispatch_test's).
    Proc node = StartNode(model.path, "all", 0, {"--max_rows=8", "--max_inflight_bytes=100000000"});
    Proc local = StartRouter({"--local=" + model.path, "--threads=1"});
    auto local_stub = Connect(local.port);
    for (const std::string replies : {"per_expert", "exact"}) {
      Proc router =
          StartRouter({"--model=" + model.path, "--experts-at=" + Address(node.port), "--node_replies=" + replies});
      auto stub = Connect(router.port);
      const std::string profile = Status(*stub).nodes(0).kernel_profile();
      const bool row_by_row = type == common::DType::kInt4 || profile.find("onednn_min_tokens 0") != std::string::npos;
      for (const int tokens : {5, 8, 40}) {
        std::vector<int32_t> ids(tokens);
        for (int t = 0; t < tokens; ++t) ids[t] = (t * 7 + 3) % 64;
        const v1::ForwardRequest request = Request(1, ids, 900 + tokens, v1::ROUTING_MODE_GATE);
        v1::ForwardResponse remote, in_process;
        const grpc::Status s = Call(*stub, request, &remote);
        INFO(common::DTypeName(type) << ", " << replies << ", " << tokens << " tokens, node kernels " << profile << ": "
                                     << s.error_message());
        REQUIRE(s.ok());
        REQUIRE(Call(*local_stub, request, &in_process).ok());
        if (row_by_row) {
          CHECK(remote.output().data() == in_process.output().data());
        } else {
          CHECK(RelativeL2(remote.output().data(), in_process.output().data()) < 1e-6);
        }
      }
      CHECK(Status(*stub).nodes(0).failed_calls() == 0);  // no call was refused and retried
    }
  }
}

TEST_CASE("the router exports Prometheus metrics: requests, stages, tokens per expert, node calls") {
  Model model(common::DType::kBF16);
  Proc a = StartNode(model.path, "all");
  Proc router = StartRouter(
      {"--model=" + model.path, "--experts_at=" + Address(a.port), "--metrics_port=0", "--metrics_host=127.0.0.1"});
  const int metrics_port = router.process->ReadPort("metrics on port ");
  auto stub = Connect(router.port);
  v1::ForwardResponse response;
  REQUIRE(Call(*stub, Request(0, {1, 2, 3}, 1), &response).ok());
  CHECK(!Call(*stub, Request(0, {99}, 1), &response).ok());
  const std::string metrics = colibri::testing::HttpGet(metrics_port, "/metrics");
  INFO(metrics);
  CHECK(metrics.find("colibri_router_requests_total{code=\"0\",method=\"Forward\"} 1") != std::string::npos);
  CHECK(metrics.find("colibri_router_requests_total{code=\"3\",method=\"Forward\"} 1") != std::string::npos);
  for (const char* stage : {"route", "dispatch", "slowest_node", "aggregate", "total"}) {
    CHECK(metrics.find(std::string("colibri_router_stage_seconds_count{stage=\"") + stage + "\"} 1") !=
          std::string::npos);
  }
  CHECK(metrics.find("colibri_router_expert_tokens_total{expert=\"0\",layer=\"0\"}") != std::string::npos);
  CHECK(metrics.find("colibri_router_node_calls_total{code=\"0\",node=\"" + Address(a.port) + "\"} 1") !=
        std::string::npos);
  CHECK(metrics.find("colibri_router_live_nodes 1") != std::string::npos);
}

TEST_CASE("a --local router merges concurrent calls as a distributed one does, unless --batch_window_us is 0") {
  Model model(common::DType::kBF16);
  for (const bool merging : {true, false}) {
    std::vector<std::string> flags = {"--local=" + model.path, "--metrics_port=0", "--metrics_host=127.0.0.1"};
    if (!merging) flags.push_back("--batch_window_us=0");
    Proc router = StartRouter(flags);
    const int metrics_port = router.process->ReadPort("metrics on port ");
    auto stub = Connect(router.port);
    v1::ForwardResponse response;
    REQUIRE(Call(*stub, Request(0, {1, 2, 3}, 1), &response).ok());
    const std::string metrics = colibri::testing::HttpGet(metrics_port, "/metrics");
    INFO(metrics);
    // The layer's batcher exists (and exports its histograms) only when merging is on.
    CHECK((metrics.find("colibri_router_batch_callers_count") != std::string::npos) == merging);
  }
}

TEST_CASE("Forward calls beyond the router's memory budget are refused, smaller ones served") {
  Model model(common::DType::kF32);
  Proc router =
      StartRouter({"--local=" + model.path, "--threads=1", "--max_inflight_bytes=200000", "--max_tokens=160"});
  auto stub = Connect(router.port);
  v1::ForwardResponse response;
  const grpc::Status refused = Call(*stub, Request(0, std::vector<int32_t>(150, 3), 1), &response);
  CHECK(refused.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(refused.error_message().find("--max_inflight_bytes") != std::string::npos);
  // A request that can never run says so, not "retry later" for memory.
  const grpc::Status too_long = Call(*stub, Request(0, std::vector<int32_t>(256, 3), 1), &response);
  CHECK(too_long.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(too_long.error_message().find("exceed the limit of 160") != std::string::npos);
  for (int i = 0; i < 3; ++i) CHECK(Call(*stub, Request(0, {1, 2}, 1), &response).ok());
}

// A stub for replies over gRPC's default 4 MiB limit; with `fixed_window`,
// its channel keeps a 64 KiB HTTP/2 window (no BDP probing): a reply larger
// than that, not read, stays with the sender.
std::unique_ptr<v1::Router::Stub> BigReplyStub(int port, bool fixed_window) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  if (fixed_window) {
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 65536);
  }
  return v1::Router::NewStub(grpc::CreateCustomChannel(Address(port), grpc::InsecureChannelCredentials(), args));
}

// One call of 60 000 tokens reserves 11.5 MB of hidden states and several
// times that of work space (RouterService::Footprint): with this budget one
// fits, two do not.
constexpr int kBigTokens = 60000;
const char kBigBudget[] = "--max_inflight_bytes=150000000";

TEST_CASE("a call of --max_tokens tokens to a node holding every expert fits the node's default budget") {
  Model model(common::DType::kF32);
  Proc node = StartNode(model.path, "all", 0, {"--max_rows=100"});
  Proc router = StartRouter({"--model=" + model.path, "--experts-at=" + Address(node.port), "--max_tokens=100"});
  auto stub = Connect(router.port);
  v1::ForwardResponse response;
  const grpc::Status s = Call(*stub, Request(0, std::vector<int32_t>(100, 3), 1), &response);
  INFO(s.error_message());
  CHECK(s.ok());
}

TEST_CASE("a reply the client does not read keeps its call's memory in the router's budget") {
  Model model(common::DType::kF32);
  Proc router = StartRouter({"--local=" + model.path, "--threads=1", kBigBudget});
  auto stub = BigReplyStub(router.port, false);
  const v1::ForwardRequest big = Request(0, std::vector<int32_t>(kBigTokens, 3), 1);
  v1::ForwardResponse response;
  // An 11.5 MB reply on a stream nobody reads stays in the router, past
  // HTTP/2's flow-control window: its call's reservation with it. (The
  // stream's call is the router's only one until it has been answered:
  // GetClusterStatus counts it then.)
  grpc::ClientContext stream_context;
  auto stream_stub = BigReplyStub(router.port, true);
  auto stream = stream_stub->ForwardStream(&stream_context);
  REQUIRE(stream->Write(big));
  REQUIRE(WaitFor([&] { return Status(*stub).requests() >= 1; }));
  auto refused = [&] {
    const grpc::Status s = Call(*stub, big, &response);
    INFO(s.error_message());
    return s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
  };
  CHECK(refused());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // answered long since: still held
  CHECK(refused());
  v1::ForwardStreamResponse reply;
  REQUIRE(stream->Read(&reply));
  CHECK(reply.code() == 0);
  CHECK(WaitFor([&] { return Call(*stub, big, &response).ok(); }));
  stream->WritesDone();
  CHECK(stream->Finish().ok());
}

// Calls `request`: true when served, false when refused for the memory
// budget; any other answer fails the test.
bool ServedOrRefused(v1::Router::Stub& stub, const v1::ForwardRequest& request) {
  v1::ForwardResponse response;
  const grpc::Status s = Call(stub, request, &response);
  INFO(s.error_message());
  CHECK((s.ok() || s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED));
  return s.ok();
}

TEST_CASE("a reply not taken within --send_timeout_ms cancels its call and frees its memory") {
  Model model(common::DType::kF32);
  Proc router = StartRouter({"--local=" + model.path, "--threads=1", kBigBudget, "--send_timeout_ms=4000"});
  auto stub = BigReplyStub(router.port, false);
  const v1::ForwardRequest big = Request(0, std::vector<int32_t>(kBigTokens, 3), 1);
  auto served = [&] { return ServedOrRefused(*stub, big); };
  // The client answers pings but does not read. (A gRPC client always reads
  // a unary reply; the unary Forward's timer is the same.)
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(40));  // if it fails: no hang
  auto unread_stub = BigReplyStub(router.port, true);
  auto stream = unread_stub->ForwardStream(&context);
  REQUIRE(stream->Write(big));
  REQUIRE(WaitFor([&] { return Status(*stub).requests() >= 1; }));
  const auto answered = Clock::now();
  CHECK_FALSE(served());
  CHECK(WaitFor(served));
  const double freed = std::chrono::duration<double>(Clock::now() - answered).count();
  v1::ForwardStreamResponse reply;
  while (stream->Read(&reply)) {
  }
  CHECK(stream->Finish().error_code() == grpc::StatusCode::CANCELLED);
  std::printf("send timeout 4 s: an unread ForwardStream reply's call freed %.2f s after it was answered\n", freed);
}

// A unary gRPC call written by hand on a TCP connection that is then never
// read: its HTTP/2 stream window is 1 KiB and no WINDOW_UPDATE ever comes,
// so a longer reply stays with the sender — what no gRPC client library can
// be made to do (each reads a unary reply whole). Closes the connection when
// destroyed.
class UnreadUnaryCall {
 public:
  UnreadUnaryCall(int port, const std::string& method, const google::protobuf::Message& request) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(connect(fd_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0);
    std::string out = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    const std::string window = {0x00, 0x04, 0x00, 0x00, 0x04, 0x00};  // SETTINGS_INITIAL_WINDOW_SIZE = 1024
    Frame(&out, 0x4, 0, 0, window);                                   // SETTINGS
    Frame(&out, 0x4, 0x1, 0, "");                                     // SETTINGS ACK (the server's)
    std::string headers;
    for (const auto& [name, value] :
         std::vector<std::pair<std::string, std::string>>{{":method", "POST"},
                                                          {":scheme", "http"},
                                                          {":path", method},
                                                          {":authority", Address(port)},
                                                          {"content-type", "application/grpc"},
                                                          {"te", "trailers"}}) {
      headers.push_back(0);  // HPACK: a literal field, not indexed, new name
      Length(&headers, name.size());
      headers += name;
      Length(&headers, value.size());
      headers += value;
    }
    Frame(&out, 0x1, 0x4, 1, headers);  // HEADERS, END_HEADERS, stream 1
    const std::string bytes = request.SerializeAsString();
    REQUIRE(bytes.size() + 5 < 65535);  // within the connection's first window
    std::string message(5, '\0');       // not compressed; the length, big-endian
    for (int i = 0; i < 4; ++i) message[1 + i] = static_cast<char>(bytes.size() >> (24 - 8 * i));
    message += bytes;
    for (size_t at = 0; at < message.size(); at += 16384) {  // frames of at most the default 16 KiB
      const bool last = at + 16384 >= message.size();
      Frame(&out, 0x0, last ? 0x1 : 0x0, 1, message.substr(at, 16384));  // DATA, END_STREAM on the last
    }
    REQUIRE(send(fd_, out.data(), out.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(out.size()));
  }
  ~UnreadUnaryCall() { close(fd_); }
  UnreadUnaryCall(const UnreadUnaryCall&) = delete;
  UnreadUnaryCall& operator=(const UnreadUnaryCall&) = delete;

 private:
  static void Frame(std::string* out, uint8_t type, uint8_t flags, uint32_t stream, const std::string& payload) {
    const size_t n = payload.size();
    *out += {static_cast<char>(n >> 16),      static_cast<char>(n >> 8),      static_cast<char>(n),
             static_cast<char>(type),         static_cast<char>(flags),       static_cast<char>(stream >> 24),
             static_cast<char>(stream >> 16), static_cast<char>(stream >> 8), static_cast<char>(stream)};
    *out += payload;
  }
  // An HPACK string length (7-bit prefix, not Huffman-coded).
  static void Length(std::string* out, size_t n) {
    if (n < 127) {
      out->push_back(static_cast<char>(n));
      return;
    }
    out->push_back(127);
    for (n -= 127; n >= 128; n /= 128) out->push_back(static_cast<char>(n % 128 + 128));
    out->push_back(static_cast<char>(n));
  }

  int fd_ = -1;
};

TEST_CASE("a unary reply not taken within --send_timeout_ms cancels its call and frees its memory") {
  Model model(common::DType::kF32);
  // 256 tokens (48 KiB of f32 hidden states) reserve ~0.5 MB: one fits, two do not.
  Proc router =
      StartRouter({"--local=" + model.path, "--threads=1", "--max_inflight_bytes=700000", "--send_timeout_ms=5000"});
  auto stub = Connect(router.port);
  v1::ForwardRequest request = Request(0, std::vector<int32_t>(256, 3), 1);
  request.set_return_routes(false);
  auto served = [&] { return ServedOrRefused(*stub, request); };
  UnreadUnaryCall unread(router.port, "/colibri.v1.Router/Forward", request);
  REQUIRE(WaitFor([&] { return Status(*stub).requests() == 1; }));  // computed: its reply is on its way
  const auto held = Clock::now();
  CHECK_FALSE(served());  // the reply is held, and with it the budget
  std::this_thread::sleep_for(std::chrono::seconds(1));
  CHECK_FALSE(served());  // still: nothing but the send timeout (5 s) frees it
  CHECK(WaitFor(served));
  const double freed = std::chrono::duration<double>(Clock::now() - held).count();
  std::printf("send timeout 5 s: an unread unary Forward reply's call freed %.2f s after it was computed\n", freed);
}

TEST_CASE("streams held open on a synchronous service are refused past a thread cap, and the router serves on") {
  Model model(common::DType::kF32);
  Proc router = StartRouter({"--local=" + model.path, "--threads=1"});
  // Reflection runs a thread per open stream: open more than the cap
  // (runtime::kMaxSyncServerThreads, 64) and send nothing on them.
  constexpr int kStreams = 64 + 16;
  grpc::GenericStub generic(grpc::CreateChannel(Address(router.port), grpc::InsecureChannelCredentials()));
  grpc::CompletionQueue cq;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::GenericClientAsyncReaderWriter>> streams;
  std::vector<grpc::Status> statuses(kStreams);
  for (int i = 0; i < kStreams; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    streams.push_back(generic.PrepareCall(contexts.back().get(),
                                          "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq));
    streams.back()->StartCall(reinterpret_cast<void*>(static_cast<intptr_t>(2 * i)));
    streams.back()->Finish(&statuses[i], reinterpret_cast<void*>(static_cast<intptr_t>(2 * i + 1)));
  }
  // The refused ones end at once; the others stay open until cancelled.
  int started = 0, finished = 0, refused = 0;
  const auto drain = [&](std::chrono::milliseconds wait) {
    void* tag;
    bool ok;
    while (cq.AsyncNext(&tag, &ok, std::chrono::system_clock::now() + wait) == grpc::CompletionQueue::GOT_EVENT) {
      const intptr_t t = reinterpret_cast<intptr_t>(tag);
      if (t % 2 == 0) {
        ++started;
        continue;
      }
      ++finished;
      if (statuses[t / 2].error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) ++refused;
    }
  };
  drain(std::chrono::milliseconds(2000));
  CHECK(refused >= 1);
  CHECK(finished < kStreams);  // the streams within the cap are open
  v1::ForwardResponse response;
  const grpc::Status served = Call(*Connect(router.port), Request(0, {1, 2}, 1), &response);
  INFO(served.error_message());
  CHECK(served.ok());
  for (auto& c : contexts) c->TryCancel();
  while (finished < kStreams || started < kStreams) {
    const int before = started + finished;
    drain(std::chrono::milliseconds(5000));
    if (started + finished == before) break;
  }
  CHECK(finished == kStreams);
  cq.Shutdown();
  drain(std::chrono::milliseconds(1000));
}

TEST_CASE("a deadline centuries away is served as no deadline") {
  Model model(common::DType::kF32);
  Proc router = StartRouter({"--local=" + model.path, "--threads=1"});
  auto stub = Connect(router.port);
  // 300 years: past the year 2262, where system_clock's nanoseconds end.
  const gpr_timespec far =
      gpr_time_add(gpr_now(GPR_CLOCK_REALTIME), gpr_time_from_seconds(int64_t{300} * 365 * 24 * 3600, GPR_TIMESPAN));
  grpc::ClientContext context;
  context.set_deadline(far);
  v1::ForwardResponse response;
  const grpc::Status s = stub->Forward(&context, Request(0, {1, 2}, 1), &response);
  INFO(s.error_message());
  CHECK(s.ok());
  grpc::ClientContext stream_context;
  stream_context.set_deadline(far);
  auto stream = stub->ForwardStream(&stream_context);
  REQUIRE(stream->Write(Request(0, {3}, 1)));
  v1::ForwardStreamResponse reply;
  REQUIRE(stream->Read(&reply));
  INFO(reply.message());
  CHECK(reply.code() == 0);
  stream->WritesDone();
  CHECK(stream->Finish().ok());
}

TEST_CASE("on SIGTERM a ForwardStream answers its request in flight and then ends UNAVAILABLE, an idle one at once") {
  Model model(common::DType::kF32);
  // The node holds every call for 4 s (fault injection): a request is in flight when SIGTERM comes.
  Proc node = StartNode(model.path, "all", 0, {"--inject_delay_ms=4000"});
  Proc router = StartRouter({"--model=" + model.path, "--experts-at=" + Address(node.port), "--drain_seconds=300",
                             "--node_timeout_ms=15000"});
  auto stub = Connect(router.port);
  grpc::ClientContext idle_context, busy_context;
  auto idle = stub->ForwardStream(&idle_context);
  REQUIRE(idle->Write(Request(0, {1}, 1)));
  v1::ForwardStreamResponse reply;
  REQUIRE(idle->Read(&reply));
  CHECK(reply.code() == 0);
  auto busy = stub->ForwardStream(&busy_context);
  REQUIRE(busy->Write(Request(0, {2}, 2)));
  // Time for the request to reach the router (a slow machine too), well inside the node's 4 s.
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  // Neither stream holds the drain (300 s) beyond the request in flight.
  CHECK(router.process->SignalAndWait(SIGTERM, std::chrono::seconds(60)) == 0);
  REQUIRE(busy->Read(&reply));
  INFO(reply.message());
  CHECK(reply.code() == 0);
  CHECK(reply.response().output().data().size() == kDModel * 4);
  for (auto* stream : {idle.get(), busy.get()}) {
    CHECK(!stream->Read(&reply));
    const grpc::Status end = stream->Finish();
    CHECK(end.error_code() == grpc::StatusCode::UNAVAILABLE);
    CHECK(end.error_message().find("shutting down") != std::string::npos);
  }
}

TEST_CASE("malformed requests get INVALID_ARGUMENT naming the field, and a stream survives one") {
  Model model(common::DType::kF32);
  Proc router = StartRouter({"--local=" + model.path, "--threads=1"});
  auto stub = Connect(router.port);
  auto expect = [&](const v1::ForwardRequest& request, const std::string& needle) {
    v1::ForwardResponse response;
    const grpc::Status s = Call(*stub, request, &response);
    INFO("expected '" << needle << "', got: " << s.error_message());
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(s.error_message().find(needle) != std::string::npos);
  };
  expect(Request(0, {1, 64}, 1), "token_ids[1] = 64");
  expect(Request(5, {1}, 1), "layer 5");
  v1::ForwardRequest r = Request(0, {1, 2}, 1);
  r.mutable_hidden()->set_shape(1, 47);
  expect(r, "hidden.shape [2, 47]");
  r = Request(0, {1, 2}, 1);
  r.mutable_hidden()->mutable_data()->resize(10);
  expect(r, "hidden.data has 10 bytes");
  r = Request(0, {1, 2}, 1);
  r.set_routing(static_cast<v1::RoutingMode>(9));
  expect(r, "routing 9");
  expect(Request(0, {1}, 1, v1::ROUTING_MODE_CLIENT), "routing CLIENT needs the request's routes: none given");
  r = Request(0, {1}, 1, v1::ROUTING_MODE_CLIENT);
  r.mutable_routes()->set_top_k(2);
  r.mutable_routes()->add_expert_ids(1);
  r.mutable_routes()->add_expert_ids(1);
  r.mutable_routes()->add_weights(0.5f);
  r.mutable_routes()->add_weights(0.5f);
  expect(r, "expert repeated for token 0");
  r.mutable_routes()->set_expert_ids(1, 9);
  expect(r, "routes.expert_ids[1] = 9");
  r.mutable_routes()->set_expert_ids(1, 2);
  r.mutable_routes()->set_weights(0, std::numeric_limits<float>::quiet_NaN());
  expect(r, "routes.weights[0] = nan");
  // Bytes that do not parse (a proto3 string that is not UTF-8; the C++
  // client logs it and sends it anyway): refused by name, not gRPC's bare UNIMPLEMENTED.
  r = Request(0, {1}, 1);
  r.set_request_id("\xff\xfe");
  expect(r, "the message is not a valid colibri.v1.ForwardRequest");

  // A stream: replies in order, the bad one carries its error, the stream goes on.
  grpc::ClientContext context;
  auto stream = stub->ForwardStream(&context);
  // Message 4's request_id is over the 256-byte limit: refused, and echoed
  // cut to the limit.
  // Of two-byte characters ("é"), from byte 5 on: byte 256 is a character's
  // second byte, so the echo keeps 255 (valid UTF-8, or the stream breaks).
  // Message 5 does not parse (its request_id is not UTF-8): answered in its
  // turn with no id, and message 6 still is.
  std::string long_id = "req-4";
  while (long_id.size() < (1 << 20)) long_id += "\xc3\xa9";
  for (int i = 0; i < 7; ++i) {
    v1::ForwardRequest request = Request(i % 2, {static_cast<int32_t>(i == 3 ? 99 : i)}, i);
    request.set_request_id(i == 4 ? long_id : i == 5 ? "\xff" : "req-" + std::to_string(i));
    REQUIRE(stream->Write(request));
  }
  stream->WritesDone();
  v1::ForwardStreamResponse reply;
  for (int i = 0; i < 7; ++i) {
    REQUIRE(stream->Read(&reply));
    CHECK(reply.request_id() == (i == 4 ? long_id.substr(0, 255) : i == 5 ? "" : "req-" + std::to_string(i)));
    if (i == 5) {
      CHECK(reply.code() == static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
      CHECK(reply.message().find("not a valid colibri.v1.ForwardRequest") != std::string::npos);
      CHECK(!reply.has_response());
    } else if (i == 3) {
      CHECK(reply.code() == static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
      CHECK(reply.message().find("token_ids[0] = 99") != std::string::npos);
    } else if (i == 4) {
      CHECK(reply.code() == static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
      CHECK(reply.message().find("request_id is 1048577 bytes") != std::string::npos);
    } else {
      CHECK(reply.code() == 0);
      CHECK(reply.response().output().data().size() == kDModel * 4);
    }
  }
  CHECK(!stream->Read(&reply));
  CHECK(stream->Finish().ok());

  grpc::ClientContext info_context;
  v1::GetModelInfoResponse info;
  REQUIRE(stub->GetModelInfo(&info_context, v1::GetModelInfoRequest(), &info).ok());
  CHECK(info.d_model() == kDModel);
  CHECK(info.n_experts() == 4);
  CHECK(info.vocab_size() == 64);
  CHECK(info.backend() == "local");
  CHECK(info.model_id().rfind("xxh3_128:", 0) == 0);
  CHECK(router.process->SignalAndWait(SIGTERM, std::chrono::seconds(15)) == 0);
}

}  // namespace
}  // namespace router_node
}  // namespace colibri
