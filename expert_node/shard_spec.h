#ifndef COLIBRI_EXPERT_NODE_SHARD_SPEC_H_
#define COLIBRI_EXPERT_NODE_SHARD_SPEC_H_

// Which (layer, expert) pairs an expert node owns (colibri-expert --experts,
// StoreOptions::shard, the Reload call's `experts`).
//
//   all | (empty)              every expert of every layer
//   0-3  |  1,3,5-7            these experts, in every layer
//   layer:0-15/expert:0-3      these experts in these layers
//   CLAUSE;CLAUSE...           the union of clauses
//
// A clause's "layer:" or "expert:" part may be omitted (= all). Ranges are
// inclusive. Immutable value type; thread-safe.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace colibri {
namespace expert_node {

class ShardSpec {
 public:
  // INVALID_ARGUMENT naming the offending text for a malformed spec.
  static absl::StatusOr<ShardSpec> Parse(absl::string_view text);

  // The selected pairs of a model of n_layers x n_experts, sorted. Errors:
  // INVALID_ARGUMENT if the spec names a layer or expert the model lacks, or
  // selects nothing.
  absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> Resolve(int64_t n_layers, int64_t n_experts) const;

  const std::string& text() const { return text_; }

 private:
  struct Range {
    int64_t first, last;  // inclusive
  };
  struct Clause {
    std::vector<Range> layers;   // empty: all
    std::vector<Range> experts;  // empty: all
  };

  std::string text_;
  std::vector<Clause> clauses_;  // empty: all
};

}  // namespace expert_node
}  // namespace colibri

#endif  // COLIBRI_EXPERT_NODE_SHARD_SPEC_H_
