#ifndef COLIBRI_KERNELS_ONEDNN_MATMUL_H_
#define COLIBRI_KERNELS_ONEDNN_MATMUL_H_

// oneDNN 2.6 matmul over weights in their stored blocked layout: bf16 weights
// are oneDNN's BA16a64b2a and f32 weights BA16a64b (common/weight_matrix.h),
// so a slice of whole 64-row blocks is used in place, with no reorder.
// Primitives are created once per (type, T, K, n, ldd) and cached; each
// calling thread has its own stream and scratchpad (user scratchpad mode), so
// any number of pool workers may call OnednnMatmul concurrently. oneDNN parallelizes
// within the calling thread's OpenMP team, which the thread pool limits to
// that thread (kernels/thread_pool.h).

#include <cstdint>

#include "common/dtype.h"

namespace colibri {
namespace kernels {

// dst[t][0..n) (row stride ldd) = src[t][0..K) · B for t < T, where B (K x n)
// is `weights`: n/64 consecutive 64-row blocks of a stored bf16 or f32
// matrix with padded_cols K. src is bf16 [T][K] for bf16 weights, f32 [T][K]
// for f32 weights. REQUIRES: type is kBF16 or kF32, n % 64 == 0, K % 64 == 0.
// Aborts, with a message, only if oneDNN cannot create a matmul for a shape
// (a broken install: every shape the executor passes is a valid blocked
// matmul); never on data. Each new (type, T, K, n, ldd) creates a primitive (milliseconds)
// and caches it for the life of the process: fine for the opt-in use the
// executor makes of it (docs/KERNELS.md), not for unbounded T variety.
void OnednnMatmul(common::DType type, int64_t num_tokens, int64_t cols, int64_t n, const void* src, const void* weights,
                  float* dst, int64_t ldd);

// Whether oneDNN has an optimized matmul for `type` (kBF16 or kF32) on this
// CPU, not only its reference loops: its bf16 matmul needs AVX-512 (with
// bf16 for more than the reference), which a CPU, a VM or ONEDNN_MAX_CPU_ISA
// may not give. Asked once per type (a primitive descriptor of a small shape), then
// cached. Where false, OnednnMatmul must not be called for that type.
bool OnednnMatmulAvailable(common::DType type);

}  // namespace kernels
}  // namespace colibri

#endif  // COLIBRI_KERNELS_ONEDNN_MATMUL_H_
