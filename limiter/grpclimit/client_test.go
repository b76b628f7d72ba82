package grpclimit_test

import (
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/rlagent/rlagent/limiter"
	"github.com/rlagent/rlagent/limiter/grpclimit"
	"github.com/rlagent/rlagent/limiter/throttle"
)

// newThrottle returns a Throttle with a seeded random source, so that a
// test's refusals are the same on every run.
func newThrottle(tb testing.TB) *throttle.Throttle {
	tb.Helper()
	r := rand.New(rand.NewPCG(1, 2))
	th, err := throttle.New(throttle.Options{Rand: r.Float64})
	if err != nil {
		tb.Fatal(err)
	}
	return th
}

// Against a server whose limit accepts ~20 calls of 400, the throttled
// client sends far fewer than 400: the rest it refuses itself, with
// Unavailable and ErrThrottled. Every call is counted: the throttle's
// requests are the 400, its accepts the server's successes.
func TestClientThrottleReducesCalls(t *testing.T) {
	const n = 400
	run := func(th *throttle.Throttle) (reached, ok, local int64) {
		// Rate 1/s: the ~100 ms run accepts the burst and little more.
		set := newSet(t, limiter.LimitConfig{Name: "backend", Rate: 1, Burst: 20})
		var dopts []grpc.DialOption
		if th != nil {
			dopts = append(dopts, grpc.WithUnaryInterceptor(grpclimit.UnaryClientInterceptor(th)))
		}
		var seen atomic.Int64 // calls that reached the server
		count := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			seen.Add(1)
			return h(ctx, req)
		}
		_, cc := startBuf(t, []grpc.ServerOption{grpc.ChainUnaryInterceptor(count, grpclimit.UnaryServerInterceptor(set, grpclimit.Options{}))}, dopts...)
		for range n {
			err := call(context.Background(), cc)
			switch {
			case err == nil:
				ok++
			case errors.Is(err, throttle.ErrThrottled):
				mustCode(t, err, codes.Unavailable)
				local++
			default:
				mustCode(t, err, codes.ResourceExhausted)
			}
		}
		return seen.Load(), ok, local
	}

	reached, _, _ := run(nil)
	if reached != n {
		t.Fatalf("unthrottled: %d calls reached the server, want %d", reached, n)
	}
	th := newThrottle(t)
	reached, ok, local := run(th)
	t.Logf("throttled: %d of %d calls reached the server, %d succeeded, %d refused locally", reached, n, ok, local)
	if reached > n/2 {
		t.Errorf("throttled: %d of %d calls reached the server, want at most %d", reached, n, n/2)
	}
	if reached+local != n {
		t.Errorf("reached %d + refused locally %d != %d calls", reached, local, n)
	}
	if ok < 20 {
		t.Errorf("only %d calls succeeded: the throttle refused calls the server would take", ok)
	}
	st := th.Stats()
	if st.Requests != n || st.Accepts != float64(ok) {
		t.Errorf("throttle counted %v requests, %v accepts; want %d, %d", st.Requests, st.Accepts, n, ok)
	}
}

// A refused connection (nothing listens on the port) counts as a
// rejection: the throttle soon refuses most calls itself.
func TestClientRefusedConnection(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	th := newThrottle(t)
	cc, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(insecureCreds()),
		grpc.WithUnaryInterceptor(grpclimit.UnaryClientInterceptor(th)))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	const n = 50
	var local int
	for range n {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := call(ctx, cc)
		cancel()
		mustCode(t, err, codes.Unavailable)
		if errors.Is(err, throttle.ErrThrottled) {
			local++
		}
	}
	if local < n/2 {
		t.Errorf("%d of %d calls to a refused port were refused locally, want more than %d", local, n, n/2)
	}
	if st := th.Stats(); st.Requests != n || st.Accepts != 0 {
		t.Errorf("throttle counted %v requests, %v accepts; want %d, 0", st.Requests, st.Accepts, n)
	}
}

// A call the caller cancels is not recorded: it says nothing of the server.
func TestClientIgnoresCancelled(t *testing.T) {
	th := newThrottle(t)
	set := newSet(t, limiter.LimitConfig{Name: "api", Rate: 1, Burst: 1, OnEmpty: limiter.OnEmptyWait, MaxWait: time.Minute})
	_, cc := startBuf(t, []grpc.ServerOption{grpc.UnaryInterceptor(grpclimit.UnaryServerInterceptor(set, grpclimit.Options{}))},
		grpc.WithUnaryInterceptor(grpclimit.UnaryClientInterceptor(th)))
	if err := call(context.Background(), cc); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(20*time.Millisecond, cancel) // while it waits for its token
	mustCode(t, call(ctx, cc), codes.Canceled)
	if st := th.Stats(); st.Requests != 1 || st.Accepts != 1 {
		t.Errorf("throttle counted %v requests, %v accepts; want 1, 1", st.Requests, st.Accepts)
	}
}

// The stream interceptor records each stream once: the streams the server
// admits as accepts, the ones its limit refuses as rejections, and the
// throttle then keeps most streams from leaving.
func TestStreamClientInterceptor(t *testing.T) {
	const n = 200
	set := newSet(t, limiter.LimitConfig{Name: "streams", Rate: 1, Burst: 5})
	var seen atomic.Int64
	count := func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		seen.Add(1)
		return h(srv, ss)
	}
	th := newThrottle(t)
	_, cc := startBuf(t, []grpc.ServerOption{grpc.ChainStreamInterceptor(count, grpclimit.StreamServerInterceptor(set, grpclimit.Options{}))},
		grpc.WithStreamInterceptor(grpclimit.StreamClientInterceptor(th)))
	var ok, local int
	for range n {
		s, err := openStream(context.Background(), cc)
		if err != nil {
			if !errors.Is(err, throttle.ErrThrottled) {
				t.Fatalf("open: %v", err)
			}
			mustCode(t, err, codes.Unavailable)
			local++
			continue
		}
		if err := s.SendMsg(wrapperspb.String("m")); err != nil && err != io.EOF {
			t.Fatalf("send: %v", err)
		}
		s.CloseSend()
		var recvErr error
		for recvErr == nil {
			recvErr = s.RecvMsg(new(wrapperspb.StringValue))
		}
		if recvErr == io.EOF {
			ok++
		} else {
			mustCode(t, recvErr, codes.ResourceExhausted)
		}
	}
	t.Logf("%d of %d streams reached the server, %d succeeded, %d refused locally", seen.Load(), n, ok, local)
	if r := seen.Load(); r > n/2 || r+int64(local) != n {
		t.Errorf("%d of %d streams reached the server and %d were refused locally; want at most %d to reach it, and all counted",
			r, n, local, n/2)
	}
	if st := th.Stats(); st.Requests != n || st.Accepts != float64(ok) {
		t.Errorf("throttle counted %v requests, %v accepts; want %d, %d", st.Requests, st.Accepts, n, ok)
	}
}

func TestClassify(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want throttle.Outcome
	}{
		{nil, throttle.Accepted},
		{status.Error(codes.NotFound, ""), throttle.Accepted},
		{status.Error(codes.Internal, ""), throttle.Accepted},
		{status.Error(codes.ResourceExhausted, ""), throttle.Rejected},
		{status.Error(codes.Unavailable, ""), throttle.Rejected},
		{status.Error(codes.Canceled, ""), throttle.Ignored},
		{status.Error(codes.DeadlineExceeded, ""), throttle.Ignored},
		{context.Canceled, throttle.Ignored}, // status.Code maps a bare context error
	} {
		if got := grpclimit.Classify(tc.err); got != tc.want {
			t.Errorf("Classify(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}
