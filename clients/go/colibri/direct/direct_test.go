package direct

import (
	"context"
	"errors"
	"math"
	"os"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/colibri-moe/colibri/clients/go/colibri"
	"google.golang.org/grpc/codes"
)

func wantCode(t *testing.T, err error, code codes.Code, needle string) {
	t.Helper()
	var e *colibri.Error
	if !errors.As(err, &e) {
		t.Fatalf("error %v (%T) is not a *colibri.Error", err, err)
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

func TestOpenRefusesBadOptions(t *testing.T) {
	_, err := Open("/nonexistent", Options{})
	wantCode(t, err, codes.InvalidArgument, "exactly one of options.nodes")
	_, err = Open("/nonexistent", Options{Nodes: []string{"127.0.0.1:1"}, NodeReplies: "some"})
	wantCode(t, err, codes.InvalidArgument, `NodeReplies "some"`)
	_, err = Open("/nonexistent", Options{Nodes: []string{"127.0.0.1:1"}})
	wantCode(t, err, codes.NotFound, "/nonexistent")
	// TLS asked for without a CA file would be plaintext: refused.
	_, err = Open("/nonexistent", Options{Nodes: []string{"127.0.0.1:1"},
		TLS: &colibri.TLSOptions{ServerName: "nodes.example"}})
	wantCode(t, err, codes.InvalidArgument, "Options.TLS.CAFile is empty")
}

// --- Against running nodes: COLIBRI_MODEL (the model directory they serve),
// COLIBRI_NODES (host:port,...) and COLIBRI_ROUTER (a router on the same
// nodes, whose answers are the reference).

type fixture struct {
	e      *Engine
	router *colibri.Client
}

func newFixture(t *testing.T, opts Options) *fixture {
	t.Helper()
	model, nodes, router := os.Getenv("COLIBRI_MODEL"), os.Getenv("COLIBRI_NODES"), os.Getenv("COLIBRI_ROUTER")
	if model == "" || nodes == "" || router == "" {
		t.Skip("COLIBRI_MODEL, COLIBRI_NODES and COLIBRI_ROUTER are not all set")
	}
	opts.Nodes = strings.Split(nodes, ",")
	e, err := Open(model, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	c, err := colibri.Dial(router, colibri.Options{Timeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	f := &fixture{e: e, router: c}
	// Open checks the nodes once (1 s per probe); on a loaded machine a node
	// may miss it and come back a health round later: wait up to 10 s.
	ids, hidden := f.batch(1, 1)
	for i := 0; i < 100; i++ {
		_, err := e.Forward(&colibri.ForwardArgs{Layer: 0, TokenIDs: ids, Hidden: hidden})
		var ce *colibri.Error
		if !errors.As(err, &ce) || ce.Code != codes.Unavailable {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	return f
}

func (f *fixture) batch(n int, seed uint32) ([]int32, []float32) {
	info := f.e.Info()
	ids := make([]int32, n)
	hidden := make([]float32, n*info.DModel)
	x := seed*2654435761 + 1
	for i := range ids {
		ids[i] = int32((uint32(i)*7 + seed) % uint32(info.VocabSize))
	}
	for i := range hidden {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		hidden[i] = float32(x>>8)/float32(1<<24)*2 - 1
	}
	return ids, hidden
}

// check runs args proxyless and through the router and wants the same bits.
func (f *fixture) check(t *testing.T, args *colibri.ForwardArgs) *colibri.ForwardResult {
	t.Helper()
	got, err := f.e.Forward(args)
	if err != nil {
		t.Fatal(err)
	}
	want, err := f.router.Forward(context.Background(), args)
	if err != nil {
		t.Fatal(err)
	}
	if !sameBits(got.Output, want.Output) || got.Tokens != want.Tokens || got.DModel != want.DModel {
		t.Fatalf("layer %d routing %d: the proxyless output differs from the router's", args.Layer, args.Routing)
	}
	if args.ReturnRoutes {
		if got.Routes == nil || want.Routes == nil || got.Routes.TopK != want.Routes.TopK ||
			!sameBits(got.Routes.Weights, want.Routes.Weights) ||
			len(got.Routes.ExpertIDs) != len(want.Routes.ExpertIDs) {
			t.Fatalf("routes differ: %+v vs %+v", got.Routes, want.Routes)
		}
		for i := range got.Routes.ExpertIDs {
			if got.Routes.ExpertIDs[i] != want.Routes.ExpertIDs[i] {
				t.Fatalf("expert ids differ: %v vs %v", got.Routes.ExpertIDs, want.Routes.ExpertIDs)
			}
		}
	}
	return got
}

func TestProxylessAnswersAreTheRoutersBytes(t *testing.T) {
	for _, replies := range []string{"exact", "partial", "per_expert"} {
		t.Run(replies, func(t *testing.T) {
			f := newFixture(t, Options{NodeReplies: replies})
			info := f.e.Info()
			if info.DModel <= 0 || info.TopK <= 0 || !strings.HasPrefix(info.ModelID, "xxh3_128:") {
				t.Fatalf("implausible model info %+v", info)
			}
			for _, n := range []int{1, 5, 33} {
				ids, hidden := f.batch(n, uint32(n))
				for layer := 0; layer < info.Layers; layer++ {
					f.check(t, &colibri.ForwardArgs{Layer: layer, TokenIDs: ids, Hidden: hidden, ReturnRoutes: true})
					gate := f.check(t, &colibri.ForwardArgs{Layer: layer, Hidden: hidden, Routing: colibri.RoutingGate,
						ReturnRoutes: true})
					f.check(t, &colibri.ForwardArgs{Layer: layer, Hidden: hidden, Routing: colibri.RoutingClient,
						Routes: gate.Routes})
				}
			}
		})
	}
}

func TestConcurrentCallsAndErrors(t *testing.T) {
	f := newFixture(t, Options{})
	ids, hidden := f.batch(4, 9)
	want := f.check(t, &colibri.ForwardArgs{Layer: 1, TokenIDs: ids, Hidden: hidden})
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 10; i++ {
				r, err := f.e.Forward(&colibri.ForwardArgs{Layer: 1, TokenIDs: ids, Hidden: hidden})
				if err == nil && !sameBits(r.Output, want.Output) {
					err = errors.New("a concurrent call gave other bits")
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}

	_, err := f.e.Forward(&colibri.ForwardArgs{Layer: 99, TokenIDs: ids, Hidden: hidden})
	wantCode(t, err, codes.InvalidArgument, "layer 99")
	_, err = f.e.Forward(&colibri.ForwardArgs{Layer: 0, TokenIDs: ids[:3], Hidden: hidden})
	wantCode(t, err, codes.InvalidArgument, "3 token ids for 4 rows")
	_, err = f.e.Forward(&colibri.ForwardArgs{Layer: 0, TokenIDs: ids, Hidden: hidden, OutputDType: colibri.BF16})
	wantCode(t, err, codes.InvalidArgument, "f32 only")
	_, err = f.e.Forward(&colibri.ForwardArgs{Layer: 0, Hidden: hidden, Routing: colibri.RoutingClient})
	wantCode(t, err, codes.InvalidArgument, "client routing needs Routes")
	f.e.Close()
	_, err = f.e.Forward(&colibri.ForwardArgs{Layer: 0, TokenIDs: ids, Hidden: hidden})
	wantCode(t, err, codes.FailedPrecondition, "closed")
}

// BenchmarkProxylessAgainstRouter times one-token calls of layer 0,
// proxyless and through the router, interleaved call by call, and reports
// each path's median (ns): go test -run x -bench . with the fixture's
// environment (clients/go/README.md).
func BenchmarkProxylessAgainstRouter(b *testing.B) {
	model, nodes, router := os.Getenv("COLIBRI_MODEL"), os.Getenv("COLIBRI_NODES"), os.Getenv("COLIBRI_ROUTER")
	if model == "" || nodes == "" || router == "" {
		b.Skip("COLIBRI_MODEL, COLIBRI_NODES and COLIBRI_ROUTER are not all set")
	}
	e, err := Open(model, Options{Nodes: strings.Split(nodes, ",")})
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	c, err := colibri.Dial(router, colibri.Options{Timeout: 30 * time.Second})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	f := &fixture{e: e, router: c}
	ids, hidden := f.batch(1, 3)
	args := &colibri.ForwardArgs{Layer: 0, TokenIDs: ids, Hidden: hidden}
	ctx := context.Background()
	direct, routed := make([]time.Duration, 0, b.N), make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		if _, err := e.Forward(args); err != nil {
			b.Fatal(err)
		}
		direct = append(direct, time.Since(start))
		start = time.Now()
		if _, err := c.Forward(ctx, args); err != nil {
			b.Fatal(err)
		}
		routed = append(routed, time.Since(start))
	}
	median := func(d []time.Duration) float64 {
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		return float64(d[len(d)/2])
	}
	b.ReportMetric(median(direct), "proxyless-p50-ns")
	b.ReportMetric(median(routed), "router-p50-ns")
}
