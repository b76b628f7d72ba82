package throttle

import (
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fakeClock is a clock the test sets.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

var clockStart = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

func newFakeClock() *fakeClock { return &fakeClock{now: clockStart} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Set sets the clock to d after its start.
func (c *fakeClock) Set(d time.Duration) {
	c.mu.Lock()
	c.now = clockStart.Add(d)
	c.mu.Unlock()
}

func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// fixedRand returns a Rand that always draws u.
func fixedRand(u float64) func() float64 { return func() float64 { return u } }

func mustNew(tb testing.TB, opts Options) *Throttle {
	tb.Helper()
	th, err := New(opts)
	if err != nil {
		tb.Fatal(err)
	}
	return th
}

// record records n requests, of which accepted were accepted.
func record(th *Throttle, n, accepted int) {
	for i := range n {
		th.Record(i < accepted)
	}
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

func TestRejectProbability(t *testing.T) {
	for _, tc := range []struct {
		name               string
		k                  float64
		requests, accepted int
		want               float64
	}{
		{name: "empty", k: 2, want: 0},
		{name: "all accepted", k: 2, requests: 100, accepted: 100, want: 0},
		{name: "half accepted, K=2", k: 2, requests: 100, accepted: 50, want: 0},
		{name: "a tenth accepted, K=2", k: 2, requests: 100, accepted: 10, want: 80.0 / 101},
		{name: "none accepted", k: 2, requests: 100, accepted: 0, want: 100.0 / 101},
		{name: "a tenth accepted, K=1.5", k: 1.5, requests: 100, accepted: 10, want: 85.0 / 101},
		{name: "half accepted, K=1", k: 1, requests: 100, accepted: 50, want: 50.0 / 101},
		{name: "default K", k: 0, requests: 100, accepted: 10, want: 80.0 / 101},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := newFakeClock()
			th := mustNew(t, Options{K: tc.k, Window: 32 * time.Second, Now: clk.Now})
			record(th, tc.requests, tc.accepted)
			st := th.Stats()
			if st.Requests != float64(tc.requests) || st.Accepts != float64(tc.accepted) {
				t.Fatalf("counts = %v/%v, want %v/%v", st.Requests, st.Accepts, tc.requests, tc.accepted)
			}
			if !near(st.RejectProbability, tc.want) {
				t.Fatalf("reject probability = %v, want %v", st.RejectProbability, tc.want)
			}
		})
	}
}

// TestAllowDraws: Allow refuses exactly when the draw is below the reject
// probability, and a refusal counts as a request, not an accept.
func TestAllowDraws(t *testing.T) {
	clk := newFakeClock()
	var u atomic.Value
	u.Store(0.0)
	th := mustNew(t, Options{Window: 32 * time.Second, Now: clk.Now, Rand: func() float64 { return u.Load().(float64) }})

	// All accepted: p = 0, even a draw of 0 passes.
	record(th, 10, 10)
	if !th.Allow() {
		t.Fatal("Allow refused with a reject probability of 0")
	}
	// Allow counts nothing by itself when it allows.
	if st := th.Stats(); st.Requests != 10 {
		t.Fatalf("an allowed request was counted before Record: requests = %v", st.Requests)
	}

	// 100 requests, 10 accepted: p = (100-20)/101.
	record(th, 90, 0)
	p := th.Stats().RejectProbability
	if !near(p, 80.0/101) {
		t.Fatalf("p = %v, want %v", p, 80.0/101)
	}
	u.Store(p + 1e-6)
	if !th.Allow() {
		t.Fatalf("Allow refused with a draw (%v) above p (%v)", p+1e-6, p)
	}
	u.Store(p - 1e-6)
	if th.Allow() {
		t.Fatalf("Allow allowed with a draw (%v) below p (%v)", p-1e-6, p)
	}
	st := th.Stats()
	if st.Requests != 101 || st.Accepts != 10 {
		t.Fatalf("after a refusal: counts = %v/%v, want 101/10", st.Requests, st.Accepts)
	}
	if !near(st.RejectProbability, 81.0/102) {
		t.Fatalf("after a refusal: p = %v, want %v", st.RejectProbability, 81.0/102)
	}
}

// TestWindowSlides: a bucket leaves the window gradually, weighed by the
// part of it still inside, then entirely; nothing older than the window
// counts.
func TestWindowSlides(t *testing.T) {
	clk := newFakeClock()
	// 32 buckets of 1 s.
	th := mustNew(t, Options{Window: 32 * time.Second, Now: clk.Now})

	record(th, 100, 20) // bucket 0
	clk.Add(10 * time.Second)
	record(th, 50, 50) // bucket 10

	for _, step := range []struct {
		at                time.Duration // since the start
		requests, accepts float64
	}{
		{at: 10 * time.Second, requests: 150, accepts: 70},
		{at: 31*time.Second + 999*time.Millisecond, requests: 150, accepts: 70},
		// Bucket 0 is now the old bucket: 3/4 of it is still in the
		// window [0.25 s, 32.25 s].
		{at: 32*time.Second + 250*time.Millisecond, requests: 75 + 50, accepts: 15 + 50},
		{at: 32*time.Second + 500*time.Millisecond, requests: 50 + 50, accepts: 10 + 50},
		{at: 33 * time.Second, requests: 50, accepts: 50},
		{at: 42*time.Second + 500*time.Millisecond, requests: 25, accepts: 25},
		{at: 43 * time.Second, requests: 0, accepts: 0},
	} {
		clk.Set(step.at)
		st := th.Stats()
		if !near(st.Requests, step.requests) || !near(st.Accepts, step.accepts) {
			t.Errorf("at %v: counts = %v/%v, want %v/%v", step.at, st.Requests, st.Accepts, step.requests, step.accepts)
		}
	}
}

// TestWindowSlidesSmoothly: under a steady load, the counts stay at a
// window's worth at every instant, not a bucket's worth of steps.
func TestWindowSlidesSmoothly(t *testing.T) {
	clk := newFakeClock()
	th := mustNew(t, Options{Window: 3200 * time.Millisecond, Now: clk.Now}) // 100 ms buckets
	// 1 request per ms (1,000/s) for 10 windows; from the second window
	// on, the counts must be 3,200 ± 1 (the request in flight at the edge).
	for ms := range 32_000 {
		th.Record(ms%10 == 0)
		clk.Add(time.Millisecond)
		if ms < 3200 || ms%7 != 0 {
			continue
		}
		st := th.Stats()
		if math.Abs(st.Requests-3200) > 1 || math.Abs(st.Accepts-320) > 1 {
			t.Fatalf("at %d ms: counts = %v/%v, want 3200/320 (±1)", ms, st.Requests, st.Accepts)
		}
	}
}

func TestIdleForgets(t *testing.T) {
	clk := newFakeClock()
	th := mustNew(t, Options{Window: 32 * time.Second, Now: clk.Now, Rand: fixedRand(0)})
	record(th, 1000, 0)
	if th.Allow() {
		t.Fatal("Allow allowed with p near 1 and a draw of 0")
	}
	clk.Add(time.Hour)
	if st := th.Stats(); st.Requests != 0 || st.Accepts != 0 {
		t.Fatalf("after an idle hour: counts = %v/%v, want 0/0", st.Requests, st.Accepts)
	}
	if !th.Allow() {
		t.Fatal("Allow refused after an idle hour")
	}
	// A clock that goes back (only a fake one can) changes nothing.
	record(th, 10, 0)
	clk.Add(-time.Minute)
	if st := th.Stats(); st.Requests != 10 {
		t.Fatalf("after the clock went back: requests = %v, want 10", st.Requests)
	}
}

func TestNewValidates(t *testing.T) {
	for _, opts := range []Options{
		{K: 0.5},
		{K: -1},
		{K: math.NaN()},
		{K: math.Inf(1)},
		{Window: time.Microsecond},
		{Window: -time.Second},
	} {
		if _, err := New(opts); err == nil {
			t.Errorf("New(%+v): no error", opts)
		}
	}
	if _, err := New(Options{K: 1, Window: time.Second}); err != nil {
		t.Errorf("New(K 1, Window 1s): %v", err)
	}
}

func TestZeroAllocs(t *testing.T) {
	th := mustNew(t, Options{})
	record(th, 100, 10) // p > 0: Allow draws
	allocs := testing.AllocsPerRun(1000, func() {
		if th.Allow() {
			th.Record(false)
		}
		_ = th.Stats()
	})
	if allocs != 0 {
		t.Fatalf("Allow+Record+Stats: %v allocations, want 0", allocs)
	}
}

// TestConcurrent: concurrent callers lose no count (run with -race).
func TestConcurrent(t *testing.T) {
	th := mustNew(t, Options{Window: time.Hour})
	const goroutines, each = 8, 2000
	var refused, accepted atomic.Int64
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			for i := range each {
				if !th.Allow() {
					refused.Add(1)
					continue
				}
				ok := (g+i)%4 == 0
				if ok {
					accepted.Add(1)
				}
				th.Record(ok)
			}
		})
	}
	wg.Wait()
	st := th.Stats()
	if st.Requests != goroutines*each || st.Accepts != float64(accepted.Load()) {
		t.Fatalf("counts = %v/%v, want %v/%v", st.Requests, st.Accepts, goroutines*each, accepted.Load())
	}
	if refused.Load() == 0 {
		t.Fatal("a quarter accepted and nothing refused")
	}
}

func BenchmarkAllowRecord(b *testing.B) {
	th := mustNew(b, Options{})
	record(th, 100, 10)
	b.ReportAllocs()
	for b.Loop() {
		if th.Allow() {
			th.Record(true)
		}
	}
}

func BenchmarkAllowRecordParallel(b *testing.B) {
	th := mustNew(b, Options{})
	record(th, 100, 10)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if th.Allow() {
				th.Record(true)
			}
		}
	})
}
