package grpclimit_test

import (
	"context"
	"errors"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/rlagent/rlagent/limiter"
)

// A tiny hand-written service, so that the tests need no protoc:
// rlagent.test.Echo with a unary Echo and a bidi Stream, both on
// wrapperspb.StringValue (the default proto codec encodes it).

const (
	echoMethod   = "/rlagent.test.Echo/Echo"
	streamMethod = "/rlagent.test.Echo/Stream"
)

// echo counts the calls and messages that reach it. reject, if set,
// decides the status of a unary call instead of echoing it.
type echo struct {
	calls    atomic.Int64 // unary calls and streams that reached the handler
	messages atomic.Int64 // stream messages received by the handler
	reject   func(n int64) error
}

type echoService interface{ isEcho() }

func (*echo) isEcho() {}

var echoDesc = grpc.ServiceDesc{
	ServiceName: "rlagent.test.Echo",
	HandlerType: (*echoService)(nil),
	Methods: []grpc.MethodDesc{{
		MethodName: "Echo",
		Handler: func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
			in := new(wrapperspb.StringValue)
			if err := dec(in); err != nil {
				return nil, err
			}
			h := func(ctx context.Context, req any) (any, error) {
				e := srv.(*echo)
				n := e.calls.Add(1)
				if e.reject != nil {
					if err := e.reject(n); err != nil {
						return nil, err
					}
				}
				return req.(*wrapperspb.StringValue), nil
			}
			if interceptor == nil {
				return h(ctx, in)
			}
			return interceptor(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: echoMethod}, h)
		},
	}},
	Streams: []grpc.StreamDesc{{
		StreamName:    "Stream",
		ServerStreams: true,
		ClientStreams: true,
		Handler: func(srv any, ss grpc.ServerStream) error {
			e := srv.(*echo)
			e.calls.Add(1)
			for {
				in := new(wrapperspb.StringValue)
				if err := ss.RecvMsg(in); err != nil {
					if errors.Is(err, io.EOF) {
						return nil
					}
					return err
				}
				e.messages.Add(1)
				if err := ss.SendMsg(in); err != nil {
					return err
				}
			}
		},
	}},
}

// serve starts a server with the echo service on lis, stopped at the
// test's end.
func serve(tb testing.TB, lis net.Listener, opts ...grpc.ServerOption) *echo {
	tb.Helper()
	e := &echo{}
	s := grpc.NewServer(opts...)
	s.RegisterService(&echoDesc, e)
	go s.Serve(lis)
	tb.Cleanup(s.Stop)
	return e
}

// startBuf serves the echo service on an in-memory listener and returns a
// client connection to it.
func startBuf(tb testing.TB, sopts []grpc.ServerOption, dopts ...grpc.DialOption) (*echo, *grpc.ClientConn) {
	tb.Helper()
	lis := bufconn.Listen(1 << 20)
	e := serve(tb, lis, sopts...)
	dopts = append([]grpc.DialOption{
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
	}, dopts...)
	cc, err := grpc.NewClient("passthrough:///bufnet", dopts...)
	if err != nil {
		tb.Fatalf("new client: %v", err)
	}
	tb.Cleanup(func() { cc.Close() })
	return e, cc
}

// startTCP serves the echo service on 127.0.0.1 and returns a client
// connection to it.
func startTCP(tb testing.TB, sopts []grpc.ServerOption, dopts ...grpc.DialOption) (*echo, *grpc.ClientConn) {
	tb.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("listen: %v", err)
	}
	e := serve(tb, lis, sopts...)
	dopts = append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, dopts...)
	cc, err := grpc.NewClient(lis.Addr().String(), dopts...)
	if err != nil {
		tb.Fatalf("new client: %v", err)
	}
	tb.Cleanup(func() { cc.Close() })
	return e, cc
}

func call(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) error {
	return cc.Invoke(ctx, echoMethod, wrapperspb.String("hi"), new(wrapperspb.StringValue), opts...)
}

func openStream(ctx context.Context, cc *grpc.ClientConn) (grpc.ClientStream, error) {
	return cc.NewStream(ctx, &echoDesc.Streams[0], streamMethod)
}

// newSet applies cfgs to a new Limiter and returns the Set of their
// names, in order.
func newSet(tb testing.TB, cfgs ...limiter.LimitConfig) *limiter.Set {
	tb.Helper()
	l, err := limiter.New(limiter.Options{})
	if err != nil {
		tb.Fatalf("limiter.New: %v", err)
	}
	if err := l.Apply(cfgs); err != nil {
		tb.Fatalf("Apply: %v", err)
	}
	names := make([]string, len(cfgs))
	for i, c := range cfgs {
		names[i] = c.Name
	}
	return l.Set(names...)
}

// retryDelay returns the RetryInfo delay of err's status, and whether it
// has one.
func retryDelay(err error) (time.Duration, bool) {
	for _, d := range status.Convert(err).Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			return ri.GetRetryDelay().AsDuration(), true
		}
	}
	return 0, false
}

// mustCode fails the test unless err's status code is want.
func mustCode(tb testing.TB, err error, want codes.Code) {
	tb.Helper()
	if got := status.Code(err); got != want {
		tb.Fatalf("status %v (%v), want %v", got, err, want)
	}
}

func insecureCreds() credentials.TransportCredentials { return insecure.NewCredentials() }
