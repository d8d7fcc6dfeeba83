#ifndef COLIBRI_RUNTIME_FLAGS_H_
#define COLIBRI_RUNTIME_FLAGS_H_

// Flag parsing shared by every Colibri binary's main(). Flags live only in
// mains: libraries take options structs, and their errors name the option
// (e.g. "RouterOptions::max_tokens"); a main adds the flag that sets it with
// NameFlags.

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace colibri {
namespace runtime {

// Sets the usage message, makes --help / --helpshort list the flags defined in
// the binary's own main file (colibri-foo's flags live in colibri_foo.cc;
// Abseil only matches files named exactly like the binary), then parses argv.
// --flag-name is accepted for --flag_name (a defined flag's name only;
// values are never rewritten). Returns the positional arguments
// (pointing into storage that lives until the next call), argv[0] first. Exits like
// absl::ParseCommandLine on --help or a malformed flag.
//
// In release builds (NDEBUG) it also turns off Abseil's mutex deadlock
// detection. Debian builds Abseil without NDEBUG, so detection is on by
// default: every absl::Mutex lock (gRPC's and Abseil's own; Colibri's locks
// are common::Mutex, which ThreadSanitizer checks) walks a process-wide lock
// graph and records stack traces, a few percent of a router's CPU on its
// request path. Debug builds (the ASan+UBSan preset) keep it.
std::vector<char*> ParseFlags(int argc, char** argv, const char* usage);

// An option name as a library's errors spell it, and the flag that sets it:
// {"RouterOptions::max_tokens", "--max_tokens"}.
using OptionFlags = std::vector<std::pair<std::string, std::string>>;

// `status` with " (--flag)" after every option name of `flags` found in its
// message; the code is kept. OK stays OK.
absl::Status NameFlags(const absl::Status& status, const OptionFlags& flags);

}  // namespace runtime
}  // namespace colibri

#endif  // COLIBRI_RUNTIME_FLAGS_H_
