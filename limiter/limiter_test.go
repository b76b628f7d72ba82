package limiter

import (
	"context"
	"errors"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlagent/rlagent/internal/nettest"

	"github.com/prometheus/client_golang/prometheus"
)

// fakeClock is a Clock that tests move by hand.
type fakeClock struct {
	now     atomic.Int64
	mu      sync.Mutex
	waiters []waiter
}

type waiter struct {
	at int64
	ch chan time.Time
}

func (c *fakeClock) Now() int64 { return c.now.Load() }

func (c *fakeClock) After(d time.Duration) <-chan time.Time {
	ch := make(chan time.Time, 1)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.waiters = append(c.waiters, waiter{at: c.now.Load() + int64(d), ch: ch})
	c.fire()
	return ch
}

// Advance moves the clock by d and wakes the waiters whose time came.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now.Add(int64(d))
	c.fire()
}

func (c *fakeClock) fire() {
	now := c.now.Load()
	kept := c.waiters[:0]
	for _, w := range c.waiters {
		if w.at <= now {
			w.ch <- time.Time{}
		} else {
			kept = append(kept, w)
		}
	}
	c.waiters = kept
}

func (c *fakeClock) pending() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.waiters)
}

func newTest(t testing.TB, opts Options, cfgs ...LimitConfig) (*Limiter, *fakeClock) {
	t.Helper()
	clock := &fakeClock{}
	clock.now.Store(int64(time.Hour)) // not 0: a bucket's zero tat is then long past
	opts.Clock = clock
	if opts.Logger == nil {
		opts.Logger = discard()
	}
	l, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Apply(cfgs); err != nil {
		t.Fatal(err)
	}
	return l, clock
}

// TestAccuracyOverload: at 2x overload for 10 s, on one goroutine and on
// GOMAXPROCS, a limit admits rate x 10 + burst within 1% (the data path's
// bound, with the tokens stranded in the shards at most burst / 8), and
// the shards never hold more than burst / 8.
func TestAccuracyOverload(t *testing.T) {
	for _, tc := range []struct {
		rate  float64
		burst int64
	}{{1000, 100}, {100_000, 10_000}} {
		for _, g := range []int{1, runtime.GOMAXPROCS(0)} {
			l, clock := newTest(t, Options{}, LimitConfig{Name: "a", Rate: tc.rate, Burst: tc.burst})
			s := l.Set("a")
			const step = time.Millisecond
			perStep := int(2 * tc.rate * step.Seconds()) // 2x the rate
			var admitted atomic.Int64
			p := s.limits[0].p.Load()
			for range int(10 * time.Second / step) {
				var wg sync.WaitGroup
				for w := range g {
					wg.Add(1)
					go func() {
						defer wg.Done()
						n := perStep / g
						if w < perStep%g {
							n++
						}
						for range n {
							if s.Allow() {
								admitted.Add(1)
							}
						}
					}()
				}
				wg.Wait()
				if c := p.b.cached(); c > tc.burst/8 {
					t.Fatalf("rate %v, %d goroutines: the shards hold %d tokens, more than burst/8 = %d", tc.rate, g, c, tc.burst/8)
				}
				clock.Advance(step)
			}
			want := tc.rate*10 + float64(tc.burst)
			got := float64(admitted.Load())
			t.Logf("rate %v burst %d, %d goroutines, chunk %d, %d shards: admitted %.0f of %.0f (%.4f)",
				tc.rate, tc.burst, g, p.r.chunk, len(p.b.shards), got, want, got/want)
			if got > want || got < 0.99*want {
				t.Errorf("rate %v, %d goroutines: admitted %.0f, want within 1%% below %.0f", tc.rate, g, got, want)
			}
		}
	}
}

// TestWaitPaces: a waiting limit releases at most its burst at once, then
// exactly one token every 1/rate (on the fake clock, with reservations:
// the delays are the GCRA's virtual clock).
func TestWaitPaces(t *testing.T) {
	l, _ := newTest(t, Options{}, LimitConfig{Name: "w", Rate: 10, Burst: 5, OnEmpty: OnEmptyWait, MaxWait: time.Minute})
	s := l.Set("w")
	for i := range 20 {
		r := s.Reserve()
		if !r.OK() {
			t.Fatalf("reservation %d refused", i)
		}
		want := time.Duration(max(i-4, 0)) * 100 * time.Millisecond
		if d := r.Delay(); d < want || d > want+time.Microsecond {
			t.Errorf("reservation %d: delay %v, want %v", i, d, want)
		}
	}
}

// TestWaitRealTime: on the real clock, 4 goroutines waiting on a limit
// of 200/s, burst 10, take (n - burst) / rate for n draws, within 2%.
func TestWaitRealTime(t *testing.T) {
	nettest.HoldTraffic(t) // a 2% band on the real clock: not beside another package's traffic
	l, err := New(Options{Logger: discard()})
	if err != nil {
		t.Fatal(err)
	}
	l.Apply([]LimitConfig{{Name: "w", Rate: 200, Burst: 10, OnEmpty: OnEmptyWait, MaxWait: 10 * time.Second}})
	s := l.Set("w")
	const n = 410
	start := time.Now()
	var wg sync.WaitGroup
	var failed atomic.Int64
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := g; i < n; i += 4 {
				if err := s.Wait(context.Background()); err != nil {
					failed.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	took := time.Since(start)
	want := time.Duration(n-10) * time.Second / 200
	t.Logf("%d waits: %v, want %v (%.4f)", n, took, want, took.Seconds()/want.Seconds())
	if failed.Load() > 0 {
		t.Errorf("%d waits failed", failed.Load())
	}
	if r := took.Seconds() / want.Seconds(); r < 0.98 || r > 1.02 {
		t.Errorf("%d waits took %v, want %v within 2%%", n, took, want)
	}
}

// TestWaitFailsAtOnce: a draw that could not be served within MaxWait,
// or before the context's deadline, fails at once and draws nothing; so
// does every draw of a limit that fails.
func TestWaitFailsAtOnce(t *testing.T) {
	l, clock := newTest(t, Options{},
		LimitConfig{Name: "w", Rate: 1, Burst: 1, OnEmpty: OnEmptyWait, MaxWait: 500 * time.Millisecond},
		LimitConfig{Name: "f", Rate: 1, Burst: 1})
	w, f := l.Set("w"), l.Set("f")
	if err := w.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	var rej *RejectedError
	err := w.Wait(context.Background()) // needs 1 s > MaxWait
	if !errors.As(err, &rej) || !errors.Is(err, ErrLimited) || rej.Limit != "w" || rej.RetryAfter != time.Second {
		t.Fatalf("Wait beyond MaxWait = %v, want a RejectedError of w, retry after 1s", err)
	}
	if clock.pending() != 0 {
		t.Error("a refused Wait started a timer")
	}
	clock.Advance(600 * time.Millisecond) // now 400 ms away: within MaxWait
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := w.Wait(ctx); !errors.As(err, &rej) {
		t.Fatalf("Wait past the deadline = %v, want a RejectedError at once", err)
	}
	done := make(chan error, 1)
	go func() { done <- w.Wait(context.Background()) }()
	for clock.pending() == 0 {
		time.Sleep(time.Millisecond)
	}
	clock.Advance(400 * time.Millisecond)
	if err := <-done; err != nil {
		t.Fatalf("Wait within MaxWait = %v", err)
	}
	if err := f.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := f.Wait(context.Background()); !errors.As(err, &rej) || rej.Limit != "f" {
		t.Fatalf("Wait on a failing limit = %v, want a RejectedError", err)
	}
}

// TestWaitCancelGivesBack: a wait whose context ends gives its tokens
// back, to every limit of the Set.
func TestWaitCancelGivesBack(t *testing.T) {
	l, clock := newTest(t, Options{},
		LimitConfig{Name: "w", Rate: 1, Burst: 1, OnEmpty: OnEmptyWait, MaxWait: time.Minute},
		LimitConfig{Name: "k", Rate: 100, Burst: 10, Keyed: true})
	s := l.Set("w", "k")
	if !s.Allow("", "x") {
		t.Fatal("first draw refused")
	}
	before := s.Status(nil, "", "x")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Wait(ctx, "", "x") }()
	for clock.pending() == 0 {
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled Wait = %v", err)
	}
	after := s.Status(nil, "", "x")
	if after[1].Remaining != before[1].Remaining || after[0].Reset != before[0].Reset {
		t.Errorf("after a cancelled wait: %+v, want %+v as before it", after, before)
	}
}

// TestAllOrNothing: a draw that one limit refuses takes nothing from the
// others, keyed or not; a shadow limit admits and counts.
func TestAllOrNothing(t *testing.T) {
	reg := prometheus.NewRegistry()
	l, _ := newTest(t, Options{Registerer: reg},
		LimitConfig{Name: "a", Rate: 0.001, Burst: 5},
		LimitConfig{Name: "k", Rate: 0.001, Burst: 3, Keyed: true},
		LimitConfig{Name: "b", Rate: 0.001, Burst: 2},
		LimitConfig{Name: "sh", Rate: 0.001, Burst: 1, Shadow: true})
	s := l.Set("a", "k", "b", "sh")
	for i := range 2 {
		if !s.Allow("", "x") {
			t.Fatalf("draw %d refused", i)
		}
	}
	for range 3 {
		if s.Allow("", "x") {
			t.Fatal("a draw beyond b's burst admitted")
		}
	}
	st := s.Status(nil, "", "x")
	if st[0].Remaining != 3 || st[1].Remaining != 1 || st[2].Remaining != 0 {
		t.Errorf("after b refused: a %d, k %d, b %d left, want 3, 1, 0", st[0].Remaining, st[1].Remaining, st[2].Remaining)
	}
	if !l.Set("a", "k").Allow("", "y") {
		t.Error("another key of k refused")
	}
	if got := metricValue(t, reg, "rlagent_limiter_failed_total", "b"); got != 3 {
		t.Errorf("b failed %v, want 3", got)
	}
	if got := metricValue(t, reg, "rlagent_limiter_failed_total", "sh"); got != 1 {
		t.Errorf("shadow failed %v, want 1 (the second draw; admitted all the same)", got)
	}
	if got := metricValue(t, reg, "rlagent_limiter_admitted_total", "a"); got != 3 {
		t.Errorf("a admitted %v, want 3", got)
	}
}

// sameShard returns n keys that land in key's shard of t.
func sameShard(t *table, key string, n int) []string {
	want, _ := t.shardOf(key)
	var out []string
	for i := 0; len(out) < n; i++ {
		k := "k" + strings.Repeat("x", i%3) + string(rune('a'+i%26)) + itoa(i)
		if s, _ := t.shardOf(k); s == want {
			out = append(out, k)
		}
	}
	return out
}

func itoa(i int) string {
	var b []byte
	for {
		b = append([]byte{byte('0' + i%10)}, b...)
		if i /= 10; i == 0 {
			return string(b)
		}
	}
}

// TestReturningKeyOwes: a key evicted while it owes comes back owing (its
// tombstone), not with a fresh burst; one evicted full comes back full.
func TestReturningKeyOwes(t *testing.T) {
	// 64 keys: one per shard of the table.
	l, clock := newTest(t, Options{MaxKeys: tableShards}, LimitConfig{Name: "k", Rate: 1, Burst: 5, Keyed: true})
	s := l.Set("k")
	tb := s.limits[0].p.Load().t
	others := sameShard(tb, "a", 2)
	for range 5 {
		if !s.Allow("a") {
			t.Fatal("a's burst refused")
		}
	}
	if s.Allow("a") {
		t.Fatal("a drew beyond its burst")
	}
	s.Allow(others[0]) // evicts a, which owes 5 s: a tombstone
	clock.Advance(2 * time.Second)
	s.Allow(others[1]) // evicts others[0], which owes nothing now
	_, _, _, keys, evicted := tb.counts()
	if evicted != 2 || keys != 1 {
		t.Fatalf("evicted %d, keys %d: want 2 and 1", evicted, keys)
	}
	n := 0
	for s.Allow("a") {
		n++
	}
	if n != 2 {
		t.Errorf("a returned 2 s after it emptied its burst of 5 at 1/s and drew %d, want 2 (no fresh burst)", n)
	}
	// A key evicted full returns full.
	clock.Advance(time.Minute)
	s.Allow(others[0]) // evicts a (full by now): no tombstone
	n = 0
	for s.Allow("a") {
		n++
	}
	if n != 5 {
		t.Errorf("a, evicted full, drew %d on return, want its burst of 5", n)
	}
}

// TestConfigChange: Apply changes a limit while draws run (with -race:
// no race), and the next draws take the new share; a key keeps what it
// owes.
func TestConfigChange(t *testing.T) {
	l, clock := newTest(t, Options{}, LimitConfig{Name: "a", Rate: 100, Burst: 10})
	s := l.Set("a")
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				s.Allow()
			}
		}()
	}
	for i := range 50 {
		rate := float64(100 + 900*(i%2))
		if err := l.Apply([]LimitConfig{{Name: "a", Rate: rate, Burst: 10}}); err != nil {
			t.Fatal(err)
		}
		clock.Advance(time.Millisecond)
	}
	cancel()
	wg.Wait()
	l.Apply([]LimitConfig{{Name: "a", Rate: 1000, Burst: 100}})
	clock.Advance(time.Second) // full again
	n := 0
	for range 10 {
		for s.Allow() {
			n++
		}
		clock.Advance(100 * time.Millisecond)
	}
	// The burst of 100 at once, then the 100 that accrue in each of the
	// next 9 steps of 100 ms.
	if n != 1000 {
		t.Errorf("after the change to 1000/s: %d drawn in 1 s, want 1000", n)
	}
}

// TestApplyRejectsInvalid: an invalid config fails the whole Apply, names
// the field, and the limits stay as they were.
func TestApplyRejectsInvalid(t *testing.T) {
	l, _ := newTest(t, Options{}, LimitConfig{Name: "a", Rate: 10, Burst: 1})
	for _, tc := range []struct {
		cfgs []LimitConfig
		want string
	}{
		{[]LimitConfig{{Name: "a", Rate: 0, Burst: 1}}, "limits[0] (a).Rate: 0 is not in (0, 1e12]"},
		{[]LimitConfig{{Name: "a", Rate: 5, Burst: 0}}, "limits[0] (a).Burst: 0 is not at least 1"},
		{[]LimitConfig{{Name: "a", Rate: 5, Burst: 1, OnEmpty: OnEmptyWait}}, "limits[0] (a).MaxWait"},
		{[]LimitConfig{{Name: "a", Rate: 5, Burst: 1, OnEmpty: "queue"}}, `OnEmpty: "queue" is not one of fail, wait`},
		{[]LimitConfig{{Name: "b", Rate: 5, Burst: 1}, {Name: "b", Rate: 5, Burst: 1}}, "limits[1] (b).Name: listed twice"},
	} {
		err := l.Apply(tc.cfgs)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Apply(%+v) = %v, want %s", tc.cfgs, err, tc.want)
		}
		if c, ok := l.Config("a"); !ok || c.Rate != 10 {
			t.Fatalf("after a rejected Apply: a is %+v, %v; want as before", c, ok)
		}
	}
}

// TestUnknownAdmits: a Set names a limit before it is configured: it
// admits until Apply configures it, then enforces it; removed, it admits
// again.
func TestUnknownAdmits(t *testing.T) {
	l, _ := newTest(t, Options{})
	s := l.Set("later")
	for range 10 {
		if !s.Allow() {
			t.Fatal("an unconfigured limit refused")
		}
	}
	l.Apply([]LimitConfig{{Name: "later", Rate: 0.001, Burst: 1}})
	if !s.Allow() || s.Allow() {
		t.Error("once configured, the limit does not hold its burst of 1")
	}
	l.Apply(nil)
	if !s.Allow() {
		t.Error("a removed limit refused")
	}
	if st := s.Status(nil); st[0].Quota != 0 {
		t.Errorf("Status of a removed limit: %+v, want Quota 0", st[0])
	}
}

// TestNoAllocs: a draw allocates nothing: key-less, keyed with a key
// already in the table, a Set of three, and Wait when nothing waits.
func TestNoAllocs(t *testing.T) {
	l, _ := newTest(t, Options{},
		LimitConfig{Name: "a", Rate: 1e9, Burst: 1e9},
		LimitConfig{Name: "k", Rate: 1e9, Burst: 1e9, Keyed: true},
		LimitConfig{Name: "c", Rate: 1e9, Burst: 1e9})
	a, k, all := l.Set("a"), l.Set("k"), l.Set("a", "k", "c")
	key := "203.0.113.7"
	k.Allow(key)
	ctx := context.Background()
	for name, f := range map[string]func(){
		"key-less":      func() { a.Allow() },
		"keyed":         func() { k.Allow(key) },
		"three limits":  func() { all.Allow("", key) },
		"wait, no wait": func() { all.Wait(ctx, "", key) },
	} {
		if n := testing.AllocsPerRun(1000, f); n != 0 {
			t.Errorf("%s: %v allocations per draw, want 0", name, n)
		}
	}
}

// TestTableHashIsSeeded: two tables put the same keys in different shards
// (a client cannot aim its keys at one shard of every process).
func TestTableHashIsSeeded(t *testing.T) {
	a, b := newTable(1000), newTable(1000)
	same := 0
	for i := range 256 {
		k := itoa(i)
		_, ha := a.shardOf(k)
		_, hb := b.shardOf(k)
		if ha>>58 == hb>>58 {
			same++
		}
	}
	if same > 32 {
		t.Errorf("%d of 256 keys in the same shard of two tables: the hash is not seeded", same)
	}
}

func discard() *slog.Logger { return slog.New(slog.DiscardHandler) }

// TestLongKeys: a key longer than maxKeyBytes (a header a client writes)
// is kept as a digest: the table holds no more than maxKeyBytes of it,
// and two long keys that differ only at their end stay two keys.
func TestLongKeys(t *testing.T) {
	l, _ := newTest(t, Options{}, LimitConfig{Name: "k", Rate: 0.001, Burst: 1, Keyed: true})
	s := l.Set("k")
	a := strings.Repeat("a", 1<<20)
	b := a[:len(a)-1] + "b"
	if !s.Allow(a) || s.Allow(a) {
		t.Fatal("a long key does not hold its burst of 1")
	}
	if !s.Allow(b) {
		t.Error("a second long key, differing at its end, shares the first's bucket")
	}
	tb := s.limits[0].p.Load().t
	if c := tb.canon(a); len(c) > maxKeyBytes || c == tb.canon(b) {
		t.Errorf("a key of %d bytes is kept as %d bytes (digests equal: %v)", len(a), len(c), c == tb.canon(b))
	}
	if st := s.Status(nil, a); st[0].Remaining != 0 {
		t.Errorf("Status of the long key: %d left, want 0", st[0].Remaining)
	}
}
