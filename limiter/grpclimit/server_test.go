package grpclimit_test

import (
	"context"
	"errors"
	"io"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/rlagent/rlagent/limiter"
	"github.com/rlagent/rlagent/limiter/grpclimit"
)

// A "fail" limit refuses the call past its burst at once, with
// ResourceExhausted, a message naming the limit, a RetryInfo carrying the
// time its token comes back, and the same time as the pushback trailer;
// the handler never sees it.
func TestUnaryFailRetryInfo(t *testing.T) {
	set := newSet(t, limiter.LimitConfig{Name: "api", Rate: 10, Burst: 2, OnEmpty: limiter.OnEmptyFail})
	e, cc := startBuf(t, []grpc.ServerOption{grpc.UnaryInterceptor(grpclimit.UnaryServerInterceptor(set, grpclimit.Options{}))})
	ctx := context.Background()
	for i := range 2 {
		if err := call(ctx, cc); err != nil {
			t.Fatalf("call %d within the burst: %v", i, err)
		}
	}
	var trailer metadata.MD
	start := time.Now()
	err := call(ctx, cc, grpc.Trailer(&trailer))
	mustCode(t, err, codes.ResourceExhausted)
	if el := time.Since(start); el > 50*time.Millisecond {
		t.Errorf("the refusal took %v, want it at once", el)
	}
	if msg := status.Convert(err).Message(); !strings.Contains(msg, `"api"`) {
		t.Errorf("message %q does not name the limit", msg)
	}
	d, ok := retryDelay(err)
	if !ok {
		t.Fatalf("no RetryInfo in %v", status.Convert(err).Details())
	}
	// Rate 10/s: the next token is at most 100 ms away.
	if d <= 0 || d > 100*time.Millisecond {
		t.Errorf("RetryInfo delay %v, want in (0, 100ms]", d)
	}
	p := trailer.Get("grpc-retry-pushback-ms")
	if len(p) != 1 {
		t.Fatalf("pushback trailer %q, want one value", p)
	}
	if ms, err := strconv.Atoi(p[0]); err != nil || ms < 1 || ms > 100 {
		t.Errorf("pushback %q ms, want in [1, 100]", p[0])
	}
	if n := e.calls.Load(); n != 2 {
		t.Errorf("handler ran %d times, want 2", n)
	}
	// The delay is true: after it, the call passes.
	time.Sleep(d)
	if err := call(ctx, cc); err != nil {
		t.Errorf("call after the RetryInfo delay: %v", err)
	}
}

// A "wait" limit holds calls sent at twice its rate instead of failing
// them: each passes after its token accrues, none waits more than MaxWait,
// and the calls come out at the limit's rate.
func TestUnaryWaitHonoured(t *testing.T) {
	const (
		rate    = 20 // per second: a token every 50 ms
		n       = 8  // calls, one every 25 ms: twice the rate
		maxWait = 400 * time.Millisecond
	)
	set := newSet(t, limiter.LimitConfig{Name: "api", Rate: rate, Burst: 1, OnEmpty: limiter.OnEmptyWait, MaxWait: maxWait})
	e, cc := startBuf(t, []grpc.ServerOption{grpc.UnaryInterceptor(grpclimit.UnaryServerInterceptor(set, grpclimit.Options{}))})
	if err := call(context.Background(), cc); err != nil { // connect
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond) // the token is back

	start := time.Now()
	var wg sync.WaitGroup
	errs := make([]error, n)
	lat := make([]time.Duration, n)
	for i := range n {
		time.Sleep(time.Until(start.Add(time.Duration(i) * 25 * time.Millisecond)))
		wg.Go(func() {
			t0 := time.Now()
			errs[i] = call(context.Background(), cc)
			lat[i] = time.Since(t0)
		})
	}
	wg.Wait()
	span := time.Since(start)
	for i, err := range errs {
		if err != nil {
			t.Errorf("call %d: %v (want it to wait)", i, err)
		}
		if lat[i] > maxWait+50*time.Millisecond {
			t.Errorf("call %d waited %v, more than MaxWait %v", i, lat[i], maxWait)
		}
	}
	// The last call's token is (n-1) x 50 ms after the first's.
	if want := time.Duration(n-1) * 50 * time.Millisecond; span < want-15*time.Millisecond {
		t.Errorf("%d calls done in %v, want at least %v: they did not wait", n, span, want)
	}
	if lat[n-1] < 100*time.Millisecond {
		t.Errorf("the last call took %v, want it to have waited ~%v", lat[n-1], time.Duration(n-1)*25*time.Millisecond)
	}
	if got := e.calls.Load(); got != n+1 {
		t.Errorf("handler ran %d times, want %d", got, n+1)
	}
}

// A "wait" limit fails at once a call that would wait longer than MaxWait.
func TestUnaryWaitBeyondMaxWaitFails(t *testing.T) {
	set := newSet(t, limiter.LimitConfig{Name: "api", Rate: 10, Burst: 1, OnEmpty: limiter.OnEmptyWait, MaxWait: 150 * time.Millisecond})
	_, cc := startBuf(t, []grpc.ServerOption{grpc.UnaryInterceptor(grpclimit.UnaryServerInterceptor(set, grpclimit.Options{}))})
	ctx := context.Background()
	// Each token is 100 ms: the 1st passes, the 2nd waits ~100 ms,
	// the 3rd would wait ~200 ms > MaxWait.
	var wg sync.WaitGroup
	errs := make([]error, 3)
	lat := make([]time.Duration, 3)
	for i := range 3 {
		wg.Go(func() {
			t0 := time.Now()
			errs[i] = call(ctx, cc)
			lat[i] = time.Since(t0)
		})
		time.Sleep(5 * time.Millisecond) // in order
	}
	wg.Wait()
	if errs[0] != nil || errs[1] != nil {
		t.Fatalf("calls within MaxWait: %v, %v", errs[0], errs[1])
	}
	mustCode(t, errs[2], codes.ResourceExhausted)
	if lat[2] > 50*time.Millisecond {
		t.Errorf("the call beyond MaxWait failed after %v, want at once", lat[2])
	}
	if d, ok := retryDelay(errs[2]); !ok || d <= 150*time.Millisecond || d > 200*time.Millisecond {
		t.Errorf("RetryInfo delay %v (%v), want in (150ms, 200ms]", d, ok)
	}
}

// A call whose deadline comes before its token fails at once, with
// ResourceExhausted, rather than waiting for its deadline.
func TestUnaryDeadlineShorterThanWait(t *testing.T) {
	set := newSet(t, limiter.LimitConfig{Name: "api", Rate: 2, Burst: 1, OnEmpty: limiter.OnEmptyWait, MaxWait: 2 * time.Second})
	e, cc := startBuf(t, []grpc.ServerOption{grpc.UnaryInterceptor(grpclimit.UnaryServerInterceptor(set, grpclimit.Options{}))})
	if err := call(context.Background(), cc); err != nil {
		t.Fatal(err)
	}
	// The next token is ~500 ms away; the call has 200 ms.
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := call(ctx, cc)
	el := time.Since(start)
	mustCode(t, err, codes.ResourceExhausted)
	if el > 100*time.Millisecond {
		t.Errorf("refused after %v, want at once", el)
	}
	if d, ok := retryDelay(err); !ok || d < 400*time.Millisecond {
		t.Errorf("RetryInfo delay %v (%v), want ~500ms", d, ok)
	}
	if n := e.calls.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
}

// A call cancelled while it waits never reaches the handler, and gives its
// token back: the next call waits for the first token, not a second.
func TestUnaryWaitCancelled(t *testing.T) {
	set := newSet(t, limiter.LimitConfig{Name: "api", Rate: 5, Burst: 1, OnEmpty: limiter.OnEmptyWait, MaxWait: time.Second})
	e, cc := startBuf(t, []grpc.ServerOption{grpc.UnaryInterceptor(grpclimit.UnaryServerInterceptor(set, grpclimit.Options{}))})
	if err := call(context.Background(), cc); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	mustCode(t, call(ctx, cc), codes.Canceled)
	time.Sleep(20 * time.Millisecond) // let the server see the cancel
	start := time.Now()
	if err := call(context.Background(), cc); err != nil {
		t.Fatal(err)
	}
	// The first token after the burst is at 200 ms from the first call;
	// had the cancelled call kept its token, this one would wait ~330 ms.
	if el := time.Since(start); el > 250*time.Millisecond {
		t.Errorf("the call after a cancelled wait waited %v: the cancelled call kept its token", el)
	}
	if n := e.calls.Load(); n != 2 {
		t.Errorf("handler ran %d times, want 2", n)
	}
}

// Each limit of the Set draws from its own key; a tenant past its burst
// does not stop another one, and a filtered method is not limited.
func TestKeysAndFilter(t *testing.T) {
	set := newSet(t,
		limiter.LimitConfig{Name: "tenant", Rate: 1, Burst: 1, Keyed: true},
		limiter.LimitConfig{Name: "method", Rate: 1, Burst: 3, Keyed: true},
	)
	var mu sync.Mutex
	var seen []string
	record := func(ctx context.Context, m string) string {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, m)
		return m
	}
	icpt := grpclimit.UnaryServerInterceptor(set,
		grpclimit.Options{
			Keys: []grpclimit.KeyFunc{grpclimit.Metadata("X-Tenant"), record},
			Filter: func(ctx context.Context, m string) bool {
				return metadata.ValueFromIncomingContext(ctx, "x-exempt") == nil
			},
		})
	_, cc := startBuf(t, []grpc.ServerOption{grpc.UnaryInterceptor(icpt)})
	as := func(tenant string) context.Context {
		return metadata.AppendToOutgoingContext(context.Background(), "x-tenant", tenant)
	}
	if err := call(as("a"), cc); err != nil {
		t.Fatal(err)
	}
	mustCode(t, call(as("a"), cc), codes.ResourceExhausted)
	if err := call(as("b"), cc); err != nil {
		t.Errorf("tenant b after tenant a's burst: %v", err)
	}
	// tenant a's refusal drew nothing from "method": 2 of its 3 are spent.
	if err := call(as("c"), cc); err != nil {
		t.Errorf("third call to the method: %v", err)
	}
	exempt := metadata.AppendToOutgoingContext(as("a"), "x-exempt", "1")
	for range 5 {
		if err := call(exempt, cc); err != nil {
			t.Fatalf("filtered-out call: %v", err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 4 || seen[0] != echoMethod {
		t.Errorf("key function saw %q, want 4 x %q (not the filtered calls)", seen, echoMethod)
	}
}

// More key functions than the Set has limits is caught when the
// interceptor is built.
func TestTooManyKeysPanics(t *testing.T) {
	set := newSet(t, limiter.LimitConfig{Name: "api", Rate: 1, Burst: 1})
	defer func() {
		if r, _ := recover().(string); !strings.Contains(r, "2 Keys") {
			t.Errorf("recovered %q, want a panic counting the keys", r)
		}
	}()
	grpclimit.UnaryServerInterceptor(set, grpclimit.Options{Keys: []grpclimit.KeyFunc{grpclimit.PeerIP, grpclimit.FullMethod}})
}

// On a real TCP listener, PeerIP keys on 127.0.0.1 and the RetryInfo
// crosses the wire.
func TestRealListenerPeerIP(t *testing.T) {
	set := newSet(t, limiter.LimitConfig{Name: "per-ip", Rate: 10, Burst: 1, Keyed: true})
	var mu sync.Mutex
	var keys []string
	peerIP := func(ctx context.Context, m string) string {
		k := grpclimit.PeerIP(ctx, m)
		mu.Lock()
		keys = append(keys, k)
		mu.Unlock()
		return k
	}
	_, cc := startTCP(t, []grpc.ServerOption{grpc.UnaryInterceptor(grpclimit.UnaryServerInterceptor(set, grpclimit.Options{Keys: []grpclimit.KeyFunc{peerIP}}))})
	if err := call(context.Background(), cc); err != nil {
		t.Fatal(err)
	}
	err := call(context.Background(), cc)
	mustCode(t, err, codes.ResourceExhausted)
	if d, ok := retryDelay(err); !ok || d <= 0 || d > 100*time.Millisecond {
		t.Errorf("RetryInfo delay %v (%v), want in (0, 100ms]", d, ok)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(keys) != 2 || keys[0] != "127.0.0.1" {
		t.Errorf("PeerIP keys %q, want 2 x 127.0.0.1", keys)
	}
}

// A client whose retry policy retries RESOURCE_EXHAUSTED comes back after
// the server's pushback, when its token is there, and succeeds.
func TestPushbackRetry(t *testing.T) {
	set := newSet(t, limiter.LimitConfig{Name: "api", Rate: 5, Burst: 1})
	const sc = `{"methodConfig": [{"name": [{"service": "rlagent.test.Echo"}], "retryPolicy": {
		"maxAttempts": 2, "initialBackoff": "0.001s", "maxBackoff": "0.001s",
		"backoffMultiplier": 1, "retryableStatusCodes": ["RESOURCE_EXHAUSTED"]}}]}`
	e, cc := startBuf(t, []grpc.ServerOption{grpc.UnaryInterceptor(grpclimit.UnaryServerInterceptor(set, grpclimit.Options{}))},
		grpc.WithDefaultServiceConfig(sc))
	if err := call(context.Background(), cc); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := call(context.Background(), cc); err != nil {
		t.Fatalf("retried call: %v (the pushback was not honoured)", err)
	}
	// Without the pushback the retry would come after 1 ms, and fail.
	if el := time.Since(start); el < 150*time.Millisecond {
		t.Errorf("retried call took %v, want ~200ms (the pushback)", el)
	}
	if n := e.calls.Load(); n != 2 {
		t.Errorf("handler ran %d times, want 2", n)
	}
}

// A stream is charged once, when it opens: its messages are free, and a
// second stream past the burst is refused before the handler runs.
func TestStreamChargedOnOpen(t *testing.T) {
	set := newSet(t, limiter.LimitConfig{Name: "streams", Rate: 1, Burst: 1})
	e, cc := startBuf(t, []grpc.ServerOption{grpc.StreamInterceptor(grpclimit.StreamServerInterceptor(set, grpclimit.Options{}))})
	ctx := context.Background()
	s1, err := openStream(ctx, cc)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		if err := s1.SendMsg(wrapperspb.String("m")); err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
		if err := s1.RecvMsg(new(wrapperspb.StringValue)); err != nil {
			t.Fatalf("message %d of an admitted stream: %v", i, err)
		}
	}
	s1.CloseSend()
	if err := s1.RecvMsg(new(wrapperspb.StringValue)); err != io.EOF {
		t.Fatalf("end of stream: %v", err)
	}

	s2, err := openStream(ctx, cc)
	if err != nil {
		t.Fatal(err)
	}
	err = s2.RecvMsg(new(wrapperspb.StringValue))
	mustCode(t, err, codes.ResourceExhausted)
	if d, ok := retryDelay(err); !ok || d <= 0 || d > time.Second {
		t.Errorf("RetryInfo delay %v (%v), want in (0, 1s]", d, ok)
	}
	if p := s2.Trailer().Get("grpc-retry-pushback-ms"); len(p) != 1 {
		t.Errorf("pushback trailer %q, want one value", p)
	}
	if n, m := e.calls.Load(), e.messages.Load(); n != 1 || m != 10 {
		t.Errorf("handler saw %d streams and %d messages, want 1 and 10", n, m)
	}
}

// With Options.PerMessage, each received message costs a token, and the first one
// past the burst ends the stream with ResourceExhausted.
func TestStreamPerMessage(t *testing.T) {
	set := newSet(t, limiter.LimitConfig{Name: "messages", Rate: 1, Burst: 3})
	e, cc := startBuf(t, []grpc.ServerOption{grpc.StreamInterceptor(grpclimit.StreamServerInterceptor(set, grpclimit.Options{PerMessage: true}))})
	s, err := openStream(context.Background(), cc)
	if err != nil {
		t.Fatal(err)
	}
	var got int
	for range 5 {
		if err := s.SendMsg(wrapperspb.String("m")); err != nil {
			break // the server ended the stream; RecvMsg says why
		}
		if err = s.RecvMsg(new(wrapperspb.StringValue)); err != nil {
			mustCode(t, err, codes.ResourceExhausted)
			if _, ok := retryDelay(err); !ok {
				t.Errorf("no RetryInfo in %v", err)
			}
			break
		}
		got++
	}
	if got != 3 {
		t.Errorf("%d messages echoed, want the burst, 3", got)
	}
	if n, m := e.calls.Load(), e.messages.Load(); n != 1 || m != 3 {
		t.Errorf("handler saw %d streams and %d messages, want 1 and 3", n, m)
	}
}

// The handler's own error passes through the interceptor untouched.
func TestHandlerErrorPassesThrough(t *testing.T) {
	set := newSet(t, limiter.LimitConfig{Name: "api", Rate: 100, Burst: 10})
	e, cc := startBuf(t, []grpc.ServerOption{grpc.UnaryInterceptor(grpclimit.UnaryServerInterceptor(set, grpclimit.Options{}))})
	e.reject = func(int64) error { return status.Error(codes.NotFound, "no such thing") }
	if err := call(context.Background(), cc); status.Code(err) != codes.NotFound || errors.Is(err, limiter.ErrLimited) {
		t.Errorf("got %v, want the handler's NotFound", err)
	}
}
