package colibri

import (
	"context"
	"math"
	"time"

	pb "github.com/colibri-moe/colibri/clients/go/colibriv1"
	"google.golang.org/grpc/codes"
)

// Routing selects how the router picks each token's experts.
type Routing int

const (
	// RoutingLUT uses the model's per-layer lookup table, indexed by token
	// id (ForwardArgs.TokenIDs required). The default.
	RoutingLUT Routing = iota
	// RoutingGate computes softmax(gate · hidden) and takes the top k.
	RoutingGate
	// RoutingClient uses ForwardArgs.Routes as given.
	RoutingClient
)

// DType is the element type of an output tensor.
type DType int

const (
	F32  DType = iota // IEEE binary32; the default
	BF16              // bfloat16, rounded once from the fp32 sum (nearest even)
	F16               // IEEE binary16, rounded once from the fp32 sum
)

// Routes are the experts of T tokens and their weights: ExpertIDs[t*TopK+j]
// and Weights[t*TopK+j] for token t and rank j.
type Routes struct {
	TopK      int
	ExpertIDs []int32
	Weights   []float32
}

// ForwardArgs is one layer for a batch of T tokens.
type ForwardArgs struct {
	// Layer is the MoE layer, in [0, n_layers).
	Layer int
	// TokenIDs holds one id per token; required with RoutingLUT.
	TokenIDs []int32
	// Hidden holds the tokens' hidden states, T rows of d_model values
	// (sent as f32; T = len(Hidden) / d_model, d_model asked of the router
	// once per Client). Ignored when Tensor is set.
	Hidden []float32
	// Tensor, when set, is the hidden states already packed ([T, d_model],
	// f32, bf16 or f16; see PackF32 and PackBF16).
	Tensor *pb.Tensor
	// Routing is the routing mode; Routes are the routes for RoutingClient.
	Routing Routing
	Routes  *Routes
	// OutputDType is the dtype the router sends the output in; the result
	// is unpacked to float32 whatever it is.
	OutputDType DType
	// RequestID is an optional id passed to the nodes and kept in logs.
	RequestID string
	// ReturnRoutes and ReturnTimings ask for the routes used and per-stage
	// timings in the result.
	ReturnRoutes, ReturnTimings bool
}

// Timing is the time spent in one stage of a call: "route", "dispatch",
// "aggregate", "total", "node:node-<i>", "node_compute:node-<i>", "local".
type Timing struct {
	Stage    string
	Duration time.Duration
	// Start is the offset from the start of the router's call (route
	// starts at 0); a node_compute span is placed at the end of its call.
	Start time.Duration
	// Detail describes node calls: "experts 0,3 rows 5" (+ " retry").
	Detail string
}

// ForwardResult is the output of one layer.
type ForwardResult struct {
	// Output holds Tokens rows of DModel values.
	Output         []float32
	Tokens, DModel int
	// Routes used, when ForwardArgs.ReturnRoutes was set; else nil.
	Routes *Routes
	// Timings in the router's order, when ForwardArgs.ReturnTimings was set.
	Timings []Timing
	// RequestID is ForwardArgs.RequestID (echoed by the router on a Session).
	RequestID string
}

// AsyncResult is what ForwardAsync delivers: a result or an error.
type AsyncResult struct {
	Result *ForwardResult
	Err    error
}

// Forward runs one layer for a batch of tokens. On failure the error is an
// *Error with the router's code and message.
func (c *Client) Forward(ctx context.Context, args *ForwardArgs) (*ForwardResult, error) {
	ctx, cancel := c.withTimeout(ctx)
	defer cancel()
	req, err := c.request(ctx, args)
	if err != nil {
		return nil, err
	}
	resp, err := c.router.Forward(ctx, req)
	if err != nil {
		return nil, toError(err)
	}
	return result(resp, req, args.RequestID)
}

// ForwardAsync runs Forward in its own goroutine and delivers its outcome on
// the returned channel (buffered: the goroutine never waits for a reader).
// args and the slices it refers to must not change until then.
func (c *Client) ForwardAsync(ctx context.Context, args *ForwardArgs) <-chan AsyncResult {
	ch := make(chan AsyncResult, 1)
	go func() {
		r, err := c.Forward(ctx, args)
		ch <- AsyncResult{Result: r, Err: err}
	}()
	return ch
}

// request builds the wire request; d_model comes from the router when the
// hidden states are given as a plain slice.
func (c *Client) request(ctx context.Context, a *ForwardArgs) (*pb.ForwardRequest, error) {
	if a == nil {
		return nil, errorf(codes.InvalidArgument, "ForwardArgs is nil")
	}
	// The wire's fields are int32: a wider value is refused, not wrapped.
	if a.Layer < math.MinInt32 || a.Layer > math.MaxInt32 {
		return nil, errorf(codes.InvalidArgument, "layer %d does not fit the request's int32", a.Layer)
	}
	if a.Routes != nil && (a.Routes.TopK < math.MinInt32 || a.Routes.TopK > math.MaxInt32) {
		return nil, errorf(codes.InvalidArgument, "routes top_k %d does not fit the request's int32", a.Routes.TopK)
	}
	req := &pb.ForwardRequest{
		Layer:         int32(a.Layer),
		TokenIds:      a.TokenIDs,
		Hidden:        a.Tensor,
		RequestId:     a.RequestID,
		ReturnRoutes:  a.ReturnRoutes,
		ReturnTimings: a.ReturnTimings,
	}
	switch a.Routing {
	case RoutingLUT:
		req.Routing = pb.RoutingMode_ROUTING_MODE_LUT
	case RoutingGate:
		req.Routing = pb.RoutingMode_ROUTING_MODE_GATE
	case RoutingClient:
		req.Routing = pb.RoutingMode_ROUTING_MODE_CLIENT
	default:
		return nil, errorf(codes.InvalidArgument, "routing %d is not a known mode", a.Routing)
	}
	switch a.OutputDType {
	case F32:
		req.OutputDtype = pb.DataType_DATA_TYPE_F32
	case BF16:
		req.OutputDtype = pb.DataType_DATA_TYPE_BF16
	case F16:
		req.OutputDtype = pb.DataType_DATA_TYPE_F16
	default:
		return nil, errorf(codes.InvalidArgument, "output dtype %d is not a known dtype", a.OutputDType)
	}
	if a.Routes != nil {
		req.Routes = &pb.Routes{TopK: int32(a.Routes.TopK), ExpertIds: a.Routes.ExpertIDs, Weights: a.Routes.Weights}
	}
	if req.Hidden == nil {
		d, err := c.modelDim(ctx)
		if err != nil {
			return nil, err
		}
		if len(a.Hidden)%d != 0 {
			return nil, errorf(codes.InvalidArgument,
				"hidden has %d values, not a multiple of d_model %d", len(a.Hidden), d)
		}
		req.Hidden = PackF32(a.Hidden, int64(len(a.Hidden)/d), int64(d))
	}
	return req, nil
}

// result unpacks the reply to req; one that does not answer it (another
// shape than req's rows, routes of other lengths) is codes.Internal, so a
// caller may index the output by the rows it sent.
func result(resp *pb.ForwardResponse, req *pb.ForwardRequest, requestID string) (*ForwardResult, error) {
	out, err := Unpack(resp.Output)
	if err != nil {
		return nil, errorf(codes.Internal, "router reply: output: %v", err)
	}
	shape, asked := resp.Output.Shape, req.Hidden.GetShape()
	if len(shape) != 2 || len(asked) != 2 || shape[0] != asked[0] || shape[1] != asked[1] {
		return nil, errorf(codes.Internal, "router reply: output shape %v for hidden states of shape %v", shape, asked)
	}
	r := &ForwardResult{Output: out, Tokens: int(shape[0]), DModel: int(shape[1]), RequestID: requestID}
	if rt := resp.Routes; rt != nil {
		slots := int64(rt.TopK) * shape[0]
		if rt.TopK < 0 || int64(len(rt.ExpertIds)) != slots || int64(len(rt.Weights)) != slots {
			return nil, errorf(codes.Internal, "router reply: routes of top_k %d with %d ids and %d weights for %d tokens",
				rt.TopK, len(rt.ExpertIds), len(rt.Weights), shape[0])
		}
		r.Routes = &Routes{TopK: int(rt.TopK), ExpertIDs: rt.ExpertIds, Weights: rt.Weights}
	}
	for _, t := range resp.Timings {
		r.Timings = append(r.Timings, Timing{Stage: t.Stage, Duration: time.Duration(t.Nanos),
			Start: time.Duration(t.StartNanos), Detail: t.Detail})
	}
	return r, nil
}
