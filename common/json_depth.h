#ifndef COLIBRI_COMMON_JSON_DEPTH_H_
#define COLIBRI_COMMON_JSON_DEPTH_H_

// A bound to check before parsing JSON someone else wrote: nlohmann's parser
// builds the whole document, ~80 bytes per nested bracket, so a file of a
// few MB of "[" exhausts memory before it fails. Every JSON format Colibri
// reads (manifests, safetensors headers, Hugging Face config and index
// files) nests a few levels.

#include "absl/strings/string_view.h"

namespace colibri {
namespace common {

// What the formats Colibri reads may nest, with room to spare.
inline constexpr int kMaxJsonDepth = 16;

// The deepest nesting of [ and { outside strings (0 for a scalar). Linear,
// allocates nothing; malformed JSON gets a number too (the parser refuses it).
int JsonDepth(absl::string_view json);

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_JSON_DEPTH_H_
