package colibri

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	pb "github.com/colibri-moe/colibri/clients/go/colibriv1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
)

// --- Tensor helpers: no router needed.

func TestPackBF16RoundsToNearestEven(t *testing.T) {
	cases := []struct {
		in   uint32 // f32 bits
		want uint16
	}{
		{0x3F800000, 0x3F80}, // 1.0 exact
		{0x3F808000, 0x3F80}, // tie, even below: stays
		{0x3F818000, 0x3F82}, // tie, odd below: rounds up to even
		{0x3F808001, 0x3F81}, // just above the tie: up
		{0x3F807FFF, 0x3F80}, // just below the tie: down
		{0xBF818000, 0xBF82}, // negative tie
		{0x7F7FFFFF, 0x7F80}, // max f32 rounds to +inf
		{0x7F800000, 0x7F80}, // +inf
		{0xFF800000, 0xFF80}, // -inf
		{0x00000001, 0x0000}, // tiny subnormal to zero
		{0x80000000, 0x8000}, // -0
	}
	for _, c := range cases {
		tensor := PackBF16([]float32{math.Float32frombits(c.in)})
		got := uint16(tensor.Data[0]) | uint16(tensor.Data[1])<<8
		if got != c.want {
			t.Errorf("PackBF16(%#08x) = %#04x, want %#04x", c.in, got, c.want)
		}
	}
	// NaNs stay NaN, even when their payload lies only in the low 16 bits.
	for _, bits := range []uint32{0x7FC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF} {
		back, err := Unpack(PackBF16([]float32{math.Float32frombits(bits)}))
		if err != nil || !math.IsNaN(float64(back[0])) {
			t.Errorf("PackBF16 of NaN %#08x unpacks to %v (%v)", bits, back, err)
		}
	}
}

func TestPackAndUnpackKeepValuesAndShape(t *testing.T) {
	in := []float32{1, -2.5, 0.15625, 3e-5, float32(math.Inf(-1)), 65504}
	f32 := PackF32(in, 2, 3)
	if f32.Dtype != pb.DataType_DATA_TYPE_F32 || len(f32.Data) != 24 || fmt.Sprint(f32.Shape) != "[2 3]" {
		t.Fatalf("PackF32: %v %v %d bytes", f32.Dtype, f32.Shape, len(f32.Data))
	}
	out, err := Unpack(f32)
	if err != nil || fmt.Sprint(out) != fmt.Sprint(in) {
		t.Fatalf("Unpack(PackF32(x)) = %v, %v; want %v", out, err, in)
	}
	if s := PackBF16(in).Shape; fmt.Sprint(s) != "[6]" {
		t.Errorf("PackBF16 default shape %v, want [6]", s)
	}
	out, err = Unpack(PackBF16([]float32{1, -2.5, 0.15625}, 3))
	if err != nil || fmt.Sprint(out) != "[1 -2.5 0.15625]" {
		t.Errorf("Unpack(PackBF16(x)) = %v, %v", out, err)
	}
}

func TestUnpackF16(t *testing.T) {
	cases := []struct {
		bits uint16
		want float32
	}{
		{0x3C00, 1}, {0xC000, -2}, {0x7BFF, 65504}, {0x3555, 0.333251953125},
		{0x0001, 5.9604645e-08}, // smallest subnormal, 2^-24
		{0x03FF, 6.097555e-05},  // largest subnormal
		{0x0400, 6.1035156e-05}, // smallest normal
		{0x8000, float32(math.Copysign(0, -1))},
		{0x7C00, float32(math.Inf(1))}, {0xFC00, float32(math.Inf(-1))},
	}
	data := make([]byte, 0, 2*len(cases))
	for _, c := range cases {
		data = append(data, byte(c.bits), byte(c.bits>>8))
	}
	out, err := Unpack(&pb.Tensor{Dtype: pb.DataType_DATA_TYPE_F16, Shape: []int64{int64(len(cases))}, Data: data})
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range cases {
		if math.Float32bits(out[i]) != math.Float32bits(c.want) {
			t.Errorf("f16 %#04x unpacks to %g, want %g", c.bits, out[i], c.want)
		}
	}
	nan, err := Unpack(&pb.Tensor{Dtype: pb.DataType_DATA_TYPE_F16, Shape: []int64{1}, Data: []byte{0x01, 0x7E}})
	if err != nil || !math.IsNaN(float64(nan[0])) {
		t.Errorf("f16 NaN unpacks to %v, %v", nan, err)
	}
}

func TestUnpackRefusesMalformedTensors(t *testing.T) {
	cases := map[string]*pb.Tensor{
		"bytes":    {Dtype: pb.DataType_DATA_TYPE_BF16, Shape: []int64{2, 3}, Data: make([]byte, 11)},
		"trailing": {Dtype: pb.DataType_DATA_TYPE_F32, Shape: []int64{1}, Data: make([]byte, 5)},
		"negative": {Dtype: pb.DataType_DATA_TYPE_F32, Shape: []int64{-1}, Data: nil},
		"dtype":    {Dtype: pb.DataType_DATA_TYPE_UNSPECIFIED, Shape: []int64{1}, Data: make([]byte, 4)},
		"huge":     {Dtype: pb.DataType_DATA_TYPE_F32, Shape: []int64{1 << 40, 1 << 40}, Data: nil},
	}
	for name, tensor := range cases {
		if _, err := Unpack(tensor); err == nil {
			t.Errorf("%s: Unpack(%v) succeeded", name, tensor)
		}
	}
	if _, err := Unpack(nil); err == nil {
		t.Error("Unpack(nil) succeeded")
	}
	_, err := Unpack(cases["bytes"])
	if err == nil || !strings.Contains(err.Error(), "11 bytes") {
		t.Errorf("message %q does not name the byte count", err)
	}
}

func TestRepliesThatDoNotAnswerTheRequestAreInternal(t *testing.T) {
	req := &pb.ForwardRequest{Hidden: PackF32(make([]float32, 6), 2, 3)}
	reply := func(tokens, d int64, routes *pb.Routes) *pb.ForwardResponse {
		return &pb.ForwardResponse{Output: PackF32(make([]float32, tokens*d), tokens, d), Routes: routes}
	}
	if _, err := result(reply(2, 3, &pb.Routes{TopK: 1, ExpertIds: []int32{0, 1}, Weights: []float32{1, 1}}),
		req, "r"); err != nil {
		t.Fatalf("a matching reply: %v", err)
	}
	cases := map[string]*pb.ForwardResponse{
		"fewer rows":     reply(1, 3, nil),
		"other d_model":  reply(2, 2, nil),
		"short routes":   reply(2, 3, &pb.Routes{TopK: 2, ExpertIds: []int32{0, 1}, Weights: []float32{1, 1}}),
		"negative top_k": reply(2, 3, &pb.Routes{TopK: -1}),
	}
	for name, resp := range cases {
		var e *Error
		if _, err := result(resp, req, "r"); !errors.As(err, &e) || e.Code != codes.Internal {
			t.Errorf("%s: got %v, want codes.Internal", name, err)
		}
	}
}

// stalledRouter reads a stream's first request and never answers it.
type stalledRouter struct {
	pb.UnimplementedRouterServer
}

func (stalledRouter) ForwardStream(stream pb.Router_ForwardStreamServer) error {
	if _, err := stream.Recv(); err != nil {
		return err
	}
	<-stream.Context().Done()
	return stream.Context().Err()
}

// serverCodec is codec under the server option's older interface.
type serverCodec struct{ codec }

func (serverCodec) String() string { return "proto" }

func TestSessionForwardWithoutAReplyEndsAtTheTimeout(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.CustomCodec(serverCodec{}))
	pb.RegisterRouterServer(srv, stalledRouter{})
	go srv.Serve(lis)
	defer srv.Stop()
	c, err := Dial(lis.Addr().String(), Options{Timeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := c.OpenSession(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err = s.Forward(&ForwardArgs{Layer: 0, TokenIDs: []int32{1}, Tensor: PackF32([]float32{1, 2, 3, 4}, 1, 4)})
	wantCode(t, err, codes.DeadlineExceeded, "Options.Timeout")
	if waited := time.Since(start); waited > 20*time.Second {
		t.Fatalf("Forward returned after %v", waited)
	}
	_, err = s.Forward(&ForwardArgs{Layer: 0, TokenIDs: []int32{1}, Tensor: PackF32([]float32{1, 2, 3, 4}, 1, 4)})
	wantCode(t, err, codes.DeadlineExceeded, "") // the session stays broken
	if err := s.Close(); err != nil {
		t.Fatalf("Close of a broken session: %v", err)
	}
}

func TestDialRefusesUnreadableTLSFiles(t *testing.T) {
	_, err := Dial("127.0.0.1:1", Options{TLS: &TLSOptions{CAFile: "/nonexistent/ca.crt"}})
	wantCode(t, err, codes.InvalidArgument, "CA file")
	_, err = Dial("127.0.0.1:1", Options{TLS: &TLSOptions{CertFile: "client.crt"}})
	wantCode(t, err, codes.InvalidArgument, "both")
}

// --- Against a running router: COLIBRI_ROUTER=host:port.

type fixture struct {
	c    *Client
	info *pb.GetModelInfoResponse
	ctx  context.Context
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	addr := os.Getenv("COLIBRI_ROUTER")
	if addr == "" {
		t.Skip("COLIBRI_ROUTER (host:port of a running colibri-router) is not set")
	}
	c, err := Dial(addr, Options{Timeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	ctx := context.Background()
	info, err := c.ModelInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return &fixture{c: c, info: info, ctx: ctx}
}

// batch returns n token ids and their hidden states, fixed by seed.
func (f *fixture) batch(n int, seed uint32) ([]int32, []float32) {
	ids := make([]int32, n)
	hidden := make([]float32, n*int(f.info.DModel))
	x := seed*2654435761 + 1
	for i := range ids {
		ids[i] = int32((uint32(i)*7 + seed) % uint32(f.info.VocabSize))
	}
	for i := range hidden {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		hidden[i] = float32(x>>8)/float32(1<<24)*2 - 1
	}
	return ids, hidden
}

func wantCode(t *testing.T, err error, code codes.Code, needle string) {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("error %v (%T) is not an *Error", err, err)
	}
	if e.Code != code || !strings.Contains(e.Message, needle) {
		t.Fatalf("error %v: want code %v and a message containing %q", e, code, needle)
	}
}

func sameBits(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return false
		}
	}
	return true
}

func TestModelInfoAndClusterStatus(t *testing.T) {
	f := newFixture(t)
	i := f.info
	if i.DModel <= 0 || i.NLayers <= 0 || i.NExperts <= 0 || i.TopK <= 0 || i.TopK > i.NExperts ||
		i.VocabSize <= 0 || i.MaxTokens <= 0 || i.ModelId == "" {
		t.Fatalf("implausible model info: %v", i)
	}
	st, err := f.c.ClusterStatus(f.ctx)
	if err != nil {
		t.Fatal(err)
	}
	if want := int(i.NLayers * i.NExperts); len(st.Experts) != want {
		t.Errorf("cluster status lists %d (layer, expert) pairs, want %d", len(st.Experts), want)
	}
	if i.Backend == "distributed" && (len(st.Nodes) == 0 || !st.Serving) {
		t.Errorf("distributed router: %d nodes, serving %v", len(st.Nodes), st.Serving)
	}
}

func TestForwardLUTReturnsRoutesAndClientRoutesGiveTheSameBits(t *testing.T) {
	f := newFixture(t)
	const tokens = 5
	ids, hidden := f.batch(tokens, 1)
	lut, err := f.c.Forward(f.ctx, &ForwardArgs{Layer: 0, TokenIDs: ids, Hidden: hidden,
		ReturnRoutes: true, ReturnTimings: true})
	if err != nil {
		t.Fatal(err)
	}
	d := int(f.info.DModel)
	if lut.Tokens != tokens || lut.DModel != d || len(lut.Output) != tokens*d {
		t.Fatalf("output [%d, %d] with %d values, want [%d, %d]", lut.Tokens, lut.DModel, len(lut.Output), tokens, d)
	}
	r := lut.Routes
	k := int(f.info.TopK)
	if r == nil || r.TopK != k || len(r.ExpertIDs) != tokens*k || len(r.Weights) != tokens*k {
		t.Fatalf("routes %+v: want top_k %d and %d experts and weights", r, k, tokens*k)
	}
	for i, e := range r.ExpertIDs {
		if e < 0 || e >= f.info.NExperts {
			t.Errorf("routes.expert_ids[%d] = %d is outside [0, %d)", i, e, f.info.NExperts)
		}
	}
	stages := map[string]bool{}
	for _, tm := range lut.Timings {
		stages[tm.Stage] = true
		if tm.Duration < 0 || tm.Start < 0 {
			t.Errorf("timing %+v is negative", tm)
		}
	}
	if !stages["route"] || !stages["total"] {
		t.Errorf("timings %+v lack route or total", lut.Timings)
	}
	nonzero := false
	for _, v := range lut.Output {
		nonzero = nonzero || v != 0
	}
	if !nonzero {
		t.Error("the output is all zeros")
	}

	client, err := f.c.Forward(f.ctx, &ForwardArgs{Layer: 0, Hidden: hidden, Routing: RoutingClient, Routes: r})
	if err != nil {
		t.Fatal(err)
	}
	if !sameBits(client.Output, lut.Output) {
		t.Error("client routing with the LUT's routes gives other bits than LUT routing")
	}
	gate, err := f.c.Forward(f.ctx, &ForwardArgs{Layer: 0, Hidden: hidden, Routing: RoutingGate, ReturnRoutes: true})
	if err != nil || len(gate.Output) != tokens*d || len(gate.Routes.ExpertIDs) != tokens*k {
		t.Fatalf("gate routing: %v", err)
	}
	packed, err := f.c.Forward(f.ctx, &ForwardArgs{Layer: 0, TokenIDs: ids, Tensor: PackF32(hidden, tokens, int64(d))})
	if err != nil || !sameBits(packed.Output, lut.Output) {
		t.Errorf("a pre-packed f32 tensor gives other bits (%v)", err)
	}
}

func TestOutputDTypesRoundTheF32Output(t *testing.T) {
	f := newFixture(t)
	ids, hidden := f.batch(3, 2)
	ref, err := f.c.Forward(f.ctx, &ForwardArgs{Layer: 0, TokenIDs: ids, Hidden: hidden})
	if err != nil {
		t.Fatal(err)
	}
	bf16, err := f.c.Forward(f.ctx, &ForwardArgs{Layer: 0, TokenIDs: ids, Hidden: hidden, OutputDType: BF16})
	if err != nil {
		t.Fatal(err)
	}
	f16, err := f.c.Forward(f.ctx, &ForwardArgs{Layer: 0, TokenIDs: ids, Hidden: hidden, OutputDType: F16})
	if err != nil {
		t.Fatal(err)
	}
	if len(bf16.Output) != len(ref.Output) || len(f16.Output) != len(ref.Output) {
		t.Fatalf("lengths %d (bf16), %d (f16), want %d", len(bf16.Output), len(f16.Output), len(ref.Output))
	}
	for i, want := range ref.Output {
		// The router rounds the fp32 sum once, as PackBF16 does.
		if got := math.Float32bits(bf16.Output[i]); got != uint32(f32ToBF16(want))<<16 {
			t.Fatalf("bf16 output[%d] = %g, f32 %g", i, bf16.Output[i], want)
		}
		if diff := math.Abs(float64(bf16.Output[i] - want)); diff > math.Abs(float64(want))/256 {
			t.Fatalf("bf16 output[%d] = %g is not within bf16 rounding of %g", i, bf16.Output[i], want)
		}
		if diff := math.Abs(float64(f16.Output[i] - want)); diff > math.Abs(float64(want))/2048+1.0/(1<<24) {
			t.Fatalf("f16 output[%d] = %g is not within f16 rounding of %g", i, f16.Output[i], want)
		}
	}
}

func TestBadRequestsAreInvalidArgument(t *testing.T) {
	f := newFixture(t)
	d := int(f.info.DModel)
	ids, hidden := f.batch(2, 3)
	_, err := f.c.Forward(f.ctx, &ForwardArgs{Layer: 0, TokenIDs: []int32{ids[0], f.info.VocabSize}, Hidden: hidden})
	wantCode(t, err, codes.InvalidArgument, "token_ids")
	// Caught by the router: a shape that is not [T, d_model].
	_, err = f.c.Forward(f.ctx, &ForwardArgs{Layer: 0, TokenIDs: ids[:1], Tensor: PackF32(hidden[:d-1], 1, int64(d-1))})
	wantCode(t, err, codes.InvalidArgument, "hidden.shape")
	// Caught here: a slice that is not whole rows.
	_, err = f.c.Forward(f.ctx, &ForwardArgs{Layer: 0, TokenIDs: ids[:1], Hidden: hidden[:d+1]})
	wantCode(t, err, codes.InvalidArgument, "d_model")
	_, err = f.c.Forward(f.ctx, &ForwardArgs{Layer: int(f.info.NLayers), TokenIDs: ids, Hidden: hidden})
	wantCode(t, err, codes.InvalidArgument, "layer")
	// Caught here: a layer that would wrap to 0 in the request's int32.
	_, err = f.c.Forward(f.ctx, &ForwardArgs{Layer: 1 << 32, TokenIDs: ids, Hidden: hidden})
	wantCode(t, err, codes.InvalidArgument, "does not fit the request's int32")
	_, err = f.c.Forward(f.ctx, &ForwardArgs{Layer: 0, Hidden: hidden, Routing: RoutingClient,
		Routes: &Routes{TopK: int(f.info.TopK)}})
	wantCode(t, err, codes.InvalidArgument, "routes")
}

func TestSessionAnswersInOrderAndSurvivesABadRequest(t *testing.T) {
	f := newFixture(t)
	ids, hidden := f.batch(1, 4)
	want, err := f.c.Forward(f.ctx, &ForwardArgs{Layer: 0, TokenIDs: ids, Hidden: hidden})
	if err != nil {
		t.Fatal(err)
	}
	s, err := f.c.OpenSession(f.ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 6; i++ {
		id := fmt.Sprintf("req-%d", i)
		args := &ForwardArgs{Layer: i % int(f.info.NLayers), TokenIDs: ids, Hidden: hidden, RequestID: id}
		if i == 3 {
			args.TokenIDs = []int32{-1}
		}
		r, err := s.Forward(args)
		if i == 3 {
			wantCode(t, err, codes.InvalidArgument, "token_ids")
			continue
		}
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if r.RequestID != id {
			t.Errorf("request %d: reply for %q", i, r.RequestID)
		}
		if args.Layer == 0 && !sameBits(r.Output, want.Output) {
			t.Errorf("request %d: the stream's output differs from Forward's", i)
		}
	}
	if err := s.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	_, err = s.Forward(&ForwardArgs{Layer: 0, TokenIDs: ids, Hidden: hidden})
	wantCode(t, err, codes.FailedPrecondition, "closed")
}

func TestForwardAsync(t *testing.T) {
	f := newFixture(t)
	ids, hidden := f.batch(2, 5)
	want, err := f.c.Forward(f.ctx, &ForwardArgs{Layer: 0, TokenIDs: ids, Hidden: hidden})
	if err != nil {
		t.Fatal(err)
	}
	var pending []<-chan AsyncResult
	for i := 0; i < 4; i++ {
		pending = append(pending, f.c.ForwardAsync(f.ctx, &ForwardArgs{Layer: 0, TokenIDs: ids, Hidden: hidden}))
	}
	bad := f.c.ForwardAsync(f.ctx, &ForwardArgs{Layer: -1, TokenIDs: ids, Hidden: hidden})
	for i, ch := range pending {
		r := <-ch
		if r.Err != nil || !sameBits(r.Result.Output, want.Output) {
			t.Errorf("async call %d: %v", i, r.Err)
		}
	}
	wantCode(t, (<-bad).Err, codes.InvalidArgument, "layer")
}

func TestDeadlineExceeded(t *testing.T) {
	f := newFixture(t)
	ids, hidden := f.batch(1, 6)
	ctx, cancel := context.WithDeadline(f.ctx, time.Now().Add(-time.Second))
	defer cancel()
	_, err := f.c.Forward(ctx, &ForwardArgs{Layer: 0, TokenIDs: ids, Hidden: hidden})
	wantCode(t, err, codes.DeadlineExceeded, "")
}
