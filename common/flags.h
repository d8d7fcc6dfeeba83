#ifndef COLIBRI_COMMON_FLAGS_H_
#define COLIBRI_COMMON_FLAGS_H_

// Flag parsing shared by every Colibri binary's main().

#include <vector>

namespace colibri {
namespace common {

// Sets the usage message, makes --help / --helpshort list the flags defined in
// the binary's own main file (colibri-foo's flags live in colibri_foo.cc;
// Abseil only matches files named exactly like the binary), then parses argv.
// --flag-name is accepted for --flag_name. Returns the positional arguments
// (pointing into storage that lives until the next call), argv[0] first. Exits like
// absl::ParseCommandLine on --help or a malformed flag.
std::vector<char*> ParseFlags(int argc, char** argv, const char* usage);

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_FLAGS_H_
