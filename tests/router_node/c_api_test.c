/* The C API (router_node/colibri.h) from a C11 program: being C, it also
 * proves the header is C. Usage: c_api_test MODEL_DIR, a converted model
 * (tests/cli/c_api.sh makes one with the tools). Prints one line per check;
 * exits 0 only if every check passes. */

#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <threads.h>

#include "router_node/colibri.h"
#include "tests/router_node/c_checks.h"

static int AllFiniteNotAllZero(const float* x, int64_t n) {
  int64_t i;
  int nonzero = 0;
  for (i = 0; i < n; ++i) {
    if (!isfinite(x[i])) return 0;
    if (x[i] != 0.0f) nonzero = 1;
  }
  return nonzero;
}

/* One thread's share of the concurrency check: `rounds` good calls that
 * must reproduce `want` and leave no error, or (bad) failing calls that must
 * see their own message, never another thread's. */
typedef struct Worker {
  colibri_engine* engine;
  const int32_t* ids;
  int64_t n_tokens;
  const float* x;
  const float* want;
  int64_t values;
  int bad;
  int ok;
} Worker;

static int RunWorker(void* arg) {
  Worker* w = (Worker*)arg;
  float* y = malloc(sizeof(float) * w->values);
  int round;
  w->ok = y != NULL;
  for (round = 0; w->ok && round < 20; ++round) {
    if (w->bad) {
      const colibri_status s = colibri_forward_batch(w->engine, -1, w->ids, w->n_tokens, w->x, y);
      w->ok = s == COLIBRI_INVALID_ARGUMENT && strstr(colibri_last_error(NULL), "layer -1") != NULL;
    } else {
      const colibri_status s = colibri_forward_batch(w->engine, 0, w->ids, w->n_tokens, w->x, y);
      w->ok =
          s == COLIBRI_OK && memcmp(y, w->want, sizeof(float) * w->values) == 0 && colibri_last_error(NULL)[0] == '\0';
    }
  }
  free(y);
  return 0;
}

/* Workers of CallUntilFreed that have had a call answered. */
static atomic_int answered_workers;

/* Calls until one is refused because the engine was freed: each before
 * that must reproduce `want`; `ok` says whether all did, at least one was
 * answered, and one was refused. */
static int CallUntilFreed(void* arg) {
  Worker* w = (Worker*)arg;
  float* y = malloc(sizeof(float) * w->values);
  int round;
  w->ok = 0;
  for (round = 0; y != NULL && round < 1000000; ++round) {
    const colibri_status s = colibri_forward_batch(w->engine, 0, w->ids, w->n_tokens, w->x, y);
    if (s == COLIBRI_INVALID_ARGUMENT && strstr(colibri_last_error(NULL), "not a live engine") != NULL) {
      w->ok = round > 0;
      break;
    }
    if (s != COLIBRI_OK || memcmp(y, w->want, sizeof(float) * w->values) != 0) break;
    if (round == 0) atomic_fetch_add(&answered_workers, 1);
  }
  if (round == 0) atomic_fetch_add(&answered_workers, 1); /* failed at once: main must not wait for it */
  free(y);
  return 0;
}

int main(int argc, char** argv) {
  enum { kTokens = 6 };
  char missing[4096];
  colibri_engine* engine = (colibri_engine*)&failures; /* must be overwritten */
  colibri_options options;
  colibri_model_info info;
  int32_t ids[kTokens];
  int64_t values, slots, i;
  float *x, *y1, *y2, *y3, *y4, *sentinel, *route_weights;
  int32_t* route_experts;
  colibri_status s;

  if (argc != 2 && argc != 3) {
    fprintf(stderr, "usage: %s MODEL_DIR [SHARED_EXPERTS]\n", argv[0]);
    return 2;
  }
  Check(colibri_abi_version() == COLIBRI_ABI_VERSION, "colibri_abi_version matches the header");
  colibri_free(NULL);
  Check(1, "colibri_free(NULL) is a no-op");

  snprintf(missing, sizeof(missing), "%s/no-such-model", argv[1]);
  s = colibri_init(missing, NULL, &engine);
  Check(s != COLIBRI_OK && engine == NULL && colibri_last_error(NULL)[0] != '\0',
        "colibri_init on a missing directory fails, sets *out to NULL and leaves a message");
  printf("  message: %s\n", colibri_last_error(NULL));

  colibri_options_init(&options);
  options.threads = 2;
  s = colibri_init(argv[1], &options, &engine);
  Check(s == COLIBRI_OK && engine != NULL, "colibri_init opens the model");
  if (s != COLIBRI_OK) {
    printf("  message: %s\n", colibri_last_error(NULL));
    return 1;
  }
  Check(colibri_last_error(engine)[0] == '\0', "colibri_last_error is empty after a success");

  s = colibri_get_model_info(engine, &info);
  printf("  d_model %lld d_ff %lld layers %lld experts %lld top_k %lld vocab %lld weights %s id %s\n",
         (long long)info.d_model, (long long)info.d_ff, (long long)info.n_layers, (long long)info.n_experts,
         (long long)info.top_k, (long long)info.vocab_size, info.weight_type, info.model_id);
  Check(s == COLIBRI_OK && info.d_model > 0 && info.d_ff > 0 && info.n_layers > 0 && info.top_k >= 1 &&
            info.top_k <= info.n_experts && info.vocab_size > 0,
        "colibri_get_model_info gives a plausible shape");
  Check(strlen(info.weight_type) > 0 && strncmp(info.model_id, "xxh3_128:", 9) == 0,
        "colibri_get_model_info gives the weight type and model id");
  {
    int64_t shared = -1, shared_d_ff = -1;
    const long long expected = argc > 2 ? atoll(argv[2]) : 0;
    s = colibri_get_shared_experts(engine, &shared, &shared_d_ff);
    printf("  shared experts %lld of d_ff %lld\n", (long long)shared, (long long)shared_d_ff);
    Check(s == COLIBRI_OK && shared == expected && (shared == 0) == (shared_d_ff == 0),
          "colibri_get_shared_experts gives the shared experts");
    Check(colibri_get_shared_experts(engine, NULL, &shared_d_ff) == COLIBRI_INVALID_ARGUMENT &&
              strstr(colibri_last_error(engine), "count") != NULL,
          "colibri_get_shared_experts names a NULL argument");
  }

  values = kTokens * info.d_model;
  slots = kTokens * info.top_k;
  x = malloc(sizeof(float) * values);
  y1 = malloc(sizeof(float) * values);
  y2 = malloc(sizeof(float) * values);
  y3 = malloc(sizeof(float) * values);
  y4 = malloc(sizeof(float) * values);
  sentinel = malloc(sizeof(float) * values);
  route_experts = malloc(sizeof(int32_t) * slots);
  route_weights = malloc(sizeof(float) * slots);
  if (!x || !y1 || !y2 || !y3 || !y4 || !sentinel || !route_experts || !route_weights) return 1;
  for (i = 0; i < kTokens; ++i) ids[i] = (int32_t)((i * 37 + 5) % info.vocab_size);
  ids[kTokens - 1] = (int32_t)(info.vocab_size - 1);
  FillSeeded(x, values, 7u);

  /* The common call, twice. */
  s = colibri_forward_batch(engine, 0, ids, kTokens, x, y1);
  Check(s == COLIBRI_OK && AllFiniteNotAllZero(y1, values), "forward_batch gives finite, non-zero outputs");
  s = colibri_forward_batch(engine, 0, ids, kTokens, x, y2);
  Check(s == COLIBRI_OK && memcmp(y1, y2, sizeof(float) * values) == 0, "forward_batch rerun is bitwise equal");
  s = colibri_forward_batch(engine, (int32_t)info.n_layers - 1, ids, kTokens, x, y2);
  Check(s == COLIBRI_OK && AllFiniteNotAllZero(y2, values), "forward_batch runs the last layer");
  s = colibri_forward_batch(engine, 0, NULL, 0, NULL, NULL);
  Check(s == COLIBRI_OK, "forward_batch with 0 tokens and NULL pointers is OK");

  /* The general call: LUT with the routes returned, then those routes as client routes. */
  s = colibri_forward(engine, 0, COLIBRI_ROUTING_LUT, ids, kTokens, x, NULL, NULL, y3, route_experts, route_weights);
  Check(s == COLIBRI_OK && memcmp(y1, y3, sizeof(float) * values) == 0, "forward (LUT) equals forward_batch bitwise");
  for (i = 0; s == COLIBRI_OK && i < slots; ++i) {
    if (route_experts[i] < 0 || route_experts[i] >= info.n_experts || !isfinite(route_weights[i])) break;
  }
  Check(s == COLIBRI_OK && i == slots, "forward (LUT) returns routes in range");
  s = colibri_forward(engine, 0, COLIBRI_ROUTING_CLIENT, NULL, kTokens, x, route_experts, route_weights, y4, NULL,
                      NULL);
  Check(s == COLIBRI_OK && memcmp(y1, y4, sizeof(float) * values) == 0,
        "forward (CLIENT) with the LUT's routes equals forward_batch bitwise");
  s = colibri_forward(engine, 0, COLIBRI_ROUTING_GATE, NULL, kTokens, x, NULL, NULL, y4, route_experts, NULL);
  Check(s == COLIBRI_OK && AllFiniteNotAllZero(y4, values), "forward (GATE) gives finite, non-zero outputs");

  /* Concurrent calls on one engine: the same bits, and errors kept per thread. */
  {
    enum { kThreads = 3 };
    thrd_t threads[kThreads];
    Worker workers[kThreads];
    int t, all_ok = 1;
    for (t = 0; t < kThreads; ++t) {
      Worker w = {engine, ids, kTokens, x, y1, values, t == kThreads - 1, 0};
      workers[t] = w;
      if (thrd_create(&threads[t], RunWorker, &workers[t]) != thrd_success) return 1;
    }
    for (t = 0; t < kThreads; ++t) {
      thrd_join(threads[t], NULL);
      all_ok = all_ok && workers[t].ok;
    }
    Check(all_ok, "concurrent calls reproduce the output and keep their errors per thread");
  }

  /* Errors: the right status, a message naming the argument, the output untouched. */
  FillSeeded(sentinel, values, 99u);
  memcpy(y2, sentinel, sizeof(float) * values);
  ids[2] = (int32_t)info.vocab_size;
  s = colibri_forward_batch(engine, 0, ids, kTokens, x, y2);
  CheckError(s, COLIBRI_INVALID_ARGUMENT, "token_ids", "a token id == vocab_size is refused");
  Check(memcmp(y2, sentinel, sizeof(float) * values) == 0, "a failed call leaves hidden_out untouched");
  ids[2] = 0;
  s = colibri_forward_batch(engine, (int32_t)info.n_layers, ids, kTokens, x, y2);
  CheckError(s, COLIBRI_INVALID_ARGUMENT, "layer", "layer == n_layers is refused");
  s = colibri_forward_batch(engine, -1, ids, kTokens, x, y2);
  CheckError(s, COLIBRI_INVALID_ARGUMENT, "layer", "layer -1 is refused");
  s = colibri_forward_batch(engine, 0, ids, kTokens, x, NULL);
  CheckError(s, COLIBRI_INVALID_ARGUMENT, "hidden_out", "a NULL hidden_out is refused");
  s = colibri_forward_batch(engine, 0, ids, -1, x, y2);
  CheckError(s, COLIBRI_INVALID_ARGUMENT, "n_tokens", "a negative n_tokens is refused");
  s = colibri_forward(engine, 0, COLIBRI_ROUTING_CLIENT, NULL, kTokens, x, NULL, route_weights, y2, NULL, NULL);
  CheckError(s, COLIBRI_INVALID_ARGUMENT, "route_experts", "client routing without route_experts is refused");
  s = colibri_forward(engine, 0, 7, ids, kTokens, x, NULL, NULL, y2, NULL, NULL);
  CheckError(s, COLIBRI_INVALID_ARGUMENT, "routing", "an unknown routing is refused");
  s = colibri_forward_batch(NULL, 0, ids, kTokens, x, y2);
  CheckError(s, COLIBRI_INVALID_ARGUMENT, "engine", "a NULL engine is refused");
  Check(memcmp(y2, sentinel, sizeof(float) * values) == 0, "no failed call wrote hidden_out");

  /* colibri_free waits for the calls in progress; calls after it are refused. */
  {
    enum { kThreads = 3 };
    thrd_t threads[kThreads];
    Worker workers[kThreads];
    int t, all_ok = colibri_forward_batch(engine, 0, ids, kTokens, x, y3) == COLIBRI_OK;
    for (t = 0; t < kThreads; ++t) {
      Worker w = {engine, ids, kTokens, x, y3, values, 0, 0};
      workers[t] = w;
      if (thrd_create(&threads[t], CallUntilFreed, &workers[t]) != thrd_success) return 1;
    }
    while (atomic_load(&answered_workers) < kThreads) thrd_yield();  /* every worker is calling */
    colibri_free(engine);
    for (t = 0; t < kThreads; ++t) {
      thrd_join(threads[t], NULL);
      all_ok = all_ok && workers[t].ok;
    }
    Check(all_ok, "colibri_free during calls: each call before it is right, every call after it refused");
  }
  s = colibri_get_model_info(engine, &info);
  CheckError(s, COLIBRI_INVALID_ARGUMENT, "not a live engine", "colibri_get_model_info on a freed engine is refused");
  colibri_free(engine);
  Check(1, "a second colibri_free of an engine does nothing");
  s = colibri_forward_batch((colibri_engine*)&failures, 0, ids, kTokens, x, y2);
  CheckError(s, COLIBRI_INVALID_ARGUMENT, "not a live engine", "a pointer that is not an engine is refused");

  /* Options: struct_size 0 is refused; a field struct_size does not cover
   * takes its default; a covered max_tokens is applied. */
  colibri_options_init(&options);
  options.struct_size = 0;
  s = colibri_init(argv[1], &options, &engine);
  CheckError(s, COLIBRI_INVALID_ARGUMENT, "struct_size", "options.struct_size 0 is refused");
  colibri_options_init(&options);
  options.threads = -3;
  s = colibri_init(argv[1], &options, &engine);
  CheckError(s, COLIBRI_INVALID_ARGUMENT, "options.threads -3", "a negative thread count is refused, naming the field");
  colibri_options_init(&options);
  options.numa_node = -5;
  s = colibri_init(argv[1], &options, &engine);
  CheckError(s, COLIBRI_INVALID_ARGUMENT, "options.numa_node -5", "a NUMA node below -1 is refused, naming the field");
  colibri_options_init(&options);
  options.max_tokens = 0;
  s = colibri_init(argv[1], &options, &engine);
  CheckError(s, COLIBRI_INVALID_ARGUMENT, "(options.max_tokens)", "max_tokens 0 is refused, naming the C field");
  colibri_options_init(&options);
  options.max_tokens = 2;
  options.struct_size = (uint32_t)offsetof(colibri_options, max_tokens);
  s = colibri_init(argv[1], &options, &engine);
  Check(s == COLIBRI_OK && colibri_forward_batch(engine, 0, ids, kTokens, x, y2) == COLIBRI_OK,
        "a max_tokens beyond struct_size takes the default");
  colibri_free(engine);
  options.struct_size = sizeof(options);
  s = colibri_init(argv[1], &options, &engine);
  Check(s == COLIBRI_OK, "colibri_init with max_tokens 2");
  s = colibri_forward_batch(engine, 0, ids, kTokens, x, y2);
  CheckError(s, COLIBRI_RESOURCE_EXHAUSTED, "max_tokens", "more tokens than max_tokens are refused");
  colibri_free(engine);

  free(x);
  free(y1);
  free(y2);
  free(y3);
  free(y4);
  free(sentinel);
  free(route_experts);
  free(route_weights);
  printf("%s: %d check(s) failed\n", failures == 0 ? "PASS" : "FAIL", failures);
  return failures == 0 ? 0 : 1;
}
