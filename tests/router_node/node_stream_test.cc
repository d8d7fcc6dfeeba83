// ExpertNode.ComputeStream end to end: the node answers each message like a
// unary Compute, by call_id; StreamNodeChannel (the router's) against a real
// node gives the unary bytes, and against scripted servers keeps each call's
// deadline, cancels on the node, fails the calls of a broken stream
// UNAVAILABLE, falls back to unary calls where the node has no stream, and
// sends large requests unary. Everything on 127.0.0.1, port 0; no sleeps
// decide an outcome (the deadlines are on servers that never answer).

#include "router_node/node_stream.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "colibri/v1/expert_node.grpc.pb.h"
#include "expert_node/expert_server.h"
#include "expert_node/expert_service.h"
#include "tests/test_util.h"

namespace colibri {
namespace router_node {
namespace {

using colibri::testing::TempDir;
namespace v1 = colibri::v1;

constexpr int64_t kDModel = 48;

v1::ComputeRequest Request(int seed, int expert = 0) {
  std::vector<float> rows(2 * kDModel);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = std::cos(0.1 * i + seed);
  v1::ComputeRequest r;
  r.set_layer(0);
  v1::Tensor* t = r.mutable_rows();
  t->set_dtype(v1::DATA_TYPE_F32);
  t->add_shape(2);
  t->add_shape(kDModel);
  t->set_data(reinterpret_cast<const char*>(rows.data()), rows.size() * 4);
  v1::ExpertWork* w = r.add_experts();
  w->set_expert(expert);
  w->add_row_indices(0);
  w->add_row_indices(1);
  w->add_weights(0.75f);
  w->add_weights(0.25f);
  return r;
}

// One call through a NodeChannel, waited for.
struct Result {
  grpc::Status status;
  v1::ComputeResponse response;
};
Result CallThrough(NodeChannel& channel, const v1::ComputeRequest& request,
                   std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  Result result;
  std::promise<grpc::Status> done;
  channel.Compute(&context, &request, &result.response, [&done](grpc::Status s) { done.set_value(std::move(s)); });
  result.status = done.get_future().get();
  return result;
}

std::shared_ptr<grpc::Channel> Loopback(int port) {
  return grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
}

// A real expert node with every expert of a small bf16 model, and a stub onto it.
struct RealNode {
  RealNode() {
    colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
    expert_node::ServerOptions options;
    options.model_dir = dir / "model";
    options.store.shard = *expert_node::ShardSpec::Parse("all");
    options.threads = 2;
    auto created = expert_node::ExpertServer::Create(options, &log);
    REQUIRE(created.ok());
    server = std::move(created).value();
    stub = v1::ExpertNode::NewStub(Loopback(server->port()));
  }
  TempDir dir;
  std::ostringstream log;  // outlives the server
  std::unique_ptr<expert_node::ExpertServer> server;
  std::unique_ptr<v1::ExpertNode::Stub> stub;
};

// A per-expert-output call of `rows` f32 rows through expert 1, and the memory the node reserves for it.
v1::ComputeRequest RowsThroughOneExpert(int rows) {
  std::vector<float> x(rows * kDModel);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.01 * static_cast<double>(i % 977));
  v1::ComputeRequest r;
  r.set_layer(0);
  r.set_per_expert_output(true);
  r.mutable_rows()->set_dtype(v1::DATA_TYPE_F32);
  r.mutable_rows()->add_shape(rows);
  r.mutable_rows()->add_shape(kDModel);
  r.mutable_rows()->set_data(reinterpret_cast<const char*>(x.data()), x.size() * 4);
  v1::ExpertWork* w = r.add_experts();
  w->set_expert(1);
  for (int i = 0; i < rows; ++i) {
    w->add_row_indices(i);
    w->add_weights(0.5f);
  }
  return r;
}
int64_t FootprintOf(int rows) {
  return expert_node::ExpertService::Footprint(rows * kDModel * 4, rows * kDModel, rows, rows, kDModel);
}

TEST_CASE("answers a stream's caller has not read hold the node's memory budget until written") {
  // The budget fits one stream call and one twice as large, not three stream calls.
  const int64_t stream_bytes = FootprintOf(2048), unary_bytes = FootprintOf(4096);
  REQUIRE(unary_bytes >= 2 * stream_bytes);
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", common::DType::kBF16);
  std::ostringstream log;
  expert_node::ServerOptions options;
  options.model_dir = dir / "model";
  options.store.shard = *expert_node::ShardSpec::Parse("all");
  options.threads = 2;
  options.max_inflight_bytes = stream_bytes + unary_bytes - 1;
  options.metrics_port = 0;
  options.metrics_host = "127.0.0.1";
  auto created = expert_node::ExpertServer::Create(options, &log);
  REQUIRE(created.ok());
  std::unique_ptr<expert_node::ExpertServer> server = std::move(created).value();
  // No BDP probing: the stream's receive window stays 64 KiB, so the node cannot write a whole answer.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  auto stub = v1::ExpertNode::NewStub(grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(server->port()),
                                                                grpc::InsecureChannelCredentials(), args));
  const v1::ComputeRequest big = RowsThroughOneExpert(4096);
  auto unary = [&] {
    v1::ComputeResponse response;
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return stub->Compute(&c, big, &response);
  };

  // A caller writes 8 calls on a stream and reads nothing. Each answered call
  // (768 KiB) waits on the node with its memory, which the unary call needs.
  grpc::ClientContext context;
  auto stream = stub->ComputeStream(&context);
  for (uint64_t id = 1; id <= 8; ++id) {
    v1::ComputeStreamRequest m;
    m.set_call_id(id);
    *m.mutable_request() = RowsThroughOneExpert(2048);
    REQUIRE(stream->Write(m));
  }
  auto answered = [&] {  // Compute calls answered so far, any code
    const std::string page = colibri::testing::HttpGet(server->metrics_port(), "/metrics");
    double n = 0;
    for (size_t at = page.find("\ncolibri_expert_calls_total{"); at != std::string::npos;
         at = page.find("\ncolibri_expert_calls_total{", at + 1)) {
      const size_t end = page.find('\n', at + 1);
      const std::string line = page.substr(at + 1, end - at - 1);
      if (line.find("method=\"Compute\"") != std::string::npos) n += std::atof(line.c_str() + line.rfind(' ') + 1);
    }
    return n;
  };
  for (int i = 0; i < 3000 && answered() < 8; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  REQUIRE(answered() == 8);
  const grpc::Status refused = unary();
  INFO(refused.error_message());
  CHECK(refused.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK_THAT(refused.error_message(), Catch::Contains("--max_inflight_bytes"));

  // Reading the answers gives the memory back.
  stream->WritesDone();
  v1::ComputeStreamResponse reply;
  int ok = 0, read = 0;
  while (stream->Read(&reply)) {
    ++read;
    ok += reply.code() == 0 ? 1 : 0;
  }
  CHECK(read == 8);
  CHECK(ok >= 1);
  CHECK(stream->Finish().ok());
  const grpc::Status served = unary();
  INFO(served.error_message());
  CHECK(served.ok());
}

TEST_CASE("calls on a ComputeStream are answered by call_id, each as its unary Compute") {
  RealNode node;

  // Raw messages: three calls written back to back, one of them malformed.
  grpc::ClientContext context;
  auto stream = node.stub->ComputeStream(&context);
  for (uint64_t id : {7, 8, 9}) {
    v1::ComputeStreamRequest m;
    m.set_call_id(id);
    *m.mutable_request() = Request(static_cast<int>(id), id == 8 ? 99 : 0);  // expert 99 does not exist
    REQUIRE(stream->Write(m));
  }
  std::map<uint64_t, v1::ComputeStreamResponse> replies;
  for (int i = 0; i < 3; ++i) {
    v1::ComputeStreamResponse r;
    REQUIRE(stream->Read(&r));
    replies[r.call_id()] = r;
  }
  stream->WritesDone();
  CHECK(stream->Finish().ok());
  REQUIRE(replies.size() == 3);
  CHECK(replies[8].code() == static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  CHECK_THAT(replies[8].message(), Catch::Contains("99"));
  for (uint64_t id : {7, 9}) {
    INFO("call " << id << ": " << replies[id].message());
    REQUIRE(replies[id].code() == 0);
    v1::ComputeResponse unary;
    grpc::ClientContext c;
    REQUIRE(node.stub->Compute(&c, Request(static_cast<int>(id)), &unary).ok());
    CHECK(replies[id].response().output().data() == unary.output().data());  // bit for bit
    CHECK(!unary.output().data().empty());
  }

  // The router's channel: concurrent calls, each the unary bytes.
  StreamNodeChannel channel(Loopback(node.server->port()), 64 << 10);
  std::vector<std::future<Result>> results;
  for (int i = 0; i < 12; ++i) {
    results.push_back(std::async(std::launch::async, [&channel, i] { return CallThrough(channel, Request(i)); }));
  }
  for (int i = 0; i < 12; ++i) {
    Result r = results[i].get();
    INFO(r.status.error_message());
    REQUIRE(r.status.ok());
    v1::ComputeResponse unary;
    grpc::ClientContext c;
    REQUIRE(node.stub->Compute(&c, Request(i), &unary).ok());
    CHECK(r.response.output().data() == unary.output().data());
  }
  const Result bad = CallThrough(channel, Request(1, 99));
  CHECK(bad.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(CallThrough(channel, Request(2)).status.ok());  // the stream goes on after a failed call
}

TEST_CASE("a node shutting down finishes its open streams once their calls are answered") {
  RealNode node;
  grpc::ClientContext context;
  auto stream = node.stub->ComputeStream(&context);
  v1::ComputeStreamRequest m;
  m.set_call_id(1);
  *m.mutable_request() = Request(1);
  REQUIRE(stream->Write(m));
  v1::ComputeStreamResponse r;
  REQUIRE(stream->Read(&r));
  CHECK(r.code() == 0);
  // A drain of a minute: the stream must not hold it (the caller never half-closes).
  std::thread shutdown([&] { node.server->Shutdown(std::chrono::system_clock::now() + std::chrono::minutes(1)); });
  CHECK_FALSE(stream->Read(&r));  // the node ended the stream itself
  const grpc::Status end = stream->Finish();
  INFO(end.error_message());
  CHECK(end.ok());  // finished, not cancelled by the drain's deadline
  shutdown.join();
}

// A node whose ComputeStream is scripted: answers (weights_version 2), holds
// every call unanswered, breaks after the first message, answers with a
// message that does not parse (invalid UTF-8 in a string), or is absent
// (UNIMPLEMENTED). Unary Compute answers with weights_version 1.
class ScriptedNode final : public v1::ExpertNode::CallbackService {
 public:
  enum class Mode { kAnswer, kHold, kBreak, kGarbage, kAbsent };
  explicit ScriptedNode(Mode mode) : mode_(mode) {}

  grpc::ServerUnaryReactor* Compute(grpc::CallbackServerContext* context, const v1::ComputeRequest*,
                                    v1::ComputeResponse* response) override {
    ++unary_calls;
    response->set_weights_version(1);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerBidiReactor<v1::ComputeStreamRequest, v1::ComputeStreamResponse>* ComputeStream(
      grpc::CallbackServerContext* context) override {
    if (mode_ == Mode::kAbsent) return v1::ExpertNode::CallbackService::ComputeStream(context);
    return new Reactor(this);
  }

  // Waits until `n` cancel messages have arrived; their call ids.
  std::set<uint64_t> WaitForCancels(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return cancels_.size() >= n; });
    return cancels_;
  }
  // Waits until `n` calls have arrived on streams.
  void WaitForCalls(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return calls_ >= n; });
  }

  std::atomic<int> unary_calls{0};

 private:
  class Reactor final : public grpc::ServerBidiReactor<v1::ComputeStreamRequest, v1::ComputeStreamResponse> {
   public:
    explicit Reactor(ScriptedNode* node) : node_(node) { StartRead(&in_); }
    void OnReadDone(bool ok) override {
      if (!ok) return Finish(grpc::Status::OK);
      {
        std::lock_guard<std::mutex> lock(node_->mu_);
        if (in_.cancel()) {
          node_->cancels_.insert(in_.call_id());
        } else {
          ++node_->calls_;
        }
      }
      node_->cv_.notify_all();
      if (node_->mode_ == Mode::kBreak) return Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "node going away"));
      if (node_->mode_ == Mode::kAnswer && !in_.cancel()) {
        out_.set_call_id(in_.call_id());
        out_.mutable_response()->set_weights_version(2);
        return StartWrite(&out_);
      }
      if (node_->mode_ == Mode::kGarbage && !in_.cancel()) {
        out_.set_call_id(in_.call_id());
        out_.set_code(13);
        out_.set_message("\xff\xfe not UTF-8");  // serialized as is; the reader's parse fails
        return StartWrite(&out_);
      }
      StartRead(&in_);
    }
    void OnWriteDone(bool) override { StartRead(&in_); }
    void OnDone() override { delete this; }

   private:
    ScriptedNode* const node_;
    v1::ComputeStreamRequest in_;
    v1::ComputeStreamResponse out_;
  };

  const Mode mode_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::set<uint64_t> cancels_;
  int calls_ = 0;
};

struct ScriptedServer {
  explicit ScriptedServer(ScriptedNode::Mode mode) : node(mode) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&node);
    server = builder.BuildAndStart();
  }
  ~ScriptedServer() { server->Shutdown(std::chrono::system_clock::now()); }
  ScriptedNode node;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

TEST_CASE("the stream channel sends small calls on the stream and large ones unary") {
  ScriptedServer s(ScriptedNode::Mode::kAnswer);
  StreamNodeChannel channel(Loopback(s.port), 1024);
  const Result small = CallThrough(channel, Request(0));
  REQUIRE(small.status.ok());
  CHECK(small.response.weights_version() == 2);
  v1::ComputeRequest large = Request(0);
  large.mutable_rows()->mutable_data()->append(2048, '\0');
  const Result big = CallThrough(channel, large);
  REQUIRE(big.status.ok());
  CHECK(big.response.weights_version() == 1);
  CHECK(s.node.unary_calls == 1);
}

TEST_CASE("a stream call keeps its deadline and is cancelled on the node when it passes") {
  ScriptedServer s(ScriptedNode::Mode::kHold);
  StreamNodeChannel channel(Loopback(s.port), 64 << 10);
  const Result r = CallThrough(channel, Request(0), std::chrono::milliseconds(200));
  CHECK(r.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
  CHECK(s.node.WaitForCancels(1).count(1) == 1);  // the node was told to drop call 1
}

TEST_CASE("cancelling a stream call ends it CANCELLED at once and tells the node") {
  ScriptedServer s(ScriptedNode::Mode::kHold);
  StreamNodeChannel channel(Loopback(s.port), 64 << 10);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
  const v1::ComputeRequest request = Request(0);
  v1::ComputeResponse response;
  std::promise<grpc::Status> done;
  channel.Compute(&context, &request, &response, [&done](grpc::Status st) { done.set_value(std::move(st)); });
  s.node.WaitForCalls(1);
  channel.Cancel(&context);
  CHECK(done.get_future().get().error_code() == grpc::StatusCode::CANCELLED);
  CHECK(s.node.WaitForCancels(1).count(1) == 1);
  channel.Cancel(&context);  // an ended call: harmless
}

TEST_CASE("calls on a stream that breaks end UNAVAILABLE, and the next call opens a new stream") {
  ScriptedServer s(ScriptedNode::Mode::kBreak);
  StreamNodeChannel channel(Loopback(s.port), 64 << 10);
  const Result r = CallThrough(channel, Request(0));
  CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK_THAT(r.status.error_message(), Catch::Contains("node going away"));
  const Result again = CallThrough(channel, Request(1));
  CHECK(again.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  s.node.WaitForCalls(2);  // both reached the node, each on a stream of its own
}

TEST_CASE("a reply that does not parse ends the stream's calls UNAVAILABLE at once, not at their deadline") {
  ScriptedServer s(ScriptedNode::Mode::kGarbage);
  StreamNodeChannel channel(Loopback(s.port), 64 << 10);
  const Result r = CallThrough(channel, Request(0), std::chrono::minutes(2));
  CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
}

TEST_CASE("a node without ComputeStream gets the same calls as unary calls") {
  ScriptedServer s(ScriptedNode::Mode::kAbsent);
  StreamNodeChannel channel(Loopback(s.port), 64 << 10);
  for (int i = 0; i < 3; ++i) {
    const Result r = CallThrough(channel, Request(i));
    INFO(r.status.error_message());
    REQUIRE(r.status.ok());
    CHECK(r.response.weights_version() == 1);
  }
  CHECK(s.node.unary_calls == 3);
}

TEST_CASE("destroying the stream channel with a call in flight ends the call") {
  ScriptedServer s(ScriptedNode::Mode::kHold);
  auto channel = std::make_unique<StreamNodeChannel>(Loopback(s.port), 64 << 10);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
  const v1::ComputeRequest request = Request(0);
  v1::ComputeResponse response;
  std::promise<grpc::Status> done;
  channel->Compute(&context, &request, &response, [&done](grpc::Status st) { done.set_value(std::move(st)); });
  s.node.WaitForCalls(1);
  channel.reset();
  CHECK(done.get_future().get().error_code() == grpc::StatusCode::UNAVAILABLE);
}

}  // namespace
}  // namespace router_node
}  // namespace colibri
