// Fuzz target: the safetensors header parser (8-byte length, JSON header,
// dtypes, shapes, offsets) on arbitrary bytes taken as a whole file.
#include <cstddef>
#include <cstdint>

#include "common/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto tensors = colibri::common::ParseSafetensorsHeader(data, size, size, "fuzz.safetensors");
  if (tensors.ok()) {
    for (const auto& t : *tensors) (void)colibri::common::SafetensorsElementSize(t.dtype);
  }
  return 0;
}
