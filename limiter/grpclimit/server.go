package grpclimit

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/rlagent/rlagent/limiter"
)

// A KeyFunc gives the key a call draws from in one keyed limit: the caller's
// address, a tenant, the method. fullMethod is "/package.Service/Method".
// It runs once per call, before the handler, on the call's goroutine.
type KeyFunc func(ctx context.Context, fullMethod string) string

// Options configure a server interceptor. The zero value keys every limit
// by "" (right for key-less limits), limits every call, and charges a
// stream once, when it opens.
type Options struct {
	// Keys are the calls' keys: Keys[i] keys the Set's i-th limit (see
	// limiter.Set.Names). A nil KeyFunc, or one past the end, gives ""
	// (a key-less limit ignores its key; a keyed one then draws every
	// call from one bucket). (Optional) More KeyFuncs than the Set has
	// limits is a mistake in the program: the interceptor's constructor
	// panics.
	Keys []KeyFunc
	// Filter limits only the calls for which it returns true; the others
	// pass untouched (health checks, reflection). (Optional) nil limits
	// every call.
	Filter func(ctx context.Context, fullMethod string) bool
	// PerMessage makes [StreamServerInterceptor] charge one token for each
	// message the server receives, instead of one for the stream's open.
	// The keys are computed once, when the stream opens. A message the
	// limits refuse makes RecvMsg return the refusal's status (the message
	// itself is dropped), which the handler returns as it returns any
	// RecvMsg error; a wait holds RecvMsg. [UnaryServerInterceptor]
	// ignores it: a unary call is one message. (Optional) false charges a
	// stream once, when it opens.
	PerMessage bool
}

// PeerIP is a KeyFunc: the IP address the call came from (an IPv4-mapped
// IPv6 address as IPv4), or "" if the connection has no address. Behind a
// proxy this is the proxy's address: key on a header the proxy sets instead
// ([Metadata]), and only if no one else can set it.
func PeerIP(ctx context.Context, _ string) string {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return ""
	}
	switch a := p.Addr.(type) {
	case *net.TCPAddr:
		ip := a.AddrPort().Addr()
		if !ip.IsValid() {
			return ""
		}
		return ip.Unmap().String()
	default:
		s := a.String()
		if host, _, err := net.SplitHostPort(s); err == nil {
			return host
		}
		return s
	}
}

// Metadata returns a KeyFunc: the first value of the call's incoming
// metadata header name (case-insensitive), or "" if the call has none.
func Metadata(name string) KeyFunc {
	name = strings.ToLower(name)
	return func(ctx context.Context, _ string) string {
		v := metadata.ValueFromIncomingContext(ctx, name)
		if len(v) == 0 {
			return ""
		}
		return v[0]
	}
}

// FullMethod is a KeyFunc: the call's method, "/package.Service/Method",
// which gives each method its own bucket.
func FullMethod(_ context.Context, fullMethod string) string { return fullMethod }

// UnaryServerInterceptor limits every unary call with set: it computes the
// key of each of set's limits (Options.Keys) and calls [limiter.Set.Wait], so
// that each limit's policy decides whether an over-limit call fails at once
// (codes.ResourceExhausted, with a google.rpc.RetryInfo) or waits for its
// token. See the package documentation for the statuses.
func UnaryServerInterceptor(set *limiter.Set, opts Options) grpc.UnaryServerInterceptor {
	g := newGate(set, opts)
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if g.opts.Filter != nil && !g.opts.Filter(ctx, info.FullMethod) {
			return handler(ctx, req)
		}
		var kb [statusBuf]string
		keys := g.keys(kb[:0], ctx, info.FullMethod)
		if err := g.wait(ctx, keys, func(md metadata.MD) { _ = grpc.SetTrailer(ctx, md) }); err != nil {
			return nil, err
		}
		return handler(ctx, req)
	}
}

// StreamServerInterceptor limits every stream with set, as
// [UnaryServerInterceptor] does a call: a stream is charged one token when
// it opens, before the handler runs, however many messages it then carries;
// with Options.PerMessage, each received message is charged instead.
func StreamServerInterceptor(set *limiter.Set, opts Options) grpc.StreamServerInterceptor {
	g := newGate(set, opts)
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		ctx := ss.Context()
		if g.opts.Filter != nil && !g.opts.Filter(ctx, info.FullMethod) {
			return handler(srv, ss)
		}
		keys := g.keys(nil, ctx, info.FullMethod)
		if g.opts.PerMessage {
			return handler(srv, &meteredStream{ServerStream: ss, g: g, keys: keys})
		}
		if err := g.wait(ctx, keys, func(md metadata.MD) { ss.SetTrailer(md) }); err != nil {
			return err
		}
		return handler(srv, ss)
	}
}

// meteredStream charges each received message (PerMessage).
type meteredStream struct {
	grpc.ServerStream
	g    *gate
	keys []string
}

func (s *meteredStream) RecvMsg(m any) error {
	if err := s.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	return s.g.wait(s.Context(), s.keys, s.ServerStream.SetTrailer)
}

// gate is what both server interceptors share: the Set and the options.
type gate struct {
	set  *limiter.Set
	opts Options
}

// statusBuf sizes a call's keys: a Set of up to this many limits needs no
// allocation for them.
const statusBuf = 4

func newGate(set *limiter.Set, opts Options) *gate {
	if set == nil {
		panic("grpclimit: nil *limiter.Set")
	}
	if n := len(set.Names()); len(opts.Keys) > n {
		panic(fmt.Sprintf("grpclimit: %d Keys for a Set of %d limits %q", len(opts.Keys), n, set.Names()))
	}
	opts.Keys = append([]KeyFunc(nil), opts.Keys...)
	return &gate{set: set, opts: opts}
}

// keys computes the call's keys into buf.
func (g *gate) keys(buf []string, ctx context.Context, fullMethod string) []string {
	for _, fn := range g.opts.Keys {
		k := ""
		if fn != nil {
			k = fn(ctx, fullMethod)
		}
		buf = append(buf, k)
	}
	return buf
}

// wait draws from the Set under its limits' policies and turns a refusal
// into the call's status; setTrailer sets the retry pushback trailer.
func (g *gate) wait(ctx context.Context, keys []string, setTrailer func(metadata.MD)) error {
	err := g.set.Wait(ctx, keys...)
	if err == nil {
		return nil
	}
	var rej *limiter.RejectedError
	if errors.As(err, &rej) {
		if rej.RetryAfter > 0 {
			setTrailer(metadata.Pairs(pushbackKey, pushbackMillis(rej.RetryAfter)))
		}
		return rejectedStatus(rej).Err()
	}
	// Only the call's own context ends a wait without a RejectedError:
	// the caller gave up or its deadline passed.
	return status.FromContextError(err).Err()
}

// pushbackKey is gRFC A6's trailer: a client whose retry policy retries
// the status waits this many milliseconds before its next attempt.
const pushbackKey = "grpc-retry-pushback-ms"

// pushbackMillis rounds up, so that a retry does not come back before
// its token.
func pushbackMillis(d time.Duration) string {
	ms := (d + time.Millisecond - 1) / time.Millisecond
	return strconv.FormatInt(int64(ms), 10)
}

func rejectedStatus(rej *limiter.RejectedError) *status.Status {
	if rej.RetryAfter <= 0 {
		// 0 is "unknown" (more tokens than the burst): no RetryInfo
		// rather than one that says "retry at once".
		return status.Newf(codes.ResourceExhausted, "limit %q: rate limited", rej.Limit)
	}
	st := status.Newf(codes.ResourceExhausted, "limit %q: rate limited, retry after %v", rej.Limit, rej.RetryAfter)
	if d, err := st.WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(rej.RetryAfter)}); err == nil {
		st = d
	}
	return st
}
