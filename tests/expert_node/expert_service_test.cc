// The expert node over real gRPC on 127.0.0.1 (port 0): answers equal the
// in-process executor bit for bit; bad requests get the documented status
// naming the field; GetNodeInfo and Reload behave as the proto says.

#include "expert_node/expert_service.h"

#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "colibri/v1/expert_node.grpc.pb.h"
#include "expert_node/compute_request.h"
#include "expert_node/expert_server.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kernels/expert_executor.h"
#include "tests/test_util.h"

namespace colibri {
namespace expert_node {
namespace {

using colibri::testing::HttpGet;
using colibri::testing::TempDir;
namespace v1 = colibri::v1;

constexpr int64_t kDModel = 48;

struct Node {
  std::unique_ptr<std::ostringstream> log = std::make_unique<std::ostringstream>();  // outlives the server
  std::unique_ptr<ExpertServer> server;
  std::unique_ptr<v1::ExpertNode::Stub> stub;
  std::unique_ptr<v1::ExpertNode::Stub> admin;  // on the admin listener
};

// A started node (and stubs for its data port and admin listener) with these options.
Node StartWith(ServerOptions options) {
  options.admin_listen = "127.0.0.1:0";
  Node node;
  auto server = ExpertServer::Create(options, node.log.get());
  INFO(server.status().message());
  REQUIRE(server.ok());
  node.server = std::move(server).value();
  auto channel =
      grpc::CreateChannel("127.0.0.1:" + std::to_string(node.server->port()), grpc::InsecureChannelCredentials());
  node.stub = v1::ExpertNode::NewStub(channel);
  node.admin = v1::ExpertNode::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(node.server->admin_port()),
                                                           grpc::InsecureChannelCredentials()));
  return node;
}

// The options of most tests: model_dir, its shard, weights mapped, 2 threads.
ServerOptions Options(const std::string& model_dir, const std::string& experts) {
  ServerOptions options;
  options.model_dir = model_dir;
  options.store.shard = *ShardSpec::Parse(experts);
  options.store.residency = Residency::kPaged;
  options.threads = 2;
  return options;
}

Node Start(const std::string& model_dir, const std::string& experts, int metrics_port = -1,
           const std::string& model_root = "", int inject_delay_ms = 0) {
  ServerOptions options = Options(model_dir, experts);
  options.model_root = model_root;
  options.inject_delay_ms = inject_delay_ms;
  options.metrics_port = metrics_port;
  options.metrics_host = "127.0.0.1";
  return StartWith(options);
}

v1::ComputeRequest Request(const std::vector<float>& rows) {
  v1::ComputeRequest r;
  r.set_layer(0);
  v1::Tensor* t = r.mutable_rows();
  t->set_dtype(v1::DATA_TYPE_F32);
  t->add_shape(static_cast<int64_t>(rows.size()) / kDModel);
  t->add_shape(kDModel);
  t->set_data(reinterpret_cast<const char*>(rows.data()), rows.size() * 4);
  v1::ExpertWork* a = r.add_experts();
  a->set_expert(0);
  a->add_row_indices(0);
  a->add_row_indices(2);
  a->add_weights(0.6f);
  a->add_weights(0.3f);
  v1::ExpertWork* b = r.add_experts();
  b->set_expert(1);
  b->add_row_indices(1);
  b->add_weights(1.0f);
  return r;
}

grpc::Status Call(Node& node, const v1::ComputeRequest& request, v1::ComputeResponse* response) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  return node.stub->Compute(&context, request, response);
}

TEST_CASE("an expert node answers Compute over gRPC exactly like the in-process executor") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  Node node = Start(dir / "model", "layer:0/expert:0-1;layer:1");
  std::vector<float> rows(3 * kDModel);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = std::cos(0.1 * i);

  v1::ComputeResponse response;
  const grpc::Status status = Call(node, Request(rows), &response);
  INFO(status.error_message());
  REQUIRE(status.ok());
  REQUIRE(response.output().dtype() == v1::DATA_TYPE_F32);
  REQUIRE(response.output().data().size() == rows.size() * 4);
  CHECK(response.weights_version() == 1);
  std::vector<float> remote(rows.size());
  std::memcpy(remote.data(), response.output().data().data(), remote.size() * 4);

  // The same tasks in-process, on the same files.
  auto model = common::ModelDir::Open(dir / "model");
  REQUIRE(model.ok());
  auto e0 = (*model)->LoadExpert(0, 0, false);
  auto e1 = (*model)->LoadExpert(0, 1, false);
  REQUIRE(e0.ok());
  REQUIRE(e1.ok());
  const int32_t rows0[2] = {0, 2}, rows1[1] = {1};
  const float w0[2] = {0.6f, 0.3f}, w1[1] = {1.0f};
  auto pool = kernels::ThreadPool::Create({2, -1, false});
  REQUIRE(pool.ok());
  std::vector<float> local(rows.size(), 0.f);
  kernels::Workspace ws;
  kernels::RunExperts(**pool, {{e0->get(), rows0, w0, 2}, {e1->get(), rows1, w1, 1}}, rows.data(), kDModel,
                      local.data(), ws);
  CHECK(remote == local);  // bit for bit
  bool nonzero = false;
  for (float v : remote) nonzero |= v != 0.f;
  CHECK(nonzero);

  // bf16 rows in, bf16 out.
  v1::ComputeRequest bf = Request(rows);
  std::string bf_rows(rows.size() * 2, '\0');
  for (size_t i = 0; i < rows.size(); ++i) {
    const uint16_t h = common::FloatToBf16(rows[i]);
    std::memcpy(&bf_rows[2 * i], &h, 2);
  }
  bf.mutable_rows()->set_dtype(v1::DATA_TYPE_BF16);
  bf.mutable_rows()->set_data(bf_rows);
  bf.set_output_dtype(v1::DATA_TYPE_BF16);
  v1::ComputeResponse bf_response;
  REQUIRE(Call(node, bf, &bf_response).ok());
  CHECK(bf_response.output().dtype() == v1::DATA_TYPE_BF16);
  CHECK(bf_response.output().data().size() == rows.size() * 2);

  // Grouped output folds the per-entry rows in rank order, bit for bit.
  v1::ComputeRequest per_entry = Request(rows);
  per_entry.mutable_experts(1)->add_row_indices(0);  // expert 1: rows 1 and 0
  per_entry.mutable_experts(1)->add_weights(0.25f);
  per_entry.set_per_expert_output(true);
  v1::ComputeResponse entries;
  REQUIRE(Call(node, per_entry, &entries).ok());
  REQUIRE(entries.output().data().size() == 4 * kDModel * 4);
  std::vector<float> e(4 * kDModel);  // (e0,r0), (e0,r2), (e1,r1), (e1,r0)
  std::memcpy(e.data(), entries.output().data().data(), e.size() * 4);
  v1::ComputeRequest grouped = per_entry;
  grouped.set_per_expert_output(false);
  grouped.set_num_output_rows(3);
  // Row 0: (e1,r0) rank 0 then (e0,r0) rank 1; row 1: (e0,r2); row 2: (e1,r1).
  for (int v : {0, 1}) grouped.mutable_experts(0)->add_output_rows(v);
  for (int v : {1, 0}) grouped.mutable_experts(0)->add_ranks(v);
  for (int v : {2, 0}) grouped.mutable_experts(1)->add_output_rows(v);
  for (int v : {0, 0}) grouped.mutable_experts(1)->add_ranks(v);
  v1::ComputeResponse folded;
  REQUIRE(Call(node, grouped, &folded).ok());
  REQUIRE(folded.output().data().size() == 3 * kDModel * 4);
  std::vector<float> got(3 * kDModel), want(3 * kDModel);
  std::memcpy(got.data(), folded.output().data().data(), got.size() * 4);
  for (int c = 0; c < kDModel; ++c) {
    want[c] = e[3 * kDModel + c];
    want[c] += e[c];
    want[kDModel + c] = e[kDModel + c];
    want[2 * kDModel + c] = e[2 * kDModel + c];
  }
  CHECK(got == want);
}

TEST_CASE("an expert node reports SERVING over grpc.health.v1 once loaded, and NOT_SERVING after shutdown") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kF16);
  Node node = Start(dir / "model", "all");
  auto channel =
      grpc::CreateChannel("127.0.0.1:" + std::to_string(node.server->port()), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::health::v1::HealthCheckResponse response;
  for (const char* service : {"", "colibri.v1.ExpertNode"}) {  // the server, and the service by its name
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    const grpc::Status s = health->Check(&context, request, &response);
    INFO(service << ": " << s.error_message());
    REQUIRE(s.ok());
    CHECK(response.status() == grpc::health::v1::HealthCheckResponse::SERVING);
  }
  node.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  CHECK_FALSE(health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response).ok());  // stopped
}

TEST_CASE("a request over the row limits is refused before its rows are widened or copied") {
  ComputeEngine::Limits limits;
  limits.max_rows = 2;
  limits.max_row_indices = 3;
  const std::vector<float> rows(3 * kDModel, 0.5f);
  ComputeInput input;
  const absl::Status s = ParseComputeRequest(Request(rows), kDModel, 4, limits, &input);  // 3 rows
  CHECK(s.code() == absl::StatusCode::kResourceExhausted);
  CHECK(s.message().find("3 rows exceed the limit of 2") != absl::string_view::npos);
  CHECK(input.rows.capacity() == 0);  // nothing was allocated for them
  limits.max_rows = 3;
  limits.max_row_indices = 2;  // the request has 3 row indices
  CHECK(ParseComputeRequest(Request(rows), kDModel, 4, limits, &input).code() == absl::StatusCode::kResourceExhausted);
  CHECK(input.rows.capacity() == 0);
  limits.max_row_indices = 3;
  CHECK(ParseComputeRequest(Request(rows), kDModel, 4, limits, &input).ok());
  // A reply of more rows than the limit is refused too, before any compute.
  limits.max_rows = 3;
  v1::ComputeRequest per_entry = Request(rows);
  per_entry.mutable_experts(1)->add_row_indices(0);
  per_entry.mutable_experts(1)->add_weights(0.25f);  // 4 row indices: a 4-row reply
  per_entry.set_per_expert_output(true);
  limits.max_row_indices = 4;
  const absl::Status reply = ParseComputeRequest(per_entry, kDModel, 4, limits, &input);
  CHECK(reply.code() == absl::StatusCode::kResourceExhausted);
  CHECK(reply.message().find("the reply would have 4 rows") != absl::string_view::npos);
  v1::ComputeRequest grouped = per_entry;  // 4 grouped rows: as many as row indices, over the limit
  grouped.set_per_expert_output(false);
  grouped.set_num_output_rows(4);
  const absl::Status grouped_reply = ParseComputeRequest(grouped, kDModel, 4, limits, &input);
  CHECK(grouped_reply.code() == absl::StatusCode::kResourceExhausted);
  CHECK(grouped_reply.message().find("num_output_rows: the reply would have 4 rows") != absl::string_view::npos);
}

TEST_CASE("a call past its deadline is abandoned during compute, not computed to the end") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  // Every Compute sleeps 1 s before computing: a 500 ms deadline (room for a
  // slow sanitizer build to deliver the call to the node: one that ends
  // before the node reads it is never seen there) has passed by the time the
  // kernels start, so the first poll between blocks stops it.
  Node node = Start(dir / "model", "layer:0/expert:0-1", /*metrics_port=*/0, "", /*inject_delay_ms=*/1000);
  const std::vector<float> rows(3 * kDModel, 0.5f);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  v1::ComputeResponse response;
  CHECK(node.stub->Compute(&context, Request(rows), &response).error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
  // The node's own record of the call: not OK.
  std::string metrics;
  for (int i = 0; i < 100 && metrics.find("method=\"Compute\"") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the node finishes after the client gave up
    metrics = HttpGet(node.server->metrics_port(), "/metrics");
  }
  // CANCELLED (1) when the compute stopped it; under a slow sanitizer build the
  // deadline may already have passed before the call started (4). Never OK.
  INFO(metrics);
  CHECK((metrics.find("colibri_expert_calls_total{code=\"1\",method=\"Compute\"} 1") != std::string::npos ||
         metrics.find("colibri_expert_calls_total{code=\"4\",method=\"Compute\"} 1") != std::string::npos));
  CHECK(metrics.find("colibri_expert_calls_total{code=\"0\",method=\"Compute\"}") == std::string::npos);
}

TEST_CASE("a stream message whose timeout passes during compute is answered DEADLINE_EXCEEDED") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  Node node = Start(dir / "model", "layer:0/expert:0-1", -1, "", /*inject_delay_ms=*/1000);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));  // if it fails: no hang
  auto stream = node.stub->ComputeStream(&context);
  v1::ComputeStreamRequest message;
  message.set_call_id(7);
  *message.mutable_request() = Request(std::vector<float>(3 * kDModel, 0.5f));
  message.set_timeout_micros(300000);  // passed by the time the kernels start
  REQUIRE(stream->Write(message));
  v1::ComputeStreamResponse reply;
  REQUIRE(stream->Read(&reply));
  INFO(reply.message());
  CHECK(reply.call_id() == 7);
  CHECK(reply.code() == static_cast<int32_t>(grpc::StatusCode::DEADLINE_EXCEEDED));
  stream->WritesDone();
  CHECK(stream->Finish().ok());
}

TEST_CASE("a stream call whose call_id is in flight is refused at once, and the first one is answered") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  // The first call stays in flight 5 s: the second message is read long before.
  Node node = Start(dir / "model", "layer:0/expert:0-1", -1, "", /*inject_delay_ms=*/5000);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));  // if it fails: no hang
  auto stream = node.stub->ComputeStream(&context);
  v1::ComputeStreamRequest message;
  message.set_call_id(7);
  *message.mutable_request() = Request(std::vector<float>(3 * kDModel, 0.5f));
  REQUIRE(stream->Write(message));
  REQUIRE(stream->Write(message));
  v1::ComputeStreamResponse first, second;
  REQUIRE(stream->Read(&first));
  REQUIRE(stream->Read(&second));
  INFO(first.message());
  CHECK(first.call_id() == 7);
  CHECK(first.code() == static_cast<int32_t>(grpc::StatusCode::INVALID_ARGUMENT));  // the duplicate, at once
  CHECK(first.message() == "call_id 7 is already in flight on this stream");
  CHECK(second.call_id() == 7);
  CHECK(second.code() == 0);
  stream->WritesDone();
  CHECK(stream->Finish().ok());
}

TEST_CASE(
    "a Compute that does not parse is refused by name, and a stream carrying one ends INVALID_ARGUMENT after the calls "
    "before it") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  Node node = Start(dir / "model", "layer:0/expert:0-1");
  // A proto3 string that is not UTF-8: the C++ client logs it and sends it anyway.
  v1::ComputeRequest bad = Request(std::vector<float>(3 * kDModel, 0.5f));
  bad.set_request_id("\xff");
  v1::ComputeResponse response;
  const grpc::Status s = Call(node, bad, &response);
  INFO(s.error_message());
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(s.error_message().find("not a valid colibri.v1.ComputeRequest") != std::string::npos);

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));  // if it fails: no hang
  auto stream = node.stub->ComputeStream(&context);
  v1::ComputeStreamRequest message;
  message.set_call_id(1);
  *message.mutable_request() = Request(std::vector<float>(3 * kDModel, 0.5f));
  REQUIRE(stream->Write(message));
  message.set_call_id(2);
  message.mutable_request()->set_request_id("\xff");
  REQUIRE(stream->Write(message));
  v1::ComputeStreamResponse reply;
  REQUIRE(stream->Read(&reply));
  CHECK(reply.call_id() == 1);
  CHECK(reply.code() == 0);
  CHECK_FALSE(stream->Read(&reply));
  const grpc::Status ended = stream->Finish();
  INFO(ended.error_message());
  CHECK(ended.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(ended.error_message().find("not a valid colibri.v1.ComputeStreamRequest") != std::string::npos);
  CHECK(Call(node, Request(std::vector<float>(3 * kDModel, 0.5f)), &response).ok());  // the node serves on
}

TEST_CASE("under a memory limit the default in-flight budget takes what the weights leave, and no room is refused") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  ServerOptions options = Options(dir / "model", "all");
  options.store.residency = Residency::kCopy;
  options.limits.max_rows = 256;
  int64_t weights = 0;
  {
    auto store = ExpertStore::Create(dir / "model", options.store, nullptr);
    REQUIRE(store.ok());
    weights = (*store)->ResidentBytes();
  }
  const int64_t rows = options.limits.max_rows, process = int64_t{256} << 20;
  const int64_t call = ExpertService::Footprint(rows * kDModel * 4, rows * kDModel, 0, rows, kDModel);
  std::ostringstream log;
  options.store.memory_limit = weights + process + call - 1;  // not even one call of max_rows rows beside the weights
  const auto refused = ExpertServer::Create(options, &log);
  INFO(refused.status().message());
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(refused.status().message(), "pass the memory limit"));

  options.store.memory_limit = weights + process + call + 1;  // one call, not the default two
  {
    Node node = StartWith(options);
    INFO(node.log->str());
    CHECK(absl::StrContains(node.log->str(), absl::StrCat("in-flight budget ", call + 1, " bytes")));
    CHECK(absl::StrContains(node.log->str(), "no room for a second version"));
    v1::ComputeResponse response;
    CHECK(Call(node, Request(std::vector<float>(3 * kDModel, 0.5f)), &response).ok());
  }
  // Room for two versions: the budget leaves it, and a staged second version loads.
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt2"), dir / "model2", common::DType::kBF16);
  options.store.memory_limit = 2 * weights + process + call + 1;
  Node node = StartWith(options);
  INFO(node.log->str());
  CHECK(absl::StrContains(node.log->str(), absl::StrCat("in-flight budget ", call + 1, " bytes")));
  CHECK(absl::StrContains(node.log->str(), "and room for a second version"));
  const absl::Status staged = node.server->store().Reload(dir / "model2", std::nullopt, /*keep_previous=*/true);
  INFO(staged.message());
  CHECK(staged.ok());
}

TEST_CASE("the locked-bytes gauge follows the weights' background locking") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  ServerOptions options = Options(dir / "model", "all");
  options.store.residency = Residency::kLocked;  // locked in the background, after the node serves
  options.metrics_port = 0;
  options.metrics_host = "127.0.0.1";
  Node node = StartWith(options);
  const std::shared_ptr<const WeightSet> set = node.server->store().Current();
  set->AwaitLock();
  if (!set->locked()) {
    WARN("mlock refused here (RLIMIT_MEMLOCK): the gauge stays 0, untested");
    return;
  }
  // Set by the locking thread once it ends (the page may be read just before).
  double locked = 0;
  for (int i = 0; i < 100 && locked <= 0; ++i) {
    locked = colibri::testing::Metric(HttpGet(node.server->metrics_port(), "/metrics"), "colibri_expert_locked_bytes");
    if (locked <= 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  CHECK(locked == static_cast<double>(set->bytes()));
}

TEST_CASE("without a model root, Reload may re-shard the loaded model but never load another directory") {
  TempDir dir;
  const tools::SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt");
  colibri::testing::MakeModel(synth, dir / "a", common::DType::kBF16);
  colibri::testing::MakeModel(synth, dir / "b", common::DType::kBF16);
  Node node = Start(dir / "a", "layer:0/expert:0-1");  // no model root
  auto reload = [&](const std::string& model_dir, const std::string& experts) {
    v1::ReloadRequest request;
    request.set_model_dir(model_dir);
    request.set_experts(experts);
    v1::ReloadResponse response;
    grpc::ClientContext context;
    return node.admin->Reload(&context, request, &response);
  };
  const grpc::Status other = reload(dir / "b", "");  // its sibling: the old implicit root allowed it
  CHECK(other.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(other.error_message().find("model_root") != std::string::npos);
  CHECK(reload("", "layer:0/expert:2").ok());
}

TEST_CASE("a reload under concurrent Compute load fails no call") {
  TempDir dir;
  const tools::SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt");
  colibri::testing::MakeModel(synth, dir / "root/a", common::DType::kBF16);
  colibri::testing::MakeModel(synth, dir / "root/b", common::DType::kInt8);
  Node node = Start(dir / "root/a", "layer:0/expert:0-1", -1, dir / "root");
  const std::vector<float> rows(3 * kDModel, 0.25f);
  std::atomic<bool> stop{false};
  std::atomic<int> calls{0}, failures{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 3; ++c) {
    clients.emplace_back([&] {
      while (!stop) {
        v1::ComputeResponse response;
        if (!Call(node, Request(rows), &response).ok()) ++failures;
        ++calls;
      }
    });
  }
  for (int i = 0; i < 4; ++i) {  // alternate between the two models under load
    v1::ReloadRequest request;
    request.set_model_dir(i % 2 == 0 ? dir / "root/b" : dir / "root/a");
    v1::ReloadResponse response;
    grpc::ClientContext context;
    const grpc::Status s = node.admin->Reload(&context, request, &response);
    INFO(s.error_message());
    REQUIRE(s.ok());
    CHECK(response.weights_version() == static_cast<uint64_t>(i + 2));
  }
  stop = true;
  for (std::thread& t : clients) t.join();
  INFO(calls << " calls during 4 reloads");
  CHECK(calls > 0);
  CHECK(failures == 0);
}

// A plain HTTP GET on 127.0.0.1; returns the whole response.
TEST_CASE("an expert node serves Prometheus metrics about its calls, rows per expert and weights") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  Node node = Start(dir / "model", "layer:0/expert:0-1", /*metrics_port=*/0);
  REQUIRE(node.server->metrics_port() > 0);
  const std::vector<float> rows(3 * kDModel, 0.5f);
  v1::ComputeResponse response;
  REQUIRE(Call(node, Request(rows), &response).ok());
  v1::ComputeRequest bad = Request(rows);
  bad.set_layer(9);
  CHECK_FALSE(Call(node, bad, &response).ok());
  const std::string metrics = HttpGet(node.server->metrics_port(), "/metrics");
  INFO(metrics);
  CHECK(metrics.rfind("HTTP/1.1 200 OK", 0) == 0);
  CHECK(metrics.find("colibri_expert_calls_total{code=\"0\",method=\"Compute\"} 1") != std::string::npos);
  CHECK(metrics.find("colibri_expert_calls_total{code=\"3\",method=\"Compute\"} 1") != std::string::npos);
  CHECK(metrics.find("colibri_expert_expert_rows_total{expert=\"0\",layer=\"0\"} 2") != std::string::npos);
  CHECK(metrics.find("colibri_expert_compute_seconds_count{layer=\"0\"} 1") != std::string::npos);
  CHECK(metrics.find("colibri_expert_compute_seconds_bucket{layer=\"0\",le=\"+Inf\"} 1") != std::string::npos);
  CHECK(metrics.find("colibri_expert_weights_version 1") != std::string::npos);
  CHECK(metrics.find("# TYPE colibri_expert_queue_seconds histogram") != std::string::npos);
  CHECK(HttpGet(node.server->metrics_port(), "/other").rfind("HTTP/1.1 404", 0) == 0);
}

TEST_CASE("slow metrics clients do not hold up a scrape") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  Node node = Start(dir / "model", "layer:0/expert:0-1", /*metrics_port=*/0);
  // 20 clients that connect and send half a request, then nothing.
  std::vector<int> slow;
  for (int i = 0; i < 20; ++i) {
    slow.push_back(colibri::testing::ConnectLoopback(node.server->metrics_port()));
    REQUIRE(::send(slow.back(), "GET /metr", 9, MSG_NOSIGNAL) == 9);
  }
  const std::string metrics = HttpGet(node.server->metrics_port(), "/metrics");
  CHECK(metrics.rfind("HTTP/1.1 200 OK", 0) == 0);
  // The scrape was answered while slow clients were still being waited for
  // (a one-at-a-time server answers it only after every one of them timed
  // out; here they time out 1 s after connecting, so normally all 20 remain).
  int still_open = 0;
  for (int fd : slow) {
    char c;
    const ssize_t n = ::recv(fd, &c, 1, MSG_DONTWAIT);
    still_open += n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
    ::close(fd);
  }
  CHECK(still_open > 0);
}

std::string Slurp(const std::string& path) { return colibri::testing::ReadFile(path); }

TEST_CASE("a Compute call with a deadline centuries away is served as one with none") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  Node node = Start(dir / "model", "layer:0/expert:0-1");
  grpc::ClientContext context;  // 300 years: past the year 2262, where system_clock's nanoseconds end
  context.set_deadline(
      gpr_time_add(gpr_now(GPR_CLOCK_REALTIME), gpr_time_from_seconds(int64_t{300} * 365 * 24 * 3600, GPR_TIMESPAN)));
  v1::ComputeResponse response;
  const grpc::Status s = node.stub->Compute(&context, Request(std::vector<float>(3 * kDModel, 0.5f)), &response);
  INFO(s.error_message());
  CHECK(s.ok());
}

TEST_CASE("a long Compute call is interleaved with later ones and still equals the in-process executor") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kInt8);
  // Every call's first step sleeps 1.5 s first (fault injection): the small
  // call below is queued while the long one sleeps, so it is behind it.
  Node node = Start(dir / "model", "layer:0/expert:0-1", /*metrics_port=*/0, "", /*inject_delay_ms=*/1500);
  // A long call: 16384 rows through expert 0, half of them through expert 1: 96 slices.
  const int64_t n = 16384;
  std::vector<float> rows(n * kDModel);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = std::sin(0.01 * static_cast<double>(i % 9973));
  v1::ComputeRequest big = Request(std::vector<float>(kDModel, 0.f));
  big.mutable_rows()->set_shape(0, n);
  big.mutable_rows()->set_data(reinterpret_cast<const char*>(rows.data()), rows.size() * 4);
  std::vector<int32_t> all(n), odd;
  std::vector<float> w_all(n), w_odd;
  for (int32_t r = 0; r < n; ++r) {
    all[r] = r;
    w_all[r] = 0.25f + 0.5f * static_cast<float>(r % 7) / 7.f;
    if (r % 2 == 1) {
      odd.push_back(r);
      w_odd.push_back(1.f - w_all[r]);
    }
  }
  v1::ExpertWork* e0 = big.mutable_experts(0);
  e0->mutable_row_indices()->Assign(all.begin(), all.end());
  e0->mutable_weights()->Assign(w_all.begin(), w_all.end());
  v1::ExpertWork* e1 = big.mutable_experts(1);
  e1->mutable_row_indices()->Assign(odd.begin(), odd.end());
  e1->mutable_weights()->Assign(w_odd.begin(), w_odd.end());

  std::atomic<int> finished{0};
  std::atomic<int> big_done_as{0}, small_done_as{0};
  grpc::ClientContext big_context;
  v1::ComputeResponse big_response;
  grpc::Status big_status;
  std::mutex mu;
  std::condition_variable cv;
  node.stub->async()->Compute(&big_context, &big, &big_response, [&](grpc::Status s) {
    std::lock_guard<std::mutex> lock(mu);
    big_status = s;
    big_done_as = ++finished;
    cv.notify_all();
  });
  // Once the node has the long call (it counts its bytes on arrival), a small call.
  for (int i = 0; i < 1000; ++i) {
    if (HttpGet(node.server->metrics_port(), "/metrics").find("colibri_expert_bytes_in_total ") != std::string::npos) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  v1::ComputeResponse small;
  const grpc::Status small_status = Call(node, Request(std::vector<float>(3 * kDModel, 0.5f)), &small);
  small_done_as = ++finished;
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return big_done_as != 0; });
  }
  REQUIRE(small_status.ok());
  INFO(big_status.error_message());
  REQUIRE(big_status.ok());
  // Answered between the long call's slices, not after them (one call at a
  // time would answer the long call 1.5 s before the small one).
  CHECK(small_done_as == 1);
  CHECK(big_done_as == 2);

  // The sliced answer equals one in-process RunExperts call bit for bit.
  auto model = common::ModelDir::Open(dir / "model");
  REQUIRE(model.ok());
  auto x0 = (*model)->LoadExpert(0, 0, false);
  auto x1 = (*model)->LoadExpert(0, 1, false);
  REQUIRE(x0.ok());
  REQUIRE(x1.ok());
  auto pool = kernels::ThreadPool::Create({2, -1, false});
  REQUIRE(pool.ok());
  std::vector<float> local(rows.size(), 0.f);
  kernels::Workspace ws;
  kernels::RunExperts(**pool,
                      {{x0->get(), all.data(), w_all.data(), n},
                       {x1->get(), odd.data(), w_odd.data(), static_cast<int64_t>(odd.size())}},
                      rows.data(), kDModel, local.data(), ws);
  std::vector<float> remote(rows.size());
  REQUIRE(big_response.output().data().size() == remote.size() * 4);
  std::memcpy(remote.data(), big_response.output().data().data(), remote.size() * 4);
  CHECK(remote == local);
}

TEST_CASE("queued calls of one layer run as one pass, each answered with the bits it gets alone") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kInt8);
  // Every call's first step sleeps 1 s (fault injection): the calls sent
  // while the first one sleeps queue behind it, and then run together.
  Node node = Start(dir / "model", "layer:0/expert:0-1", /*metrics_port=*/0, "", /*inject_delay_ms=*/1000);
  auto rows = [](int n, float phase) {
    std::vector<float> r(n * kDModel);
    for (size_t i = 0; i < r.size(); ++i) r[i] = std::sin(phase + 0.37f * static_cast<float>(i));
    return r;
  };
  // Three routers' calls: per-expert rows, per-expert rows in bf16, grouped rows.
  std::vector<v1::ComputeRequest> requests;
  requests.push_back(Request(rows(3, 0.1f)));
  requests.back().set_per_expert_output(true);
  requests.push_back(Request(rows(4, 0.7f)));
  requests.back().set_per_expert_output(true);
  requests.back().set_output_dtype(v1::DATA_TYPE_BF16);
  requests.push_back(Request(rows(3, 1.3f)));  // rows 0 and 2 through expert 0, row 1 through expert 1
  for (const int32_t o : {0, 1}) requests.back().mutable_experts(0)->add_output_rows(o);
  requests.back().mutable_experts(0)->add_ranks(0);
  requests.back().mutable_experts(0)->add_ranks(0);
  requests.back().mutable_experts(1)->add_output_rows(0);
  requests.back().mutable_experts(1)->add_ranks(1);
  requests.back().set_num_output_rows(2);

  grpc::ClientContext first_context;
  v1::ComputeRequest first = Request(rows(3, 2.f));
  first.set_per_expert_output(true);
  v1::ComputeResponse first_response;
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  node.stub->async()->Compute(&first_context, &first, &first_response, [&](grpc::Status) {
    std::lock_guard<std::mutex> lock(mu);
    ++done;
    cv.notify_all();
  });
  for (int i = 0; i < 1000; ++i) {
    if (HttpGet(node.server->metrics_port(), "/metrics").find("colibri_expert_bytes_in_total ") != std::string::npos) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  std::vector<grpc::ClientContext> contexts(requests.size());
  std::vector<v1::ComputeResponse> merged(requests.size());
  std::vector<grpc::Status> status(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    contexts[i].set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    node.stub->async()->Compute(&contexts[i], &requests[i], &merged[i], [&, i](grpc::Status s) {
      std::lock_guard<std::mutex> lock(mu);
      status[i] = s;
      ++done;
      cv.notify_all();
    });
  }
  // Were all three queued while the first call still ran (the queue gauge
  // shows 3)? Only then must they merge: the compute thread takes them
  // together when the first call ends.
  auto queued = [&] {
    const std::string page = HttpGet(node.server->metrics_port(), "/metrics");
    const std::string sample = "\ncolibri_expert_queued_calls ";  // the value's line, not its # HELP
    const size_t at = page.find(sample);
    return at == std::string::npos ? 0.0 : std::atof(page.c_str() + at + sample.size());
  };
  bool queued_in_time = false;
  for (int i = 0; i < 5000 && !queued_in_time; ++i) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (done > 0) break;
    }
    queued_in_time = queued() == 3;
    if (!queued_in_time) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done == 4; });
  }
  // The node counts a pass before it answers its calls; a scrape the test's
  // thread was too slow to finish within the metrics server's timeout reads
  // an empty page, so a few tries.
  std::string metrics;
  for (int i = 0; i < 20 && metrics.find("colibri_expert_merged_calls_total") == std::string::npos; ++i) {
    metrics = HttpGet(node.server->metrics_port(), "/metrics");
  }
  if (queued_in_time) {
    CHECK(metrics.find("colibri_expert_merged_calls_total 3") != std::string::npos);
  } else {
    WARN("the three calls reached the node only after the first one's 1 s: not checking that they merged");
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    CAPTURE(i);
    INFO(status[i].error_message());
    REQUIRE(status[i].ok());
    v1::ComputeResponse alone;  // the node is idle now: it runs on its own
    REQUIRE(Call(node, requests[i], &alone).ok());
    CHECK(merged[i].output().dtype() == alone.output().dtype());
    CHECK(merged[i].output().shape(0) == alone.output().shape(0));
    CHECK(merged[i].output().data() == alone.output().data());
  }
}

TEST_CASE("a node whose largest reply would pass gRPC's 2 GiB message limit is refused at start") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  ServerOptions options = Options(dir / "model", "all");
  options.limits.max_rows = int64_t{1} << 24;  // 16M rows of d_model 48 in f32: 3 GiB
  auto server = ExpertServer::Create(options, nullptr);
  REQUIRE_FALSE(server.ok());
  CHECK(server.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(server.status().message()),
             Catch::Contains("max_rows 16777216") && Catch::Contains("2 GiB") && Catch::Contains("at most 11179"));
  options.limits.max_rows = 11179000;  // just under: starts
  auto started = ExpertServer::Create(options, nullptr);
  REQUIRE(started.ok());
  // Its message limit is capped at 2 GiB, below what that many rows with
  // their row indices could take; a reload of the same model still goes.
  const absl::Status reloaded = (*started)->Reload();
  INFO(reloaded.message());
  CHECK(reloaded.ok());
}

TEST_CASE("a message limit below what a reply of --max_rows rows takes is refused at start, naming both") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  ServerOptions options = Options(dir / "model", "all");
  options.limits.max_rows = 65536;       // 12 MiB of f32 rows of d_model 48
  options.max_message_bytes = 16 << 20;  // the rows, 8 MiB of row indices and 1 MiB of framing: 21 MiB
  auto server = ExpertServer::Create(options, nullptr);
  REQUIRE_FALSE(server.ok());
  CHECK(server.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(server.status().message()),
             Catch::Contains("max_message_bytes 16777216") && Catch::Contains("limits.max_rows 65536"));
  options.limits.max_rows = 8192;  // 1.5 MiB of rows: 10.5 MiB in all, fits
  CHECK(ExpertServer::Create(options, nullptr).ok());
}

TEST_CASE("Compute calls beyond the node's memory budget are refused before anything is allocated") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  ServerOptions options = Options(dir / "model", "all");
  options.max_inflight_bytes = 1 << 20;  // 1 MiB
  Node node = StartWith(options);
  // 2048 rows of d_model 48 in f32: 384 KiB received, ~1.5 MiB with the f32 copy and the output.
  v1::ComputeRequest big = Request(std::vector<float>(2048 * kDModel, 0.5f));
  v1::ComputeResponse response;
  const grpc::Status refused = Call(node, big, &response);
  CHECK(refused.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(refused.error_message().find("--max_inflight_bytes") != std::string::npos);
  // Small calls fit, again and again: refused and finished calls gave their bytes back.
  for (int i = 0; i < 3; ++i) CHECK(Call(node, Request(std::vector<float>(3 * kDModel, 0.5f)), &response).ok());
}

// The value of an unlabelled metric on `node`'s /metrics page, -1 if absent.
double Gauge(const Node& node, const std::string& name) {
  const std::string page = HttpGet(node.server->metrics_port(), "/metrics");
  const size_t at = page.find("\n" + name + " ");
  return at == std::string::npos ? -1.0 : std::atof(page.c_str() + at + name.size() + 2);
}

// One Compute call of `request` with `deadline`.
grpc::Status CallWithin(Node& node, const v1::ComputeRequest& request, std::chrono::milliseconds deadline) {
  v1::ComputeResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + deadline);
  return node.stub->Compute(&context, request, &response);
}

// Until a call runs and none is queued (the queue gauge exists once a call
// was queued), or ~2 s.
void AwaitRunningAlone(const Node& node) {
  for (int i = 0; i < 1000 && !(Gauge(node, "colibri_expert_bytes_in_total") > 0 &&
                                Gauge(node, "colibri_expert_queued_calls") <= 0);
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

TEST_CASE("calls whose callers gave up do not fill the compute queue") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  ServerOptions options = Options(dir / "model", "all");
  options.threads = 1;
  options.max_queued_calls = 2;
  options.inject_delay_ms = 2000;  // every call's first step sleeps: the compute thread is busy
  options.metrics_port = 0;
  options.metrics_host = "127.0.0.1";
  Node node = StartWith(options);
  const v1::ComputeRequest request = Request(std::vector<float>(3 * kDModel, 0.5f));
  auto call = [&](std::chrono::milliseconds deadline) { return CallWithin(node, request, deadline); };
  // One call keeps the compute thread busy; two more wait with 50 ms deadlines and expire in the queue.
  std::thread busy([&] { call(std::chrono::seconds(30)); });
  AwaitRunningAlone(node);
  grpc::StatusCode expired = grpc::StatusCode::OK;  // checked on this thread: Catch's CHECK is not thread-safe
  std::thread expiring([&] { expired = call(std::chrono::milliseconds(50)).error_code(); });
  CHECK(call(std::chrono::milliseconds(50)).error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
  expiring.join();
  CHECK(expired == grpc::StatusCode::DEADLINE_EXCEEDED);
  // The queue holds two dead calls, yet a live one gets in (and is served once the thread is free).
  const grpc::Status live = call(std::chrono::seconds(30));
  INFO(live.error_message());
  CHECK(live.ok());
  busy.join();
}

TEST_CASE("calls whose callers gave up while queued give their room in the budget to a live call") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  ServerOptions options = Options(dir / "model", "all");
  options.threads = 1;
  options.inject_delay_ms = 2000;  // every call's first step sleeps: the compute thread is busy
  options.metrics_port = 0;
  options.metrics_host = "127.0.0.1";
  // Each call below holds 3 f32 rows of 48, their f32 copy, 3 entries and 3
  // output rows and their encoding: 2 352 bytes. Room for two and a half.
  options.max_inflight_bytes = ExpertService::Footprint(3 * kDModel * 4, 3 * kDModel, 3, 3, kDModel) * 5 / 2;
  Node node = StartWith(options);
  const v1::ComputeRequest request = Request(std::vector<float>(3 * kDModel, 0.5f));
  auto call = [&](std::chrono::milliseconds deadline) { return CallWithin(node, request, deadline); };
  std::thread busy([&] { call(std::chrono::seconds(30)); });
  AwaitRunningAlone(node);
  // Queued behind the busy call, its caller gone after 50 ms: it holds the second call's room.
  CHECK(call(std::chrono::milliseconds(50)).error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
  // The node's deadline of that call passes a little after the client's.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  // A third call's room is there only once the dead one gives its own up.
  const grpc::Status live = call(std::chrono::seconds(30));
  INFO(live.error_message());
  CHECK(live.ok());
  busy.join();
}

TEST_CASE("a call refused for a full queue reads none of its experts in") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  ServerOptions options = Options(dir / "model", "all");  // paged: the experts a call names are read in on arrival
  options.threads = 1;
  options.max_queued_calls = 1;
  options.inject_delay_ms = 1500;  // every call's first step sleeps: one runs, one waits, the next is refused
  options.metrics_port = 0;
  options.metrics_host = "127.0.0.1";
  Node node = StartWith(options);
  auto gauge = [&](const std::string& name) { return Gauge(node, name); };
  const v1::ComputeRequest request = Request(std::vector<float>(3 * kDModel, 0.5f));  // experts 0 and 1
  std::thread first([&] {
    v1::ComputeResponse response;
    (void)Call(node, request, &response);
  });
  for (int i = 0; i < 1000 && gauge("colibri_expert_bytes_in_total") <= 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  std::thread second([&] {
    v1::ComputeResponse response;
    (void)Call(node, request, &response);
  });
  for (int i = 0; i < 1000 && gauge("colibri_expert_queued_calls") != 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  v1::ComputeRequest others = request;  // experts 2 and 3, never asked for before
  others.mutable_experts(0)->set_expert(2);
  others.mutable_experts(1)->set_expert(3);
  v1::ComputeResponse response;
  const grpc::Status refused = Call(node, others, &response);
  first.join();
  second.join();
  if (refused.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
    WARN("the third call arrived after the queue had room (" << refused.error_message() << "): nothing to check");
    return;
  }
  // The gauge is set after each call: experts 0 and 1 were asked for, 2 and 3 not.
  CHECK(gauge("colibri_expert_paged_prefetches") == 2);
}

TEST_CASE("a weight file truncated under a node serving from the page cache fails its calls, not the node") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  Node node = Start(dir / "model", "layer:0/expert:0-1");  // paged: mapped files
  const std::string file = dir / "model/layer_000/expert_001.bin";
  const std::string saved = colibri::testing::ReadFile(file);
  std::filesystem::resize_file(file, 4096);  // the header stays; every weight page is gone
  const std::vector<float> rows(3 * kDModel, 0.5f);
  v1::ComputeResponse response;
  const grpc::Status lost = Call(node, Request(rows), &response);  // experts 0 and 1
  INFO(lost.error_message());
  CHECK(lost.error_code() == grpc::StatusCode::DATA_LOSS);
  CHECK(lost.error_message().find("expert 1") != std::string::npos);
  // The node lives on: expert 0 alone is served.
  v1::ComputeRequest only0 = Request(rows);
  only0.mutable_experts()->RemoveLast();
  CHECK(Call(node, only0, &response).ok());
  // GetNodeInfo no longer offers expert 1: a router sends its rows to a replica.
  auto owned = [&] {
    grpc::ClientContext context;
    v1::GetNodeInfoResponse info;
    REQUIRE(node.stub->GetNodeInfo(&context, v1::GetNodeInfoRequest(), &info).ok());
    REQUIRE(info.owned_size() == 1);
    return std::vector<int32_t>(info.owned(0).experts().begin(), info.owned(0).experts().end());
  };
  CHECK(owned() == std::vector<int32_t>{0});
  // With the file written back and a reload, expert 1 is served again.
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out << saved;
  }
  v1::ReloadResponse reloaded;
  grpc::ClientContext context;
  REQUIRE(node.admin->Reload(&context, v1::ReloadRequest(), &reloaded).ok());
  CHECK(Call(node, Request(rows), &response).ok());
  CHECK(owned() == std::vector<int32_t>{0, 1});
}

TEST_CASE("Reload on the data port is refused: admin calls need the admin listener") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  Node node = Start(dir / "model", "layer:0/expert:0-1");
  v1::ReloadRequest request;
  request.set_experts("layer:0/expert:0");  // a re-shard: what an attacker would use to take experts away
  v1::ReloadResponse response;
  grpc::ClientContext context;
  const grpc::Status s = node.stub->Reload(&context, request, &response);
  CHECK(s.error_code() == grpc::StatusCode::PERMISSION_DENIED);
  CHECK(s.error_message().find("admin") != std::string::npos);
  CHECK(node.server->store().Current()->owned().size() == 2);  // nothing changed
  // The admin listener does not serve Compute.
  grpc::ClientContext compute_context;
  v1::ComputeResponse out;
  CHECK(node.admin->Compute(&compute_context, Request(std::vector<float>(kDModel, 1.0f)), &out).error_code() ==
        grpc::StatusCode::UNIMPLEMENTED);
}

TEST_CASE("with mutual TLS only clients holding a certificate from the CA get in") {
  TempDir dir;
  const std::string certs = dir / "certs";
  const std::string script = std::string(COLIBRI_TEST_DATA_DIR) + "/../../scripts/make_test_certs.sh";
  REQUIRE(std::system(("bash '" + script + "' '" + certs + "' > /dev/null").c_str()) == 0);
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  ServerOptions options;
  options.model_dir = dir / "model";
  options.store.residency = Residency::kPaged;
  options.threads = 1;
  options.tls_cert_file = certs + "/server.crt";
  options.tls_key_file = certs + "/server.key";
  options.tls_client_ca_file = certs + "/ca.crt";
  auto server = ExpertServer::Create(options, nullptr);
  INFO(server.status().message());
  REQUIRE(server.ok());
  std::string target = "127.0.0.1:" + std::to_string((*server)->port());
  auto info = [&](std::shared_ptr<grpc::ChannelCredentials> credentials) {
    auto stub = v1::ExpertNode::NewStub(grpc::CreateChannel(target, credentials));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::GetNodeInfoResponse response;
    return stub->GetNodeInfo(&context, v1::GetNodeInfoRequest(), &response);
  };
  grpc::SslCredentialsOptions trusted;
  trusted.pem_root_certs = Slurp(certs + "/ca.crt");
  trusted.pem_cert_chain = Slurp(certs + "/client.crt");
  trusted.pem_private_key = Slurp(certs + "/client.key");
  const grpc::Status ok = info(grpc::SslCredentials(trusted));
  INFO(ok.error_message());
  CHECK(ok.ok());
  grpc::SslCredentialsOptions no_client_cert;
  no_client_cert.pem_root_certs = trusted.pem_root_certs;
  CHECK_FALSE(info(grpc::SslCredentials(no_client_cert)).ok());  // untrusted client refused
  CHECK_FALSE(info(grpc::InsecureChannelCredentials()).ok());    // plaintext refused
  // Admin calls on the data port: only the certificate named in admin_identities.
  auto reshard = [&](const std::string& who) {
    grpc::SslCredentialsOptions c = trusted;
    c.pem_cert_chain = Slurp(certs + "/" + who + ".crt");
    c.pem_private_key = Slurp(certs + "/" + who + ".key");
    auto stub = v1::ExpertNode::NewStub(grpc::CreateChannel(target, grpc::SslCredentials(c)));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::ReloadRequest request;
    request.set_experts("layer:0/expert:0");
    v1::ReloadResponse response;
    return stub->Reload(&context, request, &response);
  };
  CHECK(reshard("client").error_code() == grpc::StatusCode::PERMISSION_DENIED);  // no admin identities yet
  (*server).reset();
  options.admin_identities = {"colibri-test-client"};
  server = ExpertServer::Create(options, nullptr);
  REQUIRE(server.ok());
  target = "127.0.0.1:" + std::to_string((*server)->port());
  CHECK(reshard("server").error_code() == grpc::StatusCode::PERMISSION_DENIED);  // trusted, but not an admin
  const grpc::Status admin = reshard("client");
  INFO(admin.error_message());
  CHECK(admin.ok());
  options.tls_client_ca_file.clear();  // identities without client certificates mean nothing
  CHECK(ExpertServer::Create(options, nullptr).status().message().find("admin_identities") != absl::string_view::npos);
  options.tls_client_ca_file = certs + "/ca.crt";
  options.admin_identities.clear();

  options.tls_key_file.clear();
  CHECK(ExpertServer::Create(options, nullptr).status().message().find("ServerOptions::tls_key_file") !=
        absl::string_view::npos);
  options.tls_key_file = certs + "/missing.key";
  CHECK(ExpertServer::Create(options, nullptr).status().message().find("missing.key") != absl::string_view::npos);
}

TEST_CASE("an expert node refuses bad Compute requests with the documented status, naming the field") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kInt8);
  Node node = Start(dir / "model", "layer:0/expert:0-1");
  const std::vector<float> rows(3 * kDModel, 0.5f);
  auto expect = [&](v1::ComputeRequest request, grpc::StatusCode code, const std::string& needle) {
    v1::ComputeResponse response;
    const grpc::Status s = Call(node, request, &response);
    INFO("message: " << s.error_message());
    CHECK(s.error_code() == code);
    CHECK(s.error_message().find(needle) != std::string::npos);
  };
  v1::ComputeRequest r = Request(rows);
  r.mutable_experts(1)->set_expert(2);
  expect(r, grpc::StatusCode::FAILED_PRECONDITION, "layer 0 expert 2");
  r = Request(rows);
  r.mutable_experts(0)->set_row_indices(1, 3);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "experts[0].row_indices[1] = 3");
  r = Request(rows);
  r.mutable_experts(0)->add_weights(1.f);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "2 row indices but 3 weights");
  r = Request(rows);
  r.mutable_experts(0)->set_weights(0, std::nanf(""));
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "experts[0].weights[0] is not finite");
  r = Request(rows);
  r.mutable_rows()->set_shape(1, 47);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "rows: shape has 2 dims [3, 47]; must be [R, 48]");
  r = Request(rows);
  r.mutable_rows()->mutable_data()->resize(10);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "rows: 10 bytes do not hold [3, 48]");
  r = Request(rows);
  r.mutable_rows()->set_shape(0, int64_t{1} << 60);  // a huge row count: refused before any allocation
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "do not hold");
  r = Request(rows);
  r.mutable_rows()->set_dtype(v1::DATA_TYPE_F16);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "DATA_TYPE_F16");
  r = Request(rows);
  r.set_layer(7);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "layer 7");
  r = Request(rows);
  r.set_model_id("xxh3_128:00");
  expect(r, grpc::StatusCode::FAILED_PRECONDITION, "model_id");
  r = Request(rows);
  r.set_model_id(std::string(300, 'm'));  // never echoed whole
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "model_id is 300 bytes; at most 256");
  r = Request(rows);
  *r.add_experts() = r.experts(0);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "listed twice");
  // Sizes refused before the call is queued: no copy, no room in the budget, no merging.
  r = Request(rows);
  for (int i = 0; i < 3; ++i) r.add_experts()->set_expert(i);  // 5 entries; the model has 4 experts
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "experts: 5 entries; the model has 4 experts");
  r = Request(rows);
  for (int i = 0; i < 1000; ++i) r.mutable_experts(1)->add_ranks(0);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "1 row indices but 0 output_rows and 1000 ranks");
  r = Request(rows);
  r.set_per_expert_output(true);  // mergeable, were it not refused
  r.mutable_rows()->set_shape(0, -1);
  r.mutable_rows()->clear_data();
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "rows: shape has 2 dims [-1, 48]");
  // Grouped output: (e0,r0) and (e0,r2) into row 0, (e1,r1) into row 1.
  v1::ComputeRequest g = Request(rows);
  g.set_num_output_rows(2);
  for (int v : {0, 0}) g.mutable_experts(0)->add_output_rows(v);
  for (int v : {0, 1}) g.mutable_experts(0)->add_ranks(v);
  g.mutable_experts(1)->add_output_rows(1);
  g.mutable_experts(1)->add_ranks(0);
  v1::ComputeResponse grouped;
  CHECK(Call(node, g, &grouped).ok());
  r = g;
  r.set_per_expert_output(true);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "0 with per_expert_output");
  r = g;
  r.mutable_experts(1)->clear_ranks();
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "1 output_rows and 0 ranks");
  r = g;
  r.mutable_experts(1)->set_output_rows(0, 5);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "output_rows[0] = 5 (must be in [0, 2))");
  r = g;
  r.set_num_output_rows(3);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "output row 2 of 3 is named by no entry");
  r = g;
  r.set_num_output_rows(1 << 30);  // checked against the entries, never allocated
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "num_output_rows = 1073741824 exceeds the 3 row indices");
  r = g;
  r.mutable_experts(0)->set_ranks(1, 0);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "output row 0: rank 0 given twice");
  r = Request(rows);
  r.mutable_experts(0)->add_output_rows(0);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "none without num_output_rows");
  // The node still serves after all that.
  v1::ComputeResponse ok;
  CHECK(Call(node, Request(rows), &ok).ok());
}

TEST_CASE("GetNodeInfo describes the shard and Reload swaps weights within the model root") {
  TempDir dir;
  const tools::SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt");
  colibri::testing::MakeModel(synth, dir / "root/a", common::DType::kBF16);
  colibri::testing::MakeModel(synth, dir / "root/b", common::DType::kInt4);
  Node node = Start(dir / "root/a", "layer:1/expert:2-3", -1, dir / "root");

  v1::GetNodeInfoResponse info;
  {
    grpc::ClientContext context;
    REQUIRE(node.stub->GetNodeInfo(&context, v1::GetNodeInfoRequest(), &info).ok());
  }
  CHECK(info.weight_type() == "bf16");
  REQUIRE(info.owned_size() == 1);
  CHECK(info.owned(0).layer() == 1);
  CHECK(info.owned(0).experts_size() == 2);
  CHECK(info.weights_version() == 1);
  CHECK(info.d_model() == 48);
  CHECK(info.state() == v1::LOAD_STATE_READY);
  CHECK(info.model_id().rfind("xxh3_128:", 0) == 0);

  auto reload = [&](const std::string& model_dir, const std::string& experts, v1::ReloadResponse* response) {
    v1::ReloadRequest request;
    request.set_model_dir(model_dir);
    request.set_experts(experts);
    grpc::ClientContext context;
    return node.admin->Reload(&context, request, response);
  };
  v1::ReloadResponse response;
  CHECK(reload(dir / "ckpt", "", &response).error_code() == grpc::StatusCode::PERMISSION_DENIED);  // outside the root
  CHECK(reload("/etc", "", &response).error_code() == grpc::StatusCode::PERMISSION_DENIED);
  // No existence oracle: a missing path and an existing one outside the root get the same answer.
  const grpc::Status missing = reload("/no/such/dir", "", &response), outside = reload("/etc", "", &response);
  CHECK(missing.error_code() == outside.error_code());
  CHECK(missing.error_message() == outside.error_message());
  const grpc::Status file = reload(dir / "root/b/manifest.json", "", &response);  // inside, but not a directory
  CHECK(file.error_code() == outside.error_code());
  CHECK(file.error_message() == outside.error_message());
  CHECK(reload("", "9", &response).error_code() == grpc::StatusCode::INVALID_ARGUMENT);  // no expert 9
  {
    grpc::ClientContext context;
    REQUIRE(node.admin->GetNodeInfo(&context, v1::GetNodeInfoRequest(), &info).ok());
  }
  CHECK(info.last_reload_error().find("expert 9") != std::string::npos);
  CHECK(info.model_dir() == dir / "root/a");
  {  // the data port says that the reload failed, not why nor where the model lives
    grpc::ClientContext context;
    REQUIRE(node.stub->GetNodeInfo(&context, v1::GetNodeInfoRequest(), &info).ok());
  }
  CHECK(info.last_reload_error().find("expert 9") == std::string::npos);
  CHECK_FALSE(info.last_reload_error().empty());
  CHECK(info.model_dir().empty());
  CHECK(info.weights_version() == 1);  // the failed reload kept the old weights
  const grpc::Status ok = reload(dir / "root/b", "", &response);
  INFO(ok.error_message());
  REQUIRE(ok.ok());
  CHECK(response.weights_version() == 2);
  {
    grpc::ClientContext context;
    REQUIRE(node.stub->GetNodeInfo(&context, v1::GetNodeInfoRequest(), &info).ok());
  }
  CHECK(info.weight_type() == "int4");
  CHECK(info.weights_version() == 2);
  CHECK(info.last_reload_error().empty());
}

}  // namespace
}  // namespace expert_node
}  // namespace colibri
