/* The C API's proxyless engines (colibri_connect) from a C11 program,
 * against running expert nodes. Usage:
 *   c_api_direct_test MODEL_DIR NODES DEAD_NODE SLOW_NODE
 * NODES ("host:port,host:port") serve every expert of MODEL_DIR (a top-2
 * model); DEAD_NODE is an address where nothing listens; SLOW_NODE serves
 * every expert but holds each call for 5 s before computing. Every answer is
 * compared byte for byte with colibri_init's in-process engine on the same
 * model (tests/cli/c_api.sh starts the nodes). Prints one line per check;
 * exits 0 only if every check passes. */

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <threads.h>
#include <time.h>

#include "router_node/colibri.h"
#include "tests/router_node/c_checks.h"

enum { kTokens = 7, kThreads = 4 };

/* The inputs of one comparison and the local engine's answers to them. */
typedef struct Case {
  int64_t d_model, top_k, values, slots;
  int32_t ids[kTokens];
  float* x;
  float* want_lut;         /* colibri_forward_batch */
  float* want_gate;        /* colibri_forward, GATE */
  int32_t* gate_experts;   /* the routes GATE chose */
  float* gate_weights;
  float* want_client;      /* colibri_forward, CLIENT with routes reversed */
  int32_t* client_experts;
  float* client_weights;
} Case;

/* 1 if `engine` answers every call of `c` with the local engine's bytes. */
static int SameAsLocal(colibri_engine* engine, const Case* c) {
  float* y = malloc(sizeof(float) * c->values);
  int32_t* experts = malloc(sizeof(int32_t) * c->slots);
  float* weights = malloc(sizeof(float) * c->slots);
  int ok = y != NULL && experts != NULL && weights != NULL;
  ok = ok && colibri_forward_batch(engine, 1, c->ids, kTokens, c->x, y) == COLIBRI_OK &&
       memcmp(y, c->want_lut, sizeof(float) * c->values) == 0;
  ok = ok &&
       colibri_forward(engine, 1, COLIBRI_ROUTING_GATE, NULL, kTokens, c->x, NULL, NULL, y, experts, weights) ==
           COLIBRI_OK &&
       memcmp(y, c->want_gate, sizeof(float) * c->values) == 0 &&
       memcmp(experts, c->gate_experts, sizeof(int32_t) * c->slots) == 0 &&
       memcmp(weights, c->gate_weights, sizeof(float) * c->slots) == 0;
  ok = ok &&
       colibri_forward(engine, 0, COLIBRI_ROUTING_CLIENT, NULL, kTokens, c->x, c->client_experts, c->client_weights,
                       y, NULL, NULL) == COLIBRI_OK &&
       memcmp(y, c->want_client, sizeof(float) * c->values) == 0;
  if (!ok) printf("  last error: %s\n", colibri_last_error(NULL));
  free(y);
  free(experts);
  free(weights);
  return ok;
}

typedef struct Worker {
  colibri_engine* engine;
  const Case* c;
  int ok;
} Worker;

static int RunWorker(void* arg) {
  Worker* w = (Worker*)arg;
  int round;
  w->ok = 1;
  for (round = 0; w->ok && round < 10; ++round) w->ok = SameAsLocal(w->engine, w->c);
  return 0;
}

/* colibri_connect checks the nodes once (1 s per probe); on a loaded
 * machine a node may miss that probe and be taken back a health round later,
 * so this waits up to 10 s for a first call that is not UNAVAILABLE. */
static void WaitServing(colibri_engine* engine, const Case* c) {
  float* y = malloc(sizeof(float) * c->values);
  const struct timespec pause = {0, 100 * 1000 * 1000};
  int i;
  for (i = 0; i < 100; ++i) {
    if (colibri_forward_batch(engine, 1, c->ids, kTokens, c->x, y) != COLIBRI_UNAVAILABLE) break;
    thrd_sleep(&pause, NULL);
  }
  free(y);
}

/* A proxyless engine on `nodes`, waited for (WaitServing) if `wait`. */
static colibri_status Connect(const char* model, const char* nodes, int32_t replies, int wait, const Case* c,
                              colibri_engine** out) {
  colibri_direct_options options;
  colibri_status s;
  colibri_direct_options_init(&options, sizeof(options));
  options.nodes = nodes;
  options.node_replies = replies;
  options.node_timeout_ms = 10000;
  s = colibri_connect(model, &options, out);
  if (s == COLIBRI_OK && wait) WaitServing(*out, c);
  return s;
}

int main(int argc, char** argv) {
  colibri_engine* local = NULL;
  colibri_engine* direct = (colibri_engine*)&failures; /* must be overwritten */
  colibri_direct_options options;
  colibri_options local_options;
  colibri_model_info local_info, direct_info;
  colibri_status s;
  Case c;
  int64_t i, j;
  int32_t replies;
  const char* model;
  const char* nodes;
  const char* dead;
  const char* slow;
  char both[512];
  float y[1];

  if (argc != 5) {
    fprintf(stderr, "usage: %s MODEL_DIR NODES DEAD_NODE SLOW_NODE\n", argv[0]);
    return 2;
  }
  model = argv[1];
  nodes = argv[2];
  dead = argv[3];
  slow = argv[4];

  /* Options refused before anything connects, each naming its field. */
  s = colibri_connect(model, NULL, &direct);
  CheckError(s, COLIBRI_INVALID_ARGUMENT, "exactly one of options.nodes",
             "colibri_connect without nodes");
  Check(direct == NULL, "a failed colibri_connect sets *out to NULL");
  colibri_direct_options_init(&options, sizeof(options));
  options.nodes = nodes;
  options.cluster_file = "/nonexistent";
  CheckError(colibri_connect(model, &options, &direct), COLIBRI_INVALID_ARGUMENT, "exactly one",
             "colibri_connect with both nodes and a cluster file");
  colibri_direct_options_init(&options, sizeof(options));
  options.nodes = nodes;
  options.node_replies = 7;
  CheckError(colibri_connect(model, &options, &direct), COLIBRI_INVALID_ARGUMENT, "options.node_replies 7",
             "an unknown node_replies");
  options.node_replies = COLIBRI_NODE_REPLIES_EXACT;
  options.node_timeout_ms = 0;
  CheckError(colibri_connect(model, &options, &direct), COLIBRI_INVALID_ARGUMENT, "options.node_timeout_ms 0",
             "node_timeout_ms 0");
  options.node_timeout_ms = 3600 * 1000 + 1;
  CheckError(colibri_connect(model, &options, &direct), COLIBRI_INVALID_ARGUMENT,
             "options.node_timeout_ms 3600001 is outside [1, 3600000]", "node_timeout_ms over an hour");
  options.node_timeout_ms = 1000;
  options.hedge_after_ms = -1;
  CheckError(colibri_connect(model, &options, &direct), COLIBRI_INVALID_ARGUMENT,
             "options.hedge_after_ms -1 is outside [0, 3600000]", "a negative hedge_after_ms");
  options.hedge_after_ms = 0;
  options.call_timeout_ms = 24 * 3600 * 1000LL + 1;
  CheckError(colibri_connect(model, &options, &direct), COLIBRI_INVALID_ARGUMENT,
             "options.call_timeout_ms 86400001 is outside [0, 86400000]", "call_timeout_ms over a day");
  options.call_timeout_ms = 0;
  options.max_tokens = -5;
  CheckError(colibri_connect(model, &options, &direct), COLIBRI_INVALID_ARGUMENT, "options.max_tokens -5",
             "a negative max_tokens");
  options.max_tokens = 65536;
  options.batch_window_us = 2000000;
  CheckError(colibri_connect(model, &options, &direct), COLIBRI_INVALID_ARGUMENT, "options.batch_window_us 2000000",
             "batch_window_us over a second");
  options.batch_window_us = 5000;
  options.batch_max_tokens = 0;
  CheckError(colibri_connect(model, &options, &direct), COLIBRI_INVALID_ARGUMENT, "options.batch_max_tokens 0",
             "batch_max_tokens 0");
  options.batch_max_tokens = 256;
  options.nodes = " , ,";
  CheckError(colibri_connect(model, &options, &direct), COLIBRI_INVALID_ARGUMENT, "exactly one of options.nodes",
             "a node list of only commas and blanks");
  options.nodes = nodes;
  options.tls_cert_file = "/nonexistent.pem";
  CheckError(colibri_connect(model, &options, &direct), COLIBRI_INVALID_ARGUMENT, "options.tls_",
             "a client certificate without a CA or key, named by its C field");
  options.tls_cert_file = NULL;
  options.tls_server_name = "nodes.example";
  CheckError(colibri_connect(model, &options, &direct), COLIBRI_INVALID_ARGUMENT,
             "options.tls_server_name) needs RemoteOptions::tls_ca_file (options.tls_ca_file)",
             "a TLS server name without a CA (the connection would not be TLS), named by its C field");
  options.tls_server_name = NULL;
  options.struct_size = 0;
  CheckError(colibri_connect(model, &options, &direct), COLIBRI_INVALID_ARGUMENT, "struct_size is 0",
             "struct_size 0");
  colibri_direct_options_init(&options, sizeof(options));
  options.nodes = "not-an-address";
  CheckError(colibri_connect(model, &options, &direct), COLIBRI_INVALID_ARGUMENT, "not-an-address",
             "a node address that is not host:port");
  options.nodes = "127.0.0.1:abc";
  CheckError(colibri_connect(model, &options, &direct), COLIBRI_INVALID_ARGUMENT, "port must be a number",
             "a node address whose port is not a number");
  colibri_direct_options_init(&options, sizeof(options));
  options.nodes = nodes;
  CheckError(colibri_connect(NULL, &options, &direct), COLIBRI_INVALID_ARGUMENT, "model_path",
             "a NULL model_path");
  CheckError(colibri_connect(model, &options, NULL), COLIBRI_INVALID_ARGUMENT, "out", "a NULL out");

  /* The local engine's answers. */
  colibri_options_init(&local_options);
  local_options.threads = 1;
  s = colibri_init(model, &local_options, &local);
  Check(s == COLIBRI_OK, "colibri_init opens the model (the reference)");
  if (s != COLIBRI_OK) {
    printf("  message: %s\n", colibri_last_error(NULL));
    return 1;
  }
  colibri_get_model_info(local, &local_info);
  c.d_model = local_info.d_model;
  c.top_k = local_info.top_k;
  c.values = kTokens * c.d_model;
  c.slots = kTokens * c.top_k;
  c.x = malloc(sizeof(float) * c.values);
  c.want_lut = malloc(sizeof(float) * c.values);
  c.want_gate = malloc(sizeof(float) * c.values);
  c.want_client = malloc(sizeof(float) * c.values);
  c.gate_experts = malloc(sizeof(int32_t) * c.slots);
  c.gate_weights = malloc(sizeof(float) * c.slots);
  c.client_experts = malloc(sizeof(int32_t) * c.slots);
  c.client_weights = malloc(sizeof(float) * c.slots);
  FillSeeded(c.x, c.values, 17);
  for (i = 0; i < kTokens; ++i) c.ids[i] = (int32_t)((i * 13 + 5) % local_info.vocab_size);
  s = colibri_forward_batch(local, 1, c.ids, kTokens, c.x, c.want_lut);
  s = s == COLIBRI_OK ? colibri_forward(local, 1, COLIBRI_ROUTING_GATE, NULL, kTokens, c.x, NULL, NULL, c.want_gate,
                                        c.gate_experts, c.gate_weights)
                      : s;
  for (i = 0; i < kTokens; ++i) { /* the gate's routes, in reverse order, weights halved */
    for (j = 0; j < c.top_k; ++j) {
      c.client_experts[i * c.top_k + j] = c.gate_experts[i * c.top_k + (c.top_k - 1 - j)];
      c.client_weights[i * c.top_k + j] = 0.5f * c.gate_weights[i * c.top_k + (c.top_k - 1 - j)];
    }
  }
  s = s == COLIBRI_OK ? colibri_forward(local, 0, COLIBRI_ROUTING_CLIENT, NULL, kTokens, c.x, c.client_experts,
                                        c.client_weights, c.want_client, NULL, NULL)
                      : s;
  Check(s == COLIBRI_OK, "the local engine answers LUT, GATE and CLIENT calls");

  /* Every reply mode answers with the local bytes (top-2: partial sums are exact too). */
  for (replies = COLIBRI_NODE_REPLIES_EXACT; replies <= COLIBRI_NODE_REPLIES_PER_EXPERT; ++replies) {
    char what[128];
    direct = NULL;
    s = Connect(model, nodes, replies, 1, &c, &direct);
    snprintf(what, sizeof(what), "colibri_connect to %s (node_replies %d)", nodes, (int)replies);
    Check(s == COLIBRI_OK && direct != NULL, what);
    if (s != COLIBRI_OK) {
      printf("  message: %s\n", colibri_last_error(NULL));
      continue;
    }
    snprintf(what, sizeof(what), "node_replies %d: LUT, GATE and CLIENT answers are the local bytes", (int)replies);
    Check(SameAsLocal(direct, &c), what);
    if (replies == COLIBRI_NODE_REPLIES_EXACT) {
      Worker workers[kThreads];
      thrd_t threads[kThreads];
      float* scratch = malloc(sizeof(float) * c.values);
      int ok = 1;
      s = colibri_get_model_info(direct, &direct_info);
      Check(s == COLIBRI_OK && memcmp(&direct_info, &local_info, sizeof(local_info)) == 0,
            "colibri_get_model_info of the proxyless engine equals the local one's");
      for (i = 0; i < kThreads; ++i) {
        workers[i].engine = direct;
        workers[i].c = &c;
        workers[i].ok = 0;
        ok = ok && thrd_create(&threads[i], RunWorker, &workers[i]) == thrd_success;
      }
      for (i = 0; i < kThreads; ++i) {
        thrd_join(threads[i], NULL);
        ok = ok && workers[i].ok;
      }
      Check(ok, "4 threads x 10 rounds of concurrent calls all give the local bytes");
      CheckError(colibri_forward_batch(direct, 9, c.ids, kTokens, c.x, scratch), COLIBRI_INVALID_ARGUMENT,
                 "layer 9", "a layer outside the model, refused with its number");
      CheckError(colibri_forward_batch(direct, 0, c.ids, 70000, c.x, y), COLIBRI_RESOURCE_EXHAUSTED, "70000",
                 "more tokens than max_tokens");
      free(scratch);
    }
    colibri_free(direct);
  }

  /* colibri_direct_options_init never writes past the size it is given. */
  memset(&options, 0x5a, sizeof(options));
  colibri_direct_options_init(&options, (uint32_t)offsetof(colibri_direct_options, hedge_after_ms));
  Check(options.struct_size == offsetof(colibri_direct_options, hedge_after_ms) && options.nodes == NULL &&
            options.node_timeout_ms == 5000 && options.hedge_after_ms == (int64_t)0x5a5a5a5a5a5a5a5aLL,
        "colibri_direct_options_init with a shorter size fills only the fields that fit");

  /* Blanks and empty entries in the node list are skipped. */
  {
    char spaced[600];
    const char* comma = strchr(nodes, ',');
    if (comma != NULL) {
      snprintf(spaced, sizeof(spaced), " %.*s , ,%s, ", (int)(comma - nodes), nodes, comma + 1);
      s = Connect(model, spaced, COLIBRI_NODE_REPLIES_EXACT, 1, &c, &direct);
      Check(s == COLIBRI_OK, "a node list with blanks and empty entries opens");
      if (s == COLIBRI_OK) {
        Check(SameAsLocal(direct, &c), "... and answers with the local bytes");
        colibri_free(direct);
      }
    }
  }

  /* A caller's shorter struct: the fields past struct_size keep their defaults. */
  colibri_direct_options_init(&options, sizeof(options));
  options.nodes = nodes;
  options.node_timeout_ms = 0; /* would be refused if read */
  options.struct_size = (uint32_t)offsetof(colibri_direct_options, cluster_file);
  direct = NULL;
  s = colibri_connect(model, &options, &direct);
  Check(s == COLIBRI_OK, "fields beyond a shorter struct_size take their defaults");
  if (s == COLIBRI_OK) {
    WaitServing(direct, &c);
    Check(SameAsLocal(direct, &c), "an engine opened with a shorter struct answers with the local bytes");
    colibri_free(direct);
  }

  /* A dead node beside the live ones is skipped. */
  snprintf(both, sizeof(both), "%s,%s", dead, nodes);
  s = Connect(model, both, COLIBRI_NODE_REPLIES_EXACT, 1, &c, &direct);
  Check(s == COLIBRI_OK, "colibri_connect with a dead node in the list opens");
  if (s == COLIBRI_OK) {
    Check(SameAsLocal(direct, &c), "with a dead node in the list, the answers are the local bytes");
    colibri_free(direct);
  }
  /* Only a dead node: the call fails UNAVAILABLE naming an expert, quickly. */
  s = Connect(model, dead, COLIBRI_NODE_REPLIES_EXACT, 0, &c, &direct);
  Check(s == COLIBRI_OK, "colibri_connect with only a dead node opens (it is retried in the background)");
  if (s == COLIBRI_OK) {
    float* out = malloc(sizeof(float) * c.values);
    CheckError(colibri_forward_batch(direct, 1, c.ids, kTokens, c.x, out), COLIBRI_UNAVAILABLE,
               "no live expert node serves it", "a call with no live node fails UNAVAILABLE naming the expert");
    free(out);
    colibri_free(direct);
  }

  /* call_timeout_ms bounds every call: the slow node holds it for 5 s. */
  colibri_direct_options_init(&options, sizeof(options));
  options.nodes = slow;
  options.call_timeout_ms = 300;
  direct = NULL;
  s = colibri_connect(model, &options, &direct);
  Check(s == COLIBRI_OK, "colibri_connect with call_timeout_ms 300 opens");
  if (s == COLIBRI_OK) {
    float* out = malloc(sizeof(float) * c.values);
    struct timespec start, end;
    double seconds;
    timespec_get(&start, TIME_UTC);
    s = colibri_forward_batch(direct, 1, c.ids, kTokens, c.x, out);
    timespec_get(&end, TIME_UTC);
    seconds = (double)(end.tv_sec - start.tv_sec) + 1e-9 * (double)(end.tv_nsec - start.tv_nsec);
    CheckError(s, COLIBRI_DEADLINE_EXCEEDED, "", "a call past call_timeout_ms fails DEADLINE_EXCEEDED");
    printf("  it returned after %.3f s\n", seconds);
    Check(seconds < 4.0, "... before the node answers (its 5 s hold)");
    free(out);
    colibri_free(direct);
  }

  colibri_free(local);
  free(c.x);
  free(c.want_lut);
  free(c.want_gate);
  free(c.want_client);
  free(c.gate_experts);
  free(c.gate_weights);
  free(c.client_experts);
  free(c.client_weights);
  printf("%s: %d failed\n", failures == 0 ? "PASS" : "FAIL", failures);
  return failures == 0 ? 0 : 1;
}
