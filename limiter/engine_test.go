package limiter

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// drawOn draws one token through shard s of b, as Set.draw does.
func drawOn(b *bucket, s *shard, r *rates, now int64) bool {
	if s.takeFast() {
		return true
	}
	ok, _, _ := b.lease(s, r, 1, now)
	return ok
}

// TestStaleLeaseGivenBack: a shard that stopped drawing gives its cached
// tokens back when another shard leases, so that after a quiet spell the
// shards together draw at most the burst, not burst + what a shard kept.
func TestStaleLeaseGivenBack(t *testing.T) {
	b := &bucket{shards: make([]shard, 2)}
	r := newRates(100_000, 1000, 0, 2) // chunk 62: min(100/ms, 1000/16)
	now := int64(time.Hour)
	if !drawOn(b, &b.shards[1], &r, now) {
		t.Fatal("first draw refused")
	}
	if got := b.shards[1].tokens.Load(); got != r.chunk-1 {
		t.Fatalf("shard 1 holds %d after its first draw, want chunk-1 = %d", got, r.chunk-1)
	}
	now += int64(10 * time.Second) // quiet: the pool is full again
	n := 0
	for _, i := range []int{0, 1} {
		for drawOn(b, &b.shards[i], &r, now) {
			n++
		}
	}
	if n != int(r.burst) {
		t.Errorf("after a quiet spell the shards drew %d at once, want the burst, %d (shard 1 kept %d)", n, r.burst, r.chunk-1)
	}

	// A lease younger than r.stale is left alone.
	b = &bucket{shards: make([]shard, 2)}
	now = int64(time.Hour)
	drawOn(b, &b.shards[1], &r, now)
	now += r.stale / 2
	drawOn(b, &b.shards[0], &r, now)
	if got := b.shards[1].tokens.Load(); got != r.chunk-1 {
		t.Errorf("a fresh lease was taken back: shard 1 holds %d, want %d", got, r.chunk-1)
	}
}

// TestDebtKeptAndClamped: a config change keeps what a bucket owes (no
// fresh burst), but no more than the new config could owe: after a burst
// of 1000 is spent and the burst becomes 10, the bucket is full again in
// the 10 ms the new burst takes to refill, not in the old 1 s.
func TestDebtKeptAndClamped(t *testing.T) {
	for _, keyed := range []bool{false, true} {
		l, clock := newTest(t, Options{}, LimitConfig{Name: "a", Rate: 1000, Burst: 1000, Keyed: keyed})
		s := l.Set("a")
		n := 0
		for s.Allow("k") {
			n++
		}
		if n != 1000 {
			t.Fatalf("keyed %v: drew %d, want the burst of 1000", keyed, n)
		}
		if err := l.Apply([]LimitConfig{{Name: "a", Rate: 1000, Burst: 10, Keyed: keyed}}); err != nil {
			t.Fatal(err)
		}
		if s.Allow("k") {
			t.Errorf("keyed %v: a draw right after the change was admitted: the debt was forgotten", keyed)
		}
		clock.Advance(10 * time.Millisecond)
		n = 0
		for s.Allow("k") {
			n++
		}
		if n != 10 {
			t.Errorf("keyed %v: 10 ms after the change drew %d, want the new burst, 10", keyed, n)
		}
	}
}

// TestMaxKeys: a keyed limit never holds more than MaxKeys keys (the
// shards' parts add up to it, small or large), and counts what it
// evicted.
func TestMaxKeys(t *testing.T) {
	for _, maxKeys := range []int{1, 10, 63, 1000} {
		l, _ := newTest(t, Options{MaxKeys: maxKeys}, LimitConfig{Name: "k", Rate: 1, Burst: 1, Keyed: true})
		s := l.Set("k")
		const n = 5000
		for i := range n {
			s.Allow(strconv.Itoa(i))
		}
		_, _, _, keys, evicted := s.limits[0].p.Load().t.counts()
		if keys != uint64(maxKeys) || evicted != uint64(n-maxKeys) {
			t.Errorf("MaxKeys %d, %d keys drawn: holds %d, evicted %d; want %d and %d", maxKeys, n, keys, evicted, maxKeys, n-maxKeys)
		}
	}
}

// TestTableKeepsBuckets: a key keeps its bucket while its shard grows
// (rehash) and while other keys come and go; long keys (beyond a slot's
// inline bytes) and keys that share a prefix are told apart.
func TestTableKeepsBuckets(t *testing.T) {
	l, clock := newTest(t, Options{MaxKeys: 1 << 20}, LimitConfig{Name: "k", Rate: 0.001, Burst: 2, Keyed: true})
	s := l.Set("k")
	long := strings.Repeat("x", 100)
	keys := []string{"a", "ab", long, long + "y", strings.Repeat("z", inlineKey), strings.Repeat("z", inlineKey+1), ""}
	for _, k := range keys {
		if !s.Allow(k) || !s.Allow(k) || s.Allow(k) {
			t.Fatalf("key %q: not its own burst of 2", k)
		}
	}
	for i := range 50_000 { // every shard grows several times
		s.Allow("other" + strconv.Itoa(i))
	}
	clock.Advance(time.Millisecond)
	for _, k := range keys {
		if s.Allow(k) {
			t.Errorf("key %q: a fresh burst after its shard grew", k)
		}
	}
	_, _, _, n, evicted := s.limits[0].p.Load().t.counts()
	if n != uint64(len(keys)+50_000) || evicted != 0 {
		t.Errorf("holds %d keys, evicted %d; want %d, 0", n, evicted, len(keys)+50_000)
	}
}

// TestTableConcurrent: draws, inserts and evictions on many goroutines
// (run with -race): every key's burst holds while the table churns.
func TestTableConcurrent(t *testing.T) {
	l, _ := newTest(t, Options{MaxKeys: 256}, LimitConfig{Name: "k", Rate: 0.001, Burst: 3, Keyed: true})
	s := l.Set("k")
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 20_000 {
				s.Allow(strconv.Itoa(g*1_000_000 + i%1000))
			}
		}()
	}
	wg.Wait()
	// A key held since before the churn ended still holds its bucket.
	if !s.Allow("held") || !s.Allow("held") || !s.Allow("held") || s.Allow("held") {
		t.Error("a key's burst of 3 does not hold after the churn")
	}
}

// TestOverBurst: a draw of more than the burst never succeeds: Allow
// refuses it, Wait fails at once with RetryAfter 0, Reserve is not OK.
func TestOverBurst(t *testing.T) {
	l, clock := newTest(t, Options{}, LimitConfig{Name: "w", Rate: 10, Burst: 5, OnEmpty: OnEmptyWait, MaxWait: time.Hour})
	s := l.Set("w")
	if s.AllowN(6) {
		t.Error("AllowN(6) over a burst of 5 admitted")
	}
	var rej *RejectedError
	if err := s.WaitN(context.Background(), 6); !errors.As(err, &rej) || rej.RetryAfter != 0 {
		t.Errorf("WaitN(6) = %v, want a RejectedError with RetryAfter 0", err)
	}
	if clock.pending() != 0 {
		t.Error("WaitN over the burst started a timer")
	}
	if r := s.ReserveN(6); r.OK() {
		t.Error("ReserveN(6) over a burst of 5 is OK")
	}
	if !s.AllowN(5) {
		t.Error("AllowN(5), the whole burst, refused")
	}
}

// TestShadowNeverWaits: a shadow limit whose policy is wait admits at
// once, without waiting, a draw it would have made wait, and counts it
// as failed.
func TestShadowNeverWaits(t *testing.T) {
	reg := prometheus.NewRegistry()
	l, clock := newTest(t, Options{Registerer: reg},
		LimitConfig{Name: "sh", Rate: 1, Burst: 1, OnEmpty: OnEmptyWait, MaxWait: time.Minute, Shadow: true})
	s := l.Set("sh")
	for i := range 3 {
		if err := s.Wait(context.Background()); err != nil {
			t.Fatalf("shadow Wait %d = %v", i, err)
		}
	}
	if clock.pending() != 0 {
		t.Error("a shadow Wait waited")
	}
	if got := metricValue(t, reg, "rlagent_limiter_failed_total", "sh"); got != 2 {
		t.Errorf("shadow failed_total %v, want 2", got)
	}
}

// staticSource applies one set of limits and waits; it knows its counts'
// age.
type staticSource struct{ cfgs []LimitConfig }

func (s staticSource) Run(ctx context.Context, apply func([]LimitConfig)) error {
	apply(s.cfgs)
	<-ctx.Done()
	return nil
}

func (staticSource) CountAge(string) time.Duration { return 3 * time.Second }

// TestMetrics: Run applies the Source's limits, and every metric of the
// limiter is there, read at scrape time from the draws' counters.
func TestMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	src := staticSource{cfgs: []LimitConfig{
		{Name: "w", Rate: 1, Burst: 1, OnEmpty: OnEmptyWait, MaxWait: time.Minute, GlobalRate: 3, GlobalBurst: 3, Replicas: 3},
		{Name: "k", Rate: 1, Burst: 1, Keyed: true},
	}}
	l, clock := newTest(t, Options{Registerer: reg, Source: src, MaxKeys: 1})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx) }()
	for {
		if _, ok := l.Config("w"); ok {
			break
		}
		time.Sleep(time.Millisecond)
	}
	w, k := l.Set("w"), l.Set("k")
	w.Wait(ctx)
	waited := make(chan error, 1)
	go func() { waited <- w.Wait(ctx) }()
	for clock.pending() == 0 {
		time.Sleep(time.Millisecond)
	}
	clock.Advance(time.Second)
	if err := <-waited; err != nil {
		t.Fatal(err)
	}
	k.Allow("a")
	k.Allow("a")
	k.Allow("b") // evicts a
	l.Set("nope").Allow()
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run = %v", err)
	}

	for _, m := range []struct {
		name, limit string
		want        float64
	}{
		{"rlagent_limiter_admitted_total", "w", 2},
		{"rlagent_limiter_waited_total", "w", 1},
		{"rlagent_limiter_wait_seconds", "w", 1}, // the count of waits
		{"rlagent_limiter_share_rate", "w", 1},
		{"rlagent_limiter_share_burst", "w", 1},
		{"rlagent_limiter_replicas", "w", 3},
		{"rlagent_limiter_count_age_seconds", "w", 3},
		{"rlagent_limiter_admitted_total", "k", 2},
		{"rlagent_limiter_failed_total", "k", 1},
		{"rlagent_limiter_keys", "k", 1},
		{"rlagent_limiter_evictions_total", "k", 1},
		{"rlagent_limiter_unknown_total", "nope", 1},
	} {
		if got := metricValue(t, reg, m.name, m.limit); got != m.want {
			t.Errorf("%s{limit=%q} = %v, want %v", m.name, m.limit, got, m.want)
		}
	}
}

// metricValue is one series of reg: a counter's or gauge's value, a
// histogram's count.
func metricValue(t *testing.T, reg *prometheus.Registry, name, limit string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if labelOf(m, "limit") != limit {
				continue
			}
			switch {
			case m.Counter != nil:
				return m.GetCounter().GetValue()
			case m.Gauge != nil:
				return m.GetGauge().GetValue()
			case m.Histogram != nil:
				return float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	t.Fatalf("no %s{limit=%q}", name, limit)
	return 0
}

func labelOf(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}
