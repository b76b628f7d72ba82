package grpclimit

import (
	"context"
	"errors"
	"io"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rlagent/rlagent/limiter/throttle"
)

// Classify is how the client interceptors classify a call's
// outcome, the gRPC twin of [throttle.Classify]:
//
//   - codes.ResourceExhausted (the server's limits refused the call) and
//     codes.Unavailable (the server is overloaded or going away, or the
//     connection was refused or broken: gRPC gives them all this code):
//     Rejected;
//   - codes.Canceled and codes.DeadlineExceeded (the call's context
//     ended; that says nothing of the server): Ignored;
//   - success and every other code, application errors included:
//     Accepted, the server took the call.
//
// A client that needs another classification writes its own interceptor
// around [throttle.Throttle.Allow] and [throttle.Throttle.Record]; these
// ones are ten lines each.
func Classify(err error) throttle.Outcome {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		// A bare context error, from an interceptor rather than gRPC.
		return throttle.Ignored
	}
	switch status.Code(err) {
	case codes.ResourceExhausted, codes.Unavailable:
		return throttle.Rejected
	case codes.Canceled, codes.DeadlineExceeded:
		return throttle.Ignored
	default:
		return throttle.Accepted
	}
}

// UnaryClientInterceptor throttles unary calls with t, Google SRE's
// client-side adaptive throttling: a call t refuses fails at once, without
// reaching the server, with codes.Unavailable and an error that matches
// [throttle.ErrThrottled]; every call that went out is recorded in t as
// [Classify] says.
//
// An interceptor wraps gRPC's own retries: one call is one request to the
// throttle however many attempts a retry policy makes, and it is recorded
// with the last attempt's status.
func UnaryClientInterceptor(t *throttle.Throttle) grpc.UnaryClientInterceptor {
	if t == nil {
		panic("grpclimit: nil *throttle.Throttle")
	}
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if !t.Allow() {
			return errThrottled
		}
		err := invoker(ctx, method, req, reply, cc, opts...)
		record(t, Classify(err))
		return err
	}
}

// StreamClientInterceptor throttles streams with t as
// [UnaryClientInterceptor] does calls. A stream is one request, recorded
// once, by the first of: the error that fails its opening, or the first
// result of its RecvMsg (a message or io.EOF is a success, an error is
// classified). A stream whose RecvMsg is never called is not recorded.
func StreamClientInterceptor(t *throttle.Throttle) grpc.StreamClientInterceptor {
	if t == nil {
		panic("grpclimit: nil *throttle.Throttle")
	}
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		if !t.Allow() {
			return nil, errThrottled
		}
		cs, err := streamer(ctx, desc, cc, method, opts...)
		if err != nil {
			record(t, Classify(err))
			return nil, err
		}
		return &recordedStream{ClientStream: cs, t: t}, nil
	}
}

// recordedStream records the stream's outcome at its first RecvMsg: a
// rejection by the server's limits arrives there, as the stream's status,
// before any message.
type recordedStream struct {
	grpc.ClientStream
	t    *throttle.Throttle
	once sync.Once
}

func (s *recordedStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	s.once.Do(func() {
		if err == io.EOF {
			record(s.t, throttle.Accepted)
			return
		}
		record(s.t, Classify(err))
	})
	return err
}

func record(t *throttle.Throttle, o throttle.Outcome) {
	switch o {
	case throttle.Accepted:
		t.Record(true)
	case throttle.Rejected:
		t.Record(false)
	}
}

// errThrottled is the error of a call the throttle refused. Its code is
// Unavailable, not ResourceExhausted: Unavailable is gRPC's "transient,
// retry later, perhaps elsewhere", what the caller also gets when the
// backend cannot be reached, and what gRPC's own client-side throttle (in
// its RLS balancer) fails a pick with; ResourceExhausted reads as the
// caller's own quota being spent, and a server that passes the code on to
// its callers would tell them so. errors.Is(err, throttle.ErrThrottled)
// tells a local refusal from the server's.
var errThrottled error = &throttledError{
	st: status.New(codes.Unavailable, "client-side throttling: "+throttle.ErrThrottled.Error()),
}

type throttledError struct{ st *status.Status }

func (e *throttledError) Error() string              { return e.st.Err().Error() }
func (e *throttledError) GRPCStatus() *status.Status { return e.st }
func (e *throttledError) Unwrap() error              { return throttle.ErrThrottled }
