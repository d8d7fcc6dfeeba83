#include "expert_node/expert_store.h"

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "common/model_dir.h"
#include "kernels/block_kernel.h"
#include "kernels/dispatch.h"
#include "tests/test_util.h"

namespace colibri {
namespace expert_node {
namespace {

using colibri::testing::TempDir;
using common::DType;

using Pairs = std::vector<std::pair<int64_t, int64_t>>;

Pairs Resolve(const std::string& text, int64_t layers, int64_t experts) {
  auto spec = ShardSpec::Parse(text);
  INFO(text << ": " << spec.status().message());
  REQUIRE(spec.ok());
  auto pairs = spec->Resolve(layers, experts);
  INFO(pairs.status().message());
  REQUIRE(pairs.ok());
  return *pairs;
}

TEST_CASE("shard specs select experts per layer and refuse what the model lacks") {
  CHECK(Resolve("all", 2, 2) == Pairs{{0, 0}, {0, 1}, {1, 0}, {1, 1}});
  CHECK(Resolve("", 1, 2) == Pairs{{0, 0}, {0, 1}});
  CHECK(Resolve("1-2", 2, 4) == Pairs{{0, 1}, {0, 2}, {1, 1}, {1, 2}});
  CHECK(Resolve("0,3", 1, 4) == Pairs{{0, 0}, {0, 3}});
  CHECK(Resolve("layer:1/expert:0-1;layer:0/expert:3", 2, 4) == Pairs{{0, 3}, {1, 0}, {1, 1}});
  CHECK(Resolve("layer:1", 2, 2) == Pairs{{1, 0}, {1, 1}});
  for (const char* bad : {"x", "3-1", "1-", "-1", "layer:a/expert:1", "1,,2"}) {
    auto spec = ShardSpec::Parse(bad);
    INFO(bad);
    CHECK(spec.status().code() == absl::StatusCode::kInvalidArgument);
  }
  auto spec = ShardSpec::Parse("layer:0-5/expert:0");
  REQUIRE(spec.ok());
  auto out = spec->Resolve(2, 4);
  REQUIRE(out.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(out.status().message().find("layer 5") != absl::string_view::npos);
  auto experts = ShardSpec::Parse("9")->Resolve(2, 4);
  CHECK(experts.status().message().find("expert 9") != absl::string_view::npos);
  // A spec that would take hours to resolve (a Reload's field is the caller's) is refused by size.
  std::string huge;
  while (huge.size() <= (256 << 10)) huge += "layer:0-1;";
  auto refused = ShardSpec::Parse(huge);
  REQUIRE(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(refused.status().message().find("more than the 262144 one may have") != absl::string_view::npos);
}

TEST_CASE("the store loads its shard and refuses experts it does not own, naming them") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kBF16);
  StoreOptions options;
  options.shard = *ShardSpec::Parse("layer:1/expert:0-1");
  std::ostringstream log;
  auto store = ExpertStore::Create(dir / "model", options, &log);
  INFO(store.status().message());
  REQUIRE(store.ok());
  auto set = (*store)->Current();
  set->AwaitLock();
  CHECK(set->version() == 1);
  CHECK(set->owned() == Pairs{{1, 0}, {1, 1}});
  CHECK(set->Find(1, 1).ok());
  auto missing = set->Find(0, 1);
  REQUIRE(missing.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(missing.status().message().find("layer 0 expert 1") != absl::string_view::npos);
  CHECK(log.str().find("loaded 2 experts") != std::string::npos);
  if (set->locked()) CHECK(set->placement().find("locked in RAM") != std::string::npos);
}

// VmLck of this process, in kB, from /proc/self/status.
int64_t LockedKb() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmLck:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

TEST_CASE("locking the weights takes effect where permitted, and says so where not") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kF32);
  [[maybe_unused]] const int64_t before = LockedKb();  // unused under AddressSanitizer
  std::ostringstream log;
  auto store = ExpertStore::Create(dir / "model", StoreOptions{}, &log);
  REQUIRE(store.ok());
  (*store)->Current()->AwaitLock();  // locking runs in the background
  if ((*store)->Current()->locked()) {
#if defined(__SANITIZE_ADDRESS__)
    WARN("AddressSanitizer turns mlock into a no-op: VmLck is not checked in this build");
#else
    CHECK(LockedKb() > before);  // 8 experts of ~50 KiB each
#endif
    CHECK((*store)->Current()->placement().find("locked in RAM") != std::string::npos);
  } else {
    WARN("mlock is not permitted here: " << log.str());
    CHECK(log.str().find("RLIMIT_MEMLOCK") != std::string::npos);
    CHECK(log.str().find("IPC_LOCK") != std::string::npos);
  }
}

TEST_CASE("copied weights are the node's own: a weight file truncated in place changes nothing") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kBF16);
  StoreOptions options;
  options.residency = Residency::kCopy;  // a refused mlock still leaves the copy
  std::ostringstream log;
  auto store = ExpertStore::Create(dir / "model", options, &log);
  REQUIRE(store.ok());
  const common::ExpertWeights* w = *(*store)->Current()->Find(1, 3);
  CHECK(w->file == nullptr);
  std::vector<float> before(w->w2.layout.cols), after(w->w2.layout.cols);  // a row of W2 is d_ff wide
  common::DecodeRow(w->w2, 47, before.data());
  // Truncated in place: a mapping would SIGBUS on its next touch of the lost pages.
  std::filesystem::resize_file(dir / "model/layer_001/expert_003.bin", 0);
  common::DecodeRow(w->w2, 47, after.data());
  CHECK(after == before);
}

TEST_CASE("weights copied to huge-page memory decode exactly like the mapped file") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kInt4);
  StoreOptions mapped, copied;
  mapped.residency = Residency::kPaged;
  copied.hugepages = true;
  copied.residency = Residency::kPaged;
  auto a = ExpertStore::Create(dir / "model", mapped, nullptr);
  auto b = ExpertStore::Create(dir / "model", copied, nullptr);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK((*b)->Current()->placement().find("copied") != std::string::npos);
  CHECK_FALSE((*a)->Current()->locked());
  const common::ExpertWeights* x = *(*a)->Current()->Find(1, 3);
  const common::ExpertWeights* y = *(*b)->Current()->Find(1, 3);
  CHECK(y->file == nullptr);  // the mapping was released after the copy
  std::vector<float> rx(48), ry(48);
  for (int64_t r = 0; r < 80; ++r) {
    common::DecodeRow(x->w1, r, rx.data());
    common::DecodeRow(y->w1, r, ry.data());
    REQUIRE(rx == ry);
  }
}

TEST_CASE("int8 tile records are built at load where the kernels have int8 tiles, and refused with paged") {
  TempDir dir;
  colibri::testing::MakeModel(colibri::testing::SmallSynth(dir / "ckpt"), dir / "model", DType::kInt4);
  StoreOptions options;
  options.q8_records = true;
  options.residency = Residency::kPaged;
  auto paged = ExpertStore::Create(dir / "model", options, nullptr);
  REQUIRE_FALSE(paged.ok());
  CHECK(paged.status().message().find("StoreOptions::q8_records needs residency locked or copy") != std::string::npos);
  // Paged, but copied to huge pages: the records are built.
  options.hugepages = true;
  auto copied = ExpertStore::Create(dir / "model", options, nullptr);
  REQUIRE(copied.ok());
  CHECK((*copied)->Current()->q8_records() == (kernels::SelectedKernels().TileFor(DType::kInt4) != nullptr));
  options.hugepages = false;
  options.residency = Residency::kCopy;
  std::ostringstream log;
  auto store = ExpertStore::Create(dir / "model", options, &log);
  REQUIRE(store.ok());
  const common::ExpertWeights* w = *(*store)->Current()->Find(1, 3);
  if (kernels::SelectedKernels().TileFor(DType::kInt4) == nullptr) {
    CHECK(log.str().find("int8 tile records not built: the ") != std::string::npos);
    CHECK(log.str().find("kernels have no int8 tiles for int4") != std::string::npos);
    CHECK(w->w1.q8_records == nullptr);
    CHECK_FALSE((*store)->Current()->q8_records());
    WARN("no int8 tiles on this CPU's kernels: records not built, as the log says");
    return;
  }
  CHECK((*store)->Current()->placement().find("with int8 tile records") != std::string::npos);
  CHECK((*store)->Current()->q8_records());
  for (const common::MatrixView* v : {&w->w1, &w->w3, &w->w2}) {
    REQUIRE(v->q8_records != nullptr);
    std::vector<uint8_t> expected(kernels::Q8RecordsBytes(v->layout) + 64);
    uint8_t* aligned = expected.data() + (64 - reinterpret_cast<uintptr_t>(expected.data()) % 64) % 64;
    kernels::BuildQ8Records(*v, aligned);
    CHECK(std::equal(aligned, aligned + kernels::Q8RecordsBytes(v->layout), v->q8_records));
  }
}

TEST_CASE("reload swaps atomically, keeps in-flight sets alive, and a failed reload keeps the old weights") {
  TempDir dir;
  const tools::SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt");
  colibri::testing::MakeModel(synth, dir / "bf16", DType::kBF16);
  colibri::testing::MakeModel(synth, dir / "int8", DType::kInt8);
  StoreOptions options;
  options.residency = Residency::kPaged;
  auto store = ExpertStore::Create(dir / "bf16", options, nullptr);
  REQUIRE(store.ok());
  std::shared_ptr<const WeightSet> in_flight = (*store)->Current();  // a call that started before the reload

  REQUIRE((*store)->Reload(dir / "int8", std::nullopt).ok());
  auto now = (*store)->Current();
  CHECK(now->version() == 2);
  CHECK(now->model().manifest().weight_type == DType::kInt8);
  CHECK((*store)->model_dir() == dir / "int8");
  // The old set is still fully usable by the call that holds it.
  std::vector<float> row(48);
  common::DecodeRow((*in_flight->Find(0, 0))->w1, 5, row.data());
  CHECK(in_flight->model().manifest().weight_type == DType::kBF16);

  // A reload onto a damaged directory fails with the file and reason; version 2 keeps serving.
  colibri::testing::FlipByte(dir / "bf16/layer_001/expert_002.bin", 5000);
  const absl::Status failed = (*store)->Reload(dir / "bf16", std::nullopt);
  REQUIRE(failed.code() == absl::StatusCode::kDataLoss);
  CHECK(failed.message().find("layer_001/expert_002.bin") != absl::string_view::npos);
  CHECK((*store)->Current()->version() == 2);
  CHECK((*store)->model_dir() == dir / "int8");

  // A reload may change the shard; an impossible shard is refused.
  REQUIRE((*store)->Reload("", *ShardSpec::Parse("layer:0/expert:2")).ok());
  CHECK((*store)->Current()->owned() == Pairs{{0, 2}});
  CHECK((*store)->Current()->version() == 3);
  CHECK((*store)->Reload("", *ShardSpec::Parse("7")).code() == absl::StatusCode::kInvalidArgument);
  CHECK((*store)->Current()->version() == 3);
  CHECK((*store)->Reload(dir / "missing", std::nullopt).code() == absl::StatusCode::kNotFound);
}

TEST_CASE("a reload can keep the previous model served beside the new one, and either can be dropped") {
  TempDir dir;
  tools::SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt");
  colibri::testing::MakeModel(synth, dir / "v1", DType::kBF16);
  colibri::testing::MakeModel(synth, dir / "v2", DType::kInt8);
  StoreOptions options;
  options.residency = Residency::kPaged;
  auto created = ExpertStore::Create(dir / "v1", options, nullptr);
  REQUIRE(created.ok());
  ExpertStore& store = **created;
  const std::string v1 = store.Current()->model().model_id();

  REQUIRE(store.Reload(dir / "v2", std::nullopt, /*keep_previous=*/true).ok());
  const std::string v2 = store.Current()->model().model_id();
  REQUIRE(v1 != v2);
  CHECK(store.Previous()->model().model_id() == v1);
  CHECK(store.ForModel(v1)->model().model_id() == v1);
  CHECK(store.ForModel(v2)->model().model_id() == v2);
  CHECK(store.ForModel("")->model().model_id() == v2);
  CHECK(store.ForModel("xxh3_128:other") == nullptr);

  // Dropping the previous model releases it.
  REQUIRE(store.Drop(v1).ok());
  CHECK(store.Previous() == nullptr);
  CHECK(store.ForModel(v1) == nullptr);

  // Dropping the current model while a previous one is kept rolls back to it.
  REQUIRE(store.Reload(dir / "v1", std::nullopt, /*keep_previous=*/true).ok());
  CHECK(store.Current()->model().model_id() == v1);
  CHECK(store.Current()->version() == 3);
  REQUIRE(store.Drop(v1).ok());
  CHECK(store.Current()->model().model_id() == v2);
  CHECK(store.Current()->version() == 2);
  CHECK(store.model_dir() == dir / "v2");
  CHECK(store.Previous() == nullptr);

  const absl::Status only = store.Drop(v2);
  CHECK(only.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(only.message().find("only model") != absl::string_view::npos);
  CHECK(store.Drop("xxh3_128:other").code() == absl::StatusCode::kNotFound);

  // A reload without keep_previous releases a kept model too. Versions are
  // not reused after a roll-back: the dropped set was 3.
  REQUIRE(store.Reload(dir / "v1", std::nullopt, true).ok());
  CHECK(store.Current()->version() == 4);
  REQUIRE(store.Reload("", std::nullopt).ok());
  CHECK(store.Previous() == nullptr);

  // Another shape cannot be kept beside: refused, nothing changes.
  synth.d_model = 64;
  synth.out_dir = dir / "ckpt64";
  colibri::testing::MakeModel(synth, dir / "wide", DType::kBF16);
  const absl::Status wide = store.Reload(dir / "wide", std::nullopt, true);
  CHECK(wide.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(wide.message().find("shape") != absl::string_view::npos);
  CHECK(store.Current()->model().model_id() == v1);
  CHECK(store.Previous() == nullptr);
}

TEST_CASE("staging the model already current again keeps the previous one, and an abandoned reload installs nothing") {
  TempDir dir;
  tools::SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt");
  colibri::testing::MakeModel(synth, dir / "v1", DType::kBF16);
  colibri::testing::MakeModel(synth, dir / "v2", DType::kInt8);
  auto created = ExpertStore::Create(dir / "v1", StoreOptions{}, nullptr);
  REQUIRE(created.ok());
  ExpertStore& store = **created;
  const std::string v1 = store.Current()->model().model_id();
  REQUIRE(store.Reload(dir / "v2", std::nullopt, /*keep_previous=*/true).ok());
  const std::string v2 = store.Current()->model().model_id();

  // A stage repeated: v2 again, and v1 still served beside it (not v2 twice).
  REQUIRE(store.Reload(dir / "v2", std::nullopt, /*keep_previous=*/true).ok());
  CHECK(store.Current()->model().model_id() == v2);
  CHECK(store.Current()->version() == 3);
  REQUIRE(store.Previous() != nullptr);
  CHECK(store.Previous()->model().model_id() == v1);
  CHECK(store.ForModel(v1) != nullptr);

  // Abandoned once loaded: CANCELLED, the sets in use unchanged, the version not taken.
  const absl::Status gone = store.Reload(dir / "v1", std::nullopt, /*keep_previous=*/false, [] { return true; });
  CHECK(gone.code() == absl::StatusCode::kCancelled);
  CHECK(store.Current()->model().model_id() == v2);
  CHECK(store.Current()->version() == 3);
  CHECK(store.Previous()->model().model_id() == v1);
  REQUIRE(store.Reload(dir / "v1", std::nullopt, /*keep_previous=*/false, [] { return false; }).ok());
  CHECK(store.Current()->model().model_id() == v1);
  CHECK(store.Previous() == nullptr);
}

TEST_CASE("a load whose resident weights would pass the memory limit is refused before anything is copied") {
  TempDir dir;
  tools::SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt");
  colibri::testing::MakeModel(synth, dir / "v1", DType::kBF16);
  colibri::testing::MakeModel(synth, dir / "v2", DType::kInt8);
  // The shard's resident size, measured without a limit.
  StoreOptions options;
  options.residency = Residency::kCopy;
  int64_t v1_bytes = 0;
  {
    auto unlimited = ExpertStore::Create(dir / "v1", options, nullptr);
    REQUIRE(unlimited.ok());
    v1_bytes = (*unlimited)->ResidentBytes();
    CHECK(v1_bytes == static_cast<int64_t>((*unlimited)->Current()->bytes()));
  }
  REQUIRE(v1_bytes > 0);
  options.memory_reserve = 1000;
  options.memory_limit = v1_bytes + 999;
  options.memory_limit_source = "/sys/fs/cgroup/test/memory.max";
  const auto refused = ExpertStore::Create(dir / "v1", options, nullptr);
  INFO(refused.status().message());
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(refused.status().message(), "pass the memory limit"));
  CHECK(absl::StrContains(refused.status().message(), "/sys/fs/cgroup/test/memory.max"));

  // It fits alone; a second version kept beside it does not, and the first stays.
  options.memory_limit = v1_bytes + 1000;
  auto created = ExpertStore::Create(dir / "v1", options, nullptr);
  REQUIRE(created.ok());
  ExpertStore& store = **created;
  const std::string v1 = store.Current()->model().model_id();
  const absl::Status beside = store.Reload(dir / "v2", std::nullopt, /*keep_previous=*/true);
  INFO(beside.message());
  CHECK(beside.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(store.Current()->model().model_id() == v1);
  CHECK(store.ResidentBytes() == v1_bytes);
  // A reserve lowered later (the server's, once its budget is known) counts from then on.
  store.SetMemoryReserve(-v1_bytes);
  CHECK(store.Reload(dir / "v2", std::nullopt, /*keep_previous=*/true).ok());
  CHECK(store.ResidentBytes() > v1_bytes);

  // int8 tile records are counted before they are built, to the byte.
  StoreOptions with_records;
  with_records.residency = Residency::kCopy;
  with_records.q8_records = true;
  int64_t v2_bytes = 0;
  {
    auto unlimited = ExpertStore::Create(dir / "v2", with_records, nullptr);
    REQUIRE(unlimited.ok());
    v2_bytes = (*unlimited)->ResidentBytes();
    if (!(*unlimited)->Current()->q8_records()) WARN("no int8 tiles on this CPU: records are not built here");
  }
  with_records.memory_limit = v2_bytes - 1;
  CHECK(ExpertStore::Create(dir / "v2", with_records, nullptr).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  with_records.memory_limit = v2_bytes;
  CHECK(ExpertStore::Create(dir / "v2", with_records, nullptr).ok());

  // Paged weights are the kernel's to reclaim: not counted.
  options.residency = Residency::kPaged;
  options.memory_limit = 0;
  options.memory_reserve = 0;
  auto paged = ExpertStore::Create(dir / "v1", options, nullptr);
  REQUIRE(paged.ok());
  CHECK((*paged)->ResidentBytes() == 0);
}

TEST_CASE("weights replaced while a call holds them count as held until it lets them go") {
  TempDir dir;
  tools::SynthOptions synth = colibri::testing::SmallSynth(dir / "ckpt");
  colibri::testing::MakeModel(synth, dir / "v1", DType::kBF16);
  colibri::testing::MakeModel(synth, dir / "v2", DType::kInt8);
  StoreOptions options;
  options.residency = Residency::kCopy;
  auto created = ExpertStore::Create(dir / "v1", options, nullptr);
  REQUIRE(created.ok());
  ExpertStore& store = **created;
  const int64_t v1_bytes = store.ResidentBytes();
  std::shared_ptr<const WeightSet> in_flight = store.Current();  // a call that started before the reloads
  REQUIRE(store.Reload(dir / "v2", std::nullopt, /*keep_previous=*/false).ok());
  const int64_t v2_bytes = static_cast<int64_t>(store.Current()->resident_bytes());
  CHECK(store.ResidentBytes() == v1_bytes + v2_bytes);
  // Back to v1 while the first v1 is still held: three sets in memory, and a
  // limit that fits two refuses a third.
  REQUIRE(store.Reload(dir / "v1", std::nullopt, /*keep_previous=*/false).ok());
  CHECK(store.ResidentBytes() == 2 * v1_bytes);
  in_flight.reset();  // the call ends: its set is freed
  CHECK(store.ResidentBytes() == v1_bytes);
}

TEST_CASE("a reload of a model with a larger d_model than the node's limits hold is refused") {
  TempDir dir;
  tools::SynthOptions small = colibri::testing::SmallSynth(dir / "small");
  tools::SynthOptions wide = colibri::testing::SmallSynth(dir / "wide");
  wide.d_model = 2 * small.d_model;
  colibri::testing::MakeModel(small, dir / "v1", DType::kBF16);
  colibri::testing::MakeModel(wide, dir / "v2", DType::kBF16);
  auto created = ExpertStore::Create(dir / "v1", StoreOptions{}, nullptr);
  REQUIRE(created.ok());
  ExpertStore& store = **created;
  const std::string v1 = store.Current()->model().model_id();
  store.SetMaxDModel(small.d_model);
  for (bool keep_previous : {false, true}) {
    const absl::Status refused = store.Reload(dir / "v2", std::nullopt, keep_previous);
    INFO(refused.message());
    CHECK(refused.code() == absl::StatusCode::kFailedPrecondition);
    CHECK(absl::StrContains(refused.message(), "d_model 96"));
    CHECK(store.Current()->model().model_id() == v1);
  }
  // The same d_model reloads; without a bound, the wider model does too.
  CHECK(store.Reload(dir / "v1", std::nullopt).ok());
  store.SetMaxDModel(0);
  REQUIRE(store.Reload(dir / "v2", std::nullopt).ok());
  CHECK(store.Current()->model().manifest().d_model == wide.d_model);
}

}  // namespace
}  // namespace expert_node
}  // namespace colibri
