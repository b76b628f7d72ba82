package httplimit

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlagent/rlagent/limiter"
)

// newLimiter returns a Limiter with cfgs applied.
func newLimiter(tb testing.TB, opts limiter.Options, cfgs ...limiter.LimitConfig) *limiter.Limiter {
	tb.Helper()
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	l, err := limiter.New(opts)
	if err != nil {
		tb.Fatal(err)
	}
	if err := l.Apply(cfgs); err != nil {
		tb.Fatal(err)
	}
	return l
}

// counting is a handler that counts the requests that reach it.
type counting struct{ n atomic.Int64 }

func (c *counting) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	c.n.Add(1)
	w.Write([]byte("ok"))
}

// do sends a request from remote through h and returns the response.
func do(h http.Handler, remote string) *httptest.ResponseRecorder {
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.RemoteAddr = remote
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

// TestRejected429: past a fail limit's burst, a request gets 429 at once,
// with Retry-After, the fields and the problem, and never reaches the
// handler. The limit is slow enough (1 token in 1,000 s) that no token
// comes back during the test, so the values are exact on the real clock.
func TestRejected429(t *testing.T) {
	l := newLimiter(t, limiter.Options{}, limiter.LimitConfig{Name: "api", Rate: 0.001, Burst: 2, OnEmpty: limiter.OnEmptyFail})
	next := &counting{}
	h := New(l.Set("api"), Options{})(next)

	for i, want := range []string{`"api";r=1;t=1000`, `"api";r=0;t=1000`} {
		w := do(h, "192.0.2.1:1000")
		if w.Code != http.StatusOK {
			t.Fatalf("request %d: status %d, want 200", i, w.Code)
		}
		if got := w.Header().Get("RateLimit"); got != want {
			t.Errorf("request %d: RateLimit = %s, want %s", i, got, want)
		}
		if got := w.Header().Get("RateLimit-Policy"); got != `"api";q=2;w=2000` {
			t.Errorf("request %d: RateLimit-Policy = %s, want \"api\";q=2;w=2000", i, got)
		}
		if w.Header().Get("Retry-After") != "" {
			t.Errorf("request %d: an admitted response has Retry-After", i)
		}
	}

	w := do(h, "192.0.2.1:1000")
	if w.Code != http.StatusTooManyRequests {
		t.Fatalf("past the burst: status %d, want 429", w.Code)
	}
	if next.n.Load() != 2 {
		t.Fatalf("the handler ran %d times, want 2", next.n.Load())
	}
	// Retry-After: the next token, in 1,000 s (less a few µs), rounded up.
	if got := w.Header().Get("Retry-After"); got != "1000" {
		t.Errorf("Retry-After = %s, want 1000", got)
	}
	if got := w.Header().Get("RateLimit"); got != `"api";r=0;t=1000` {
		t.Errorf("RateLimit = %s, want \"api\";r=0;t=1000", got)
	}
	if _, _, err := checkFields(w.Header().Get("RateLimit-Policy"), w.Header().Get("RateLimit")); err != nil {
		t.Error(err)
	}
	if ct := w.Header().Get("Content-Type"); ct != "application/problem+json" {
		t.Errorf("Content-Type = %s", ct)
	}
	var problem struct {
		Type     string   `json:"type"`
		Violated []string `json:"violated-policies"`
	}
	if err := json.Unmarshal(w.Body.Bytes(), &problem); err != nil {
		t.Fatalf("body %q: %v", w.Body, err)
	}
	if problem.Type != ProblemQuotaExceeded || len(problem.Violated) != 1 || problem.Violated[0] != "api" {
		t.Errorf("problem = %+v", problem)
	}
}

// TestHeaderModes: which responses carry the fields.
func TestHeaderModes(t *testing.T) {
	for _, tc := range []struct {
		mode                   HeaderMode
		onAdmitted, onRejected bool
	}{
		{HeadersAlways, true, true},
		{HeadersOnRejected, false, true},
		{HeadersNever, false, false},
	} {
		l := newLimiter(t, limiter.Options{}, limiter.LimitConfig{Name: "api", Rate: 0.001, Burst: 1})
		h := New(l.Set("api"), Options{Headers: tc.mode})(&counting{})
		ok, refused := do(h, "192.0.2.1:1"), do(h, "192.0.2.1:1")
		if ok.Code != 200 || refused.Code != 429 {
			t.Fatalf("mode %d: statuses %d, %d, want 200, 429", tc.mode, ok.Code, refused.Code)
		}
		has := func(w *httptest.ResponseRecorder) bool {
			return w.Header().Get("RateLimit") != "" && w.Header().Get("RateLimit-Policy") != ""
		}
		if has(ok) != tc.onAdmitted || has(refused) != tc.onRejected {
			t.Errorf("mode %d: fields on admitted %v, on refused %v; want %v, %v", tc.mode, has(ok), has(refused), tc.onAdmitted, tc.onRejected)
		}
		if refused.Header().Get("Retry-After") == "" {
			t.Errorf("mode %d: a 429 without Retry-After", tc.mode)
		}
	}
}

// TestClientIPKey: a keyed limit keyed by ClientIP gives each client its
// own bucket, and a client cannot pick another's with X-Forwarded-For.
func TestClientIPKey(t *testing.T) {
	l := newLimiter(t, limiter.Options{}, limiter.LimitConfig{Name: "per-client", Rate: 0.001, Burst: 1, Keyed: true})
	h := New(l.Set("per-client"), Options{Keys: []KeyFunc{ClientIP}})(&counting{})

	if w := do(h, "192.0.2.1:1000"); w.Code != 200 {
		t.Fatalf("first request of 192.0.2.1: %d", w.Code)
	}
	if w := do(h, "192.0.2.1:2000"); w.Code != 429 {
		t.Fatalf("second request of 192.0.2.1 (another port): %d, want 429", w.Code)
	}
	if w := do(h, "198.51.100.1:1000"); w.Code != 200 {
		t.Fatalf("first request of 198.51.100.1: %d", w.Code)
	}
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.RemoteAddr = "192.0.2.1:3000"
	r.Header.Set("X-Forwarded-For", "203.0.113.5")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != 429 {
		t.Fatalf("192.0.2.1 claiming to forward for 203.0.113.5: %d, want 429", w.Code)
	}
}

// TestClientIPOnLoopback: through a real server, ClientIP is the
// connection's address.
func TestClientIPOnLoopback(t *testing.T) {
	l := newLimiter(t, limiter.Options{}, limiter.LimitConfig{Name: "per-client", Rate: 0.001, Burst: 1, Keyed: true})
	var seen atomic.Value
	key := func(r *http.Request) string {
		k := ClientIP(r)
		seen.Store(k)
		return k
	}
	srv := httptest.NewServer(New(l.Set("per-client"), Options{Keys: []KeyFunc{key}})(&counting{}))
	defer srv.Close()
	var codes []int
	for range 2 {
		resp, err := http.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		codes = append(codes, resp.StatusCode)
	}
	if k, _ := seen.Load().(string); k != "127.0.0.1" {
		t.Errorf("ClientIP = %q, want 127.0.0.1", k)
	}
	if codes[0] != 200 || codes[1] != 429 {
		t.Errorf("statuses %v, want [200 429]", codes)
	}
}

// TestOnRejected: a custom hook gets the refusal, with the fields already
// set, and writes its own response.
func TestOnRejected(t *testing.T) {
	l := newLimiter(t, limiter.Options{},
		limiter.LimitConfig{Name: "a", Rate: 1000, Burst: 1000},
		limiter.LimitConfig{Name: "b", Rate: 0.001, Burst: 1, Keyed: true},
	)
	var got error
	h := New(l.Set("a", "b"), Options{
		Keys: []KeyFunc{nil, Header("X-Tenant")},
		OnRejected: func(w http.ResponseWriter, r *http.Request, err error) {
			got = err
			if w.Header().Get("Retry-After") == "" || w.Header().Get("RateLimit") == "" {
				t.Error("OnRejected called before the fields were set")
			}
			w.WriteHeader(http.StatusServiceUnavailable)
		},
	})(&counting{})
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.Header.Set("X-Tenant", "t1")
	for range 2 {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if got != nil && w.Code != http.StatusServiceUnavailable {
			t.Fatalf("status %d from the hook, want 503", w.Code)
		}
	}
	var rej *limiter.RejectedError
	if !errors.As(got, &rej) || rej.Limit != "b" || !errors.Is(got, limiter.ErrLimited) {
		t.Fatalf("OnRejected got %v, want a RejectedError of limit b", got)
	}
}

// TestUnconfiguredLimit: a limit the Set names but that is not configured
// admits, and is left out of the fields.
func TestUnconfiguredLimit(t *testing.T) {
	l := newLimiter(t, limiter.Options{}, limiter.LimitConfig{Name: "known", Rate: 0.001, Burst: 5})
	h := New(l.Set("later", "known"), Options{})(&counting{})
	w := do(h, "192.0.2.1:1")
	if w.Code != 200 {
		t.Fatalf("status %d", w.Code)
	}
	if got := w.Header().Get("RateLimit"); got != `"known";r=4;t=1000` {
		t.Errorf("RateLimit = %s, want \"known\";r=4;t=1000 only", got)
	}
	if got := w.Header().Get("RateLimit-Policy"); strings.Contains(got, "later") {
		t.Errorf("RateLimit-Policy = %s names the unconfigured limit", got)
	}
}

func TestNewPanics(t *testing.T) {
	l := newLimiter(t, limiter.Options{})
	for name, f := range map[string]func(){
		"nil set":       func() { New(nil, Options{}) },
		"too many keys": func() { New(l.Set("a"), Options{Keys: []KeyFunc{ClientIP, ClientIP}}) },
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: New did not panic", name)
				}
			}()
			f()
		}()
	}
}

// TestWaitHonoured: against a wait limit (20/s, burst 1, MaxWait 1 s),
// requests at twice its rate wait for their tokens instead of being
// refused, and come out at its rate; requests that would wait longer than
// MaxWait are refused at once, not after waiting.
func TestWaitHonoured(t *testing.T) {
	const (
		rate    = 20
		gap     = time.Second / rate // one token
		maxWait = time.Second
	)
	l := newLimiter(t, limiter.Options{}, limiter.LimitConfig{Name: "api", Rate: rate, Burst: 1, OnEmpty: limiter.OnEmptyWait, MaxWait: maxWait})
	next := &counting{}
	h := New(l.Set("api"), Options{})(next)

	// 6 requests at 2x the rate: request k arrives at k×gap/2 and gets its
	// token at k×gap, a wait of k×gap/2 <= 125 ms, well within MaxWait.
	const n = 6
	start := time.Now()
	done := make([]time.Duration, n)
	codes := make([]int, n)
	var wg sync.WaitGroup
	for k := range n {
		time.Sleep(time.Until(start.Add(time.Duration(k) * gap / 2)))
		wg.Go(func() {
			codes[k] = do(h, "192.0.2.1:1").Code
			done[k] = time.Since(start)
		})
	}
	wg.Wait()
	for k, c := range codes {
		if c != http.StatusOK {
			t.Fatalf("request %d at 2x the rate: status %d, want 200 after a wait", k, c)
		}
	}
	// The tokens come at the limit's rate: the last of n requests cannot
	// be out before (n-1) gaps after the first draw. (A lower bound: a
	// wait never ends early.)
	last := slices.Max(done)
	if last < time.Duration(n-1)*gap-gap/10 {
		t.Errorf("the %d requests were all served in %v, faster than the rate allows (%v)", n, last, time.Duration(n-1)*gap)
	}

	// 40 requests at once, after the bucket refilled: those whose token
	// comes within MaxWait (about 1 + MaxWait×rate = 21) wait and pass,
	// the others get 429 at once.
	time.Sleep(2 * gap)
	const burst = 40
	type result struct {
		code    int
		latency time.Duration
	}
	results := make([]result, burst)
	start = time.Now()
	for i := range burst {
		wg.Go(func() {
			w := do(h, "192.0.2.1:1")
			results[i] = result{w.Code, time.Since(start)}
		})
	}
	wg.Wait()
	var admitted, refused int
	for _, r := range results {
		switch r.code {
		case http.StatusOK:
			admitted++
		case http.StatusTooManyRequests:
			refused++
			// Refused before MaxWait passed: it did not wait first.
			if r.latency >= maxWait {
				t.Errorf("a refused request took %v, at least MaxWait (%v): it waited before being refused", r.latency, maxWait)
			}
		default:
			t.Errorf("status %d", r.code)
		}
	}
	want := 1 + int(maxWait/gap)
	t.Logf("%d at once: %d admitted (waiting up to %v), %d refused", burst, admitted, maxWait, refused)
	// One less at the boundary (a token due exactly at MaxWait); up to two
	// more if the 40 goroutines reached the limiter over a few
	// milliseconds, as a late request needs a shorter wait.
	if admitted < want-1 || admitted > want+2 {
		t.Errorf("%d admitted, want %d (-1, +2): a request waits up to MaxWait and no longer", admitted, want)
	}
}

// TestWaitCancelled: a request whose context ends while it waits is
// answered at once (503 by default), never reaches the handler, and gives
// its token back.
func TestWaitCancelled(t *testing.T) {
	// 1 token in 10 s: a wait that is not cancelled takes 10 s.
	l := newLimiter(t, limiter.Options{}, limiter.LimitConfig{Name: "api", Rate: 0.1, Burst: 1, OnEmpty: limiter.OnEmptyWait, MaxWait: time.Minute})
	next := &counting{}
	set := l.Set("api")
	h := New(set, Options{})(next)
	if w := do(h, "192.0.2.1:1"); w.Code != 200 {
		t.Fatalf("first request: %d", w.Code)
	}

	ctx, cancel := context.WithCancel(context.Background())
	r := httptest.NewRequest(http.MethodGet, "/", nil).WithContext(ctx)
	w := httptest.NewRecorder()
	served := make(chan struct{})
	go func() {
		h.ServeHTTP(w, r)
		close(served)
	}()
	time.Sleep(50 * time.Millisecond) // let it start waiting
	cancel()
	select {
	case <-served:
	case <-time.After(5 * time.Second):
		t.Fatal("the request still waits 5 s after its context was cancelled")
	}
	if w.Code != http.StatusServiceUnavailable {
		t.Errorf("cancelled wait: status %d, want 503", w.Code)
	}
	if next.n.Load() != 1 {
		t.Errorf("the handler ran %d times, want 1", next.n.Load())
	}
	// The token went back: the bucket is owed one token's time (10 s,
	// less what passed), not two.
	st := set.Status(nil)
	if len(st) != 1 || st[0].Reset > 10*time.Second {
		t.Errorf("after the cancelled wait: status %+v, want Reset <= 10s (its token given back)", st)
	}
}
