#include "common/weight_matrix.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace colibri {
namespace common {
namespace {

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

template <typename T>
void Store(uint8_t* base, size_t index, T value) {
  std::memcpy(base + index * sizeof(T), &value, sizeof(T));
}

template <typename T>
T Load(const uint8_t* base, size_t index) {
  T value;
  std::memcpy(&value, base + index * sizeof(T), sizeof(T));
  return value;
}

// Element index of w(n, k) inside the data of a blocked float matrix.
size_t BlockedIndex(const MatrixLayout& l, int64_t n, int64_t k) {
  const int64_t block = n / kBlockRows, j = n % kBlockRows;
  if (l.dtype == DType::kBF16) {
    return ((block * (l.padded_cols / 2) + k / 2) * kBlockRows + j) * 2 + k % 2;
  }
  return (block * l.padded_cols + k) * kBlockRows + j;
}

void EncodeInt8Row(const float* w, int64_t cols, int64_t padded_cols, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(w[c]));
  const float s = amax / 127.f;
  *scale = s;
  for (int64_t c = 0; c < padded_cols; ++c) {
    const long v = (c < cols && s > 0.f) ? std::lrint(w[c] / s) : 0;
    q[c] = static_cast<int8_t>(std::clamp(v, -127L, 127L));
  }
}

// Byte of nibble `c` in an int4 row, and whether it is the high nibble.
size_t Int4Byte(int64_t c) { return (c / kInt4GroupSize) * 32 + (c % 32); }
bool Int4High(int64_t c) { return (c % kInt4GroupSize) >= 32; }

void EncodeInt4Row(const float* w, int64_t cols, int64_t groups, uint8_t* packed, float* scales, uint8_t* zeros) {
  std::memset(packed, 0, groups * 32);
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
      packed[Int4Byte(c)] |= static_cast<uint8_t>(Int4High(c) ? q << 4 : q);
    }
  }
}

}  // namespace

MatrixLayout ComputeMatrixLayout(DType dtype, int64_t rows, int64_t cols) {
  MatrixLayout l;
  l.dtype = dtype;
  l.rows = rows;
  l.cols = cols;
  l.padded_rows = RoundUp(rows, kBlockRows);
  l.padded_cols = RoundUp(cols, kColPadding);
  size_t row_bytes = 0;
  switch (dtype) {
    case DType::kF32: row_bytes = l.padded_cols * 4; break;
    case DType::kBF16:
    case DType::kF16: row_bytes = l.padded_cols * 2; break;
    case DType::kInt8:
      row_bytes = l.padded_cols;
      l.groups = 1;
      l.scale_bytes = l.padded_rows * sizeof(float);
      break;
    case DType::kInt4:
      row_bytes = l.padded_cols / 2;
      l.groups = l.padded_cols / kInt4GroupSize;
      l.scale_bytes = l.padded_rows * l.groups * sizeof(float);
      l.zero_bytes = l.padded_rows * l.groups;
      break;
    default: break;  // REQUIRES violated: leaves a zero-sized layout
  }
  l.block_bytes = row_bytes * kBlockRows;
  l.data_bytes = l.num_blocks() * l.block_bytes;
  return l;
}

void EncodeBlock(const MatrixLayout& l, const float* src, int64_t block, uint8_t* block_data, float* scales,
                 uint8_t* zeros) {
  const int64_t first = block * kBlockRows;
  const int64_t real_rows = std::max<int64_t>(0, std::min(kBlockRows, l.rows - first));
  const size_t elements_per_block = l.block_bytes / (l.dtype == DType::kF32 ? 4 : 2);
  std::memset(block_data, 0, l.block_bytes);
  const size_t row_bytes = l.block_bytes / kBlockRows;
  for (int64_t j = 0; j < kBlockRows; ++j) {
    const int64_t n = first + j;
    const float* w = j < real_rows ? src + j * l.cols : nullptr;  // null: a padding row
    switch (l.dtype) {
      case DType::kF32:
      case DType::kBF16:
      case DType::kF16:
        if (w == nullptr) break;
        for (int64_t k = 0; k < l.cols; ++k) {
          const size_t i = BlockedIndex(l, n, k) - block * elements_per_block;
          if (l.dtype == DType::kF32) Store<float>(block_data, i, w[k]);
          if (l.dtype == DType::kBF16) Store<uint16_t>(block_data, i, FloatToBf16(w[k]));
          if (l.dtype == DType::kF16) Store<uint16_t>(block_data, i, FloatToF16(w[k]));
        }
        break;
      case DType::kInt8: {
        int8_t* q = reinterpret_cast<int8_t*>(block_data + j * row_bytes);
        if (w == nullptr) {
          scales[n] = 0.f;
        } else {
          EncodeInt8Row(w, l.cols, l.padded_cols, q, &scales[n]);
        }
        break;
      }
      case DType::kInt4:
        if (w == nullptr) {
          std::fill(scales + n * l.groups, scales + (n + 1) * l.groups, 0.f);
          std::fill(zeros + n * l.groups, zeros + (n + 1) * l.groups, 0);
        } else {
          EncodeInt4Row(w, l.cols, l.groups, block_data + j * row_bytes, scales + n * l.groups, zeros + n * l.groups);
        }
        break;
      default: break;
    }
  }
}

void DecodeRow(const MatrixView& v, int64_t n, float* out) {
  const MatrixLayout& l = v.layout;
  const size_t row_bytes = l.block_bytes / kBlockRows;
  for (int64_t k = 0; k < l.cols; ++k) {
    switch (l.dtype) {
      case DType::kF32: out[k] = Load<float>(v.data, BlockedIndex(l, n, k)); break;
      case DType::kBF16: out[k] = Bf16ToFloat(Load<uint16_t>(v.data, BlockedIndex(l, n, k))); break;
      case DType::kF16: out[k] = F16ToFloat(Load<uint16_t>(v.data, BlockedIndex(l, n, k))); break;
      case DType::kInt8:
        out[k] = v.scales[n] * static_cast<float>(static_cast<int8_t>(v.data[n * row_bytes + k]));
        break;
      case DType::kInt4: {
        const uint8_t byte = v.data[n * row_bytes + Int4Byte(k)];
        const int q = Int4High(k) ? byte >> 4 : byte & 0x0f;
        const int64_t g = n * l.groups + k / kInt4GroupSize;
        out[k] = v.scales[g] * static_cast<float>(q - static_cast<int>(v.zeros[g]));
        break;
      }
      default: out[k] = 0.f;
    }
  }
}

float MaxEncodingError(const MatrixView& v, int64_t r, float row_abs_max) {
  switch (v.layout.dtype) {
    case DType::kF32: return 0.f;
    case DType::kBF16: return row_abs_max * 0x1p-8f;
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
