package colibri

import (
	"context"
	"io"
	"sync"
	"sync/atomic"
	"time"

	pb "github.com/colibri-moe/colibri/clients/go/colibriv1"
	"google.golang.org/grpc/codes"
)

// Session is one open ForwardStream: requests answered in order on one
// stream, for a decoding loop. A request the router refuses fails alone and
// the stream stays usable; a broken stream fails this and every later call.
// Its methods serialize, so a Session can be shared, but calls do not overlap.
type Session struct {
	c      *Client
	ctx    context.Context
	cancel context.CancelFunc
	stream pb.Router_ForwardStreamClient

	mu     sync.Mutex
	broken error // the stream's failure, once it failed; guarded by mu
}

// OpenSession opens a stream that lives until Close or until ctx is done.
// Each Forward on it is bounded by Options.Timeout (see Forward).
func (c *Client) OpenSession(ctx context.Context) (*Session, error) {
	ctx, cancel := context.WithCancel(ctx)
	stream, err := c.router.ForwardStream(ctx)
	if err != nil {
		cancel()
		return nil, toError(err)
	}
	return &Session{c: c, ctx: ctx, cancel: cancel, stream: stream}, nil
}

// Forward sends one request and waits for its reply. A reply with a non-zero
// code is an *Error with that code and message. No reply within
// Options.Timeout (if set): the stream is cancelled (its replies come in
// order, so the later ones cannot be had either) and Forward returns
// codes.DeadlineExceeded; open a new session.
func (s *Session) Forward(args *ForwardArgs) (*ForwardResult, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.broken != nil {
		return nil, s.broken
	}
	var expired int32
	var timer *time.Timer
	if t := s.c.timeout; t > 0 {
		timer = time.AfterFunc(t, func() {
			atomic.StoreInt32(&expired, 1)
			s.cancel()
		})
		defer timer.Stop()
	}
	timedOut := func() error {
		return errorf(codes.DeadlineExceeded,
			"no reply on the session's stream within Options.Timeout (%v); the stream is cancelled: open a new session",
			s.c.timeout)
	}
	fail := func(err error) error {
		if atomic.LoadInt32(&expired) == 1 {
			err = timedOut()
		}
		return s.fail(err)
	}
	req, err := s.c.request(s.ctx, args)
	if err != nil {
		if atomic.LoadInt32(&expired) == 1 {
			return nil, fail(err)
		}
		return nil, err
	}
	if err := s.stream.Send(req); err != nil {
		// io.EOF means the stream ended; Recv tells why (nil or io.EOF: it
		// ended normally, or with a reply nobody asked for).
		if err == io.EOF {
			if _, err = s.stream.Recv(); err == nil || err == io.EOF {
				err = errorf(codes.Unavailable, "the router ended the stream")
			}
		}
		return nil, fail(err)
	}
	reply, err := s.stream.Recv()
	if err == io.EOF {
		return nil, fail(errorf(codes.Unavailable, "the router ended the stream"))
	}
	if err != nil {
		return nil, fail(err)
	}
	if timer != nil && !timer.Stop() {
		// The timer fired as the reply came: this reply stands, but the
		// stream is cancelled, so the next call says why.
		s.broken = timedOut()
	}
	if reply.RequestId != req.RequestId {
		return nil, fail(errorf(codes.Internal, "reply for request id %q while waiting for %q",
			reply.RequestId, req.RequestId))
	}
	if reply.Code != int32(codes.OK) {
		code := codes.Unknown // a code out of range is not passed on as one
		if reply.Code > 0 && reply.Code <= int32(codes.Unauthenticated) {
			code = codes.Code(reply.Code)
		}
		return nil, &Error{Code: code, Message: reply.Message}
	}
	if reply.Response == nil {
		return nil, errorf(codes.Internal, "router reply: OK without a response")
	}
	return result(reply.Response, req, reply.RequestId)
}

// fail marks the stream broken with err (as an *Error) and returns it.
func (s *Session) fail(err error) error {
	if _, ok := err.(*Error); !ok {
		err = toError(err)
	}
	s.broken = err
	s.cancel()
	return err
}

// How long Close waits for the router to end the stream.
const closeWait = 10 * time.Second

// Close half-closes the stream, waits for the router to end it (up to 10 s)
// and returns the stream's status (nil when it ended normally or had
// already failed). A Forward in flight on another goroutine is cancelled
// (codes.Canceled), not waited for: a stalled router cannot hold Close.
func (s *Session) Close() error {
	cancelled := false
	if !s.mu.TryLock() {
		s.cancel()
		cancelled = true
		s.mu.Lock()
	}
	defer s.mu.Unlock()
	defer s.cancel()
	defer time.AfterFunc(closeWait, s.cancel).Stop()
	drained := s.broken != nil || cancelled // failed or closed already, or ended by this Close's cancel
	s.broken = errorf(codes.FailedPrecondition, "session is closed")
	if drained {
		return nil
	}
	if err := s.stream.CloseSend(); err != nil {
		return toError(err)
	}
	for {
		if _, err := s.stream.Recv(); err == io.EOF {
			return nil
		} else if err != nil {
			return toError(err)
		}
	}
}
