#include "expert_node/paged_weights.h"

#include <catch2/catch.hpp>

#include "tests/test_util.h"

namespace colibri {
namespace expert_node {
namespace {

using colibri::testing::TempDir;

std::unique_ptr<ExpertStore> PagedStore(const std::string& dir) {
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir + "/ckpt"), dir + "/model", common::DType::kBF16);
  StoreOptions options;
  options.residency = Residency::kPaged;
  auto store = ExpertStore::Create(dir + "/model", options, nullptr);
  REQUIRE(store.ok());
  return std::move(*store);
}

int64_t FileBytes(const WeightSet& set, int64_t layer, int64_t expert) {
  return static_cast<int64_t>((*set.Find(layer, expert))->file->size());
}

TEST_CASE("paged weights keep the most recently used experts within the budget and never evict pinned ones") {
  TempDir dir;
  auto store = PagedStore(dir.path());
  std::shared_ptr<const WeightSet> set = store->Current();
  const int64_t one = FileBytes(*set, 0, 0);  // every expert file of the model has the same size
  PagedWeights paged({/*memory_budget=*/2 * one, nullptr});

  {
    PagedWeights::Pin a = paged.Acquire(set, 0, {0, 1});
    paged.Drain();
    CHECK(paged.stats().kept_bytes == 2 * one);
    CHECK(paged.stats().prefetches == 2);
    // Pinned: a third expert goes over the budget, but nothing in use is evicted.
    PagedWeights::Pin b = paged.Acquire(set, 0, {2});
    paged.Drain();
    CHECK(paged.stats().evictions == 0);
    CHECK(paged.stats().kept_bytes == 3 * one);
  }
  // Released: the least recently used (expert 0, then 1) go first, down to the budget.
  paged.Drain();
  CHECK(paged.stats().evictions == 1);
  CHECK(paged.stats().kept_bytes == 2 * one);

  // Expert 1 is used again, so expert 2 is now the coldest.
  { PagedWeights::Pin again = paged.Acquire(set, 0, {1}); }
  { PagedWeights::Pin next = paged.Acquire(set, 1, {3}); }
  paged.Drain();
  CHECK(paged.stats().evictions == 2);
  CHECK(paged.stats().prefetches == 4);  // 0, 1, 2 and layer 1's 3; 1 was kept
  { PagedWeights::Pin kept = paged.Acquire(set, 0, {1}); }
  paged.Drain();
  CHECK(paged.stats().prefetches == 4);  // still kept: no new read

  // Experts the set does not own (or out of range) are skipped, not an error.
  PagedWeights::Pin none = paged.Acquire(set, 7, {0, 99});
  paged.Drain();
  CHECK(paged.stats().prefetches == 4);
}

TEST_CASE("paged weights do nothing for sets that are not paged, and start afresh for a reloaded set") {
  TempDir dir;
  auto store = PagedStore(dir.path());
  PagedWeights paged({/*memory_budget=*/0, nullptr});
  {
    PagedWeights::Pin pin = paged.Acquire(store->Current(), 0, {0, 1, 2, 3});
    paged.Drain();
    CHECK(paged.stats().kept_bytes == 4 * FileBytes(*store->Current(), 0, 0));
  }
  CHECK(paged.stats().evictions == 0);  // no budget: nothing is evicted

  REQUIRE(store->Reload("", std::nullopt).ok());
  PagedWeights::Pin fresh = paged.Acquire(store->Current(), 1, {2});
  paged.Drain();
  CHECK(paged.stats().kept_bytes == FileBytes(*store->Current(), 1, 2));

  TempDir other;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(other / "ckpt"), other / "model", common::DType::kBF16);
  auto locked = ExpertStore::Create(other / "model", StoreOptions{}, nullptr);
  REQUIRE(locked.ok());
  PagedWeights::Pin empty = paged.Acquire((*locked)->Current(), 0, {0});
  paged.Drain();
  CHECK(paged.stats().kept_bytes == FileBytes(*store->Current(), 1, 2));  // unchanged
}

}  // namespace
}  // namespace expert_node
}  // namespace colibri
