#include "kernels/kernel_profile.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <tuple>
#include <vector>

#include "absl/strings/str_replace.h"
#include "catch2/catch.hpp"
#include "tests/test_util.h"

namespace colibri {
namespace kernels {
namespace {

using colibri::testing::ReadFile;
using colibri::testing::TempDir;

// The row counts a threshold is timed at (0: never): on the small expert,
// and on the large one streamed from memory.
bool IsMeasuredRowCount(int64_t rows, bool streamed = false) {
  for (int64_t r :
       streamed ? std::vector<int64_t>{0, 2, 4, 6, 8, 16, 32, 64} : std::vector<int64_t>{0, 2, 4, 8, 16, 32, 64, 128}) {
    if (rows == r) return true;
  }
  return false;
}

TEST_CASE("a kernel profile survives its file format") {
  KernelProfile p = DefaultProfile(Isa::kAvx512Bf16);
  p.bf16_widen = true;
  p.int8_widen = false;
  p.int4_widen = true;
  p.onednn_min_tokens = 64;
  p.int8_tile_min_tokens = 0;
  p.int4_tile_min_tokens = 16;
  p.int8_records_tile_min_tokens = 2;
  p.int4_records_tile_min_tokens = 8;
  p.evidence = {"bf16 block rows=32: vdpbf16ps 2.000 ms, widened+fma 1.000 ms"};
  auto parsed = ParseProfile(SerializeProfile(p), Isa::kAvx512Bf16);
  REQUIRE(parsed.ok());
  CHECK(parsed->bf16_widen);
  CHECK_FALSE(parsed->int8_widen);
  CHECK(parsed->int4_widen);
  CHECK(parsed->onednn_min_tokens == 64);
  CHECK(parsed->int8_tile_min_tokens == 0);
  CHECK(parsed->int4_tile_min_tokens == 16);
  CHECK(parsed->int8_records_tile_min_tokens == 2);
  CHECK(parsed->int4_records_tile_min_tokens == 8);
  CHECK_THAT(DescribeProfile(*parsed), Catch::Contains("int8 tiles never (2 with records)"));
  CHECK_THAT(DescribeProfile(*parsed), Catch::Contains("from 16 rows (8 with records)"));
  CHECK(parsed->evidence == p.evidence);
  // Written by hand (a pinned ConfigMap): "\r\n" line ends and spaces read the same.
  const std::string crlf = absl::StrReplaceAll(SerializeProfile(p), {{"\n", " \r\n"}});
  auto by_hand = ParseProfile(" " + crlf, Isa::kAvx512Bf16);
  INFO(by_hand.status().message());
  REQUIRE(by_hand.ok());
  CHECK(SerializeProfile(*by_hand) == SerializeProfile(*parsed));
  CHECK(ProfiledTable(*parsed).For(common::DType::kBF16) == BlockBf16Avx512);
  CHECK(ProfiledTable(*parsed).For(common::DType::kInt8) == BlockInt8Avx512Vnni);
  CHECK(ProfiledTable(*parsed).For(common::DType::kInt4) == BlockInt4Avx512);
  CHECK(ProfiledTable(DefaultProfile(Isa::kAvx512Bf16)).For(common::DType::kBF16) == BlockBf16Avx512Bf16);
  // At avx512_amx, bf16 keeps its AMX tiles even where its block kernel is widened.
  KernelProfile amx = DefaultProfile(Isa::kAvx512Amx);
  amx.bf16_widen = true;
  amx.bf16_tile_min_tokens = 32;
  auto amx_parsed = ParseProfile(SerializeProfile(amx), Isa::kAvx512Amx);
  REQUIRE(amx_parsed.ok());
  CHECK(amx_parsed->bf16_tile_min_tokens == 32);
  CHECK(ProfiledTable(*amx_parsed).TileFor(common::DType::kBF16) == TileBf16Amx);
  CHECK(ProfiledTable(*amx_parsed).For(common::DType::kBF16) == BlockBf16Avx512);
  CHECK_THAT(DescribeProfile(*amx_parsed), Catch::Contains("bf16 on AMX tiles from 32 rows"));
}

TEST_CASE("the kernel choices compare the choices alone") {
  KernelProfile p = DefaultProfile(Isa::kAvx512Bf16);
  KernelProfile timed = p;
  timed.evidence = {"int8 block rows=1+8: vpdpbusd 4.8 ms, widened 6.8 ms"};
  timed.source = "measured, cached in /somewhere";
  CHECK(ProfileChoices(timed) == ProfileChoices(p));  // timings and source are not choices
  CHECK_THAT(ProfileChoices(p), Catch::StartsWith("isa avx512_bf16, bf16_widen 0, "));
  CHECK(ProfileChoices(p).find('\n') == std::string::npos);
  KernelProfile other = p;
  other.int4_tile_min_tokens = p.int4_tile_min_tokens + 8;
  CHECK(ProfileChoices(other) != ProfileChoices(p));
}

TEST_CASE("the kernel description says why AMX is not used where it is not") {
  const std::string described = DescribeProfile(DefaultProfile(SelectedIsa()));
  if (SelectedIsa() == Isa::kAvx512Amx) {
    CHECK(AmxAbsence().empty());
    CHECK_THAT(described, Catch::Contains("bf16 on AMX tiles from"));
  } else {
    WARN("AMX not in use here: " << AmxAbsence());
    CHECK_FALSE(AmxAbsence().empty());
    CHECK_THAT(described, Catch::Contains("; AMX tiles not available: " + AmxAbsence() + ";"));
  }
  // A profile of another ISA (not this process's) says nothing about AMX here.
  if (SelectedIsa() != Isa::kScalar) {
    CHECK_THAT(DescribeProfile(DefaultProfile(Isa::kScalar)), !Catch::Contains("AMX"));
  }
}

TEST_CASE("a bad kernel profile is refused naming what is wrong") {
  const std::string good = SerializeProfile(DefaultProfile(Isa::kAvx2));
  CHECK(ParseProfile(good, Isa::kAvx2).ok());
  auto other_isa = ParseProfile(good, Isa::kAvx512);
  REQUIRE_FALSE(other_isa.ok());
  CHECK_THAT(std::string(other_isa.status().message()), Catch::Contains("profile of ISA avx2, not avx512"));
  auto bad = ParseProfile(good + "int8_tile_min_tokens -3\n", Isa::kAvx2);
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(std::string(bad.status().message()), Catch::Contains("line 11 'int8_tile_min_tokens -3'"));
  // AMX tiles only where the ISA has them.
  std::string amx = good;
  amx.replace(amx.find("bf16_tile_min_tokens 0"), 22, "bf16_tile_min_tokens 16");
  auto no_amx = ParseProfile(amx, Isa::kAvx2);
  REQUIRE_FALSE(no_amx.ok());
  CHECK_THAT(std::string(no_amx.status().message()), Catch::Contains("'bf16_tile_min_tokens 16'"));
  // int8 widens at avx2 only where AVX-VNNI gave it a vpdpbusd kernel to replace.
  std::string widened_int8 = good;
  widened_int8.replace(widened_int8.find("int8_widen 0"), 12, "int8_widen 1");
  auto int8_widen = ParseProfile(widened_int8, Isa::kAvx2);
  CHECK(int8_widen.ok() == HasAvxVnni());
  if (int8_widen.ok()) CHECK(ProfiledTable(*int8_widen).For(common::DType::kInt8) == BlockInt8Avx2);
  auto widen = ParseProfile("isa avx2\nbf16_widen 1\n", Isa::kAvx2);  // no vdpbf16ps to replace there
  REQUIRE_FALSE(widen.ok());
  CHECK_THAT(std::string(widen.status().message()), Catch::Contains("bf16_widen 1"));
  auto twice = ParseProfile(good + "int8_tile_min_tokens 3\n", Isa::kAvx2);  // a key twice
  REQUIRE_FALSE(twice.ok());
  CHECK_THAT(std::string(twice.status().message()), Catch::Contains("a second int8_tile_min_tokens"));
  auto unknown = ParseProfile(good + "speed 11\n", Isa::kAvx2);
  REQUIRE_FALSE(unknown.ok());
  CHECK_THAT(std::string(unknown.status().message()), Catch::Contains("'speed 11'"));
  // A profile without the records thresholds (written before they existed): theirs are the others.
  KernelProfile old_format = DefaultProfile(Isa::kAvx2);
  old_format.int8_tile_min_tokens = 24;
  std::string old_text = SerializeProfile(old_format);
  for (const char* key : {"int8_records_tile_min_tokens", "int4_records_tile_min_tokens"}) {
    const size_t at = old_text.find(key);
    old_text.erase(at, old_text.find('\n', at) + 1 - at);
  }
  auto old = ParseProfile(old_text, Isa::kAvx2);
  REQUIRE(old.ok());
  CHECK(old->int8_records_tile_min_tokens == 24);
  CHECK(old->int4_records_tile_min_tokens == old->int4_tile_min_tokens);
  auto incomplete = ParseProfile("isa avx2\n", Isa::kAvx2);
  REQUIRE_FALSE(incomplete.ok());
  CHECK_THAT(std::string(incomplete.status().message()), Catch::Contains("incomplete"));
}

TEST_CASE("the measured profile chooses among measured row counts and says why") {
  const Isa isa = SelectedIsa();
  const KernelProfile p = MeasureProfile(isa);
  CHECK(p.isa == isa);
  // int8/int4 against int8 tiles on the large expert, against bf16 tiles on the small one.
  const KernelTable table = ProfiledTable(p);
  const bool int8_tiles = table.TileFor(common::DType::kInt8) != nullptr;
  const bool int4_tiles = table.TileFor(common::DType::kInt4) != nullptr;
  CHECK(IsMeasuredRowCount(p.onednn_min_tokens));
  CHECK(IsMeasuredRowCount(p.bf16_tile_min_tokens, /*streamed=*/true));
  CHECK(IsMeasuredRowCount(p.int8_tile_min_tokens, int8_tiles));
  CHECK(IsMeasuredRowCount(p.int4_tile_min_tokens, int4_tiles));
  CHECK(IsMeasuredRowCount(p.int8_records_tile_min_tokens, int8_tiles));
  CHECK(IsMeasuredRowCount(p.int4_records_tile_min_tokens, int4_tiles));
  // A kernel is widened only where there is a widening one to take its place.
  int pairs = 0;
  for (auto [type, widen] :
       {std::pair{common::DType::kBF16, p.bf16_widen}, std::pair{common::DType::kInt8, p.int8_widen},
        std::pair{common::DType::kInt4, p.int4_widen}}) {
    if (WidenedKernel(isa, type) != nullptr) {
      ++pairs;
    } else {
      CHECK_FALSE(widen);
    }
  }
  if (isa == Isa::kScalar) return;
  // One line per comparison and the time it took: 7 row counts for oneDNN
  // (or one saying why it is not used);
  // for int8 and int4, 7 against bf16 tiles or 7 + 7 on the large expert
  // against int8 tiles, without and with records (where the profiled table
  // has int8 tiles; without them the records thresholds are the others);
  // 7 for bf16 on AMX tiles
  // (where there are some); the three pairs of block kernels where there are
  // two.
  auto tile_lines = [&](common::DType type) { return table.TileFor(type) != nullptr ? 14 : 7; };
  for (auto [type, with, without] :
       {std::tuple{common::DType::kInt8, p.int8_records_tile_min_tokens, p.int8_tile_min_tokens},
        std::tuple{common::DType::kInt4, p.int4_records_tile_min_tokens, p.int4_tile_min_tokens}}) {
    if (table.TileFor(type) == nullptr) CHECK(with == without);
  }
  const size_t amx_lines = table.TileFor(common::DType::kBF16) != nullptr ? 7 : 0;
  const bool onednn_refused = std::any_of(p.evidence.begin(), p.evidence.end(), [](const std::string& line) {
    return line.rfind("oneDNN not used: its bits depend on the width of a run", 0) == 0;
  });
  if (onednn_refused) CHECK(p.onednn_min_tokens == 0);
  const size_t onednn_lines = onednn_refused ? 1 : 7;
  const size_t lines =
      onednn_lines + tile_lines(common::DType::kInt8) + tile_lines(common::DType::kInt4) + amx_lines + pairs + 1;
  CHECK(p.evidence.size() == lines);
  CHECK_THAT(p.evidence.front(), Catch::Contains("ms"));
}

// Stand-ins for oneDNN on f32 weights: output j of token t is the weights'
// float j · cols (counted from the matrix's start, whatever the run: the
// same for every cut) times x[t][0], or that plus a trace of the run's width.
void ExactMatmul(common::DType, int64_t tokens, int64_t cols, int64_t n, const void* src, const void* weights,
                 float* dst, int64_t ldd) {
  const float* w = static_cast<const float*>(weights);
  const float* x = static_cast<const float*>(src);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < n; ++j) dst[t * ldd + j] = w[j * cols] * x[t * cols];
  }
}

void WidthDependentMatmul(common::DType type, int64_t tokens, int64_t cols, int64_t n, const void* src,
                          const void* weights, float* dst, int64_t ldd) {
  ExactMatmul(type, tokens, cols, n, src, weights, dst, ldd);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < n; ++j) dst[t * ldd + j] += 1e-3f * static_cast<float>(n);
  }
}

TEST_CASE("oneDNN is trusted only where its bits do not depend on the width of a run") {
  const int64_t tokens[] = {1, 3};
  CHECK(MatmulWidthDependence(ExactMatmul, common::DType::kF32, 128, tokens).empty());
  const std::string found = MatmulWidthDependence(WidthDependentMatmul, common::DType::kF32, 128, tokens);
  CHECK_THAT(found, Catch::StartsWith("f32, 1 tokens, 128 inputs: output [0][0]"));
  CHECK_THAT(found, Catch::Contains("in one run of 16 blocks"));
}

TEST_CASE("the kernel profile is measured once and then read from its cache file") {
  TempDir dir;
  const std::string path = dir / "nested/kernels.txt";
  const Isa isa = SelectedIsa();
  auto first = LoadOrMeasureProfile(path, isa);
  REQUIRE(first.ok());
  CHECK(first->source == "measured, cached in " + path);
  const std::string written = ReadFile(path);
  CHECK(written == SerializeProfile(*first));
  auto second = LoadOrMeasureProfile(path, isa);
  REQUIRE(second.ok());
  CHECK(second->source == "cached in " + path);
  CHECK(SerializeProfile(*second) == written);
  // A chosen profile is kept as written, even if measuring now would differ.
  KernelProfile pinned = DefaultProfile(isa);
  pinned.onednn_min_tokens = 128;
  std::ofstream(path, std::ios::trunc) << SerializeProfile(pinned);
  auto third = LoadOrMeasureProfile(path, isa);
  REQUIRE(third.ok());
  CHECK(third->onednn_min_tokens == 128);
  // A corrupt file is measured again and rewritten.
  std::ofstream(path, std::ios::trunc) << "garbage\n";
  auto fourth = LoadOrMeasureProfile(path, isa);
  REQUIRE(fourth.ok());
  CHECK(fourth->source == "measured, cached in " + path);
  CHECK(ParseProfile(ReadFile(path), isa).ok());
  // One an operator named is never measured over: a typo must not lose a
  // pinned choice, nor processes at two ISAs sharing it overwrite each other.
  std::ofstream(path, std::ios::trunc) << "garbage\n";
  auto chosen = LoadOrMeasureProfile(path, isa, ProfileFile::kChosen);
  REQUIRE_FALSE(chosen.ok());
  CHECK(chosen.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(chosen.status().message()), Catch::Contains(path + " (COLIBRI_KERNEL_PROFILE)"));
  CHECK(ReadFile(path) == "garbage\n");
  CHECK(LoadOrMeasureProfile(dir / "chosen.txt", isa, ProfileFile::kChosen).ok());  // absent: measured and written
}

TEST_CASE("a cache file another process keeps locked is waited for a while, then measured apart") {
  TempDir dir;
  const std::string path = dir / "kernels.txt";
  const Isa isa = SelectedIsa();
  std::ofstream(path) << "";
  const int holder = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);  // a stopped process's lock
  REQUIRE(holder >= 0);
  REQUIRE(::flock(holder, LOCK_EX) == 0);
  auto loaded = LoadOrMeasureProfile(path, isa, ProfileFile::kCache, absl::Milliseconds(200));
  ::close(holder);
  REQUIRE(loaded.ok());
  CHECK_THAT(loaded->source, Catch::StartsWith("measured, not cached (" + path + " stayed locked"));
  CHECK(ReadFile(path).empty());  // not written without the lock
  // An operator's pinned profile is used as written, not measured over, when its lock is held.
  KernelProfile pinned = DefaultProfile(isa);
  pinned.onednn_min_tokens = 96;
  std::ofstream(path, std::ios::trunc) << SerializeProfile(pinned);
  const int again = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(again >= 0);
  REQUIRE(::flock(again, LOCK_EX) == 0);
  auto chosen = LoadOrMeasureProfile(path, isa, ProfileFile::kChosen, absl::Milliseconds(200));
  ::close(again);
  REQUIRE(chosen.ok());
  CHECK(chosen->onednn_min_tokens == 96);
  CHECK_THAT(chosen->source, Catch::StartsWith("pinned in " + path + " (read without its lock"));
}

TEST_CASE("a cache file that cannot be opened is an error naming it") {
  TempDir dir;
  std::filesystem::create_directories(dir / "a_directory");
  const std::string path = dir / "a_directory";
  auto loaded = LoadOrMeasureProfile(path, SelectedIsa());
  REQUIRE_FALSE(loaded.ok());
  CHECK(loaded.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(loaded.status().message()), Catch::Contains("cannot open " + path));
  // A FIFO would block the read forever.
  const std::string fifo = dir / "fifo";
  REQUIRE(mkfifo(fifo.c_str(), 0644) == 0);
  auto from_fifo = LoadOrMeasureProfile(fifo, SelectedIsa());
  REQUIRE_FALSE(from_fifo.ok());
  CHECK_THAT(std::string(from_fifo.status().message()), Catch::Contains(fifo + " is not a regular file"));
}

TEST_CASE("a profile that can only be read is used as written, and refused if it is not one") {
  const Isa isa = SelectedIsa();
  // A file the process may not write: a sysfs attribute (EACCES even for root).
  const std::string sysfs = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size";
  if (access(sysfs.c_str(), R_OK) == 0) {
    auto refused = LoadOrMeasureProfile(sysfs, isa);
    REQUIRE_FALSE(refused.ok());
    CHECK_THAT(std::string(refused.status().message()),
               Catch::Contains(sysfs + " is read-only and not a profile for this CPU"));
  } else {
    WARN("no " << sysfs << " here: the refusal of a read-only non-profile is not exercised");
  }
  if (geteuid() == 0) {
    WARN("running as root, which may write any file: the read-only pinned profile is not exercised");
    return;
  }
  TempDir dir;
  const std::string path = dir / "pinned.txt";
  KernelProfile pinned = DefaultProfile(isa);
  pinned.onednn_min_tokens = 64;
  std::ofstream(path) << SerializeProfile(pinned);
  REQUIRE(chmod(path.c_str(), 0444) == 0);
  auto loaded = LoadOrMeasureProfile(path, isa);
  REQUIRE(loaded.ok());
  CHECK(loaded->onednn_min_tokens == 64);
  CHECK(loaded->source == "pinned in " + path + " (read-only)");
}

TEST_CASE("the CPU signature names vendor, family, model and stepping") {
  const std::string sig = CpuSignature();
  CHECK(std::count(sig.begin(), sig.end(), '-') == 3);
  CHECK(sig.find(' ') == std::string::npos);
}

}  // namespace
}  // namespace kernels
}  // namespace colibri
