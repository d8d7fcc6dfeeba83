#ifndef COLIBRI_RUNTIME_MESSAGE_LIMITS_H_
#define COLIBRI_RUNTIME_MESSAGE_LIMITS_H_

// What fits in one gRPC message: protobuf cannot serialize a message of
// 2 GiB or more, and gRPC aborts the process when asked to send one.

#include <cstdint>
#include <limits>

namespace colibri {
namespace runtime {

// The most f32 rows of `d_model` values one message may hold, each with
// `extra_bytes` more of per-row fields (e.g. a token's routes), leaving 1 MiB
// for the others. REQUIRES: d_model >= 1, extra_bytes >= 0.
inline int64_t MaxF32RowsPerMessage(int64_t d_model, int64_t extra_bytes = 0) {
  return (std::numeric_limits<int>::max() - (int64_t{1} << 20)) / (d_model * 4 + extra_bytes);
}

}  // namespace runtime
}  // namespace colibri

#endif  // COLIBRI_RUNTIME_MESSAGE_LIMITS_H_
