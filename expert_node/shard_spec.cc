#include "expert_node/shard_spec.h"

#include <algorithm>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace colibri {
namespace expert_node {
namespace {

constexpr int64_t kMaxIndex = 1 << 20;
// A plan's spec for DeepSeek-V3 (58 layers, 32 listed experts each) is ~8 KB.
constexpr size_t kMaxSpecBytes = 256 << 10;

absl::Status Bad(absl::string_view spec, absl::string_view part, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("bad shard spec '", spec, "': '", part, "' ", why));
}

}  // namespace

absl::StatusOr<ShardSpec> ShardSpec::Parse(absl::string_view text) {
  ShardSpec spec;
  spec.text_ = std::string(absl::StripAsciiWhitespace(text));
  if (spec.text_.empty() || spec.text_ == "all") return spec;
  if (spec.text_.size() > kMaxSpecBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard spec of ", spec.text_.size(), " bytes: more than the ", kMaxSpecBytes, " one may have"));
  }
  auto parse_ranges = [&](absl::string_view list, std::vector<Range>* out) -> absl::Status {
    for (absl::string_view item : absl::StrSplit(list, ',')) {
      item = absl::StripAsciiWhitespace(item);
      std::pair<absl::string_view, absl::string_view> bounds = absl::StrSplit(item, absl::MaxSplits('-', 1));
      int64_t first = 0, last = 0;
      if (!absl::SimpleAtoi(bounds.first, &first) || first < 0 || first > kMaxIndex) {
        return Bad(spec.text_, item, "is not an index or an inclusive range like 0-3");
      }
      last = first;
      if (!bounds.second.empty() || absl::EndsWith(item, "-")) {
        if (!absl::SimpleAtoi(bounds.second, &last) || last < first || last > kMaxIndex) {
          return Bad(spec.text_, item, "is not an inclusive range like 0-3");
        }
      }
      out->push_back({first, last});
    }
    return absl::OkStatus();
  };
  for (absl::string_view clause_text : absl::StrSplit(spec.text_, ';')) {
    Clause clause;
    for (absl::string_view part : absl::StrSplit(clause_text, '/')) {
      part = absl::StripAsciiWhitespace(part);
      if (absl::ConsumePrefix(&part, "layer:")) {
        if (auto s = parse_ranges(part, &clause.layers); !s.ok()) return s;
      } else if (absl::ConsumePrefix(&part, "expert:")) {
        if (auto s = parse_ranges(part, &clause.experts); !s.ok()) return s;
      } else if (auto s = parse_ranges(part, &clause.experts); !s.ok()) {
        return s;
      }
    }
    spec.clauses_.push_back(std::move(clause));
  }
  return spec;
}

absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> ShardSpec::Resolve(int64_t n_layers, int64_t n_experts) const {
  std::vector<char> selected(n_layers * n_experts, 0);  // [layer][expert]
  const std::vector<Clause> all = {Clause{}};
  for (const Clause& c : clauses_.empty() ? all : clauses_) {
    const std::vector<Range> layers = c.layers.empty() ? std::vector<Range>{{0, n_layers - 1}} : c.layers;
    const std::vector<Range> experts = c.experts.empty() ? std::vector<Range>{{0, n_experts - 1}} : c.experts;
    for (const Range& l : layers) {
      if (l.last >= n_layers) {
        return absl::InvalidArgumentError(absl::StrCat("shard spec '", text_, "' names layer ", l.last,
                                                       " but the model has ", n_layers, " MoE layers"));
      }
      for (const Range& e : experts) {
        if (e.last >= n_experts) {
          return absl::InvalidArgumentError(absl::StrCat("shard spec '", text_, "' names expert ", e.last,
                                                         " but the model has ", n_experts, " experts per layer"));
        }
        for (int64_t layer = l.first; layer <= l.last; ++layer) {
          std::fill_n(selected.begin() + layer * n_experts + e.first, e.last - e.first + 1, 1);
        }
      }
    }
  }
  std::vector<std::pair<int64_t, int64_t>> pairs;
  for (int64_t i = 0; i < n_layers * n_experts; ++i) {
    if (selected[i]) pairs.push_back({i / n_experts, i % n_experts});
  }
  if (pairs.empty()) return absl::InvalidArgumentError(absl::StrCat("shard spec '", text_, "' selects nothing"));
  return pairs;
}

}  // namespace expert_node
}  // namespace colibri
