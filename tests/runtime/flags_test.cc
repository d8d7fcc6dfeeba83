#include "runtime/flags.h"

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, test_value, "", "a string flag of this test");
ABSL_FLAG(std::string, test_other, "", "another string flag of this test");
ABSL_FLAG(bool, test_switch, true, "a boolean flag of this test");

namespace colibri {
namespace runtime {
namespace {

// ParseFlags sets the process's usage message, which Abseil allows once per
// process: this is the file's only test case.
TEST_CASE("dashed flag names are accepted and values are left as given") {
  std::vector<std::string> given = {"colibri-test",    "--test-value", "-a-b",         "--test-other=x-y--z",
                                    "--notest-switch", "--",           "--test-value", "pos-arg"};
  std::vector<char*> argv;
  for (std::string& a : given) argv.push_back(a.data());
  const std::vector<char*> positional = ParseFlags(static_cast<int>(argv.size()), argv.data(), "test");
  CHECK(absl::GetFlag(FLAGS_test_value) == "-a-b");
  CHECK(absl::GetFlag(FLAGS_test_other) == "x-y--z");
  CHECK_FALSE(absl::GetFlag(FLAGS_test_switch));
  REQUIRE(positional.size() == 3);
  CHECK(std::string(positional[1]) == "--test-value");
  CHECK(std::string(positional[2]) == "pos-arg");
}

}  // namespace
}  // namespace runtime
}  // namespace colibri
