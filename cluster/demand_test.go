package cluster

import (
	"context"
	"math"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
)

// fakeClock is a clock a test sets.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time      { return c.t }
func (c *fakeClock) add(d time.Duration) { c.t = c.t.Add(d) }

// TestDemandPublisher: a node's demand Lease, against a real API server, is
// written at most once per interval and only when a demand moved by more
// than its threshold (or the report is KeepAlive old); the allocator reads
// it back, and ignores it once it expired.
func TestDemandPublisher(t *testing.T) {
	env := sharedEnv(t)
	ns := env.Namespace(t)
	clock := &fakeClock{t: time.Now().Truncate(time.Second)}
	p := NewDemandPublisher(DemandConfig{Client: env.Clientset(), Namespace: ns, Node: "node-a",
		Interval: 10 * time.Second, KeepAlive: 100 * time.Second, Now: clock.now})
	leases := env.Clientset().CoordinationV1().Leases(ns)
	ctx := context.Background()

	// Every write of the Lease, as a watch sees it.
	w, err := leases.Watch(ctx, metav1.ListOptions{LabelSelector: labelDemand + "=node"})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	writes := 0
	expectWrites := func(want int) {
		t.Helper()
		deadline := time.After(5 * time.Second)
		for writes < want {
			select {
			case ev := <-w.ResultChan():
				if ev.Type == watch.Added || ev.Type == watch.Modified {
					writes++
				}
			case <-deadline:
				t.Fatalf("%d writes of the demand Lease, want %d", writes, want)
			}
		}
		// None beyond want, within a moment.
		select {
		case ev := <-w.ResultChan():
			t.Fatalf("write %d of the demand Lease (%s), want %d", writes+1, ev.Type, want)
		case <-time.After(200 * time.Millisecond):
		}
	}
	publish := func(want bool, ds ...Demand) {
		t.Helper()
		w, err := p.Publish(ctx, ds)
		if err != nil {
			t.Fatal(err)
		}
		if wrote := w != nil; wrote != want {
			t.Fatalf("at %v, Publish(%+v) wrote %v, want %v", clock.t, ds, wrote, want)
		}
	}

	publish(true, Demand{"web", 7000, 60}, Demand{"api", 300, 10})
	expectWrites(1)
	if got := p.Published(); got["web"] != 7000 || got["api"] != 300 || len(got) != 2 {
		t.Fatalf("published %v", got)
	}
	clock.add(5 * time.Second)
	publish(false, Demand{"web", 20_000, 60}, Demand{"api", 300, 10}) // within the interval
	clock.add(5 * time.Second)
	publish(false, Demand{"web", 7300, 60}, Demand{"api", 305, 10}) // moved 4%, 1.6%
	publish(true, Demand{"web", 8000, 60}, Demand{"api", 305, 10})  // moved 12.5%
	expectWrites(2)
	clock.add(10 * time.Second)
	publish(false, Demand{"web", 8000, 60}, Demand{"api", 320, 10}) // 6%: below Moved
	publish(true, Demand{"web", 8000, 60})                          // api is no longer demand-shared
	expectWrites(3)
	if got := p.Published(); len(got) != 1 || got["web"] != 8000 {
		t.Fatalf("published %v, want only web", got)
	}
	third := clock.t
	// Unchanged, it is written again when KeepAlive old.
	clock.add(90 * time.Second)
	publish(false, Demand{"web", 8000, 60})
	clock.add(10 * time.Second)
	publish(true, Demand{"web", 8000, 60})
	expectWrites(4)

	// The allocator's view: the Lease read back, fresh, then expired.
	l, err := leases.Get(ctx, DemandLeasePrefix+"node-a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	nd, ok, err := parseDemandLease(l, clock.t, maxReportAge(10*time.Second))
	if err != nil || !ok || nd.Node != "node-a" || nd.Demands["web"] != 8000 || !nd.Renewed.Equal(clock.t) {
		t.Fatalf("read back: %+v ok %v err %v", nd, ok, err)
	}
	// With the report it replaced, for the rounds that cannot have seen
	// the latest yet.
	if nd.Previous["web"] != 8000 || len(nd.Previous) != 1 || !nd.PrevAt.Equal(third) {
		t.Errorf("the previous report: %v at %v, want web 8000 at %v", nd.Previous, nd.PrevAt, third)
	}
	if _, ok, _ := parseDemandLease(l, clock.t.Add(201*time.Second), time.Hour); ok {
		t.Error("a report older than twice KeepAlive still counts")
	}
}

// TestDemandPublisherFailedWrite: a write that fails is returned, changes
// nothing published, and is tried again one interval later, not at every
// call.
func TestDemandPublisherFailedWrite(t *testing.T) {
	env := sharedEnv(t)
	clock := &fakeClock{t: time.Now()}
	p := NewDemandPublisher(DemandConfig{Client: env.Clientset(), Namespace: "no-such-namespace", Node: "node-a",
		Interval: 10 * time.Second, Now: clock.now})
	ctx := context.Background()
	if w, err := p.Publish(ctx, []Demand{{"web", 7000, 60}}); w == nil || w.Demands["web"] != 7000 || err == nil {
		t.Fatalf("into a namespace that does not exist: tried %+v, err %v; want the write tried, and its error", w, err)
	}
	if p.Published() != nil {
		t.Fatalf("published %v after a failed write", p.Published())
	}
	clock.add(time.Second)
	if w, err := p.Publish(ctx, []Demand{{"web", 7000, 60}}); w != nil || err != nil {
		t.Fatalf("a second after the failure: tried %+v, err %v; want no attempt", w, err)
	}
	clock.add(9 * time.Second)
	if _, err := p.Publish(ctx, []Demand{{"web", 7000, 60}}); err == nil {
		t.Fatal("an interval after the failure: no attempt")
	}
}

func TestDemandUnits(t *testing.T) {
	for _, tc := range []struct {
		rate float64
		want uint64
	}{{7000.4, 7000}, {7000.5, 7001}, {0, 0}, {-5, 0}, {math.NaN(), 0}, {math.Inf(1), math.MaxUint64}, {1e30, math.MaxUint64}} {
		if got := units(tc.rate); got != tc.want {
			t.Errorf("units(%v) = %d, want %d", tc.rate, got, tc.want)
		}
	}
}
