package k8s

import (
	"context"
	"fmt"
	"math"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/rlagent/rlagent/agent"
	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/demand"
	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
	"github.com/rlagent/rlagent/watcher"
)

// The demand shares' test: parameters shorter than the defaults (15 s,
// 60 s), so that the phases take seconds, not minutes.
const (
	demandRate       = 6000
	demandInterval   = 5 * time.Second
	demandStaleAfter = 15 * time.Second // 3 intervals, the least allowed
	demandPerMille   = 10
	// demandOffered is what the senders offer together: 1.2 x the rate,
	// so that the demands sum past it and the allocation is tight.
	demandOffered = 7200
)

// TestDemandShares: three agents enforce one limit of scope nodes, 6,000
// pkt/s, on real UDP traffic over veth, offered 7:3:0 and then 1:1:1
// (7,200 pkt/s in all). With share equal, in the same test, the 7:3:0
// split admits ~67% of the rate (the busy node is held to a third, the idle
// node's third is unused); with share demand, each steady phase admits the
// rate within 3%, no node's share is above its demand by more than the
// floor, and the shares converge within 3 report intervals of the change.
// At every poll (every 100 ms, all the test long) the nodes' shares sum to
// at most the rate: no node joins, so the documented transition bound is
// the rate itself. With the API server cut off from every node (no
// allocator, no reports), every agent is back on its equal share once the
// allocation is staleAfter old (to the agents' 1 s tick; the decreases come
// half an interval before), and on demand shares again once the API server
// is back.
func TestDemandShares(t *testing.T) {
	testenv.RequireRoot(t)
	env := k8stest.Shared(t)
	installCRD(t, env)
	ns := env.Namespace(t)
	c := startClusterWith(t, env, ns, 3, fmt.Sprintf("demandShares: {interval: %v, staleAfter: %v, floorPerMille: %d}\n",
		demandInterval, demandStaleAfter, demandPerMille))
	c.setAgents(3)
	const name = "demand-shares"
	equal := uint64(demandRate / 3)
	floor := uint64(demandRate * demandPerMille / 1000 / 3)

	spec := map[string]any{
		"rate": int64(demandRate), "scope": "nodes", "share": "equal",
		"match": map[string]any{"protocol": "udp", "dstPorts": []any{fmt.Sprint(svcPort)}},
	}
	created := time.Now()
	createRateLimit(t, env, rateLimit(name, spec))
	all3 := []want{{share: equal, replicas: 3, local: 1}, {share: equal, replicas: 3, local: 1}, {share: equal, replicas: 3, local: 1}}
	if _, err := c.waitShares(name, all3, created, 10*time.Second); err != nil {
		t.Fatalf("the new RateLimit (share equal): %v", err)
	}
	senders := c.startDemandSenders()
	mon := c.monitorShares(name)
	defer mon.stop()
	writes := c.countDemandWrites(name)

	split := func(parts ...float64) []float64 {
		var sum float64
		for _, p := range parts {
			sum += p
		}
		out := make([]float64, len(parts))
		for i, p := range parts {
			out[i] = demandOffered * p / sum
		}
		return out
	}
	offer := func(rates []float64) {
		for i, s := range senders {
			s.SetRate(rates[i])
		}
	}

	// Equal shares, 7:3:0: the busy node is held to its third.
	seven := split(7, 3, 0)
	offer(seven)
	from := time.Now().Add(2 * time.Second)
	eq := c.measure("share equal, 7:3:0", senders, from, window)
	if eq.admitted > 0.75*demandRate || eq.admitted < 0.55*demandRate {
		t.Errorf("share equal, 7:3:0: admitted %.0f pkt/s, want ~67%% of %d (two nodes at a third each)", eq.admitted, demandRate)
	}

	// Demand shares, the same traffic.
	switched := time.Now()
	spec["share"] = "demand"
	c.updateSpec(name, spec)
	wantSeven := demandWants(seven, floor)
	conv := c.waitConverged(name, "share demand, 7:3:0", wantSeven, switched)
	dm := c.measure("share demand, 7:3:0", senders, time.Now().Add(time.Second), window)
	c.checkDemandPhase("share demand, 7:3:0", dm, seven, floor, conv)
	t.Logf("7:3:0: share demand admits %.1f%% of the rate, share equal %.1f%% (measured in this test)",
		100*dm.admitted/demandRate, 100*eq.admitted/demandRate)

	// 1:1:1.
	changed := time.Now()
	even := split(1, 1, 1)
	offer(even)
	conv = c.waitConverged(name, "share demand, 1:1:1", demandWants(even, floor), changed)
	dm = c.measure("share demand, 1:1:1", senders, time.Now().Add(time.Second), window)
	c.checkDemandPhase("share demand, 1:1:1", dm, even, floor, conv)

	// Back to 7:3:0 before the API server goes away, so that the fall
	// back has shares to move.
	offer(seven)
	c.waitConverged(name, "share demand, 7:3:0 again", wantSeven, time.Now())
	rounds, reports := writes()
	t.Logf("API writes while demand-shared (%.0f s): %d allocation rounds (status writes) and %d demand Lease writes by 3 nodes",
		time.Since(switched).Seconds(), rounds, reports)

	// The API server out of reach of every node: no allocator, no
	// reports. The allocation goes stale and every node steps back to
	// its equal share.
	last := c.allocation(name)
	cut := time.Now()
	upAgain := c.cutAPIServer()
	// Every node on its equal share when the allocation is staleAfter
	// old, to the agents' 1 s tick and the monitor's poll.
	deadline := last.Time.Add(demandStaleAfter + 2*time.Second)
	var fellBack time.Time
	for fellBack.IsZero() {
		shares := mon.now()
		if shares[0] == equal && shares[1] == equal && shares[2] == equal {
			fellBack = time.Now()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the allocation of round %d (%v) is %v old and the shares are %v, want the equal share %d on every node by staleAfter %v (and a tick)",
				last.Round, last.Time.Format(time.RFC3339), time.Since(last.Time).Round(100*time.Millisecond), shares, equal, demandStaleAfter)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("API server cut off %v after round %d: every node on its equal share %d %v after the cut, %v after the round (staleAfter %v: the decreases half an interval before, the increases at it)",
		cut.Sub(last.Time).Round(100*time.Millisecond), last.Round, equal, ms(fellBack.Sub(cut)), ms(fellBack.Sub(last.Time)), demandStaleAfter)
	if fellBack.Sub(last.Time) < demandStaleAfter-time.Second {
		t.Errorf("every node was back on equal shares %v after the last round, before staleAfter %v", fellBack.Sub(last.Time), demandStaleAfter)
	}

	// The API server back: demand shares again.
	back := time.Now()
	upAgain()
	c.waitConvergedWithin(name, "the API server back", wantSeven, back, 20*time.Second+3*demandInterval)

	if peak, at := mon.peak(); peak > demandRate {
		t.Errorf("the nodes' shares summed to %d at %v: above the rate %d (no node joined: the bound is the rate)", peak, at.Format(time.StampMilli), demandRate)
	} else {
		t.Logf("the sum of the shares peaked at %d of %d over %d polls", peak, demandRate, mon.polls())
	}
}

// cutAPIServer takes the API server out of every node's reach (no
// allocator, no reports) and returns what brings it back; the test's
// cleanup brings it back too.
func (c *cluster) cutAPIServer() (upAgain func()) {
	for _, nd := range c.nodes {
		nd.api.down()
	}
	upAgain = sync.OnceFunc(func() {
		for _, nd := range c.nodes {
			nd.api.up()
		}
	})
	c.t.Cleanup(upAgain)
	return upAgain
}

// demandWants is each node's share under demand shares for the offered
// rates: the allocation of demand.Allocate over them.
func demandWants(offered []float64, floor uint64) []uint64 {
	ds := make([]uint64, len(offered))
	for i, o := range offered {
		ds[i] = uint64(o)
	}
	l := demand.Allocate(demandRate, floor, ds)
	out := make([]uint64, len(ds))
	for i, d := range ds {
		out[i] = l.Share(d)
	}
	return out
}

// startDemandSenders starts one sender per node, from A to B's service
// port, at rate 0: the phases set their rates.
func (c *cluster) startDemandSenders() []*nettest.Sender {
	c.t.Helper()
	var out []*nettest.Sender
	for _, nd := range c.nodes {
		conn, err := nd.pair.A.DialUDP(netip.AddrPortFrom(endpointAddr(nd.index, 1), svcPort))
		if err != nil {
			c.t.Fatal(err)
		}
		// Making up 50 ms of lag keeps the offered rate while the test's
		// polls and the agents' rounds compete for two CPUs (with 10 ms,
		// the senders fell ~4% short while the test polled): the bursts,
		// 50 ms of a node's rate, fit the buckets' 100 ms.
		out = append(out, c.startOn(conn, nettest.SenderConfig{Count: 1_500_000, Duration: 4 * time.Minute, CatchUp: 50 * time.Millisecond}))
	}
	return out
}

// startOn starts a sender on conn; the test's cleanup stops it and closes
// conn.
func (c *cluster) startOn(conn *net.UDPConn, cfg nettest.SenderConfig) *nettest.Sender {
	c.t.Helper()
	s, err := nettest.StartSender(conn, cfg)
	if err != nil {
		conn.Close()
		c.t.Fatal(err)
	}
	c.t.Cleanup(func() {
		s.Stop()
		conn.Close()
	})
	return s
}

// phase is what one window measured: each node's offered and admitted
// rates and share, and the sums.
type phase struct {
	offered, got       []float64
	shares             []uint64
	admitted, sumOffer float64
}

// measure waits for the window [from, from+d) to pass and reads what each
// node was offered and admitted in it, and its share after it.
func (c *cluster) measure(what string, senders []*nettest.Sender, from time.Time, d time.Duration) phase {
	c.t.Helper()
	to := from.Add(d)
	time.Sleep(time.Until(to.Add(late)))
	var p phase
	var parts []string
	for i, nd := range c.nodes {
		o, g := senders[i].Sent().Rate(from, to), nd.recv.Got().Rate(from, to)
		s, _ := nd.limit(c.t, "demand-shares")
		p.offered, p.got, p.shares = append(p.offered, o), append(p.got, g), append(p.shares, s.ShareRate)
		p.admitted, p.sumOffer = p.admitted+g, p.sumOffer+o
		parts = append(parts, fmt.Sprintf("%s offered %.0f admitted %.0f share %d", nd.name, o, g, s.ShareRate))
	}
	c.t.Logf("%s: admitted %.0f pkt/s of the rate %d (%+.1f%%), offered %.0f; %s", what, p.admitted, demandRate,
		pct(p.admitted, demandRate), p.sumOffer, strings.Join(parts, ", "))
	if p.sumOffer < 0.9*demandOffered {
		c.t.Errorf("%s: the senders offered only %.0f of %d pkt/s: the machine is too busy to measure", what, p.sumOffer, demandOffered)
	}
	return p
}

// checkDemandPhase checks a steady phase of demand shares: the rate
// admitted within 3%, no share above its node's demand by more than the
// floor (and 2% for the demand's measurement), converged within 3 report
// intervals.
func (c *cluster) checkDemandPhase(what string, p phase, offered []float64, floor uint64, converged time.Duration) {
	c.t.Helper()
	if math.Abs(p.admitted-demandRate) > 0.03*demandRate {
		c.t.Errorf("%s: admitted %.0f pkt/s, want the rate %d within 3%%", what, p.admitted, demandRate)
	}
	for i, nd := range c.nodes {
		if float64(p.shares[i]) > 1.02*offered[i]+float64(floor) {
			c.t.Errorf("%s: %s's share %d is above its demand %.0f by more than the floor %d", what, nd.name, p.shares[i], offered[i], floor)
		}
	}
	if converged > 3*demandInterval {
		c.t.Errorf("%s: converged %v after the change, want within 3 report intervals (%v)", what, converged, 3*demandInterval)
	}
}

// waitConverged waits until every node's share is within 5% (or twice the
// floor) of its want, and returns how long after since that was.
func (c *cluster) waitConverged(name, what string, wants []uint64, since time.Time) time.Duration {
	c.t.Helper()
	return c.waitConvergedWithin(name, what, wants, since, 6*demandInterval)
}

func (c *cluster) waitConvergedWithin(name, what string, wants []uint64, since time.Time, timeout time.Duration) time.Duration {
	c.t.Helper()
	floor := uint64(demandRate * demandPerMille / 1000 / 3)
	for {
		var shares []uint64
		ok := true
		for i, nd := range c.nodes {
			s, _ := nd.limit(c.t, name)
			shares = append(shares, s.ShareRate)
			tol := max(wants[i]/20, 2*floor)
			ok = ok && s.ShareRate+tol >= wants[i] && s.ShareRate <= wants[i]+tol
		}
		if ok {
			d := time.Since(since)
			a := c.allocation(name)
			c.t.Logf("%s: shares %v (want %v) %v after the change; round %d, water %d, floor %d",
				what, shares, wants, ms(d), a.Round, a.Level.Water, a.Level.Floor)
			return d
		}
		if time.Since(since) > timeout {
			c.t.Fatalf("%s: shares %v after %v, want %v (within 5%% or twice the floor)", what, shares, timeout, wants)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// updateSpec replaces the RateLimit's spec.
func (c *cluster) updateSpec(name string, spec map[string]any) {
	c.t.Helper()
	rl := dynamicClient(c.t, c.env).Resource(v1alpha1.RateLimitResource)
	patch := fmt.Sprintf(`{"spec": {"share": %q}}`, spec["share"])
	if _, err := rl.Patch(c.t.Context(), name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		c.t.Fatalf("patch RateLimit %s: %v", name, err)
	}
}

// allocation is the RateLimit's status.allocation as the API server holds
// it (the zero Allocation: none).
func (c *cluster) allocation(name string) demand.Allocation {
	c.t.Helper()
	obj, err := dynamicClient(c.t, c.env).Resource(v1alpha1.RateLimitResource).Get(c.t.Context(), name, metav1.GetOptions{})
	if err != nil {
		c.t.Fatalf("get RateLimit %s: %v", name, err)
	}
	return allocationOf(c.t, obj)
}

func allocationOf(t testing.TB, obj *unstructured.Unstructured) demand.Allocation {
	var rl v1alpha1.RateLimit
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(obj.Object, &rl); err != nil {
		t.Fatalf("RateLimit %s: %v", obj.GetName(), err)
	}
	return watcher.AllocationOf(rl.Status.Allocation)
}

// countDemandWrites counts, from now, the allocation rounds written to the
// RateLimit's status and the writes of the demand Leases, as watches see
// them; the returned function reads the counts so far.
func (c *cluster) countDemandWrites(name string) func() (rounds, reports int) {
	c.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c.t.Cleanup(cancel)
	leases, err := c.env.Clientset().CoordinationV1().Leases(c.ns).Watch(ctx, metav1.ListOptions{LabelSelector: "rlagent.io/demand=node"})
	if err != nil {
		c.t.Fatal(err)
	}
	rls, err := dynamicClient(c.t, c.env).Resource(v1alpha1.RateLimitResource).Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + name})
	if err != nil {
		c.t.Fatal(err)
	}
	var mu sync.Mutex
	var rounds, reports int
	var lastRound int64 = -1
	go func() {
		for {
			select {
			case ev, ok := <-leases.ResultChan():
				if !ok {
					return
				}
				if ev.Type == watch.Added || ev.Type == watch.Modified {
					mu.Lock()
					reports++
					mu.Unlock()
				}
			case ev, ok := <-rls.ResultChan():
				if !ok {
					return
				}
				if u, isU := ev.Object.(*unstructured.Unstructured); isU {
					r, _, _ := unstructured.NestedInt64(u.Object, "status", "allocation", "round")
					mu.Lock()
					if lastRound >= 0 && r != lastRound {
						rounds++
					}
					lastRound = r
					mu.Unlock()
				}
			}
		}
	}()
	return func() (int, int) {
		mu.Lock()
		defer mu.Unlock()
		return rounds, reports
	}
}

// shareMonitor polls every node's share of a limit, from its pinned maps,
// and keeps the largest sum.
type shareMonitor struct {
	mu     sync.Mutex
	last   []uint64
	max    uint64
	maxAt  time.Time
	n      int
	cancel context.CancelFunc
	done   chan struct{}
}

func (c *cluster) monitorShares(name string) *shareMonitor {
	return c.monitor(func(dir string) uint64 {
		st, err := agent.ReadStatus(dir)
		if err != nil {
			return 0
		}
		for _, s := range st {
			if s.Name == name {
				return s.ShareRate
			}
		}
		return 0
	})
}

// monitor polls share, read from each node's pinned maps, every 100 ms
// for at most 5 minutes.
func (c *cluster) monitor(share func(pinDir string) uint64) *shareMonitor {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	m := &shareMonitor{cancel: cancel, done: make(chan struct{}), last: make([]uint64, len(c.nodes))}
	dirs := make([]string, len(c.nodes))
	for i, nd := range c.nodes {
		dirs[i] = nd.pins.Dir
	}
	go func() {
		defer close(m.done)
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			shares := make([]uint64, len(dirs))
			var sum uint64
			for i, dir := range dirs {
				shares[i] = share(dir)
				sum += shares[i]
			}
			m.mu.Lock()
			m.last, m.n = shares, m.n+1
			if sum > m.max {
				m.max, m.maxAt = sum, time.Now()
			}
			m.mu.Unlock()
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	c.t.Cleanup(m.stop)
	return m
}

func (m *shareMonitor) stop() {
	m.cancel()
	<-m.done
}

func (m *shareMonitor) now() []uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]uint64(nil), m.last...)
}

func (m *shareMonitor) peak() (uint64, time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.max, m.maxAt
}

func (m *shareMonitor) polls() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.n
}
