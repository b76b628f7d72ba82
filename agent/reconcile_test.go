package agent

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/attach"
	"github.com/rlagent/rlagent/internal/testenv"
	"github.com/rlagent/rlagent/maps"
	"github.com/rlagent/rlagent/watcher"
)

// fakeSource is a count source the test sets.
type fakeSource struct {
	mu  sync.Mutex
	obs map[string]watcher.Observation
	all watcher.Observation
}

func (f *fakeSource) Run(ctx context.Context, _ func()) { <-ctx.Done() }
func (f *fakeSource) Observe(name string) watcher.Observation {
	f.mu.Lock()
	defer f.mu.Unlock()
	if o, ok := f.obs[name]; ok {
		return o
	}
	return f.all
}
func (f *fakeSource) set(n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.all = watcher.Observation{Replicas: n, Local: n, At: time.Now()}
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func newTestAgent(tb testing.TB, cfg string, src watcher.Source) *Agent {
	tb.Helper()
	testenv.RequireRoot(tb)
	c, err := v1alpha1.ParseConfig([]byte(cfg))
	if err != nil {
		tb.Fatal(err)
	}
	dp, err := maps.Load(maps.Options{})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { dp.Close() })
	// The hooks are in memory: nothing of the host's is attached to. The
	// attacher finds the host's addresses (reading only) for the maps of
	// the test's own data path.
	return &Agent{
		log: quiet(), cfg: c, dp: dp, source: src, ap: newApplier(dp, quiet()),
		att: attach.New(attach.Options{PinDir: tb.TempDir(), Log: quiet()}), hooks: newMemHooks(c.Interfaces...),
		warned: map[string]string{}, pending: map[uint32]counterSnap{},
	}
}

const twoLimits = `
interfaces: [lo]
limits:
- name: dns
  rate: 100000
  burst: 10000
  match: {protocol: udp, dstPorts: ["53"]}
- name: web
  rate: 30000
  match: {protocol: tcp, dstPorts: ["80", "443"]}
  key: src-ip
`

func mustReconcile(tb testing.TB, a *Agent) {
	tb.Helper()
	if err := a.reconcile(); err != nil {
		tb.Fatalf("reconcile: %v", err)
	}
}

func shareOf(tb testing.TB, a *Agent, name string) maps.Limit {
	tb.Helper()
	l, err := a.dp.Limit(idOf(tb, a, name))
	if err != nil {
		tb.Fatal(err)
	}
	return l
}

// idOf is the id the data path's metadata gives the limit name.
func idOf(tb testing.TB, a *Agent, name string) uint32 {
	tb.Helper()
	id, ok := lookupID(tb, a, name)
	if !ok {
		tb.Fatalf("limit %s has no id", name)
	}
	return id
}

func lookupID(tb testing.TB, a *Agent, name string) (uint32, bool) {
	tb.Helper()
	metas, err := a.dp.Metas()
	if err != nil {
		tb.Fatal(err)
	}
	for id, m := range metas {
		if m.Name == name {
			return id, true
		}
	}
	return noID, false
}

// What the reconcile writes is the applier's tables' (apply_test.go) and
// the plan's (plan_test.go), which run without root: shares that follow the
// count, ids, removals, isolation. The tests here and in isolation_test.go
// keep one test per behaviour against the real data path.

// An unchanged reconcile writes nothing.
func TestReconcileIdempotent(t *testing.T) {
	src := &fakeSource{}
	src.set(3)
	a := newTestAgent(t, twoLimits, src)
	mustReconcile(t, a)
	e1, _ := a.dp.Limit(idOf(t, a, "dns"))
	mustReconcile(t, a)
	mustReconcile(t, a)
	e2, _ := a.dp.Limit(idOf(t, a, "dns"))
	if e1.Rate != e2.Rate {
		t.Fatal("share changed without a count change")
	}
	// The limit entry's seq moves on every parameter write: unchanged
	// reconciles must not write.
	if a.dp.Seq(idOf(t, a, "dns")) != 1 {
		t.Fatalf("seq %d after idempotent reconciles, want 1 (no rewrite)", a.dp.Seq(idOf(t, a, "dns")))
	}
}

// Benchmark: a count change in the file source to rewritten maps: write the
// file, read it (the source polls every 200 ms; that wait is not counted
// here), divide, and rewrite the map entries.
func BenchmarkCountChange(b *testing.B) {
	for _, n := range []int{1, 10, 100} {
		b.Run(limitsName(n), func(b *testing.B) {
			path := filepath.Join(b.TempDir(), "replicas")
			if err := os.WriteFile(path, []byte("1"), 0o644); err != nil {
				b.Fatal(err)
			}
			src := watcher.NewFile(path, 0, quiet())
			src.Poll()
			a := newTestAgent(b, manyLimits(n), src)
			mustReconcile(b, a)
			var lat []time.Duration
			b.ResetTimer()
			for i := range b.N {
				count := 2 + i%7
				start := time.Now()
				if err := os.WriteFile(path, []byte(strconv.Itoa(count)), 0o644); err != nil {
					b.Fatal(err)
				}
				if !src.Poll() {
					b.Fatal("count change not seen")
				}
				if err := a.reconcile(); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(start))
			}
			b.StopTimer()
			if l := shareOf(b, a, "l0"); l.Rate != 10000/uint64(2+(b.N-1)%7) {
				b.Fatalf("share %d after the last change", l.Rate)
			}
			b.ReportMetric(float64(percentile(lat, 0.99).Microseconds())/1000, "p99-ms")
		})
	}
}
