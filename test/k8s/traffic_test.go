package k8s

import (
	"fmt"
	"math"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// Traffic bounds: every sender stops by itself after senderSpan or
// senderMax packets.
const (
	senderSpan = 30 * time.Second
	senderMax  = 500_000
	// settle is how long after the shares applied the measuring starts: the
	// burst (a tenth of a second's share) is spent in a tenth of a second at
	// twice the share.
	settle = time.Second
	// window is how long the admitted rate is measured.
	window = 3 * time.Second
	// late is how long after a window's end it is counted: the last
	// admitted packets are still on their way to the receivers.
	late = 100 * time.Millisecond
)

// TestThreeNodesAggregateRate: three agents as three nodes enforce one
// service-scoped limit of 6,000 pkt/s on real UDP traffic sent to every
// ready endpoint of every node, each node offered twice its share. The
// aggregate admitted rate, added up over the three nodes' receivers, is the
// global rate within +-5% at 3 ready endpoints (1+1+1) and at 6 (3+2+1).
func TestThreeNodesAggregateRate(t *testing.T) {
	testenv.RequireRoot(t)
	env := k8stest.Shared(t)
	installCRD(t, env)
	c := startCluster(t, env, env.Namespace(t), 3)
	c.createService()

	const name = "svc-traffic"
	first := layout{ready: []int{1, 1, 1}}
	c.setEndpoints(first)
	created := time.Now()
	createRateLimit(t, env, rateLimit(name, c.serviceSpec(globalRate)))
	if _, err := c.waitShares(name, c.serviceWants(globalRate, first), created, 10*time.Second); err != nil {
		t.Fatalf("the new RateLimit: %v", err)
	}

	var senders []*nettest.Sender
	for _, l := range []layout{first, {ready: []int{3, 2, 1}}} {
		what := fmt.Sprintf("%d ready endpoints %s", l.total(), l)
		if started, writes := c.setEndpoints(l); writes > 0 {
			a, err := c.waitShares(name, c.serviceWants(globalRate, l), started, 5*time.Second)
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
			t.Logf("%s: %v", what, a)
		}
		for _, s := range senders {
			s.Stop()
		}
		senders = c.startSenders(l)
		from := time.Now().Add(settle)
		c.checkAggregate(what, l, senders, from, window)
	}
}

// startSenders starts, on every node, one paced sender from A to each of
// the node's ready endpoints, together offering twice the node's share.
func (c *cluster) startSenders(l layout) []*nettest.Sender {
	c.t.Helper()
	var out []*nettest.Sender
	wants := c.serviceWants(globalRate, l)
	for i, nd := range c.nodes {
		if wants[i].absent {
			continue
		}
		n := l.ready[i]
		for j := 1; j <= n; j++ {
			conn, err := nd.pair.A.DialUDP(netip.AddrPortFrom(endpointAddr(nd.index, j), svcPort))
			if err != nil {
				c.t.Fatal(err)
			}
			out = append(out, c.startOn(conn, nettest.SenderConfig{
				Rate: 2 * float64(wants[i].share) / float64(n), Count: senderMax, Duration: senderSpan,
			}))
		}
	}
	return out
}

// checkAggregate waits for the window [from, from+d) to pass and checks
// that the receivers of all nodes together admitted the global rate within
// +-5%, and each node its share within +-10%.
func (c *cluster) checkAggregate(what string, l layout, senders []*nettest.Sender, from time.Time, d time.Duration) {
	c.t.Helper()
	to := from.Add(d)
	time.Sleep(time.Until(to.Add(late)))
	var offered, admitted float64
	for _, s := range senders {
		offered += s.Sent().Rate(from, to)
	}
	wants := c.serviceWants(globalRate, l)
	var parts []string
	for i, nd := range c.nodes {
		got := nd.recv.Got().Rate(from, to)
		admitted += got
		share := float64(wants[i].share)
		parts = append(parts, fmt.Sprintf("%s %.0f of %.0f (%+.2f%%)", nd.name, got, share, pct(got, share)))
		if wants[i].absent {
			continue
		}
		if math.Abs(got-share) > 0.10*share {
			c.t.Errorf("%s: %s admitted %.0f pkt/s, want its share %.0f +-10%%", what, nd.name, got, share)
		}
	}
	c.t.Logf("%s: aggregate admitted %.0f pkt/s over %v, global rate %d (%+.2f%%), offered %.0f; per node: %s",
		what, admitted, d, globalRate, pct(admitted, globalRate), offered, strings.Join(parts, ", "))
	if offered < 1.3*globalRate {
		c.t.Errorf("%s: the senders offered only %.0f pkt/s against a global rate of %d: the machine is too busy to measure", what, offered, globalRate)
	}
	if math.Abs(admitted-globalRate) > 0.05*globalRate {
		c.t.Errorf("%s: the three nodes admitted %.0f pkt/s together, want the global rate %d +-5%%", what, admitted, globalRate)
	}
}

func pct(got, want float64) float64 { return (got - want) / want * 100 }
