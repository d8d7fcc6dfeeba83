#include "common/weight_matrix.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace colibri {
namespace common {
namespace {

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

void EncodeInt8Row(const float* w, int64_t cols, int64_t padded_cols, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(w[c]));
  const float s = amax / 127.f;
  *scale = s;
  for (int64_t c = 0; c < padded_cols; ++c) {
    long v = (c < cols && s > 0.f) ? std::lrint(w[c] / s) : 0;
    q[c] = static_cast<int8_t>(std::clamp(v, -127L, 127L));
  }
}

void EncodeInt4Row(const float* w, int64_t cols, int64_t groups, uint8_t* packed, float* scales,
                   uint8_t* zeros) {
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t begin = g * kInt4GroupSize;
    const int64_t end = std::min(cols, begin + kInt4GroupSize);
    float lo = 0.f, hi = 0.f;  // the range always includes 0
    for (int64_t c = begin; c < end; ++c) {
      lo = std::min(lo, w[c]);
      hi = std::max(hi, w[c]);
    }
    const float s = (hi - lo) / 15.f;
    const long z = s > 0.f ? std::clamp(std::lrint(-lo / s), 0L, 15L) : 0L;
    scales[g] = s;
    zeros[g] = static_cast<uint8_t>(z);
    for (int64_t c = begin; c < begin + kInt4GroupSize; ++c) {
      long q = z;
      if (c < end && s > 0.f) q = std::clamp(std::lrint(w[c] / s) + z, 0L, 15L);
      uint8_t& byte = packed[c / 2];
      if (c % 2 == 0) {
        byte = static_cast<uint8_t>(q);
      } else {
        byte = static_cast<uint8_t>(byte | (q << 4));
      }
    }
  }
}

}  // namespace

MatrixLayout ComputeMatrixLayout(DType dtype, int64_t rows, int64_t cols) {
  MatrixLayout l;
  l.dtype = dtype;
  l.rows = rows;
  l.cols = cols;
  l.padded_cols = RoundUp(cols, kRowPadding);
  switch (dtype) {
    case DType::kF32: l.row_bytes = l.padded_cols * 4; break;
    case DType::kBF16:
    case DType::kF16: l.row_bytes = l.padded_cols * 2; break;
    case DType::kInt8:
      l.row_bytes = l.padded_cols;
      l.groups = 1;
      l.scale_bytes = rows * sizeof(float);
      break;
    case DType::kInt4:
      l.row_bytes = l.padded_cols / 2;
      l.groups = l.padded_cols / kInt4GroupSize;
      l.scale_bytes = rows * l.groups * sizeof(float);
      l.zero_bytes = rows * l.groups;
      break;
    default: break;  // REQUIRES violated: leaves a zero-sized layout
  }
  l.data_bytes = rows * l.row_bytes;
  return l;
}

void EncodeRows(const MatrixLayout& l, const float* src, int64_t first_row, int64_t n,
                uint8_t* data, float* scales, uint8_t* zeros) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = first_row + i;
    const float* w = src + i * l.cols;
    uint8_t* row = data + r * l.row_bytes;
    std::memset(row, 0, l.row_bytes);
    switch (l.dtype) {
      case DType::kF32: std::memcpy(row, w, l.cols * sizeof(float)); break;
      case DType::kBF16:
        for (int64_t c = 0; c < l.cols; ++c) {
          const uint16_t h = FloatToBf16(w[c]);
          std::memcpy(row + 2 * c, &h, 2);
        }
        break;
      case DType::kF16:
        for (int64_t c = 0; c < l.cols; ++c) {
          const uint16_t h = FloatToF16(w[c]);
          std::memcpy(row + 2 * c, &h, 2);
        }
        break;
      case DType::kInt8:
        EncodeInt8Row(w, l.cols, l.padded_cols, reinterpret_cast<int8_t*>(row), &scales[r]);
        break;
      case DType::kInt4:
        EncodeInt4Row(w, l.cols, l.groups, row, scales + r * l.groups, zeros + r * l.groups);
        break;
      default: break;
    }
  }
}

void DecodeRow(const MatrixView& v, int64_t r, float* out) {
  const MatrixLayout& l = v.layout;
  const uint8_t* row = v.data + r * l.row_bytes;
  for (int64_t c = 0; c < l.cols; ++c) {
    uint16_t h;
    switch (l.dtype) {
      case DType::kF32: std::memcpy(&out[c], row + 4 * c, 4); break;
      case DType::kBF16:
        std::memcpy(&h, row + 2 * c, 2);
        out[c] = Bf16ToFloat(h);
        break;
      case DType::kF16:
        std::memcpy(&h, row + 2 * c, 2);
        out[c] = F16ToFloat(h);
        break;
      case DType::kInt8:
        out[c] = v.scales[r] * static_cast<float>(static_cast<int8_t>(row[c]));
        break;
      case DType::kInt4: {
        const int64_t g = r * l.groups + c / kInt4GroupSize;
        const int q = (c % 2 == 0) ? (row[c / 2] & 0x0f) : (row[c / 2] >> 4);
        out[c] = v.scales[g] * static_cast<float>(q - static_cast<int>(v.zeros[g]));
        break;
      }
      default: out[c] = 0.f;
    }
  }
}

float MaxEncodingError(const MatrixView& v, int64_t r, float row_abs_max) {
  switch (v.layout.dtype) {
    case DType::kF32: return 0.f;
    case DType::kBF16: return row_abs_max * 0x1p-8f;  // half an ulp is 2^-9 relative; allow 2^-8
    case DType::kF16: return row_abs_max * 0x1p-10f + 0x1p-25f;
    case DType::kInt8: return v.scales[r] * 0.5f * (1.f + 1e-5f);
    case DType::kInt4: {
      float s = 0.f;
      for (int64_t g = 0; g < v.layout.groups; ++g) s = std::max(s, v.scales[r * v.layout.groups + g]);
      return s * 0.5f * (1.f + 1e-5f);
    }
    default: return 0.f;
  }
}

}  // namespace common
}  // namespace colibri
