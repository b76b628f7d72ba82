package grpclimit_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/rlagent/rlagent/limiter"
	"github.com/rlagent/rlagent/limiter/grpclimit"
	"github.com/rlagent/rlagent/limiter/throttle"
)

// serveHealth serves gRPC's health service on 127.0.0.1 with opts, and
// returns its address and how to stop it.
func serveHealth(opts ...grpc.ServerOption) (addr string, stop func()) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	s := grpc.NewServer(opts...)
	healthpb.RegisterHealthServer(s, health.NewServer())
	go s.Serve(lis)
	return lis.Addr().String(), s.Stop
}

// dial connects to addr without TLS, with opts.
func dial(addr string, opts ...grpc.DialOption) *grpc.ClientConn {
	cc, err := grpc.NewClient(addr, append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		log.Fatal(err)
	}
	return cc
}

// A server that lets each client address make one call per second: the
// second call at once is refused, and its status says when to come back.
func ExampleUnaryServerInterceptor() {
	l, err := limiter.New(limiter.Options{})
	if err != nil {
		log.Fatal(err)
	}
	err = l.Apply([]limiter.LimitConfig{{Name: "per-ip", Rate: 1, Burst: 1, Keyed: true}})
	if err != nil {
		log.Fatal(err)
	}
	addr, stop := serveHealth(grpc.UnaryInterceptor(
		grpclimit.UnaryServerInterceptor(l.Set("per-ip"), grpclimit.Options{
			Keys: []grpclimit.KeyFunc{grpclimit.PeerIP}, // the key of "per-ip"
		})))
	defer stop()

	cc := dial(addr)
	defer cc.Close()
	client := healthpb.NewHealthClient(cc)
	for range 2 {
		resp, err := client.Check(context.Background(), &healthpb.HealthCheckRequest{})
		if err != nil {
			st := status.Convert(err)
			msg, _, _ := strings.Cut(st.Message(), ",") // the rest is the delay
			fmt.Println(st.Code(), msg)
			for _, d := range st.Details() {
				if ri, ok := d.(*errdetails.RetryInfo); ok {
					fmt.Println("retry in", ri.GetRetryDelay().AsDuration().Round(time.Second))
				}
			}
			continue
		}
		fmt.Println(resp.GetStatus())
	}
	// Output:
	// SERVING
	// ResourceExhausted limit "per-ip": rate limited
	// retry in 1s
}

// A limit with OnEmpty "wait" holds a call until its token is there,
// rather than failing it, if that is no longer than MaxWait.
func ExampleUnaryServerInterceptor_wait() {
	l, err := limiter.New(limiter.Options{})
	if err != nil {
		log.Fatal(err)
	}
	err = l.Apply([]limiter.LimitConfig{{
		Name: "smooth", Rate: 10, Burst: 1,
		OnEmpty: limiter.OnEmptyWait, MaxWait: time.Second,
	}})
	if err != nil {
		log.Fatal(err)
	}
	addr, stop := serveHealth(grpc.UnaryInterceptor(grpclimit.UnaryServerInterceptor(l.Set("smooth"), grpclimit.Options{})))
	defer stop()

	cc := dial(addr)
	defer cc.Close()
	client := healthpb.NewHealthClient(cc)
	start := time.Now()
	for range 3 {
		if _, err := client.Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil {
			log.Fatal(err)
		}
	}
	// Tokens every 100 ms: the 2nd and 3rd calls waited for theirs.
	fmt.Println("3 calls in at least 200ms:", time.Since(start) >= 190*time.Millisecond)
	// Output:
	// 3 calls in at least 200ms: true
}

// Streams are charged one token when they open: here, one stream per
// second whatever it carries.
func ExampleStreamServerInterceptor() {
	l, err := limiter.New(limiter.Options{})
	if err != nil {
		log.Fatal(err)
	}
	if err := l.Apply([]limiter.LimitConfig{{Name: "streams", Rate: 1, Burst: 1}}); err != nil {
		log.Fatal(err)
	}
	addr, stop := serveHealth(grpc.StreamInterceptor(grpclimit.StreamServerInterceptor(l.Set("streams"), grpclimit.Options{})))
	defer stop()

	cc := dial(addr)
	defer cc.Close()
	client := healthpb.NewHealthClient(cc)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for range 2 {
		w, err := client.Watch(ctx, &healthpb.HealthCheckRequest{})
		if err != nil {
			log.Fatal(err)
		}
		resp, err := w.Recv()
		if err != nil {
			fmt.Println(status.Code(err))
			continue
		}
		fmt.Println(resp.GetStatus())
	}
	// Output:
	// SERVING
	// ResourceExhausted
}

// Limits keyed by a metadata header: each tenant has its own bucket.
func ExampleMetadata() {
	l, err := limiter.New(limiter.Options{})
	if err != nil {
		log.Fatal(err)
	}
	if err := l.Apply([]limiter.LimitConfig{{Name: "per-tenant", Rate: 1, Burst: 1, Keyed: true}}); err != nil {
		log.Fatal(err)
	}
	addr, stop := serveHealth(grpc.UnaryInterceptor(grpclimit.UnaryServerInterceptor(l.Set("per-tenant"),
		grpclimit.Options{Keys: []grpclimit.KeyFunc{grpclimit.Metadata("x-tenant")}})))
	defer stop()

	cc := dial(addr)
	defer cc.Close()
	client := healthpb.NewHealthClient(cc)
	for _, tenant := range []string{"a", "a", "b"} {
		ctx := metadata.AppendToOutgoingContext(context.Background(), "x-tenant", tenant)
		_, err := client.Check(ctx, &healthpb.HealthCheckRequest{})
		fmt.Println(tenant, status.Code(err))
	}
	// Output:
	// a OK
	// a ResourceExhausted
	// b OK
}

// Health checks are left out of the limit, so that a busy server is not
// also taken for a dead one.
func ExampleOptions_filter() {
	l, err := limiter.New(limiter.Options{})
	if err != nil {
		log.Fatal(err)
	}
	if err := l.Apply([]limiter.LimitConfig{{Name: "api", Rate: 1, Burst: 1}}); err != nil {
		log.Fatal(err)
	}
	notHealth := func(_ context.Context, fullMethod string) bool {
		return !strings.HasPrefix(fullMethod, "/grpc.health.v1.Health/")
	}
	addr, stop := serveHealth(grpc.UnaryInterceptor(
		grpclimit.UnaryServerInterceptor(l.Set("api"), grpclimit.Options{Filter: notHealth})))
	defer stop()

	cc := dial(addr)
	defer cc.Close()
	client := healthpb.NewHealthClient(cc)
	for range 3 {
		_, err := client.Check(context.Background(), &healthpb.HealthCheckRequest{})
		fmt.Println(status.Code(err))
	}
	// Output:
	// OK
	// OK
	// OK
}

// A client that throttles itself when its backend refuses most calls: of
// 200 calls to a backend that accepts 10, most never leave the client.
func ExampleUnaryClientInterceptor() {
	// The overloaded backend: 10 calls, then one a minute.
	l, err := limiter.New(limiter.Options{})
	if err != nil {
		log.Fatal(err)
	}
	if err := l.Apply([]limiter.LimitConfig{{Name: "capacity", Rate: 1.0 / 60, Burst: 10}}); err != nil {
		log.Fatal(err)
	}
	addr, stop := serveHealth(grpc.UnaryInterceptor(grpclimit.UnaryServerInterceptor(l.Set("capacity"), grpclimit.Options{})))
	defer stop()

	// One Throttle per backend, shared by all the calls to it.
	th, err := throttle.New(throttle.Options{})
	if err != nil {
		log.Fatal(err)
	}
	cc := dial(addr, grpc.WithUnaryInterceptor(grpclimit.UnaryClientInterceptor(th)))
	defer cc.Close()
	client := healthpb.NewHealthClient(cc)
	var ok, refused, throttled int
	for range 200 {
		_, err := client.Check(context.Background(), &healthpb.HealthCheckRequest{})
		switch {
		case err == nil:
			ok++
		case errors.Is(err, throttle.ErrThrottled):
			throttled++ // codes.Unavailable, and the server never saw it
		default:
			refused++ // codes.ResourceExhausted, from the server
		}
	}
	fmt.Println("accepted:", ok)
	fmt.Println("most calls refused locally:", throttled > refused)
	// Output:
	// accepted: 10
	// most calls refused locally: true
}

// Streams are throttled as calls are: each stream is one request.
func ExampleStreamClientInterceptor() {
	addr, stop := serveHealth()
	defer stop()
	th, err := throttle.New(throttle.Options{})
	if err != nil {
		log.Fatal(err)
	}
	cc := dial(addr, grpc.WithStreamInterceptor(grpclimit.StreamClientInterceptor(th)))
	defer cc.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w, err := healthpb.NewHealthClient(cc).Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		log.Fatal(err)
	}
	resp, err := w.Recv()
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(resp.GetStatus(), th.Stats().Accepts)
	// Output:
	// SERVING 1
}
