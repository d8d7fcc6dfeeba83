#ifndef COLIBRI_ROUTER_NODE_COLIBRI_H_
#define COLIBRI_ROUTER_NODE_COLIBRI_H_

/* The Colibri C API: colibri::Engine (router_node/engine.h) behind a stable
 * C ABI, for C programs and for other languages' foreign-function layers —
 * or, opened with colibri_connect, the router's core calling expert nodes
 * itself (proxyless).
 * Plain C89/C99 and C++; no C++ types cross it and no exception escapes it.
 *
 *   colibri_engine* engine = NULL;
 *   if (colibri_init("model/", NULL, &engine) != COLIBRI_OK) {
 *     fprintf(stderr, "%s\n", colibri_last_error(NULL));
 *   }
 *   colibri_forward_batch(engine, layer, token_ids, n_tokens, hidden, out);
 *   colibri_free(engine);
 *
 * Errors: every call that can fail returns a colibri_status (0 is success)
 * and leaves a message naming the argument or file and the reason in
 * colibri_last_error(). A failed call writes nothing to its outputs, except
 * colibri_init and colibri_connect, which set *out to NULL.
 *
 * Thread safety: colibri_forward_batch, colibri_forward and
 * colibri_get_model_info may run concurrently on one engine from any number
 * of threads. colibri_free waits for the calls in progress on its engine;
 * a call on an engine freed already (or being freed), or on a pointer that
 * colibri_init or colibri_connect did not return, is INVALID_ARGUMENT, and
 * a second colibri_free of it does nothing. (A freed handle's address may
 * be given to a later engine, which such a stale handle then reaches: do
 * not keep handles past colibri_free.)
 *
 * ABI: only colibri_* functions are exported. colibri_options and
 * colibri_direct_options carry their size so later versions can append
 * fields; colibri_model_info is fixed for
 * ABI version 1 (growing it takes a new function). Enum values are never
 * renumbered; a new one is only appended. */

#include <stdint.h>

#if defined(__GNUC__)
#define COLIBRI_EXPORT __attribute__((visibility("default")))
#else
#define COLIBRI_EXPORT
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define COLIBRI_ABI_VERSION 1

/* COLIBRI_ABI_VERSION of the library actually loaded; a program may refuse
 * to run if it differs from the header it was compiled with. */
COLIBRI_EXPORT int colibri_abi_version(void);

/* The absl / gRPC canonical codes, with their numbers. */
typedef enum colibri_status {
  COLIBRI_OK = 0,
  COLIBRI_CANCELLED = 1,
  COLIBRI_UNKNOWN = 2,
  COLIBRI_INVALID_ARGUMENT = 3,
  COLIBRI_DEADLINE_EXCEEDED = 4,
  COLIBRI_NOT_FOUND = 5,
  COLIBRI_ALREADY_EXISTS = 6,
  COLIBRI_PERMISSION_DENIED = 7,
  COLIBRI_RESOURCE_EXHAUSTED = 8,
  COLIBRI_FAILED_PRECONDITION = 9,
  COLIBRI_ABORTED = 10,
  COLIBRI_OUT_OF_RANGE = 11,
  COLIBRI_UNIMPLEMENTED = 12,
  COLIBRI_INTERNAL = 13,
  COLIBRI_UNAVAILABLE = 14,
  COLIBRI_DATA_LOSS = 15,
  COLIBRI_UNAUTHENTICATED = 16
} colibri_status;

/* An open model. Opaque; created by colibri_init or colibri_connect,
 * destroyed by colibri_free. */
typedef struct colibri_engine colibri_engine;

/* Engine options. Always start from colibri_options_init, then change
 * fields. struct_size is how many bytes of this struct the caller filled:
 * fields that end beyond it take their defaults, so a program built against
 * an older, shorter struct keeps working; bytes beyond the library's own
 * sizeof (a newer caller) are ignored. Booleans are 0 or non-zero. */
typedef struct colibri_options {
  uint32_t struct_size;     /* sizeof(colibri_options); 0 is INVALID_ARGUMENT */
  int32_t threads;          /* compute threads; 0: one per allowed CPU (of numa_node) */
  int32_t numa_node;        /* >= 0: bind threads and weight copies to it; -1: none */
  int32_t lock_memory;      /* mlock the weights (refusal is not an error) */
  int32_t verify_checksums; /* hash every model file at load */
  int64_t max_tokens;       /* tokens per forward call; more: RESOURCE_EXHAUSTED */
} colibri_options;

/* Fills the defaults: struct_size = sizeof(colibri_options), threads 0,
 * numa_node -1, lock_memory 0, verify_checksums 1, max_tokens 65536.
 * NULL is a no-op. It writes the library's sizeof(colibri_options): the
 * struct keeps its ABI version 1 size, and fields added to it would come
 * with a sized init like colibri_direct_options_init. */
COLIBRI_EXPORT void colibri_options_init(colibri_options* options);

/* Loads every expert, gate and LUT of the converted model in `model_path`
 * (made by colibri-convert). `options` may be NULL for the defaults; it is
 * read during the call only. On success *out is a new engine the caller
 * owns and must pass to colibri_free. On failure *out is NULL (if `out` is
 * not) and the status is NOT_FOUND for a missing file, DATA_LOSS for a
 * checksum mismatch, INVALID_ARGUMENT for a malformed file or option,
 * FAILED_PRECONDITION when lock_memory is set (or numa_node, which copies
 * the weights) and the weights would not fit
 * in the memory limit of the process's cgroup (beside 256 MiB for the
 * process; checked before anything is locked), RESOURCE_EXHAUSTED when
 * memory runs out. Thread-safe. The weights stay mapped from their files: a
 * file truncated in place later makes the calls that read it DATA_LOSS,
 * naming it, never a crash or zeros. For that colibri_init (and
 * colibri_connect, for the routing files) installs a process-wide SIGBUS
 * handler; a SIGBUS that is not such a file's goes on to the handler the
 * program had installed before its first engine, else to the default
 * action (a SIGBUS handler installed later is replaced at the next load). */
COLIBRI_EXPORT colibri_status colibri_init(const char* model_path, const colibri_options* options,
                                           colibri_engine** out);

/* Proxyless: the router's core in this process, calling expert nodes
 * (colibri-expert) directly — routes from the model's gates and LUTs in
 * model_path (the directory the nodes serve), the plan, one gRPC call per
 * node, health checks every 500 ms, failover to replicas, hedging; the same
 * code as colibri-router, with one network hop per layer instead of two. An
 * engine from colibri_connect takes every call below exactly as one from
 * colibri_init, and answers with the router's bytes. */

/* What nodes return (colibri-router's --node_replies). */
typedef enum colibri_node_replies {
  COLIBRI_NODE_REPLIES_EXACT = 1,     /* one row per token where that keeps the bits (default) */
  COLIBRI_NODE_REPLIES_PARTIAL = 2,   /* per-token partial sums (f32 for split tokens) */
  COLIBRI_NODE_REPLIES_PER_EXPERT = 3 /* one row per (token, expert) */
} colibri_node_replies;

/* Options of colibri_connect; struct_size as in colibri_options. Strings
 * are read during colibri_connect only; NULL and "" mean unset. Each value
 * outside its range is INVALID_ARGUMENT naming the field. */
typedef struct colibri_direct_options {
  uint32_t struct_size;        /* sizeof(colibri_direct_options); 0 is INVALID_ARGUMENT */
  const char* nodes;           /* "host:port,host:port,...": the expert nodes; or: */
  const char* cluster_file;    /* a file of host:port lines ('#' comments), re-read on change */
  int64_t node_timeout_ms;     /* per node call attempt; 1 .. 3 600 000 */
  int64_t hedge_after_ms;      /* > 0: a node silent this long gets its work sent to a replica too; 0: off;
                                  at most 3 600 000 */
  int32_t node_replies;        /* a colibri_node_replies value */
  int64_t max_tokens;          /* tokens per forward call (1 .. 2^24); more: RESOURCE_EXHAUSTED */
  int64_t call_timeout_ms;     /* > 0: a forward call fails DEADLINE_EXCEEDED after this; 0: none;
                                  at most 86 400 000 */
  int64_t batch_window_us;     /* > 0: concurrent calls of one layer are merged into one per node; 0: off;
                                  at most 1 000 000 */
  int64_t batch_max_tokens;    /* tokens of one merged call; >= 1 */
  const char* tls_ca_file;     /* TLS to the nodes: a CA (PEM) turns it on; */
  const char* tls_cert_file;   /* cert + key add a client certificate (mutual TLS); */
  const char* tls_key_file;
  const char* tls_server_name; /* overrides the name checked in the node's certificate */
} colibri_direct_options;

/* Fills the defaults into the first `size` bytes of *options — pass
 * sizeof(colibri_direct_options) as the caller sees it, so a library newer
 * than the caller's header never writes past the caller's struct: fields
 * that do not fit whole are left alone, and struct_size becomes
 * min(size, the library's sizeof). Defaults: nodes and cluster_file NULL,
 * node_timeout_ms 5000, hedge_after_ms 0, node_replies EXACT, max_tokens
 * 65536, call_timeout_ms 0, batch_window_us 5000, batch_max_tokens 256, no
 * TLS. NULL is a no-op. */
COLIBRI_EXPORT void colibri_direct_options_init(colibri_direct_options* options, uint32_t size);

/* Opens a proxyless engine on the nodes named by exactly one of `nodes` and
 * `cluster_file`, for the model in `model_path` (its manifest, gates and
 * LUTs are read here; the experts' weights live on the nodes). Checks the
 * nodes once before returning; nodes that are down then are retried in the
 * background, and a call whose experts have no live node fails UNAVAILABLE
 * naming the expert. On failure *out is NULL and the status is
 * INVALID_ARGUMENT for bad options (naming the field) or a malformed model
 * file, NOT_FOUND for a missing file (or cluster file), DATA_LOSS for a
 * gate or LUT whose checksum does not match. Not hot-swappable: a new model version
 * is a new engine (colibri_connect again, then colibri_free the old one once
 * its calls have returned). Thread-safe. */
COLIBRI_EXPORT colibri_status colibri_connect(const char* model_path, const colibri_direct_options* options,
                                              colibri_engine** out);

/* The common call: one MoE layer for a batch, routed by the model's
 * token -> experts table (LUT). `token_ids` holds n_tokens ids in
 * [0, vocab_size); `hidden_in` and `hidden_out` hold n_tokens * d_model f32
 * values, row-major [n_tokens][d_model]; they must not overlap. n_tokens 0
 * checks the other arguments and writes nothing (the pointers may then be
 * NULL). Errors: INVALID_ARGUMENT naming the argument (a NULL pointer, a
 * negative n_tokens, a layer outside [0, n_layers), a token id outside the
 * vocabulary), RESOURCE_EXHAUSTED over max_tokens; hidden_out is then left
 * as it was. A proxyless engine may also fail with a node's code
 * (UNAVAILABLE when an expert has no live node, DEADLINE_EXCEEDED past
 * call_timeout_ms). Thread-safe; the output bits depend only on the
 * inputs (a proxyless engine with NODE_REPLIES_PARTIAL: also on which node
 * holds which experts, docs/ROUTER.md). */
COLIBRI_EXPORT colibri_status colibri_forward_batch(colibri_engine* engine, int32_t layer, const int32_t* token_ids,
                                                    int64_t n_tokens, const float* hidden_in, float* hidden_out);

/* How colibri_forward picks each token's top_k experts and their weights. */
typedef enum colibri_routing {
  COLIBRI_ROUTING_LUT = 1,   /* by token id, from the model's table */
  COLIBRI_ROUTING_GATE = 2,  /* softmax top-k of the gate over hidden_in */
  COLIBRI_ROUTING_CLIENT = 3 /* the caller's route_experts / route_weights */
} colibri_routing;

/* The general call. Arguments as colibri_forward_batch, and:
 *   routing          a colibri_routing value, passed as int32_t so that an
 *                    unknown value is refused rather than undefined in C++;
 *   token_ids        read in LUT mode only (may be NULL otherwise);
 *   route_experts,   read in CLIENT mode only (may be NULL otherwise):
 *   route_weights    n_tokens * top_k expert ids / weights, token-major;
 *                    ids in [0, n_experts), none repeated within a token,
 *                    finite weights;
 *   routes_out_experts, routes_out_weights
 *                    optional (NULL: not wanted); receive the routes used,
 *                    n_tokens * top_k each, in the same layout; passing
 *                    them back in CLIENT mode gives the same output bits.
 * In GATE mode hidden_in must be finite. Errors as colibri_forward_batch,
 * plus INVALID_ARGUMENT for an unknown routing or bad client routes; on
 * failure no output is written. Thread-safe. */
COLIBRI_EXPORT colibri_status colibri_forward(colibri_engine* engine, int32_t layer, int32_t routing,
                                              const int32_t* token_ids, int64_t n_tokens, const float* hidden_in,
                                              const int32_t* route_experts, const float* route_weights,
                                              float* hidden_out, int32_t* routes_out_experts,
                                              float* routes_out_weights);

/* The model's shape. Strings are NUL-terminated, truncated to fit. */
typedef struct colibri_model_info {
  int64_t d_model;
  int64_t d_ff;
  int64_t n_layers;
  int64_t n_experts;
  int64_t top_k;
  int64_t vocab_size;
  char weight_type[8]; /* "f32", "bf16", "f16", "int8" or "int4" */
  char model_id[64];   /* "xxh3_128:<hex>", the checksum of manifest.json */
} colibri_model_info;

/* Fills *out. INVALID_ARGUMENT if engine or out is NULL. Thread-safe.
 * (Named get_ because C puts a function and a typedef in one namespace.) */
COLIBRI_EXPORT colibri_status colibri_get_model_info(const colibri_engine* engine, colibri_model_info* out);

/* The model's shared experts: *count experts of *d_ff each, always on, run
 * for every token after its routed ones (0 and 0 when it has none; routes in
 * and out of colibri_forward_batch are the routed ones only). INVALID_ARGUMENT
 * if an argument is NULL. Thread-safe. (A function of its own, as
 * colibri_model_info is fixed for ABI version 1.) */
COLIBRI_EXPORT colibri_status colibri_get_shared_experts(const colibri_engine* engine, int64_t* count, int64_t* d_ff);

/* The message of the calling thread's most recent status-returning colibri_*
 * call if that call failed, else "" (every such call clears it first).
 * Messages are per thread, not per engine: `engine` is ignored and may be
 * NULL. Never NULL; the text is owned by the library and stays valid until
 * the thread's next status-returning call; at most 1023 bytes (longer is cut). */
COLIBRI_EXPORT const char* colibri_last_error(const colibri_engine* engine);

/* Releases the engine and its weights (a proxyless one: its channels and
 * health checks), once the calls in progress on it have returned; calls
 * that start meanwhile or later are INVALID_ARGUMENT. NULL, an engine freed
 * already or a pointer that is not an engine: nothing happens. */
COLIBRI_EXPORT void colibri_free(colibri_engine* engine);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* COLIBRI_ROUTER_NODE_COLIBRI_H_ */
