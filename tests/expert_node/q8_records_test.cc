// int8 tile records and the tile thresholds they bring, under a kernel
// profile pinned for this process whose records thresholds differ from the
// others (int8 and int4 never on tiles without records, from 2 and 3 rows
// with them), so every check can tell which threshold was taken: by the
// executor, per expert, and in the row_split_limit a node reports.

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "colibri/v1/expert_node.grpc.pb.h"
#include "common/model_dir.h"
#include "expert_node/expert_server.h"
#include "kernels/expert_executor.h"
#include "kernels/kernel_profile.h"
#include "tests/test_util.h"

namespace colibri {
namespace expert_node {
namespace {

using colibri::testing::TempDir;
using common::DType;

constexpr int64_t kInt8Records = 2, kInt4Records = 3;

// The pinned profile's file, removed when the process ends.
struct PinnedProfile {
  std::string path = "/tmp/colibri-q8-records-test-" + std::to_string(getpid()) + ".txt";
  PinnedProfile() {
    kernels::KernelProfile p = kernels::DefaultProfile(kernels::SelectedIsa());
    p.int8_widen = p.int4_widen = false;  // the vpdpbusd kernels, and so int8 tiles where there are some
    p.int8_tile_min_tokens = p.int4_tile_min_tokens = 0;
    p.int8_records_tile_min_tokens = kInt8Records;
    p.int4_records_tile_min_tokens = kInt4Records;
    std::ofstream(path) << kernels::SerializeProfile(p);
    setenv("COLIBRI_KERNEL_PROFILE", path.c_str(), 1);
  }
  ~PinnedProfile() { std::remove(path.c_str()); }
};
const PinnedProfile kPinned;  // before any SelectedProfile()

std::vector<std::unique_ptr<common::ExpertWeights>> LoadExperts(const std::string& dir) {
  auto model = common::ModelDir::Open(dir);
  REQUIRE(model.ok());
  std::vector<std::unique_ptr<common::ExpertWeights>> experts;
  for (int64_t e = 0; e < (*model)->manifest().n_experts; ++e) {
    auto w = (*model)->LoadExpert(0, e, false);
    REQUIRE(w.ok());
    experts.push_back(std::move(w).value());
  }
  return experts;
}

TEST_CASE("an expert with int8 tile records takes tiles from the records threshold, one without from its own") {
  const kernels::KernelTable& kernels = kernels::SelectedKernels();
  REQUIRE(kernels::SelectedProfile().source.find(kPinned.path) != std::string::npos);
  bool tested = false;
  for (const DType type : {DType::kInt8, DType::kInt4}) {
    CAPTURE(common::DTypeName(type));
    const int64_t threshold = type == DType::kInt8 ? kInt8Records : kInt4Records;
    if (kernels.TileFor(type) == nullptr) continue;  // no int8 tiles: no records (AttachQ8Records refuses)
    CHECK(kernels::TileMinTokens({}, kernels, type, true) == threshold);
    CHECK(kernels::TileMinTokens({}, kernels, type, false) == 0);
    CHECK(kernels::RowSplitLimit({}, kernels, type, true) == threshold);
    CHECK(kernels::RowSplitLimit({}, kernels, type, false) == 0);
    kernels::ExecutorOptions fixed;  // a threshold given holds with records too
    fixed.int8_tile_min_tokens = fixed.int4_tile_min_tokens = 5;
    CHECK(kernels::TileMinTokens(fixed, kernels, type, true) == 5);

    TempDir dir;
    colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", type);
    const auto plain = LoadExperts(dir / "model"), recorded = LoadExperts(dir / "model");
    REQUIRE(kernels::AttachQ8Records(recorded[1].get(), kernels, {}).ok());
    auto model = common::ModelDir::Open(dir / "model");
    REQUIRE(model.ok());
    const int64_t d_model = (*model)->manifest().d_model;
    auto pool = kernels::ThreadPool::Create({2, -1, false});
    REQUIRE(pool.ok());
    kernels::Workspace ws;
    for (const int64_t rows : {threshold, threshold - 1}) {
      CAPTURE(rows);
      std::vector<float> x(rows * d_model);
      for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std::sin(0.3 * static_cast<double>(i)));
      std::vector<int32_t> indices(rows);
      for (int64_t r = 0; r < rows; ++r) indices[r] = static_cast<int32_t>(r);
      const std::vector<float> weights(rows, 0.5f);
      auto run = [&](const common::ExpertWeights* expert, int64_t tile_min_tokens) {
        kernels::ExecutorOptions options;
        options.int8_tile_min_tokens = options.int4_tile_min_tokens = tile_min_tokens;
        std::vector<float> out(x.size(), 0.f);
        const kernels::ExpertTask task{expert, indices.data(), weights.data(), rows};
        REQUIRE(kernels::RunExperts(**pool, {task}, x.data(), d_model, out.data(), ws, options));
        return out;
      };
      const std::vector<float> tiles = run(plain[1].get(), 1), block = run(plain[1].get(), 0);
      REQUIRE(tiles != block);                    // the two kernels are told apart by their bits
      CHECK(run(recorded[1].get(), 1) == tiles);  // records give the repacking's bits
      CHECK(run(recorded[1].get(), -1) == (rows >= threshold ? tiles : block));
      CHECK(run(plain[1].get(), -1) == block);
      tested = true;
    }
  }
  if (!tested) WARN("no int8 tiles on this CPU's kernels: no records to run here");
}

TEST_CASE("GetNodeInfo's row_split_limit is the records' threshold where the node built them") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kInt8);
  auto limit_of = [&](bool records) {
    ServerOptions options;
    options.model_dir = dir / "model";
    options.store.shard = *ShardSpec::Parse("all");
    options.store.residency = Residency::kCopy;
    options.store.q8_records = records;
    options.threads = 1;
    auto server = ExpertServer::Create(options, nullptr);
    REQUIRE(server.ok());
    auto stub = v1::ExpertNode::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string((*server)->port()), grpc::InsecureChannelCredentials()));
    v1::GetNodeInfoResponse info;
    grpc::ClientContext context;
    REQUIRE(stub->GetNodeInfo(&context, v1::GetNodeInfoRequest(), &info).ok());
    CHECK(info.reads_kernel_rows());
    return info.row_split_limit();
  };
  const bool tiles = kernels::SelectedKernels().TileFor(DType::kInt8) != nullptr;
  CHECK(limit_of(false) == -1);  // never on tiles without records: no limit
  CHECK(limit_of(true) == (tiles ? kInt8Records : -1));
  if (!tiles) WARN("no int8 tiles on this CPU's kernels: the node built no records");
}

}  // namespace
}  // namespace expert_node
}  // namespace colibri
