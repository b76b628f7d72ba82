package httplimit

import (
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/rlagent/rlagent/limiter"
)

// fakeClock is a limiter.Clock the test moves.
type fakeClock struct {
	mu      sync.Mutex
	now     int64
	waiters []fakeWaiter
}

type fakeWaiter struct {
	at int64
	ch chan time.Time
}

func (c *fakeClock) Now() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) After(d time.Duration) <-chan time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch := make(chan time.Time, 1)
	if d <= 0 {
		ch <- time.Time{}
		return ch
	}
	c.waiters = append(c.waiters, fakeWaiter{at: c.now + int64(d), ch: ch})
	return ch
}

// Advance moves the clock and wakes the waiters whose time came.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now += int64(d)
	kept := c.waiters[:0]
	for _, w := range c.waiters {
		if w.at <= c.now {
			w.ch <- time.Time{}
			continue
		}
		kept = append(kept, w)
	}
	c.waiters = kept
}

// awaitWaiters blocks until n callers wait on the clock.
func (c *fakeClock) awaitWaiters(tb testing.TB, n int) {
	tb.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		c.mu.Lock()
		got := len(c.waiters)
		c.mu.Unlock()
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("%d waiters on the clock, want %d", got, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestGoldenFakeClock: the fields through the middleware, exact, for a
// state the fake clock fixes: a keyed limit (2/s, burst 4) and a key-less
// one (100/s, burst 100).
func TestGoldenFakeClock(t *testing.T) {
	clk := &fakeClock{}
	l := newLimiter(t, limiter.Options{Clock: clk},
		limiter.LimitConfig{Name: "per-client", Rate: 2, Burst: 4, Keyed: true},
		limiter.LimitConfig{Name: "global", Rate: 100, Burst: 100},
	)
	h := New(l.Set("per-client", "global"), Options{Keys: []KeyFunc{ClientIP}})(&counting{})
	const policy = `"per-client";q=4;w=2, "global";q=100;w=1`

	type want struct {
		code             int
		rateLimit, retry string
	}
	check := func(step string, w *httptest.ResponseRecorder, x want) {
		t.Helper()
		if w.Code != x.code {
			t.Errorf("%s: status %d, want %d", step, w.Code, x.code)
		}
		if got := w.Header().Get("RateLimit-Policy"); got != policy {
			t.Errorf("%s: RateLimit-Policy = %s, want %s", step, got, policy)
		}
		if got := w.Header().Get("RateLimit"); got != x.rateLimit {
			t.Errorf("%s: RateLimit = %s, want %s", step, got, x.rateLimit)
		}
		if got := w.Header().Get("Retry-After"); got != x.retry {
			t.Errorf("%s: Retry-After = %q, want %q", step, got, x.retry)
		}
		if _, _, err := checkFields(w.Header().Get("RateLimit-Policy"), w.Header().Get("RateLimit")); err != nil {
			t.Errorf("%s: %v", step, err)
		}
	}

	// At 0: 4 requests spend 192.0.2.1's burst; each is half a second of
	// its bucket, so its next token is 0.5 s away (t=1, rounded up).
	check("first", do(h, "192.0.2.1:1"), want{200, `"per-client";r=3;t=1, "global";r=99;t=1`, ""})
	do(h, "192.0.2.1:1")
	do(h, "192.0.2.1:1")
	check("fourth", do(h, "192.0.2.1:1"), want{200, `"per-client";r=0;t=1, "global";r=96;t=1`, ""})
	// The fifth is refused, and draws nothing from "global" either.
	check("fifth", do(h, "192.0.2.1:1"), want{429, `"per-client";r=0;t=1, "global";r=96;t=1`, "1"})
	// Another client has its own bucket.
	check("other client", do(h, "198.51.100.1:1"), want{200, `"per-client";r=3;t=1, "global";r=95;t=1`, ""})

	// At 1.5 s: 3 tokens came back to 192.0.2.1, one is drawn; the bucket
	// is full at 2.5 s, its next token at 2 s (0.5 s away). "global" is
	// full again.
	clk.Advance(1500 * time.Millisecond)
	check("at 1.5s", do(h, "192.0.2.1:1"), want{200, `"per-client";r=2;t=1, "global";r=99;t=1`, ""})
}

// TestWaitFakeClock: a wait limit (1/s, burst 1, MaxWait 2 s) holds a
// request until its token, exactly, and refuses at once one that would
// wait longer than MaxWait.
func TestWaitFakeClock(t *testing.T) {
	clk := &fakeClock{}
	l := newLimiter(t, limiter.Options{Clock: clk},
		limiter.LimitConfig{Name: "api", Rate: 1, Burst: 1, OnEmpty: limiter.OnEmptyWait, MaxWait: 2 * time.Second})
	next := &counting{}
	h := New(l.Set("api"), Options{})(next)

	if w := do(h, "192.0.2.1:1"); w.Code != 200 {
		t.Fatalf("first: %d", w.Code)
	}
	// Two more at once (more than the rate: the first alone spent the
	// burst): they wait 1 s and 2 s, both within MaxWait.
	results := make(chan *httptest.ResponseRecorder, 2)
	for range 2 {
		go func() { results <- do(h, "192.0.2.1:1") }()
	}
	clk.awaitWaiters(t, 2)
	// A fourth would wait 3 s: refused at once, the clock unmoved.
	w := do(h, "192.0.2.1:1")
	if w.Code != http.StatusTooManyRequests {
		t.Fatalf("a request 3 s from its token: %d, want 429 at once", w.Code)
	}
	if got := w.Header().Get("Retry-After"); got != "3" {
		t.Errorf("its Retry-After = %s, want 3", got)
	}

	clk.Advance(999 * time.Millisecond)
	select {
	case w := <-results:
		t.Fatalf("a request came out (%d) before its token", w.Code)
	case <-time.After(20 * time.Millisecond):
	}
	clk.Advance(time.Millisecond) // 1 s: the first waiter's token
	if w := <-results; w.Code != 200 {
		t.Fatalf("after its wait: %d, want 200", w.Code)
	}
	clk.Advance(time.Second) // 2 s: the second's
	if w := <-results; w.Code != 200 {
		t.Fatalf("after its wait: %d, want 200", w.Code)
	}
	if next.n.Load() != 3 {
		t.Fatalf("the handler ran %d times, want 3", next.n.Load())
	}
}
