/* Checks shared by the C API's C test programs (c_api_test.c,
 * c_api_direct_test.c): each prints one PASS/FAIL line and counts failures
 * in `failures`, which main returns on. */
#ifndef COLIBRI_TESTS_ROUTER_NODE_C_CHECKS_H_
#define COLIBRI_TESTS_ROUTER_NODE_C_CHECKS_H_

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "router_node/colibri.h"

static int failures = 0;

static void Check(int ok, const char* what) {
  printf("%s: %s\n", ok ? "PASS" : "FAIL", what);
  if (!ok) ++failures;
}

/* A failing call's status and message, checked together. */
static void CheckError(colibri_status status, colibri_status want, const char* needle, const char* what) {
  const char* message = colibri_last_error(NULL);
  const int ok = status == want && strstr(message, needle) != NULL;
  printf("%s: %s (status %d, \"%s\")\n", ok ? "PASS" : "FAIL", what, (int)status, message);
  if (!ok) ++failures;
}

/* Seeded values in [-1, 1). */
static void FillSeeded(float* x, int64_t n, uint32_t seed) {
  int64_t i;
  for (i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    x[i] = (float)(seed >> 8) / 8388608.0f - 1.0f;
  }
}

#endif /* COLIBRI_TESTS_ROUTER_NODE_C_CHECKS_H_ */
