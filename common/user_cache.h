#ifndef COLIBRI_COMMON_USER_CACHE_H_
#define COLIBRI_COMMON_USER_CACHE_H_

// Where Colibri keeps per-user caches (the kernel profile, the list of
// verified model files): $XDG_CACHE_HOME/colibri, else $HOME/.cache/colibri.
// Created by whoever writes into it. Thread-safe (reads the environment).

#include <string>

namespace colibri {
namespace common {

// Empty when neither variable is set.
std::string UserCacheDir();

}  // namespace common
}  // namespace colibri

#endif  // COLIBRI_COMMON_USER_CACHE_H_
