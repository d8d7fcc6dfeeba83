// Paged residency end to end: an expert node serving its shard with a memory
// budget of half the shard answers a decoding workload byte for byte like a
// node with the weights locked, and its metrics show the evictions, faults
// and reads.
#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>

#include "tests/integration/cluster.h"

namespace colibri {
namespace testing {
namespace {

uint64_t ShardBytes(const std::string& model) {
  uint64_t bytes = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(model)) {
    if (entry.path().filename().string().rfind("expert_", 0) == 0) bytes += entry.file_size();
  }
  return bytes;
}

TEST_CASE("a paged node with a memory budget of half its shard serves decoding exactly like a locked node") {
  Model model(common::DType::kBF16);
  const uint64_t budget = ShardBytes(model.path) / 2;
  Proc paged = StartNode(model.path, "all", 0,
                         {"--memory_budget=" + std::to_string(budget), "--metrics_port=0", "--verify_cache=off"});
  const int metrics_port = paged.process->ReadPort("metrics on port ");
  Proc locked = StartNode(model.path, "all", 0, {"--residency=locked"});
  Proc router_paged = StartRouter({"--model=" + model.path, "--experts_at=" + Address(paged.port)});
  Proc router_locked = StartRouter({"--model=" + model.path, "--experts_at=" + Address(locked.port)});
  auto a = Connect(router_paged.port);
  auto b = Connect(router_locked.port);

  // Decoding: one token per call, layers alternating, gate routing spreading over every expert.
  int calls = 0, differing = 0;
  for (int i = 0; i < 120; ++i) {
    const v1::ForwardRequest request = Request(i % 2, {(i * 13) % 64}, 1000 + i, v1::ROUTING_MODE_GATE);
    v1::ForwardResponse x, y;
    const grpc::Status sa = Call(*a, request, &x);
    const grpc::Status sb = Call(*b, request, &y);
    INFO(sa.error_message() << " / " << sb.error_message());
    REQUIRE(sa.ok());
    REQUIRE(sb.ok());
    ++calls;
    differing += x.output().data() != y.output().data();
  }
  CHECK(differing == 0);

  const std::string page = HttpGet(metrics_port, "/metrics");
  const double evictions = Metric(page, "colibri_expert_paged_evictions");
  const double kept = Metric(page, "colibri_expert_paged_kept_bytes");
  std::printf(
      "paged node, budget %llu of %llu bytes: %d calls, all equal to the locked node's; %.0f evictions, "
      "%.0f bytes kept, %.0f major / %.0f minor faults, %.0f bytes read from storage\n",
      static_cast<unsigned long long>(budget), static_cast<unsigned long long>(ShardBytes(model.path)), calls,
      evictions, kept, Metric(page, "colibri_expert_page_faults_total\\{kind=\"major\"\\}"),
      Metric(page, "colibri_expert_page_faults_total\\{kind=\"minor\"\\}"),
      Metric(page, "colibri_expert_storage_read_bytes"));
  CHECK(evictions > 0);
  CHECK(kept >= 0);
  CHECK(kept <= static_cast<double>(budget));
  CHECK(page.find("colibri_expert_call_major_faults_count") != std::string::npos);
  CHECK(page.find("colibri_expert_resident_bytes{") != std::string::npos);
}

}  // namespace
}  // namespace testing
}  // namespace colibri
