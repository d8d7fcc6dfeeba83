#include "common/model_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_replace.h"
#include "common/weight_file.h"
#include "tests/test_util.h"

namespace colibri {
namespace common {
namespace {

using colibri::testing::TempDir;

bool Contains(const absl::Status& s, const std::string& needle) {
  return s.message().find(needle) != absl::string_view::npos;
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

TEST_CASE("a converted model directory opens and loads every expert and layer") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kInt4);
  auto model = ModelDir::Open(dir / "model");
  REQUIRE(model.ok());
  const Manifest& m = (*model)->manifest();
  CHECK(m.d_model == 48);
  CHECK(m.d_ff == 80);
  CHECK(m.weight_type == DType::kInt4);
  CHECK((*model)->model_id().rfind("xxh3_128:", 0) == 0);
  for (int64_t layer = 0; layer < m.n_layers; ++layer) {
    REQUIRE((*model)->LoadRouting(layer, true).ok());
    for (int64_t e = 0; e < m.n_experts; ++e) {
      auto w = (*model)->LoadExpert(layer, e, true);
      INFO(w.status().message());
      REQUIRE(w.ok());
      CHECK((*w)->w1.layout.rows == 80);
      CHECK((*w)->w2.layout.cols == 80);
      CHECK(reinterpret_cast<uintptr_t>((*w)->w1.data) % 4096 == 0);
      CHECK(reinterpret_cast<uintptr_t>((*w)->w2.data) % 4096 == 0);
    }
  }
  CHECK((*model)->LoadExpert(2, 0, false).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK((*model)->LoadExpert(0, 4, false).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK((*model)->LoadRouting(-1, false).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("routing tables stay readable and unchanged after their files are truncated in place") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kBF16);
  auto model = ModelDir::Open(dir / "model");
  REQUIRE(model.ok());
  const Manifest& m = (*model)->manifest();
  auto routing = (*model)->LoadRouting(1, /*verify_checksum=*/true);
  INFO(routing.status().message());
  REQUIRE(routing.ok());
  const LayerRouting& r = **routing;
  const std::vector<float> gate(r.gate, r.gate + m.n_experts * m.d_model);
  const std::vector<int32_t> ids(r.lut_ids, r.lut_ids + m.vocab_size * m.top_k);
  const std::vector<float> weights(r.lut_weights, r.lut_weights + m.vocab_size * m.top_k);
  // What `cp new_gate.bin gate.bin` does first. Reading a mapping past its
  // file's new end would raise SIGBUS here.
  std::filesystem::resize_file(dir / ("model/" + GateFilePath(1)), 0);
  std::filesystem::resize_file(dir / ("model/" + LutFilePath(1)), 0);
  CHECK(std::vector<float>(r.gate, r.gate + gate.size()) == gate);
  CHECK(std::vector<int32_t>(r.lut_ids, r.lut_ids + ids.size()) == ids);
  CHECK(std::vector<float>(r.lut_weights, r.lut_weights + weights.size()) == weights);
  // A new load sees the damage.
  CHECK((*model)->LoadRouting(1, false).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("a manifest rewritten in place while models open never crashes them nor gives a mixed identity") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kF32);
  const std::string path = dir / "model/manifest.json";
  const std::string text = colibri::testing::ReadFile(path);
  std::string id;
  {
    auto model = ModelDir::Open(dir / "model");
    REQUIRE(model.ok());
    id = (*model)->model_id();
  }
  // What `cp manifest.json model/` does, again and again: truncate, then
  // write. A parser reading a mapping of the file would meet its new end
  // (SIGBUS) in some of the opens below.
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    const int fd = ::open(path.c_str(), O_WRONLY);
    while (fd >= 0 && !stop.load()) {
      if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
        break;
      }
    }
    if (fd >= 0) ::close(fd);
  });
  int opened = 0, refused = 0;
  for (int i = 0; i < 2000; ++i) {
    auto model = ModelDir::Open(dir / "model");
    if (model.ok()) {
      ++opened;
      CHECK((*model)->model_id() == id);  // what was parsed is what was hashed: the whole manifest
    } else {
      ++refused;
      CHECK(model.status().code() == absl::StatusCode::kInvalidArgument);  // a part of it, refused
    }
  }
  stop = true;
  writer.join();
  INFO(opened << " opened, " << refused << " refused");
  CHECK(opened + refused == 2000);
}

TEST_CASE("a flipped byte in a weight file is refused with the path and reason") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kBF16);
  const std::string path = dir / "model/layer_001/expert_002.bin";
  colibri::testing::FlipByte(path, kWeightFileHeaderBytes + 10);
  auto model = ModelDir::Open(dir / "model");
  REQUIRE(model.ok());
  auto bad = (*model)->LoadExpert(1, 2, /*verify_checksum=*/true);
  REQUIRE(bad.status().code() == absl::StatusCode::kDataLoss);
  CHECK(Contains(bad.status(), path));
  CHECK(Contains(bad.status(), "checksum"));
  CHECK((*model)->LoadExpert(1, 1, true).ok());  // its neighbours are fine
}

TEST_CASE("a truncated weight file or damaged header is refused with the path and reason") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kInt8);
  auto model = ModelDir::Open(dir / "model");
  REQUIRE(model.ok());
  const std::string expert = dir / "model/layer_000/expert_000.bin";
  colibri::testing::TruncateFile(expert, 5000);
  auto truncated = (*model)->LoadExpert(0, 0, false);
  REQUIRE(truncated.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(Contains(truncated.status(), expert));
  CHECK(Contains(truncated.status(), "truncated"));

  const std::string gate = dir / "model/layer_000/gate.bin";
  colibri::testing::FlipByte(gate, 0);  // the magic
  auto magic = (*model)->LoadRouting(0, /*verify_checksum=*/false);
  REQUIRE(magic.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(Contains(magic.status(), gate));
  CHECK(Contains(magic.status(), "magic"));

  std::remove((dir / "model/layer_001/lut.bin").c_str());
  auto missing = (*model)->LoadRouting(1, false);
  CHECK(missing.status().code() == absl::StatusCode::kNotFound);
  CHECK(Contains(missing.status(), "layer_001/lut.bin"));
}

TEST_CASE("negative or non-finite quantization scales are refused at load") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kInt8);
  const std::string path = dir / "model/layer_000/expert_001.bin";
  const std::string bytes = colibri::testing::ReadFile(path);
  auto layout = ParseHeader(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path);
  REQUIRE(layout.ok());
  const Section* scales = layout->Find("w3.scales");
  REQUIRE(scales != nullptr);
  const float negative = -1.0f;
  colibri::testing::WriteBytesAt(path, scales->offset + 8, std::string(reinterpret_cast<const char*>(&negative), 4));
  auto model = ModelDir::Open(dir / "model");
  REQUIRE(model.ok());
  auto bad = (*model)->LoadExpert(0, 1, /*verify_checksum=*/false);
  REQUIRE(bad.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(Contains(bad.status(), "w3.scales[2]"));
  CHECK(Contains(bad.status(), path));
}

TEST_CASE("a LUT routing to a nonexistent expert is refused at load") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kF32);
  const std::string lut = dir / "model/layer_000/lut.bin";
  // The ids section starts right after the header; token 0's first id := 0xff..
  colibri::testing::FlipByte(lut, kWeightFileHeaderBytes + 3);
  auto model = ModelDir::Open(dir / "model");
  REQUIRE(model.ok());
  auto bad = (*model)->LoadRouting(0, false);
  REQUIRE(bad.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(Contains(bad.status(), lut));
  CHECK(Contains(bad.status(), "token 0 routes to expert"));
}

TEST_CASE("a LUT routing a token to one expert twice, or with a negative weight, is refused at load") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kF32);
  const std::string lut = dir / "model/layer_000/lut.bin";
  auto model = ModelDir::Open(dir / "model");
  REQUIRE(model.ok());
  auto good = (*model)->LoadRouting(0, false);
  REQUIRE(good.ok());
  const int64_t top_k = (*model)->manifest().top_k;
  REQUIRE(top_k >= 2);
  const std::string bytes = colibri::testing::ReadFile(lut);
  auto layout = ParseHeader(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), lut);
  REQUIRE(layout.ok());
  const Section* weights = layout->Find("weights");
  REQUIRE(weights != nullptr);
  SECTION("the same expert twice") {
    // Token 0's second id := its first.
    const int32_t first = (*good)->lut_ids[0];
    colibri::testing::WriteBytesAt(lut, kWeightFileHeaderBytes + 4,
                                   std::string(reinterpret_cast<const char*>(&first), 4));
    auto bad = (*model)->LoadRouting(0, false);
    REQUIRE(bad.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(Contains(bad.status(), "token 0 routes to expert " + std::to_string(first) + " twice"));
  }
  SECTION("a negative weight") {
    const float negative = -0.5f;
    colibri::testing::WriteBytesAt(lut, weights->offset + 4 * top_k,
                                   std::string(reinterpret_cast<const char*>(&negative), 4));
    auto bad = (*model)->LoadRouting(0, false);
    REQUIRE(bad.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(Contains(bad.status(), "token 1 has route weight -0.5"));
  }
}

TEST_CASE("a weight file that is a symlink to outside the model directory is refused without its size") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kF32);
  const std::string expert = dir / "model/layer_000/expert_001.bin";
  std::filesystem::rename(expert, dir / "elsewhere.bin");
  std::filesystem::create_symlink(dir / "elsewhere.bin", expert);
  auto model = ModelDir::Open(dir / "model");
  REQUIRE(model.ok());
  const auto loaded = (*model)->LoadExpert(0, 1, false);
  REQUIRE_FALSE(loaded.ok());
  CHECK(Contains(loaded.status(), "resolves outside the model directory"));
  CHECK_FALSE(Contains(loaded.status(), "bytes"));
  CHECK((*model)->LoadExpert(0, 0, false).ok());  // the others still load
}

TEST_CASE("a FIFO in place of manifest.json is refused at once, not waited on") {
  TempDir dir;
  std::filesystem::create_directories(dir / "model");
  REQUIRE(::mkfifo((dir / "model/manifest.json").c_str(), 0600) == 0);
  auto model = ModelDir::Open(dir / "model");  // no writer ever opens the FIFO: a blocking open would hang here
  REQUIRE_FALSE(model.ok());
  CHECK(Contains(model.status(), "not a regular file"));
}

TEST_CASE("a manifest with an unknown version, a missing field or an escaping path is refused") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kF32);
  const std::string path = dir / "model/manifest.json";
  const std::string good = colibri::testing::ReadFile(path);

  WriteText(path, absl::StrReplaceAll(good, {{"\"format_version\": 1", "\"format_version\": 9"}}));
  auto v = ModelDir::Open(dir / "model");
  REQUIRE(v.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(Contains(v.status(), "unsupported format_version 9"));
  CHECK(Contains(v.status(), path));

  WriteText(path, absl::StrReplaceAll(good, {{"\"d_ff\"", "\"dff\""}}));
  CHECK(Contains(ModelDir::Open(dir / "model").status(), "'d_ff'"));

  WriteText(path, absl::StrReplaceAll(good, {{"layer_000/gate.bin", "../gate.bin"}}));
  CHECK(Contains(ModelDir::Open(dir / "model").status(), "stay inside"));

  WriteText(path, absl::StrReplaceAll(good, {{"\"weight_type\": \"f32\"", "\"weight_type\": \"int3\""}}));
  CHECK(Contains(ModelDir::Open(dir / "model").status(), "int3"));

  WriteText(path, absl::StrReplaceAll(good, {{"\"format\": \"colibri-model\"", "\"format\": 1"}}));
  CHECK(Contains(ModelDir::Open(dir / "model").status(), "'format'"));  // a wrong type, not an exception

  WriteText(path, absl::StrReplaceAll(good, {{"\"source\": \"embedding\"", "\"source\": [1]"}}));
  CHECK(ModelDir::Open(dir / "model").ok());  // informational field of the wrong type: ignored

  // Bounded before parsing: deep nesting (the parser builds it all first).
  WriteText(path, absl::StrReplaceAll(
                      good, {{"\"source\": \"embedding\"", absl::StrCat("\"source\": ", std::string(100000, '['))}}));
  CHECK(Contains(ModelDir::Open(dir / "model").status(), "nested 100002 levels deep"));
  WriteText(path, absl::StrReplaceAll(good, {{"\"source\": \"embedding\"", "\"source\": \"[[[[[[[[[[[[[[[[[[[[\""}}));
  CHECK(ModelDir::Open(dir / "model").ok());  // brackets in a string are not nesting

  // Shared experts need format_version 2, a count that fits, and their files listed.
  const std::string shared = "\"shared_experts\": {\"count\": 1, \"d_ff\": 32, \"gated\": false},\n  \"top_k\"";
  WriteText(path, absl::StrReplaceAll(good, {{"\"top_k\"", shared}}));
  CHECK(Contains(ModelDir::Open(dir / "model").status(), "'shared_experts' needs format_version 2"));
  WriteText(path,
            absl::StrReplaceAll(good, {{"\"top_k\"", shared}, {"\"format_version\": 1", "\"format_version\": 2"}}));
  CHECK(Contains(ModelDir::Open(dir / "model").status(), "required file 'layer_000/expert_004.bin' is not listed"));
  WriteText(path, absl::StrReplaceAll(
                      good, {{"\"top_k\"", absl::StrReplaceAll(shared, {{"\"count\": 1", "\"count\": 9999"}})},
                             {"\"format_version\": 1", "\"format_version\": 2"}}));
  CHECK(Contains(ModelDir::Open(dir / "model").status(), "'shared_experts.count' = 9999 is outside"));

  const std::string routing =
      "\"routing\": {\"scoring\": \"sigmoid\", \"n_group\": 3, \"topk_group\": 1, \"group_score\": \"max\", "
      "\"correction_bias\": false, \"scaling\": 2.0},\n  \"top_k\"";
  WriteText(path, absl::StrReplaceAll(good, {{"\"top_k\"", routing}}));
  CHECK(Contains(ModelDir::Open(dir / "model").status(), "'routing' needs format_version 2"));
  WriteText(path,
            absl::StrReplaceAll(good, {{"\"top_k\"", routing}, {"\"format_version\": 1", "\"format_version\": 2"}}));
  CHECK(Contains(ModelDir::Open(dir / "model").status(), "must divide the 4 experts"));

  // Expert activations and biases: format_version 3, sane constants, both bias kinds never together.
  const std::string experts =
      "\"experts\": {\"activation\": {\"alpha\": 1.702, \"limit\": 7.0, \"up_offset\": 1.0}, "
      "\"biases\": false},\n  \"top_k\"";
  WriteText(path, absl::StrReplaceAll(good, {{"\"top_k\"", experts}}));
  WriteText(path,
            absl::StrReplaceAll(good, {{"\"top_k\"", experts}, {"\"format_version\": 1", "\"format_version\": 2"}}));
  CHECK(Contains(ModelDir::Open(dir / "model").status(), "'experts' needs format_version 3"));
  WriteText(path,
            absl::StrReplaceAll(good, {{"\"top_k\"", experts}, {"\"format_version\": 1", "\"format_version\": 3"}}));
  auto with_activation = ModelDir::Open(dir / "model");
  REQUIRE(with_activation.ok());
  CHECK((*with_activation)->manifest().activation.alpha == 1.702);
  CHECK((*with_activation)->manifest().activation.limit == 7.0);
  WriteText(path, absl::StrReplaceAll(good, {{"\"top_k\"", absl::StrReplaceAll(experts, {{"7.0", "-1"}})},
                                             {"\"format_version\": 1", "\"format_version\": 3"}}));
  CHECK(Contains(ModelDir::Open(dir / "model").status(), "limit > 0 or null"));
  WriteText(path, absl::StrReplaceAll(good, {{"\"top_k\"", absl::StrReplaceAll(experts, {{"false", "true"}})},
                                             {"\"format_version\": 1", "\"format_version\": 3"}}));
  auto no_biases = ModelDir::Open(dir / "model");
  REQUIRE(no_biases.ok());  // the manifest is fine; the expert files lack the sections
  CHECK(Contains((*no_biases)->LoadExpert(0, 1, false).status(), "no section 'b1'"));
  const std::string both =
      absl::StrReplaceAll(routing, {{"\"n_group\": 3", "\"n_group\": 1"},
                                    {"\"correction_bias\": false", "\"correction_bias\": true, \"logit_bias\": true"}});
  WriteText(path, absl::StrReplaceAll(good, {{"\"top_k\"", both}, {"\"format_version\": 1", "\"format_version\": 3"}}));
  CHECK(Contains(ModelDir::Open(dir / "model").status(), "correction_bias and logit_bias cannot both be set"));

  WriteText(path, good.substr(0, good.size() / 2));
  CHECK(Contains(ModelDir::Open(dir / "model").status(), "not a JSON object"));

  std::remove(path.c_str());
  CHECK(ModelDir::Open(dir / "model").status().code() == absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace common
}  // namespace colibri
