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

	publish(true, Demand{Limit: "web", Rate: 7000, Threshold: 60}, Demand{Limit: "api", Rate: 300, Threshold: 10})
	expectWrites(1)
	if got := p.Published(); got["web"] != 7000 || got["api"] != 300 || len(got) != 2 {
		t.Fatalf("published %v", got)
	}
	clock.add(5 * time.Second)
	publish(false, Demand{Limit: "web", Rate: 20_000, Threshold: 60}, Demand{Limit: "api", Rate: 300, Threshold: 10}) // within the interval
	clock.add(5 * time.Second)
	publish(false, Demand{Limit: "web", Rate: 7300, Threshold: 60}, Demand{Limit: "api", Rate: 305, Threshold: 10}) // moved 4%, 1.6%
	publish(true, Demand{Limit: "web", Rate: 8000, Threshold: 60}, Demand{Limit: "api", Rate: 305, Threshold: 10})  // moved 12.5%
	expectWrites(2)
	clock.add(10 * time.Second)
	publish(false, Demand{Limit: "web", Rate: 8000, Threshold: 60}, Demand{Limit: "api", Rate: 320, Threshold: 10}) // 6%: below Moved
	publish(true, Demand{Limit: "web", Rate: 8000, Threshold: 60})                                                  // api is no longer demand-shared
	expectWrites(3)
	if got := p.Published(); len(got) != 1 || got["web"] != 8000 {
		t.Fatalf("published %v, want only web", got)
	}
	third := clock.t
	// Unchanged, it is written again when KeepAlive old.
	clock.add(90 * time.Second)
	publish(false, Demand{Limit: "web", Rate: 8000, Threshold: 60})
	clock.add(10 * time.Second)
	publish(true, Demand{Limit: "web", Rate: 8000, Threshold: 60})
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
	if w, err := p.Publish(ctx, []Demand{{Limit: "web", Rate: 7000, Threshold: 60}}); w == nil || w.Demands["web"] != 7000 || err == nil {
		t.Fatalf("into a namespace that does not exist: tried %+v, err %v; want the write tried, and its error", w, err)
	}
	if p.Published() != nil {
		t.Fatalf("published %v after a failed write", p.Published())
	}
	clock.add(time.Second)
	if w, err := p.Publish(ctx, []Demand{{Limit: "web", Rate: 7000, Threshold: 60}}); w != nil || err != nil {
		t.Fatalf("a second after the failure: tried %+v, err %v; want no attempt", w, err)
	}
	clock.add(9 * time.Second)
	if _, err := p.Publish(ctx, []Demand{{Limit: "web", Rate: 7000, Threshold: 60}}); err == nil {
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

// TestDemandPublisherKeys: a keyed limit's hot keys travel in the same
// Lease (annotation rlagent.io/key-demand), written when a key appears,
// cools or moves by more than Moved and the threshold, and not otherwise;
// the allocator reads them back with the report they replaced.
func TestDemandPublisherKeys(t *testing.T) {
	env := sharedEnv(t)
	ns := env.Namespace(t)
	clock := &fakeClock{t: time.Now().Truncate(time.Second)}
	p := NewDemandPublisher(DemandConfig{Client: env.Clientset(), Namespace: ns, Node: "node-a",
		Interval: 10 * time.Second, KeepAlive: 100 * time.Second, Now: clock.now})
	ctx := context.Background()
	publish := func(want bool, keys map[string]float64) *DemandWrite {
		t.Helper()
		w, err := p.Publish(ctx, []Demand{{Limit: "web", Rate: 100, Threshold: 10}, {Limit: "per-source", Rate: 900, Threshold: 10, Keys: keys}})
		if err != nil {
			t.Fatal(err)
		}
		if wrote := w != nil; wrote != want {
			t.Fatalf("at %v, keys %v: wrote %v, want %v", clock.t, keys, wrote, want)
		}
		return w
	}
	w := publish(true, map[string]float64{})
	if ks, ok := w.Keys["per-source"]; !ok || len(ks) != 0 || len(w.Keys) != 1 {
		t.Fatalf("keys written %v, want per-source with none", w.Keys)
	}
	clock.add(10 * time.Second)
	publish(true, map[string]float64{"10.0.0.1": 5000}) // a key is hot
	clock.add(10 * time.Second)
	publish(false, map[string]float64{"10.0.0.1": 5300}) // 6%
	w = publish(true, map[string]float64{"10.0.0.1": 5300, "10.0.0.2": 2000})
	if w.Keys["per-source"]["10.0.0.2"] != 2000 {
		t.Fatalf("keys written %v", w.Keys)
	}
	second := clock.t
	clock.add(10 * time.Second)
	publish(true, map[string]float64{"10.0.0.2": 2000}) // 10.0.0.1 cooled

	leases := env.Clientset().CoordinationV1().Leases(ns)
	l, err := leases.Get(ctx, DemandLeasePrefix+"node-a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	nd, ok, err := parseDemandLease(l, clock.t, maxReportAge(10*time.Second))
	if err != nil || !ok {
		t.Fatalf("read back: %v %v", ok, err)
	}
	if ks := nd.Keys["per-source"]; len(ks) != 1 || ks["10.0.0.2"] != 2000 || len(nd.Keys) != 1 {
		t.Errorf("keys read back %v, want per-source 10.0.0.2 only", nd.Keys)
	}
	if ks := nd.PrevKeys["per-source"]; len(ks) != 2 || ks["10.0.0.1"] != 5300 || !nd.PrevAt.Equal(second) {
		t.Errorf("the previous report's keys %v at %v, want both keys at %v", nd.PrevKeys, nd.PrevAt, second)
	}

	// A node without keyed limits writes no key annotation.
	clock.add(10 * time.Second)
	if _, err := p.Publish(ctx, []Demand{{Limit: "web", Rate: 100, Threshold: 10}}); err != nil {
		t.Fatal(err)
	}
	l, err = leases.Get(ctx, DemandLeasePrefix+"node-a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := l.Annotations[annotationKeyDemand]; ok {
		t.Errorf("annotation %s left after the keyed limit went", annotationKeyDemand)
	}
}
