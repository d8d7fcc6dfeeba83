#ifndef COLIBRI_COMMON_STATUS_MACROS_H_
#define COLIBRI_COMMON_STATUS_MACROS_H_

// Abseil 20220623 (Debian 12) ships no ABSL_RETURN_IF_ERROR / ASSIGN_OR_RETURN.
// These two macros have the same shape.

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define COLIBRI_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::absl::Status colibri_status_ = (expr);           \
    if (!colibri_status_.ok()) return colibri_status_; \
  } while (0)

#define COLIBRI_STATUS_CONCAT_INNER_(a, b) a##b
#define COLIBRI_STATUS_CONCAT_(a, b) COLIBRI_STATUS_CONCAT_INNER_(a, b)

// COLIBRI_ASSIGN_OR_RETURN(auto x, MakeX()); declares/assigns `x` or returns the error.
#define COLIBRI_ASSIGN_OR_RETURN(lhs, expr) \
  COLIBRI_ASSIGN_OR_RETURN_IMPL_(COLIBRI_STATUS_CONCAT_(colibri_statusor_, __LINE__), lhs, expr)

#define COLIBRI_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()

#endif  // COLIBRI_COMMON_STATUS_MACROS_H_
