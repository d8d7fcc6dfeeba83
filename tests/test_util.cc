#include "tests/test_util.h"

#include <stdlib.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/safetensors.h"
#include "tools/convert.h"

namespace colibri {
namespace testing {

TempDir::TempDir() {
  const char* tmp = getenv("TMPDIR");
  std::string pattern = std::string(tmp != nullptr ? tmp : "/tmp") + "/colibri_test_XXXXXX";
  REQUIRE(mkdtemp(pattern.data()) != nullptr);
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

tools::SynthOptions SmallSynth(const std::string& out_dir, const std::string& naming) {
  tools::SynthOptions o;
  o.out_dir = out_dir;
  o.naming = naming;
  o.d_model = 48;
  o.d_ff = 80;
  o.n_layers = 2;
  o.n_experts = 4;
  o.top_k = 2;
  o.vocab_size = 64;
  o.dtype = common::DType::kF32;
  o.seed = 7;
  return o;
}

void MakeModel(const tools::SynthOptions& synth, const std::string& model_dir, common::DType weight_type) {
  std::ostringstream log;
  if (!std::filesystem::exists(synth.out_dir + "/config.json")) {  // converting one checkpoint twice is fine
    const absl::Status written = tools::WriteSyntheticCheckpoint(synth, log);
    INFO(written.message());
    REQUIRE(written.ok());
  }
  tools::ConvertOptions convert;
  convert.checkpoint_dir = synth.out_dir;
  convert.out_dir = model_dir;
  convert.weight_type = weight_type;
  convert.overwrite = true;
  convert.progress = false;
  const absl::Status converted = tools::ConvertCheckpoint(convert, log);
  INFO(converted.message());
  REQUIRE(converted.ok());
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void FlipByte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f.good());
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0xff);
  f.seekp(offset);
  f.write(&c, 1);
  REQUIRE(f.good());
}

void WriteBytesAt(const std::string& path, uint64_t offset, const std::string& bytes) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f.good());
  f.seekp(offset);
  f.write(bytes.data(), bytes.size());
  REQUIRE(f.good());
}

void TruncateFile(const std::string& path, uint64_t size) {
  REQUIRE(::truncate(path.c_str(), static_cast<off_t>(size)) == 0);
}

namespace {

template <typename T>
std::vector<T> ReadTensor(const std::string& path, const std::string& name, const char* dtype) {
  auto file = common::SafetensorsFile::Open(path);
  INFO(path << ": " << file.status().message());
  REQUIRE(file.ok());
  const common::SafetensorsTensor* t = (*file)->Find(name);
  INFO("tensor " << name << " in " << path);
  REQUIRE(t != nullptr);
  REQUIRE(t->dtype == dtype);
  std::vector<T> out(t->nbytes / sizeof(T));
  std::memcpy(out.data(), t->data, t->nbytes);
  return out;
}

}  // namespace

std::vector<float> ReadF32(const std::string& path, const std::string& name) {
  return ReadTensor<float>(path, name, "F32");
}

std::vector<int32_t> ReadI32(const std::string& path, const std::string& name) {
  return ReadTensor<int32_t>(path, name, "I32");
}

}  // namespace testing
}  // namespace colibri
