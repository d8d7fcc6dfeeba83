// Package colibri is the Go client of a Colibri router (the colibri.v1.Router
// gRPC service, docs/ROUTER.md): it runs MoE layers for batches of tokens on
// a cluster of expert nodes.
//
//	c, err := colibri.Dial("127.0.0.1:50051", colibri.Options{Timeout: 5 * time.Second})
//	if err != nil { ... }
//	defer c.Close()
//	r, err := c.Forward(ctx, &colibri.ForwardArgs{Layer: 0, TokenIDs: ids, Hidden: hidden})
//	// r.Output holds len(ids) rows of d_model float32 values.
//
// A decoding loop that calls every layer for every token keeps one stream
// open with OpenSession. Failed calls return an *Error carrying the router's
// status code (codes.InvalidArgument for a bad request, codes.Unavailable
// when an expert has no live node, ...) and its message.
//
// A Client is safe for concurrent use by several goroutines; a Session is
// used by one caller at a time (its methods serialize).
package colibri

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"sync"
	"time"

	pb "github.com/colibri-moe/colibri/clients/go/colibriv1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
)

// DefaultMaxMessageBytes is the message size limit when
// Options.MaxMessageBytes is 0: room for large batches of f32 hidden states.
const DefaultMaxMessageBytes = 64 << 20

// Options configures Dial. The zero value is a plaintext connection with no
// default timeout.
type Options struct {
	// TLS, when not nil, makes the connection use TLS.
	TLS *TLSOptions
	// Timeout bounds every unary call (Forward, ModelInfo, ClusterStatus)
	// whose context has no deadline, and each Forward of a Session (whose
	// stream lives as long as its context). 0: no bound.
	Timeout time.Duration
	// MaxMessageBytes limits sent and received messages; 0 means
	// DefaultMaxMessageBytes.
	MaxMessageBytes int
}

// TLSOptions are the files of a TLS connection, PEM encoded.
type TLSOptions struct {
	// CAFile holds the certificates that may sign the router's certificate;
	// empty: the system's roots.
	CAFile string
	// CertFile and KeyFile are the client's certificate and key for mutual
	// TLS; both or neither.
	CertFile, KeyFile string
	// ServerName overrides the name checked in the router's certificate
	// (default: the host of the target).
	ServerName string
}

// Error is a failed call: the gRPC status code and message the router (or
// gRPC itself, or this package for a malformed request or reply) gave.
type Error struct {
	Code    codes.Code
	Message string
}

func (e *Error) Error() string { return fmt.Sprintf("colibri: %v: %s", e.Code, e.Message) }

// toError converts an error from a gRPC call into an *Error.
func toError(err error) error {
	if err == nil {
		return nil
	}
	s, _ := status.FromError(err) // not a status: codes.Unknown with err's text
	return &Error{Code: s.Code(), Message: s.Message()}
}

func errorf(code codes.Code, format string, args ...interface{}) error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

// Client is a connection to one router. Create it with Dial; Close it when
// done. Safe for concurrent use.
type Client struct {
	conn    *grpc.ClientConn
	router  pb.RouterClient
	timeout time.Duration

	mu     sync.Mutex
	dModel int // from GetModelInfo, 0 until known; guarded by mu
}

// Dial returns a Client of the router at target ("host:port" or any gRPC
// target). It does not wait for the connection: the first call does. It
// fails only on bad options (a TLS file that cannot be read or parsed).
func Dial(target string, opts Options) (*Client, error) {
	max := opts.MaxMessageBytes
	if max <= 0 {
		max = DefaultMaxMessageBytes
	}
	dialOpts := []grpc.DialOption{
		grpc.WithDefaultCallOptions(grpc.ForceCodec(codec{}),
			grpc.MaxCallRecvMsgSize(max), grpc.MaxCallSendMsgSize(max)),
		// Reconnect within seconds of a router's return: gRPC's default
		// backoff grows to 2 minutes, and calls fail at once meanwhile.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: time.Second, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 5 * time.Second},
			MinConnectTimeout: 20 * time.Second,
		}),
		// A router gone silent without closing the connection (its host
		// powered off, a partition) is noticed within 50 s and reconnected,
		// not after TCP gives up; as Colibri's C++ channels (the router
		// accepts pings this often).
		grpc.WithKeepaliveParams(keepalive.ClientParameters{
			Time: 30 * time.Second, Timeout: 20 * time.Second, PermitWithoutStream: true,
		}),
	}
	if opts.TLS == nil {
		dialOpts = append(dialOpts, grpc.WithInsecure())
	} else {
		cfg, err := opts.TLS.config()
		if err != nil {
			return nil, err
		}
		dialOpts = append(dialOpts, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	}
	conn, err := grpc.Dial(target, dialOpts...)
	if err != nil {
		return nil, toError(err)
	}
	return &Client{conn: conn, router: pb.NewRouterClient(conn), timeout: opts.Timeout}, nil
}

func (o *TLSOptions) config() (*tls.Config, error) {
	cfg := &tls.Config{ServerName: o.ServerName, MinVersion: tls.VersionTLS12}
	if o.CAFile != "" {
		pem, err := os.ReadFile(o.CAFile)
		if err != nil {
			return nil, errorf(codes.InvalidArgument, "TLS CA file: %v", err)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, errorf(codes.InvalidArgument, "TLS CA file %s holds no PEM certificate", o.CAFile)
		}
	}
	if (o.CertFile == "") != (o.KeyFile == "") {
		return nil, errorf(codes.InvalidArgument, "TLS needs both a client certificate and its key, or neither")
	}
	if o.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(o.CertFile, o.KeyFile)
		if err != nil {
			return nil, errorf(codes.InvalidArgument, "TLS client certificate: %v", err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

// Close closes the connection; calls in flight fail with codes.Canceled.
func (c *Client) Close() error { return c.conn.Close() }

// Router returns the generated stub on the client's connection, for what this
// package does not wrap.
func (c *Client) Router() pb.RouterClient { return c.router }

// withTimeout applies the default timeout to a context without a deadline.
func (c *Client) withTimeout(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok || c.timeout <= 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, c.timeout)
}

// ModelInfo returns the model the router serves (shape, layers, experts,
// top-k, vocabulary, routing modes, model id, backend, max tokens).
func (c *Client) ModelInfo(ctx context.Context) (*pb.GetModelInfoResponse, error) {
	ctx, cancel := c.withTimeout(ctx)
	defer cancel()
	info, err := c.router.GetModelInfo(ctx, &pb.GetModelInfoRequest{})
	if err != nil {
		return nil, toError(err)
	}
	c.mu.Lock()
	c.dModel = int(info.DModel)
	c.mu.Unlock()
	return info, nil
}

// ClusterStatus returns the router's view of its expert nodes (liveness,
// experts served, load, errors) and per-expert routing statistics.
func (c *Client) ClusterStatus(ctx context.Context) (*pb.GetClusterStatusResponse, error) {
	ctx, cancel := c.withTimeout(ctx)
	defer cancel()
	st, err := c.router.GetClusterStatus(ctx, &pb.GetClusterStatusRequest{})
	if err != nil {
		return nil, toError(err)
	}
	return st, nil
}

// modelDim returns d_model, asking the router the first time.
func (c *Client) modelDim(ctx context.Context) (int, error) {
	c.mu.Lock()
	d := c.dModel
	c.mu.Unlock()
	if d > 0 {
		return d, nil
	}
	info, err := c.ModelInfo(ctx)
	if err != nil {
		return 0, err
	}
	if info.DModel <= 0 {
		return 0, errorf(codes.Internal, "router reports d_model %d", info.DModel)
	}
	return int(info.DModel), nil
}
