#include "common/user_cache.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace colibri {
namespace common {

std::string UserCacheDir() {
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    return absl::StrCat(xdg, "/colibri");
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    return absl::StrCat(home, "/.cache/colibri");
  }
  return "";
}

}  // namespace common
}  // namespace colibri
