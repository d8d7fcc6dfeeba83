#include "common/safetensors.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <fstream>

#include "tests/test_util.h"

namespace colibri {
namespace common {
namespace {

using colibri::testing::TempDir;

std::string WithHeader(const std::string& json, const std::string& data = "") {
  std::string out(8, '\0');
  const uint64_t n = json.size();
  std::memcpy(&out[0], &n, 8);
  return out + json + data;
}

absl::Status ParseBytes(const std::string& bytes) {
  auto parsed = ParseSafetensorsHeader(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), bytes.size(),
                                       "test.safetensors");
  return parsed.status();
}

void ExpectRefused(const std::string& bytes, const std::string& needle) {
  const absl::Status s = ParseBytes(bytes);
  INFO("message: " << s.message());
  REQUIRE(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.message().find("test.safetensors") != absl::string_view::npos);
  CHECK(s.message().find(needle) != absl::string_view::npos);
}

TEST_CASE("a written safetensors file reads back with the same tensors") {
  TempDir dir;
  const std::string path = dir / "a.safetensors";
  const float a[6] = {1, 2, 3, 4, 5, 6};
  const int32_t b[2] = {-7, 9};
  auto w = SafetensorsWriter::Create(path, {{"a", "F32", {2, 3}}, {"b", "I32", {2}}}, {{"k", "v"}});
  REQUIRE(w.ok());
  REQUIRE((*w)->Append(a, 12).ok());  // a tensor may arrive in pieces
  REQUIRE((*w)->Append(a + 3, 12).ok());
  REQUIRE((*w)->Append(b, 8).ok());
  REQUIRE((*w)->Close().ok());

  auto f = SafetensorsFile::Open(path);
  REQUIRE(f.ok());
  REQUIRE((*f)->tensors().size() == 2);
  const SafetensorsTensor* ta = (*f)->Find("a");
  REQUIRE(ta != nullptr);
  CHECK(ta->dtype == "F32");
  CHECK(ta->shape == std::vector<int64_t>{2, 3});
  CHECK(ta->numel() == 6);
  CHECK(std::memcmp(ta->data, a, 24) == 0);
  CHECK(ta->offset % 8 == 0);
  const SafetensorsTensor* tb = (*f)->Find("b");
  REQUIRE(tb != nullptr);
  CHECK(std::memcmp(tb->data, b, 8) == 0);
  CHECK((*f)->Find("c") == nullptr);
}

TEST_CASE("the writer refuses a wrong byte count and unknown dtypes") {
  TempDir dir;
  auto w = SafetensorsWriter::Create(dir / "a.safetensors", {{"a", "F32", {2}}});
  REQUIRE(w.ok());
  REQUIRE((*w)->Append("abcd", 4).ok());
  CHECK((*w)->Append("0123456789", 10).code() == absl::StatusCode::kFailedPrecondition);
  CHECK((*w)->Close().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(SafetensorsWriter::Create(dir / "b.safetensors", {{"a", "F128", {2}}}).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(SafetensorsWriter::Create(dir / "c.safetensors", {{"a", "F32", {1}}, {"a", "F32", {1}}}).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("malformed safetensors headers are refused with the reason") {
  const std::string ok_entry = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  CHECK(ParseBytes(WithHeader("{" + ok_entry + "}", std::string(8, '\0'))).ok());
  ExpectRefused("1234", "shorter than the 8-byte");
  ExpectRefused(WithHeader("{}").substr(0, 9), "runs past the end");
  ExpectRefused(WithHeader("{\"t\":"), "not valid JSON");
  ExpectRefused(WithHeader("[1,2]"), "not a JSON object");
  ExpectRefused(WithHeader(R"({"t":{"shape":[2],"data_offsets":[0,8]}})", std::string(8, '\0')), "dtype");
  ExpectRefused(WithHeader(R"({"t":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", std::string(8, '\0')),
                "unknown dtype 'Q7'");
  ExpectRefused(WithHeader(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", std::string(8, '\0')),
                "non-negative");
  ExpectRefused(WithHeader(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", std::string(8, '\0')),
                "end before begin");
  ExpectRefused(WithHeader(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(4, '\0')),
                "run past");
  ExpectRefused(WithHeader(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0')),
                "needs 12");
  ExpectRefused(WithHeader(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                           std::string(12, '\0')),
                "overlap");
  ExpectRefused(
      WithHeader(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", std::string(8, '\0')),
      "overflow");
  // An empty tensor inside another must not hide an overlap with a third.
  ExpectRefused(WithHeader(R"({"a":{"dtype":"U8","shape":[100],"data_offsets":[0,100]},)"
                           R"("b":{"dtype":"U8","shape":[0],"data_offsets":[50,50]},)"
                           R"("c":{"dtype":"U8","shape":[10],"data_offsets":[60,70]}})",
                           std::string(100, '\0')),
                "overlap");
  // Deep nesting in a hostile header: a clear error, no stack exhaustion.
  const std::string deep = std::string(100000, '[') + "1" + std::string(100000, ']');
  ExpectRefused(
      WithHeader(R"({"t":{"dtype":"F32","shape":[)" + deep + R"(],"data_offsets":[0,4]}})", std::string(4, '\0')),
      "header nests 100003 levels deep, more than 16");
  std::string huge(8, '\0');
  const uint64_t n = uint64_t{1} << 40;
  std::memcpy(&huge[0], &n, 8);
  ExpectRefused(huge, "exceeds the limit");
}

TEST_CASE("a truncated safetensors file is refused when opened") {
  TempDir dir;
  const std::string path = dir / "t.safetensors";
  auto w = SafetensorsWriter::Create(path, {{"a", "F32", {16}}});
  REQUIRE(w.ok());
  const std::vector<float> zeros(16, 0.f);
  REQUIRE((*w)->Append(zeros.data(), 64).ok());
  REQUIRE((*w)->Close().ok());
  colibri::testing::TruncateFile(path, colibri::testing::ReadFile(path).size() - 4);
  auto f = SafetensorsFile::Open(path);
  REQUIRE_FALSE(f.ok());
  CHECK(f.status().message().find(path) != absl::string_view::npos);
  CHECK(f.status().message().find("truncated") != absl::string_view::npos);
  CHECK(SafetensorsFile::Open(dir / "missing.safetensors").status().code() == absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace common
}  // namespace colibri
