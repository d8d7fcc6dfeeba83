#include "runtime/flags.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>

#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"

namespace colibri {
namespace runtime {

std::vector<char*> ParseFlags(int argc, char** argv, const char* usage) {
#ifdef NDEBUG
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
  absl::SetProgramUsageMessage(usage);
  std::string program = argc > 0 ? argv[0] : "colibri";
  program = program.substr(program.find_last_of('/') + 1);
  // The OpenMP runtime under oneDNN reads these when it loads and pins the
  // main thread to its first place; every thread started later inherits
  // that one CPU, and the thread pools size themselves from it.
  for (const char* binding : {"OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY"}) {
    if (std::getenv(binding) != nullptr) {
      std::cerr << program << ": warning: " << binding
                << " is set: the OpenMP runtime may have pinned this process's threads to one CPU; unset it (Colibri "
                   "places its own threads)\n";
    }
  }
  static std::string main_file;  // read by the usage config's callbacks
  main_file = absl::StrReplaceAll(program, {{"-", "_"}}) + ".cc";
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [](absl::string_view file) { return absl::EndsWith(file, main_file); };
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);
  // Accept --flag-name as well as --flag_name (the spelling docs and
  // operators often use): the name part of an argument, up to '=', gets
  // underscores when that spells a defined flag (or --noflag of a boolean).
  // Anything else, such as a value "-1-2" after "--flag", is left alone, and
  // so is every argument after "--".
  static std::vector<std::string> normalized;
  normalized.assign(argv, argv + argc);
  std::vector<char*> args;
  bool positional = false;
  for (int i = 0; i < argc; ++i) {
    std::string& a = normalized[i];
    if (a == "--") positional = true;
    const size_t start = a.find_first_not_of('-');
    const size_t end = std::min(a.find('='), a.size());
    if (i > 0 && !positional && start > 0 && start < end) {
      std::string name = a.substr(start, end - start);
      std::replace(name.begin(), name.end(), '-', '_');
      if (absl::FindCommandLineFlag(name) != nullptr ||
          (absl::StartsWith(name, "no") && absl::FindCommandLineFlag(name.substr(2)) != nullptr)) {
        a.replace(start, end - start, name);
      }
    }
    args.push_back(a.data());
  }
  return absl::ParseCommandLine(argc, args.data());
}

absl::Status NameFlags(const absl::Status& status, const OptionFlags& flags) {
  if (status.ok()) return status;
  std::vector<std::pair<std::string, std::string>> replacements;
  for (const auto& [option, flag] : flags) replacements.emplace_back(option, absl::StrCat(option, " (", flag, ")"));
  return absl::Status(status.code(), absl::StrReplaceAll(status.message(), replacements));
}

}  // namespace runtime
}  // namespace colibri
