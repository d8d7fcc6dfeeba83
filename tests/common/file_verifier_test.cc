#include "common/file_verifier.h"

#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

#include "tests/test_util.h"

namespace colibri {
namespace common {
namespace {

using colibri::testing::TempDir;

// A model's expert files, mapped as a node maps them.
struct Mapped {
  std::unique_ptr<ModelDir> model;
  std::vector<std::unique_ptr<MappedFile>> files;
  std::vector<const MappedFile*> views;
};

Mapped MapExperts(const std::string& dir) {
  Mapped m;
  auto model = ModelDir::Open(dir);
  REQUIRE(model.ok());
  m.model = std::move(*model);
  const Manifest& manifest = m.model->manifest();
  for (int64_t layer = 0; layer < manifest.n_layers; ++layer) {
    for (int64_t expert = 0; expert < manifest.n_experts; ++expert) {
      auto file = m.model->MapListedFile(ExpertFilePath(layer, expert), /*verify_checksum=*/false);
      REQUIRE(file.ok());
      m.views.push_back(file->get());
      m.files.push_back(std::move(*file));
    }
  }
  return m;
}

VerifyReport Verify(const std::string& dir, const VerifyOptions& options) {
  Mapped m = MapExperts(dir);
  auto report = VerifyMappedFiles(*m.model, m.views, options);
  INFO(report.status().message());
  REQUIRE(report.ok());
  return *report;
}

// Files changed within the last 0.1 s are not remembered (the racy rule).
void WaitPastRacyWindow() { std::this_thread::sleep_for(std::chrono::milliseconds(150)); }

TEST_CASE("files verified once are not hashed again until they change, and a changed file is caught") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kBF16);
  WaitPastRacyWindow();
  const VerifyOptions options{/*threads=*/2, /*cache_path=*/""};

  const VerifyReport first = Verify(dir / "model", options);
  CHECK(first.files_hashed == 8);  // 2 layers x 4 experts
  CHECK(first.files_remembered == 0);
  CHECK(first.cache_path == dir / (std::string("model/") + kVerifiedCacheFileName));
  CHECK(first.cache_note.empty());
  CHECK(first.Describe().find("verified 8 files") != std::string::npos);

  const VerifyReport second = Verify(dir / "model", options);
  CHECK(second.files_hashed == 0);
  CHECK(second.files_remembered == 8);
  CHECK(second.bytes_remembered == first.bytes_hashed);

  // Changed in place after it was verified: a new ctime, so it is hashed again and refused.
  colibri::testing::FlipByte(dir / "model/layer_001/expert_003.bin", 3000);
  Mapped m = MapExperts(dir / "model");
  auto failed = VerifyMappedFiles(*m.model, m.views, options);
  REQUIRE(failed.status().code() == absl::StatusCode::kDataLoss);
  CHECK(failed.status().message().find("layer_001/expert_003.bin") != absl::string_view::npos);

  // Put back (the same bytes, a new identity): hashed once more, then remembered again.
  colibri::testing::FlipByte(dir / "model/layer_001/expert_003.bin", 3000);
  WaitPastRacyWindow();
  const VerifyReport third = Verify(dir / "model", options);
  CHECK(third.files_hashed == 1);
  CHECK(third.files_remembered == 7);
  CHECK(Verify(dir / "model", options).files_hashed == 0);
}

TEST_CASE("the verified-files cache can be turned off, moved, and survives a damaged cache file") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kInt8);
  WaitPastRacyWindow();

  const VerifyReport off = Verify(dir / "model", {1, "off"});
  CHECK(off.cache_path.empty());
  CHECK(Verify(dir / "model", {1, "off"}).files_hashed == 8);
  CHECK_FALSE(std::filesystem::exists(dir / (std::string("model/") + kVerifiedCacheFileName)));

  const std::string elsewhere = dir / "cache/verified.txt";
  CHECK(Verify(dir / "model", {1, elsewhere}).files_hashed == 8);
  CHECK(Verify(dir / "model", {1, elsewhere}).files_remembered == 8);

  // A damaged cache is ignored with a note and rewritten.
  std::ofstream(elsewhere, std::ios::trunc) << "colibri-verified 1\nnot a line\n";
  const VerifyReport damaged = Verify(dir / "model", {1, elsewhere});
  CHECK(damaged.files_hashed == 8);
  CHECK(damaged.cache_note.find("malformed") != std::string::npos);
  CHECK(Verify(dir / "model", {1, elsewhere}).files_remembered == 8);
  std::ofstream(elsewhere, std::ios::trunc) << "something else\n";
  CHECK(Verify(dir / "model", {1, elsewhere}).cache_note.find("not a verified-files cache") != std::string::npos);

  // A cache that cannot be written is a note, not an error.
  const VerifyReport unwritable = Verify(dir / "model", {1, dir / "model/manifest.json/x"});
  CHECK(unwritable.files_hashed == 8);
  CHECK(unwritable.cache_note.find("cannot") != std::string::npos);
}

TEST_CASE("a cache file planted in a model directory cannot block the load or redirect the write") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kBF16);
  WaitPastRacyWindow();
  const std::string cache = dir / (std::string("model/") + kVerifiedCacheFileName);
  const std::string victim = dir / "victim.txt";
  std::ofstream(victim) << "precious\n";

  // A FIFO would block a read forever: ignored with a note, replaced by the cache.
  REQUIRE(mkfifo(cache.c_str(), 0644) == 0);
  const VerifyReport fifo = Verify(dir / "model", {1, ""});
  CHECK(fifo.files_hashed == 8);
  CHECK(fifo.cache_note.find("not a regular file") != std::string::npos);
  CHECK(std::filesystem::is_regular_file(cache));

  // Symlinks, at the cache's name or at its temporary file's, are not followed.
  std::filesystem::remove(cache);
  std::filesystem::create_symlink(victim, cache);
  std::filesystem::create_symlink(victim, cache + ".tmp." + std::to_string(getpid()));
  const VerifyReport linked = Verify(dir / "model", {1, ""});
  CHECK(linked.files_hashed == 8);
  CHECK(linked.cache_note.find("cannot open") != std::string::npos);
  CHECK_FALSE(std::filesystem::is_symlink(cache));
  std::ifstream in(victim);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(text == "precious\n");
  CHECK(Verify(dir / "model", {1, ""}).files_remembered == 8);
}

TEST_CASE("a remembered file whose manifest checksum changed is hashed again") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kBF16);
  WaitPastRacyWindow();
  const std::string cache = dir / "verified.txt";
  REQUIRE(Verify(dir / "model", {1, cache}).files_hashed == 8);
  // The same files listed with another checksum (a manifest from another model): every file is hashed, one fails.
  std::string text = colibri::testing::ReadFile(dir / "model/manifest.json");
  Mapped m = MapExperts(dir / "model");
  const std::string listed = m.model->manifest().FindFile(ExpertFilePath(0, 2))->checksum;
  text.replace(text.find(listed), listed.size(), std::string("xxh3_128:") + std::string(32, '0'));
  std::ofstream(dir / "model/manifest.json", std::ios::trunc) << text;
  Mapped again = MapExperts(dir / "model");
  auto failed = VerifyMappedFiles(*again.model, again.views, {1, cache});
  REQUIRE(failed.status().code() == absl::StatusCode::kDataLoss);
  CHECK(failed.status().message().find("layer_000/expert_002.bin") != absl::string_view::npos);
}

}  // namespace
}  // namespace common
}  // namespace colibri
