#include "tools/convert.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/checksum.h"
#include "common/manifest.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "common/weight_file.h"
#include "common/weight_matrix.h"
#include "tools/hf_checkpoint.h"
#include "tools/model_writer.h"

namespace colibri {
namespace tools {
namespace {

namespace fs = std::filesystem;
using common::DType;

constexpr size_t kChunkBytes = 8u << 20;  // f32 source rows encoded at a time

// One (layer, expert) file: w1, w3, w2 encoded chunk by chunk from the
// source, then the f32 biases b1, b3, b2 when the model has them.
absl::StatusOr<common::ManifestFile> WriteExpertFile(const HfCheckpoint& ckpt, const std::string& out_dir,
                                                     int64_t hf_layer, int64_t layer, int64_t expert, DType type,
                                                     LayerReport* report) {
  const HfModelShape& s = ckpt.shape();
  struct Source {
    std::string name;
    ExpertMatrix which;
    int64_t rows, cols;
  };
  const int64_t d_ff = expert < s.n_experts ? s.d_ff : s.shared_d_ff;  // the shared expert's width may differ
  const Source sources[] = {{"w1", ExpertMatrix::kW1, d_ff, s.d_model},
                            {"w3", ExpertMatrix::kW3, d_ff, s.d_model},
                            {"w2", ExpertMatrix::kW2, s.d_model, d_ff}};
  std::vector<common::Section> sections;
  for (const Source& src : sources) {
    const common::MatrixLayout l = common::ComputeMatrixLayout(type, src.rows, src.cols);
    sections.push_back({src.name, type, 0, l.data_bytes, src.rows, src.cols});
    if (l.scale_bytes > 0) {
      sections.push_back({src.name + ".scales", DType::kF32, 0, l.scale_bytes, l.padded_rows, l.groups});
    }
    if (l.zero_bytes > 0)
      sections.push_back({src.name + ".zeros", DType::kU8, 0, l.zero_bytes, l.padded_rows, l.groups});
  }
  std::vector<std::vector<float>> biases;  // b1, b3, b2
  if (s.expert_biases && expert < s.n_experts) {
    for (const Source& src : sources) {
      COLIBRI_ASSIGN_OR_RETURN(std::vector<float> b, ckpt.ExpertBias(hf_layer, expert, src.which));
      sections.push_back({"b" + src.name.substr(1), DType::kF32, 0, b.size() * 4, 1, static_cast<int64_t>(b.size())});
      biases.push_back(std::move(b));
    }
  }
  const common::WeightFileLayout layout = common::PlanWeightFile(common::FileKind::kExpert, layer, expert, sections);
  const std::string rel = common::ExpertFilePath(layer, expert);
  COLIBRI_ASSIGN_OR_RETURN(auto w, HashingWriter::Create(out_dir + "/" + rel));
  COLIBRI_RETURN_IF_ERROR(w->Write(common::SerializeHeader(layout).data(), common::kWeightFileHeaderBytes));

  for (const Source& src : sources) {
    COLIBRI_ASSIGN_OR_RETURN(const ExpertSource tensor, ckpt.Expert(hf_layer, expert, src.which));
    const common::MatrixLayout l = common::ComputeMatrixLayout(type, src.rows, src.cols);
    std::vector<float> scales(l.scale_bytes / sizeof(float));
    std::vector<uint8_t> zeros(l.zero_bytes);
    // Whole 64-row blocks at a time, about kChunkBytes of f32 source.
    const int64_t chunk_blocks = std::max<int64_t>(1, kChunkBytes / (src.cols * sizeof(float) * common::kBlockRows));
    const int64_t chunk_rows = chunk_blocks * common::kBlockRows;
    std::vector<float> rows(chunk_rows * src.cols), decoded(src.cols);
    std::vector<uint8_t> encoded(chunk_blocks * l.block_bytes);
    COLIBRI_RETURN_IF_ERROR(w->PadTo(layout.Find(src.name)->offset));
    for (int64_t first = 0; first < l.padded_rows; first += chunk_rows) {
      const int64_t n = std::max<int64_t>(0, std::min(chunk_rows, src.rows - first));  // real rows
      const int64_t blocks = std::min(chunk_blocks, l.num_blocks() - first / common::kBlockRows);
      tensor.Rows(first, n, rows.data());
      for (int64_t b = 0; b < blocks; ++b) {
        common::EncodeBlock(l, rows.data() + b * common::kBlockRows * src.cols, first / common::kBlockRows + b,
                            encoded.data() + b * l.block_bytes, scales.data(), zeros.data());
      }
      // Measure what the encoding lost: decode the chunk through a view whose
      // row 0 is the chunk's first row (layouts repeat every 64 rows).
      const common::MatrixView view{l, encoded.data(), scales.empty() ? nullptr : scales.data() + first * l.groups,
                                    zeros.empty() ? nullptr : zeros.data() + first * l.groups};
      for (int64_t r = 0; r < n; ++r) {
        common::DecodeRow(view, r, decoded.data());
        for (int64_t c = 0; c < src.cols; ++c) {
          const double orig = rows[r * src.cols + c];
          if (!std::isfinite(orig)) {
            return absl::InvalidArgumentError(
                absl::StrCat("tensor '", tensor.name(), "' has a non-finite value at ", tensor.Where(first + r, c)));
          }
          if (!std::isfinite(decoded[c])) {  // beyond f16's range, or an int4 group's scale overflowed
            return absl::InvalidArgumentError(
                absl::StrCat("tensor '", tensor.name(), "' holds ", orig, " at ", tensor.Where(first + r, c),
                             ", which does not fit weight type ", common::DTypeName(type)));
          }
          report->max_weight_error = std::max(report->max_weight_error, std::fabs(orig - decoded[c]));
          report->max_abs_weight = std::max(report->max_abs_weight, std::fabs(orig));
        }
      }
      COLIBRI_RETURN_IF_ERROR(w->Write(encoded.data(), blocks * l.block_bytes));
    }
    if (!scales.empty()) {
      COLIBRI_RETURN_IF_ERROR(w->PadTo(layout.Find(src.name + ".scales")->offset));
      COLIBRI_RETURN_IF_ERROR(w->Write(scales.data(), l.scale_bytes));
    }
    if (!zeros.empty()) {
      COLIBRI_RETURN_IF_ERROR(w->PadTo(layout.Find(src.name + ".zeros")->offset));
      COLIBRI_RETURN_IF_ERROR(w->Write(zeros.data(), l.zero_bytes));
    }
  }
  for (size_t i = 0; i < biases.size(); ++i) {
    COLIBRI_RETURN_IF_ERROR(w->PadTo(layout.Find("b" + sources[i].name.substr(1))->offset));
    COLIBRI_RETURN_IF_ERROR(w->Write(biases[i].data(), biases[i].size() * 4));
  }
  COLIBRI_RETURN_IF_ERROR(w->PadTo(layout.file_size));
  return w->Close(rel);
}

struct Calibration {
  std::unique_ptr<common::SafetensorsFile> file;
  std::vector<int32_t> tokens;
};

absl::StatusOr<Calibration> OpenCalibration(const std::string& path) {
  Calibration c;
  COLIBRI_ASSIGN_OR_RETURN(c.file, common::SafetensorsFile::Open(path));
  const common::SafetensorsTensor* t = c.file->Find("token_ids");
  if (t == nullptr || t->shape.size() != 1 || (t->dtype != "I32" && t->dtype != "I64")) {
    return absl::InvalidArgumentError(
        absl::StrCat("calibration file ", path, ": needs a 1-D I32 or I64 tensor 'token_ids'"));
  }
  for (int64_t i = 0; i < t->shape[0]; ++i) {
    int64_t v = 0;
    if (t->dtype == "I32") {
      int32_t v32;
      std::memcpy(&v32, t->data + 4 * i, 4);
      v = v32;
    } else {
      std::memcpy(&v, t->data + 8 * i, 8);
    }
    if (v < INT32_MIN || v > INT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("calibration file ", path, ": token_ids[", i, "] = ", v, " does not fit 32 bits"));
    }
    c.tokens.push_back(static_cast<int32_t>(v));
  }
  return c;
}

// Removes what an earlier conversion left: the manifest first, then layer dirs.
const char* NamingName(Naming n) {
  switch (n) {
    case Naming::kMixtral: return "Mixtral";
    case Naming::kQwenMoe: return "mlp.experts";
    case Naming::kGptOss: return "gpt-oss fused experts";
    case Naming::kLlama4: return "Llama 4 fused experts";
  }
  return "?";
}

void PrintLayer(const LayerReport& r, DType type, std::ostream& log) {
  const LutResult& lut = r.lut;
  log << absl::StrFormat("layer %d (checkpoint layer %d): LUT from %s", r.layer, r.hf_layer, r.lut_source);
  if (lut.calibrated_tokens > 0) log << absl::StrFormat(" (%d token ids calibrated)", lut.calibrated_tokens);
  log << "\n  expert load before balancing: " << absl::StrJoin(lut.load_before, " ")
      << "\n  expert load after balancing:  " << absl::StrJoin(lut.load_after, " ")
      << absl::StrFormat("\n  LUT vs exact gate routing: %.2f%% of %d inputs agree before balancing, %.2f%% after\n",
                         100.0 * lut.agree_before / std::max<int64_t>(1, lut.compared), lut.compared,
                         100.0 * lut.agree_after / std::max<int64_t>(1, lut.compared));
  log << absl::StrFormat("  %s weights: max |error| %.3g (max |w| %.3g, relative %.3g)\n", common::DTypeName(type),
                         r.max_weight_error, r.max_abs_weight,
                         r.max_abs_weight > 0 ? r.max_weight_error / r.max_abs_weight : 0.0);
}

}  // namespace

absl::Status ConvertCheckpoint(const ConvertOptions& o, std::ostream& log, ConvertReport* report) {
  if (!common::IsWeightType(o.weight_type)) {
    return absl::InvalidArgumentError(absl::StrCat("unsupported weight type ", common::DTypeName(o.weight_type)));
  }
  COLIBRI_ASSIGN_OR_RETURN(auto ckpt, HfCheckpoint::Open(o.checkpoint_dir));
  const HfModelShape& s = ckpt->shape();
  Calibration calibration;
  if (!o.calibration_path.empty()) {
    COLIBRI_ASSIGN_OR_RETURN(calibration, OpenCalibration(o.calibration_path));
  }
  COLIBRI_ASSIGN_OR_RETURN(const common::SafetensorsTensor* embedding,
                           ckpt->Matrix(ckpt->EmbeddingName(), s.vocab_size, s.d_model));
  COLIBRI_ASSIGN_OR_RETURN(const std::unique_ptr<OutputDir> output, OutputDir::Begin(o.out_dir, o.overwrite));
  log << absl::StrFormat(
      "converting %s (%s naming, model_type %s): %d MoE layers x %d experts, d_model %d, "
      "d_ff %d, top-%d%s%s, vocab %d -> %s weights\n",
      o.checkpoint_dir, NamingName(s.naming), s.model_type, s.moe_layers.size(), s.n_experts, s.d_model, s.d_ff,
      s.top_k, s.norm_topk_prob ? " renormalized" : "",
      s.n_shared_experts > 0 ? absl::StrFormat(", a shared expert of d_ff %d%s (expert %d)", s.shared_d_ff,
                                               s.shared_gate ? " with a sigmoid gate" : "", s.n_experts)
                             : "",
      s.vocab_size, common::DTypeName(o.weight_type));

  common::Manifest m;
  m.architecture = s.model_type;
  m.d_model = s.d_model;
  m.d_ff = s.d_ff;
  m.n_layers = static_cast<int64_t>(s.moe_layers.size());
  m.n_experts = s.n_experts;
  m.n_shared_experts = s.n_shared_experts;
  m.shared_d_ff = s.shared_d_ff;
  m.shared_gate = s.shared_gate;
  m.activation = s.activation;
  m.expert_biases = s.expert_biases;
  m.top_k = s.top_k;
  m.norm_topk_prob = s.norm_topk_prob;
  m.routing = s.routing;
  m.vocab_size = s.vocab_size;
  m.weight_type = o.weight_type;
  m.hf_layers = s.moe_layers;
  m.lut_source = "embedding";  // "calibration" once a layer's LUT comes from it
  m.balance_loss_weight = o.balance_loss_weight;
  ConvertReport local;
  ConvertReport& rep = report != nullptr ? *report : local;
  const auto start = std::chrono::steady_clock::now();

  for (int64_t layer = 0; layer < m.n_layers; ++layer) {
    const int64_t hf = s.moe_layers[layer];
    const std::string dir = (fs::path(output->path()) / common::GateFilePath(layer)).parent_path();
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
    LayerReport lr;
    lr.layer = layer;
    lr.hf_layer = hf;

    COLIBRI_ASSIGN_OR_RETURN(const common::SafetensorsTensor* gate_tensor,
                             ckpt->Matrix(ckpt->GateName(hf), s.n_experts, s.d_model));
    std::vector<float> gate(s.n_experts * s.d_model);
    HfCheckpoint::RowsToFloat(*gate_tensor, 0, s.n_experts, gate.data(), ckpt->ScaleOf(*gate_tensor));
    for (float g : gate) {
      if (!std::isfinite(g))
        return absl::InvalidArgumentError(absl::StrCat("tensor '", gate_tensor->name, "' has a non-finite value"));
    }
    std::vector<PlainSection> gate_sections = {
        {"gate", DType::kF32, s.n_experts, s.d_model, gate.data(), gate.size() * 4}};
    std::vector<float> bias;
    if (s.routing.has_bias()) {
      COLIBRI_ASSIGN_OR_RETURN(bias, ckpt->Vector(ckpt->BiasName(hf), s.n_experts));
      gate_sections.push_back({"bias", DType::kF32, 1, s.n_experts, bias.data(), bias.size() * 4});
    }
    std::vector<float> shared_gate(s.shared_gate ? s.n_shared_experts * s.d_model : 0);
    if (s.shared_gate) {
      COLIBRI_ASSIGN_OR_RETURN(const common::SafetensorsTensor* tensor,
                               ckpt->Matrix(ckpt->SharedGateName(hf), s.n_shared_experts, s.d_model));
      HfCheckpoint::RowsToFloat(*tensor, 0, s.n_shared_experts, shared_gate.data(), ckpt->ScaleOf(*tensor));
      for (float g : shared_gate) {
        if (!std::isfinite(g)) {
          return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor->name, "' has a non-finite value"));
        }
      }
      gate_sections.push_back(
          {"shared_gate", DType::kF32, s.n_shared_experts, s.d_model, shared_gate.data(), shared_gate.size() * 4});
    }
    COLIBRI_ASSIGN_OR_RETURN(auto gate_file, WritePlainFile(output->path(), common::GateFilePath(layer),
                                                            common::FileKind::kGate, layer, gate_sections));
    m.files.push_back(gate_file);

    LutInputs in;
    in.gate = gate.data();
    in.n_experts = s.n_experts;
    in.d_model = s.d_model;
    in.top_k = s.top_k;
    in.normalize = s.norm_topk_prob;
    in.spec = s.routing;
    in.bias = bias.empty() ? nullptr : bias.data();
    in.vocab_size = s.vocab_size;
    in.embedding_rows = [&](int64_t first, int64_t n, float* out) {
      HfCheckpoint::RowsToFloat(*embedding, first, n, out, ckpt->ScaleOf(*embedding));
      ckpt->ReleaseRows(*embedding, first, n);
    };
    in.balance_loss_weight = o.balance_loss_weight;
    std::vector<float> hidden;
    lr.lut_source = "embedding";
    if (calibration.file) {
      const std::string name = absl::StrCat("hidden_states.", layer);
      const common::SafetensorsTensor* h = calibration.file->Find(name);
      const int64_t records = static_cast<int64_t>(calibration.tokens.size());
      if (h == nullptr) {
        log << "  calibration file has no '" << name << "': layer " << layer << " uses the embedding\n";
      } else if (h->shape != std::vector<int64_t>{records, s.d_model} ||
                 (h->dtype != "F32" && h->dtype != "BF16" && h->dtype != "F16")) {
        return absl::InvalidArgumentError(absl::StrCat("calibration file ", o.calibration_path, ": '", name,
                                                       "' must be F32/BF16/F16 [", records, ", ", s.d_model, "]"));
      } else {
        hidden.resize(records * s.d_model);
        HfCheckpoint::RowsToFloat(*h, 0, records, hidden.data());
        in.calibration_tokens = calibration.tokens;
        in.calibration_hidden = hidden.data();
        lr.lut_source = "calibration";
        m.lut_source = "calibration";
      }
    }
    COLIBRI_ASSIGN_OR_RETURN(lr.lut, BuildLut(in));
    COLIBRI_ASSIGN_OR_RETURN(
        auto lut_file,
        WritePlainFile(
            output->path(), common::LutFilePath(layer), common::FileKind::kLut, layer,
            {{"ids", DType::kI32, s.vocab_size, s.top_k, lr.lut.ids.data(), lr.lut.ids.size() * 4},
             {"weights", DType::kF32, s.vocab_size, s.top_k, lr.lut.weights.data(), lr.lut.weights.size() * 4}}));
    m.files.push_back(lut_file);
    lr.lut.ids.clear();
    lr.lut.weights.clear();

    for (int64_t e = 0; e < s.n_experts + s.n_shared_experts; ++e) {  // the shared expert last
      COLIBRI_ASSIGN_OR_RETURN(auto file, WriteExpertFile(*ckpt, output->path(), hf, layer, e, o.weight_type, &lr));
      m.files.push_back(file);
      rep.bytes += file.size;
      if (o.progress) {
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        log << absl::StrFormat("  layer %d/%d expert %d/%d: %s (%.1f MiB, %.0f MiB/s so far)\n", layer + 1, m.n_layers,
                               e + 1, s.n_experts + s.n_shared_experts, file.path, file.size / 1048576.0,
                               rep.bytes / 1048576.0 / std::max(secs, 1e-9));
      }
    }
    PrintLayer(lr, o.weight_type, log);
    rep.layers.push_back(std::move(lr));
  }
  COLIBRI_RETURN_IF_ERROR(output->Commit(m));
  rep.files = static_cast<int64_t>(m.files.size()) + 1;
  log << absl::StrFormat("wrote %d files (%.1f MiB of weights) to %s in %.2f s\n", rep.files, rep.bytes / 1048576.0,
                         o.out_dir, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return absl::OkStatus();
}

}  // namespace tools
}  // namespace colibri
