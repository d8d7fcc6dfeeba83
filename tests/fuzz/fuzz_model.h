#ifndef COLIBRI_TESTS_FUZZ_FUZZ_MODEL_H_
#define COLIBRI_TESTS_FUZZ_FUZZ_MODEL_H_

// A tiny converted model for the fuzz targets, made once per process with the
// real tools (d_model 32, d_ff 64, 2 layers, 4 experts, top-2, vocab 16, int4
// so every decode path runs) under $TMPDIR and removed at exit.

#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>

#include "tools/convert.h"
#include "tools/synth.h"

namespace colibri {
namespace fuzz {

inline const std::string& TinyModel() {
  static const std::string dir = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string base = std::string(tmp != nullptr ? tmp : "/tmp") + "/colibri_fuzz_XXXXXX";
    if (mkdtemp(base.data()) == nullptr) std::abort();
    tools::SynthOptions synth;
    synth.out_dir = base + "/ckpt";
    synth.d_model = 32;
    synth.d_ff = 64;
    synth.n_layers = 2;
    synth.n_experts = 4;
    synth.top_k = 2;
    synth.vocab_size = 16;
    synth.dtype = common::DType::kF32;
    std::ostringstream log;
    if (!tools::WriteSyntheticCheckpoint(synth, log).ok()) std::abort();
    tools::ConvertOptions convert;
    convert.checkpoint_dir = synth.out_dir;
    convert.out_dir = base + "/model";
    convert.weight_type = common::DType::kInt4;
    convert.progress = false;
    if (!tools::ConvertCheckpoint(convert, log).ok()) std::abort();
    static const std::string remove = base;
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(remove, ec);
    });
    return base + "/model";
  }();
  return dir;
}

}  // namespace fuzz
}  // namespace colibri

#endif  // COLIBRI_TESTS_FUZZ_FUZZ_MODEL_H_
