#include "common/flags.h"

#include <string>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"

namespace colibri {
namespace common {

std::vector<char*> ParseFlags(int argc, char** argv, const char* usage) {
  absl::SetProgramUsageMessage(usage);
  std::string program = argc > 0 ? argv[0] : "colibri";
  program = program.substr(program.find_last_of('/') + 1);
  static std::string main_file;  // read by the usage config's callbacks
  main_file = absl::StrReplaceAll(program, {{"-", "_"}}) + ".cc";
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [](absl::string_view file) { return absl::EndsWith(file, main_file); };
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);
  return absl::ParseCommandLine(argc, argv);
}

}  // namespace common
}  // namespace colibri
