// The shard map and the per-layer plan: replicas, the batch union (one call
// per node), least-loaded choice, exclusion of failed nodes, and the
// UNAVAILABLE message naming the layer and the expert; replicas in turn and
// a replicated expert's rows split among them.

#include "router_node/shard_map.h"

#include <catch2/catch.hpp>
#include <map>
#include <set>

namespace colibri {
namespace router_node {
namespace {

std::vector<ExpertWork> Works(const std::vector<int32_t>& experts) {
  std::vector<ExpertWork> w;
  for (const int32_t e : experts) w.push_back({e, {0}, {1.f}, {0}});
  return w;
}

// 2 layers x 4 experts: node 0 owns experts 0-2, node 1 owns 2-3 (expert 2
// replicated), node 2 owns everything but is down.
ShardMap Map() {
  std::vector<NodeState> nodes(3);
  nodes[0] = {"a:1", true, "", {}};
  nodes[1] = {"b:1", true, "", {}};
  nodes[2] = {"c:1", false, "connection refused", {}};
  for (int64_t l = 0; l < 2; ++l) {
    for (int64_t e = 0; e < 4; ++e) {
      if (e <= 2) nodes[0].owned.emplace_back(l, e);
      if (e >= 2) nodes[1].owned.emplace_back(l, e);
      nodes[2].owned.emplace_back(l, e);
    }
  }
  return ShardMap(2, 4, nodes);
}

TEST_CASE("the map lists live replicas only and finds uncovered experts") {
  const ShardMap map = Map();
  CHECK(map.replicas(0, 0) == std::vector<int>{0});
  CHECK(map.replicas(1, 2) == std::vector<int>{0, 1});
  CHECK(map.replicas(1, 3) == std::vector<int>{1});
  CHECK(!map.FirstUncovered().has_value());

  std::vector<NodeState> one = {{"a:1", true, "", {{0, 0}, {0, 1}, {7, 7}}}};
  const ShardMap partial(1, 3, one);
  REQUIRE(partial.FirstUncovered().has_value());
  CHECK(*partial.FirstUncovered() == std::make_pair<int64_t, int64_t>(0, 2));
}

TEST_CASE("a layer's experts are grouped into one call per node") {
  const ShardMap map = Map();
  const std::vector<ExpertWork> works = Works({0, 1, 2, 3});
  auto plan = PlanNodeCalls(map, 0, works, {0, 1, 2, 3}, std::vector<int>{0, 0, 0}, {});
  REQUIRE(plan.ok());
  REQUIRE(plan->size() == 2);
  // Expert 2 joins node 0's call (already used, equally loaded) rather than opening a third.
  CHECK((*plan)[0].node == 0);
  CHECK((*plan)[0].works == std::vector<int>{0, 1, 2});
  CHECK((*plan)[1].node == 1);
  CHECK((*plan)[1].works == std::vector<int>{3});
}

TEST_CASE("a replicated expert goes to the least loaded replica") {
  const ShardMap map = Map();
  const std::vector<ExpertWork> works = Works({2});
  auto plan = PlanNodeCalls(map, 1, works, {0}, std::vector<int>{3, 1, 0}, {});
  REQUIRE(plan.ok());
  REQUIRE(plan->size() == 1);
  CHECK((*plan)[0].node == 1);
}

TEST_CASE("a failed node is avoided and an expert without replicas is UNAVAILABLE by name") {
  const ShardMap map = Map();
  const std::vector<ExpertWork> works = Works({2, 3});
  auto retry = PlanNodeCalls(map, 0, works, {0}, std::vector<int>{0, 0, 0}, {1});
  REQUIRE(retry.ok());
  CHECK((*retry)[0].node == 0);

  auto none = PlanNodeCalls(map, 0, works, {0, 1}, std::vector<int>{0, 0, 0}, {1});
  REQUIRE(!none.ok());
  CHECK(none.status().code() == absl::StatusCode::kUnavailable);
  const std::string message(none.status().message());
  INFO(message);
  CHECK(message.find("layer 0 expert 3") != std::string::npos);
  // Nodes by index, with no address nor their errors (those name addresses): admins see them.
  CHECK(message.find("node-1: failed this request") != std::string::npos);
  CHECK(message.find("node-2: down") != std::string::npos);
  CHECK(message.find("c:1") == std::string::npos);
  CHECK(message.find("connection refused") == std::string::npos);
}

TEST_CASE("equally loaded replicas are taken in turn, evenly") {
  // Expert 2's replicas are nodes 0 and 1 of three: every other rotation picks each.
  const ShardMap map = Map();
  const std::vector<ExpertWork> works = Works({2});
  std::map<int, int> chosen;
  for (uint32_t rotation = 0; rotation < 6; ++rotation) {
    auto plan = PlanNodeCalls(map, 0, works, {0}, std::vector<int>{0, 0, 0}, {}, {}, rotation);
    REQUIRE(plan.ok());
    ++chosen[(*plan)[0].node];
  }
  CHECK(chosen == std::map<int, int>{{0, 3}, {1, 3}});
}

TEST_CASE("an avoided node is used only for experts nothing else serves") {
  const ShardMap map = Map();
  const std::vector<ExpertWork> works = Works({2, 3});
  // Node 1 answered that it no longer owns one of them: expert 2 moves to node 0, expert 3 stays.
  auto plan = PlanNodeCalls(map, 0, works, {0, 1}, std::vector<int>{5, 0, 0}, {}, {1});
  REQUIRE(plan.ok());
  REQUIRE(plan->size() == 2);
  CHECK((*plan)[0].node == 0);
  CHECK((*plan)[0].works == std::vector<int>{0});
  CHECK((*plan)[1].node == 1);
  CHECK((*plan)[1].works == std::vector<int>{1});
}

// One work of expert 2 with `rows` rows 0.., weights 0.5, slots 2t.
std::vector<ExpertWork> Rows(int rows) {
  ExpertWork w{2, {}, {}, {}};
  for (int r = 0; r < rows; ++r) {
    w.rows.push_back(r);
    w.weights.push_back(0.5f);
    w.slots.push_back(2 * r);
  }
  return {Works({0})[0], w, Works({3})[0]};
}

TEST_CASE("a replicated expert's rows are split among its replicas and planned on both") {
  const ShardMap map = Map();
  const std::vector<ExpertWork> works = Rows(5);
  std::vector<ExpertWork> parts;
  REQUIRE(SplitAmongReplicas(map, 0, works, {RowSplit::kAlways, 2}, &parts));
  REQUIRE(parts.size() == 4);  // expert 0, expert 2 in two parts, expert 3
  CHECK(parts[0].expert == 0);
  CHECK(parts[1].expert == 2);
  CHECK(parts[1].rows == std::vector<int32_t>{0, 1});
  CHECK(parts[1].slots == std::vector<int32_t>{0, 2});
  CHECK(parts[2].expert == 2);
  CHECK(parts[2].rows == std::vector<int32_t>{2, 3, 4});
  CHECK(parts[2].weights.size() == 3);
  CHECK(parts[1].kernel_rows == 5);  // each part chooses the node's kernel as the whole would
  CHECK(parts[2].kernel_rows == 5);
  CHECK(parts[3].expert == 3);

  auto plan = PlanNodeCalls(map, 0, parts, {0, 1, 2, 3}, std::vector<int>{0, 0, 0}, {});
  REQUIRE(plan.ok());
  REQUIRE(plan->size() == 2);
  CHECK((*plan)[0].works == std::vector<int>{0, 1});
  CHECK((*plan)[1].works == std::vector<int>{2, 3});
}

TEST_CASE("rows are not split below min_rows, without replicas, or where bits would change") {
  std::vector<ExpertWork> parts;
  const ShardMap map = Map();
  CHECK(!SplitAmongReplicas(map, 0, Rows(5), {RowSplit::kAlways, 6}, &parts));
  CHECK(!SplitAmongReplicas(map, 0, Rows(5), {RowSplit::kNever, 1}, &parts));
  std::vector<ExpertWork> lone = Rows(5);  // expert 2 has two replicas, 0 and 3 one each
  lone.erase(lone.begin() + 1);
  lone[0].rows = lone[1].rows = {0, 1, 2, 3, 4};
  lone[0].weights = lone[1].weights = std::vector<float>(5, 0.5f);
  lone[0].slots = lone[1].slots = {0, 2, 4, 6, 8};
  CHECK(!SplitAmongReplicas(map, 0, lone, {RowSplit::kAlways, 1}, &parts));  // no replicas
  CHECK(parts.empty());
  // exact: only below every replica's row_split_limit (-1: none; 0: unknown, never).
  std::vector<NodeState> nodes = {{"a:1", true, "", {{0, 2}}, -1}, {"b:1", true, "", {{0, 2}}, 8}};
  const ShardMap limited(1, 4, nodes);
  const std::vector<ExpertWork> two = {Rows(7)[1]}, many = {Rows(8)[1]};
  CHECK(SplitAmongReplicas(limited, 0, two, {RowSplit::kExact, 2}, &parts));
  CHECK(parts.size() == 2);
  CHECK(!SplitAmongReplicas(limited, 0, many, {RowSplit::kExact, 2}, &parts));
  CHECK(SplitAmongReplicas(limited, 0, many, {RowSplit::kAlways, 2}, &parts));
  nodes[1].row_split_limit = 0;  // a node that does not say
  CHECK(!SplitAmongReplicas(ShardMap(1, 4, nodes), 0, two, {RowSplit::kExact, 2}, &parts));
  CHECK(ParseRowSplit("exact") == RowSplit::kExact);
  CHECK(!ParseRowSplit("sometimes").has_value());
}

TEST_CASE("an expert with more rows than half a node's call limit is cut into runs that keep its kernel count") {
  // Expert 2 on a live node taking 8 rows a call and a suspect one (a
  // fallback) taking 6 row indices; expert 0 only on a node without limits.
  std::vector<NodeState> nodes = {
      {"a:1", true, "", {{0, 0}, {0, 2}}}, {"b:1", true, "", {{0, 2}}}, {"c:1", false, "call failed", {{0, 2}}}};
  nodes[1].max_rows = 8;
  nodes[2].suspect = true;
  nodes[2].max_row_indices = 6;
  const ShardMap map(1, 4, nodes);
  std::vector<ExpertWork> works = {{0, {}, {}, {}}, {2, {}, {}, {}}};
  for (int32_t r = 0; r < 10; ++r) {
    for (ExpertWork& w : works) {
      w.rows.push_back(r);
      w.weights.push_back(0.5f);
      w.slots.push_back(r * 4 + w.expert);
    }
  }
  std::vector<ExpertWork> parts;
  REQUIRE(SplitOverNodeLimits(map, 0, works, &parts));
  // Expert 0 whole; expert 2 in runs of at most 3 (half of the fallback's 6): 2, 3, 2, 3 rows.
  REQUIRE(parts.size() == 5);
  CHECK(parts[0].rows.size() == 10);
  CHECK(parts[0].kernel_rows == 0);
  std::vector<int32_t> rows;
  for (size_t i = 1; i < parts.size(); ++i) {
    CHECK(parts[i].expert == 2);
    CHECK(parts[i].rows.size() <= 3);
    CHECK(parts[i].kernel_rows == 10);
    CHECK(parts[i].weights.size() == parts[i].rows.size());
    CHECK(parts[i].slots.size() == parts[i].rows.size());
    rows.insert(rows.end(), parts[i].rows.begin(), parts[i].rows.end());
  }
  CHECK(rows == works[1].rows);
  // Within half of every limit (or none reported): nothing to cut.
  nodes[2].max_row_indices = 20;
  nodes[1].max_rows = 0;
  CHECK(!SplitOverNodeLimits(ShardMap(1, 4, nodes), 0, works, &parts));
}

}  // namespace
}  // namespace router_node
}  // namespace colibri
