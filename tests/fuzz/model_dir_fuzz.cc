// Fuzz target: the model-directory loader. The input's first byte picks the
// file it replaces in a copy of a real tiny model — 0: manifest.json, 1: an
// expert file, 2: a LUT, 3: a gate — the rest is the file's new content. For
// a binary file the manifest's size for it is updated to the input's, so the
// weight-file header and section parsers see the bytes (checksums are not
// verified: a mismatch would stop every input before the parser). Then the
// model is opened and every layer's routing and every expert loaded.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "common/model_dir.h"
#include "tests/fuzz/fuzz_model.h"

namespace {

namespace fs = std::filesystem;

const fs::path& Scratch() {
  static const fs::path dir = [] {
    fs::path d = fs::path(colibri::fuzz::TinyModel()).parent_path() / "scratch";
    fs::remove_all(d);
    fs::copy(colibri::fuzz::TinyModel(), d, fs::copy_options::recursive);
    return d;
  }();
  return dir;
}

std::string ReadAll(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteAll(const fs::path& p, const char* data, size_t size) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(data, static_cast<std::streamsize>(size));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const fs::path& dir = Scratch();
  static const std::string manifest = ReadAll(fs::path(colibri::fuzz::TinyModel()) / "manifest.json");
  const char* files[] = {"manifest.json", "layer_001/expert_002.bin", "layer_000/lut.bin", "layer_001/gate.bin"};
  const int which = data[0] % 4;
  const char* body = reinterpret_cast<const char*>(data + 1);
  // Restore the originals, then replace one file.
  WriteAll(dir / "manifest.json", manifest.data(), manifest.size());
  for (int i = 1; i < 4; ++i)
    fs::copy_file(fs::path(colibri::fuzz::TinyModel()) / files[i], dir / files[i],
                  fs::copy_options::overwrite_existing);
  if (which == 0) {
    WriteAll(dir / "manifest.json", body, size - 1);
  } else {
    WriteAll(dir / files[which], body, size - 1);
    nlohmann::json m = nlohmann::json::parse(manifest);
    for (auto& f : m["files"]) {
      if (f["path"] == files[which]) f["size"] = size - 1;
    }
    const std::string text = m.dump();
    WriteAll(dir / "manifest.json", text.data(), text.size());
  }
  auto model = colibri::common::ModelDir::Open(dir.string());
  if (!model.ok()) return 0;
  const auto& mf = (*model)->manifest();
  for (int64_t l = 0; l < mf.n_layers && l < 4; ++l) {
    (void)(*model)->LoadRouting(l, false);
    for (int64_t e = 0; e < mf.n_experts && e < 8; ++e) (void)(*model)->LoadExpert(l, e, false);
  }
  return 0;
}
