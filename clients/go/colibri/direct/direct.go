// Package direct runs Colibri's router core inside a Go program and calls the
// expert nodes itself (proxyless): one network hop per layer instead of two.
// It is the C API's proxyless engine (colibri_connect in
// router_node/colibri.h, libcolibri.so) through cgo — the same C++ code as
// colibri-router, so the answers are the router's bytes.
//
//	e, err := direct.Open("/models/mixtral", direct.Options{
//		Nodes: []string{"10.0.0.5:50061", "10.0.0.6:50061"},
//	})
//	if err != nil { ... }
//	defer e.Close()
//	r, err := e.Forward(&colibri.ForwardArgs{Layer: 0, TokenIDs: ids, Hidden: hidden})
//
// Forward takes the colibri package's ForwardArgs and returns its
// ForwardResult, as colibri.Client.Forward does. What the proxyless engine
// does not do: f32 is the only dtype in and out (ForwardArgs.Tensor and
// OutputDType other than F32 are refused), it returns no timings, and its
// calls take no context (Options.CallTimeout bounds each one). Errors are
// *colibri.Error.
//
// Building needs cgo, router_node/colibri.h on the include path and
// libcolibri.so on the library path (clients/go/build.sh sets both from a
// Colibri build). An Engine is safe for concurrent use.
package direct

/*
#cgo LDFLAGS: -lcolibri
#include <stdlib.h>
#include <string.h>
#include "router_node/colibri.h"

// colibri_forward and, on failure, its message copied to err: one cgo call,
// so the thread-local message is read on the thread that set it.
static colibri_status forward_with_error(colibri_engine* engine, int32_t layer, int32_t routing,
                                         const int32_t* token_ids, int64_t n_tokens, const float* hidden_in,
                                         const int32_t* route_experts, const float* route_weights,
                                         float* hidden_out, int32_t* routes_out_experts, float* routes_out_weights,
                                         char* err, size_t err_size) {
  colibri_status s = colibri_forward(engine, layer, routing, token_ids, n_tokens, hidden_in, route_experts,
                                     route_weights, hidden_out, routes_out_experts, routes_out_weights);
  if (s != COLIBRI_OK) {
    strncpy(err, colibri_last_error(NULL), err_size - 1);
    err[err_size - 1] = '\0';
  }
  return s;
}

static colibri_status connect_with_error(const char* model_path, const colibri_direct_options* options,
                                         colibri_engine** out, char* err, size_t err_size) {
  colibri_status s = colibri_connect(model_path, options, out);
  if (s != COLIBRI_OK) {
    strncpy(err, colibri_last_error(NULL), err_size - 1);
    err[err_size - 1] = '\0';
  }
  return s;
}
*/
import "C"

import (
	"fmt"
	"runtime"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/colibri-moe/colibri/clients/go/colibri"
	"google.golang.org/grpc/codes"
)

// Options configures Open. The zero value of a field means its default.
type Options struct {
	// Nodes are the expert nodes' host:port; or ClusterFile names a file of
	// host:port lines ('#' comments), re-read when it changes. Exactly one.
	Nodes       []string
	ClusterFile string
	// NodeTimeout bounds each node call attempt (default 5 s); HedgeAfter
	// > 0 sends a silent node's work to a replica too (default off).
	NodeTimeout, HedgeAfter time.Duration
	// NodeReplies is what nodes return: "exact" (default), "partial" or
	// "per_expert" (docs/ROUTER.md).
	NodeReplies string
	// MaxTokens per Forward (default 65536).
	MaxTokens int
	// CallTimeout > 0 fails a Forward with codes.DeadlineExceeded after it
	// (default: none; each node attempt is bounded by NodeTimeout).
	CallTimeout time.Duration
	// BatchWindow merges concurrent Forward calls of one layer into one call
	// per node (default 5 ms, as the router; negative: off); BatchMaxTokens
	// caps a merged call (default 256).
	BatchWindow    time.Duration
	BatchMaxTokens int
	// TLS to the nodes: CAFile (required: unlike colibri.Client, the engine
	// does not fall back to the system's roots), CertFile/KeyFile for mutual
	// TLS, ServerName to check instead of the node's host.
	TLS *colibri.TLSOptions
}

// Info is the model's shape.
type Info struct {
	DModel, DFF, Layers, Experts, TopK, VocabSize int
	WeightType, ModelID                           string
}

// Engine is an open proxyless engine. Create it with Open; Close it when done.
type Engine struct {
	mu     sync.RWMutex // Forward holds it shared; Close exclusively
	engine *C.colibri_engine
	info   Info
}

const errSize = 1024

// millis is d in whole milliseconds, rounded up: a positive duration under
// 1 ms stays on (1 ms) rather than becoming 0 ("off").
func millis(d time.Duration) int64 {
	if d <= 0 {
		return int64(d / time.Millisecond)
	}
	return int64((d + time.Millisecond - 1) / time.Millisecond)
}

func newError(code C.colibri_status, message string) error {
	return &colibri.Error{Code: codes.Code(code), Message: message}
}

// Open reads the routing of the model in modelDir (the directory the nodes
// serve: manifest, gates, LUTs), checks the nodes once and returns the
// engine. Nodes that are down are retried in the background; a call whose
// experts have no live node fails with codes.Unavailable naming the expert.
func Open(modelDir string, opts Options) (*Engine, error) {
	var o C.colibri_direct_options
	C.colibri_direct_options_init(&o, C.uint32_t(unsafe.Sizeof(o)))
	var frees []unsafe.Pointer
	defer func() {
		for _, p := range frees {
			C.free(p)
		}
	}()
	cstr := func(s string) *C.char {
		if s == "" {
			return nil
		}
		p := C.CString(s)
		frees = append(frees, unsafe.Pointer(p))
		return p
	}
	o.nodes = cstr(strings.Join(opts.Nodes, ","))
	o.cluster_file = cstr(opts.ClusterFile)
	if opts.NodeTimeout != 0 {
		o.node_timeout_ms = C.int64_t(millis(opts.NodeTimeout))
	}
	o.hedge_after_ms = C.int64_t(millis(opts.HedgeAfter))
	switch opts.NodeReplies {
	case "", "exact":
		o.node_replies = C.COLIBRI_NODE_REPLIES_EXACT
	case "partial":
		o.node_replies = C.COLIBRI_NODE_REPLIES_PARTIAL
	case "per_expert":
		o.node_replies = C.COLIBRI_NODE_REPLIES_PER_EXPERT
	default:
		return nil, newError(C.COLIBRI_INVALID_ARGUMENT,
			fmt.Sprintf("Options.NodeReplies %q is not exact, partial or per_expert", opts.NodeReplies))
	}
	if opts.MaxTokens != 0 {
		o.max_tokens = C.int64_t(opts.MaxTokens)
	}
	o.call_timeout_ms = C.int64_t(millis(opts.CallTimeout))
	switch {
	case opts.BatchWindow < 0:
		o.batch_window_us = 0
	case opts.BatchWindow > 0:
		o.batch_window_us = C.int64_t((opts.BatchWindow + time.Microsecond - 1) / time.Microsecond)
	}
	if opts.BatchMaxTokens != 0 {
		o.batch_max_tokens = C.int64_t(opts.BatchMaxTokens)
	}
	if t := opts.TLS; t != nil {
		if t.CAFile == "" {
			return nil, newError(C.COLIBRI_INVALID_ARGUMENT,
				"Options.TLS.CAFile is empty: the proxyless engine checks the nodes against a CA file "+
					"(it does not use the system's roots); without TLS, leave Options.TLS nil")
		}
		o.tls_ca_file = cstr(t.CAFile)
		o.tls_cert_file = cstr(t.CertFile)
		o.tls_key_file = cstr(t.KeyFile)
		o.tls_server_name = cstr(t.ServerName)
	}
	path := C.CString(modelDir)
	defer C.free(unsafe.Pointer(path))
	var err [errSize]C.char
	var handle *C.colibri_engine
	if s := C.connect_with_error(path, &o, &handle, &err[0], errSize); s != C.COLIBRI_OK {
		return nil, newError(s, C.GoString(&err[0]))
	}
	e := &Engine{engine: handle}
	var info C.colibri_model_info
	if s := C.colibri_get_model_info(e.engine, &info); s != C.COLIBRI_OK {
		C.colibri_free(handle)
		return nil, newError(s, "colibri_get_model_info failed on a new engine")
	}
	e.info = Info{DModel: int(info.d_model), DFF: int(info.d_ff), Layers: int(info.n_layers),
		Experts: int(info.n_experts), TopK: int(info.top_k), VocabSize: int(info.vocab_size),
		WeightType: C.GoString(&info.weight_type[0]), ModelID: C.GoString(&info.model_id[0])}
	// An engine dropped without Close still releases its connections and
	// threads, on a goroutine of its own: colibri_free may wait seconds for
	// node calls, and the runtime runs every finalizer on one goroutine.
	runtime.SetFinalizer(e, func(e *Engine) { go e.Close() })
	return e, nil
}

// Info returns the model's shape.
func (e *Engine) Info() Info { return e.info }

// Forward runs one layer for a batch of tokens, as colibri.Client.Forward:
// Hidden holds T rows of d_model float32 values; Routing, Routes (top_k of
// the model) and ReturnRoutes as there. RequestID is echoed in the result.
// Tensor, an OutputDType other than F32 and ReturnTimings are refused
// (codes.InvalidArgument).
func (e *Engine) Forward(args *colibri.ForwardArgs) (*colibri.ForwardResult, error) {
	invalid := func(format string, a ...interface{}) error {
		return newError(C.COLIBRI_INVALID_ARGUMENT, fmt.Sprintf(format, a...))
	}
	switch {
	case args == nil:
		return nil, invalid("ForwardArgs is nil")
	case args.Tensor != nil:
		return nil, invalid("ForwardArgs.Tensor: the proxyless engine takes f32 Hidden only")
	case args.OutputDType != colibri.F32:
		return nil, invalid("ForwardArgs.OutputDType %d: the proxyless engine answers in f32 only", args.OutputDType)
	case args.ReturnTimings:
		return nil, invalid("ForwardArgs.ReturnTimings: the proxyless engine returns no timings")
	}
	if args.Layer < 0 || args.Layer >= e.info.Layers {
		return nil, invalid("layer %d is outside [0, %d)", args.Layer, e.info.Layers)
	}
	d, k := e.info.DModel, e.info.TopK
	if len(args.Hidden)%d != 0 {
		return nil, invalid("hidden has %d values, not a multiple of d_model %d", len(args.Hidden), d)
	}
	tokens := len(args.Hidden) / d
	var routing C.int32_t
	var routeExperts *C.int32_t
	var routeWeights *C.float
	switch args.Routing {
	case colibri.RoutingLUT:
		routing = C.COLIBRI_ROUTING_LUT
		if len(args.TokenIDs) != tokens {
			return nil, invalid("%d token ids for %d rows of hidden states", len(args.TokenIDs), tokens)
		}
	case colibri.RoutingGate:
		routing = C.COLIBRI_ROUTING_GATE
	case colibri.RoutingClient:
		routing = C.COLIBRI_ROUTING_CLIENT
		r := args.Routes
		if r == nil || r.TopK != k || len(r.ExpertIDs) != tokens*k || len(r.Weights) != tokens*k {
			return nil, invalid("client routing needs Routes of top_k %d with %d expert ids and weights", k, tokens*k)
		}
		if tokens > 0 {
			routeExperts = (*C.int32_t)(unsafe.Pointer(&r.ExpertIDs[0]))
			routeWeights = (*C.float)(unsafe.Pointer(&r.Weights[0]))
		}
	default:
		return nil, invalid("routing %d is not a known mode", args.Routing)
	}
	result := &colibri.ForwardResult{Output: make([]float32, tokens*d), Tokens: tokens, DModel: d,
		RequestID: args.RequestID}
	var ids *C.int32_t
	var hidden, out *C.float
	var usedExperts *C.int32_t
	var usedWeights *C.float
	if tokens > 0 {
		if len(args.TokenIDs) > 0 {
			ids = (*C.int32_t)(unsafe.Pointer(&args.TokenIDs[0]))
		}
		hidden = (*C.float)(unsafe.Pointer(&args.Hidden[0]))
		out = (*C.float)(unsafe.Pointer(&result.Output[0]))
		if args.ReturnRoutes {
			result.Routes = &colibri.Routes{TopK: k, ExpertIDs: make([]int32, tokens*k), Weights: make([]float32, tokens*k)}
			usedExperts = (*C.int32_t)(unsafe.Pointer(&result.Routes.ExpertIDs[0]))
			usedWeights = (*C.float)(unsafe.Pointer(&result.Routes.Weights[0]))
		}
	} else if args.ReturnRoutes {
		result.Routes = &colibri.Routes{TopK: k}
	}
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.engine == nil {
		return nil, newError(C.COLIBRI_FAILED_PRECONDITION, "the engine is closed")
	}
	var err [errSize]C.char
	s := C.forward_with_error(e.engine, C.int32_t(args.Layer), routing, ids, C.int64_t(tokens), hidden, routeExperts,
		routeWeights, out, usedExperts, usedWeights, &err[0], errSize)
	if s != C.COLIBRI_OK {
		return nil, newError(s, C.GoString(&err[0]))
	}
	return result, nil
}

// Close waits for the calls in flight, then releases the engine (its node
// channels and health checks). Later calls fail with
// codes.FailedPrecondition. Idempotent.
func (e *Engine) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.engine != nil {
		C.colibri_free(e.engine)
		e.engine = nil
		runtime.SetFinalizer(e, nil)
	}
	return nil
}
