package e2e

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/agent"
	"github.com/rlagent/rlagent/internal/bpftest"
	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
	"github.com/rlagent/rlagent/maps"
)

// TestRejectVisible: limits with action reject on the uplink (XDP), against
// real sockets over veth whose checksum offloads are off, so that the
// receiving kernel verifies every checksum of the replies. Against a port
// the node listens on:
//   - a TCP connect whose SYN a reject limit rejects fails with
//     ECONNREFUSED within 50 ms, where the same connect to a port whose
//     limit drops times out;
//   - a connected UDP socket whose datagram a reject limit rejects sees
//     ECONNREFUSED, where one whose limit drops sees nothing;
//   - under a SYN flood the replies stay within the node's rejectBudget
//     (the rest are dropped, counted), and the refusals the client sees
//     are those replies.
func TestRejectVisible(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		t.Run(family(v6), func(t *testing.T) { testReject(t, v6) })
	}
}

func testReject(t *testing.T, v6 bool) {
	const (
		rejectPort = 7000
		dropPort   = 7001
		budget     = 100 // replies/s
		burst      = 10
	)
	r := newRig(t, nettest.TopologyConfig{Uplink: true})
	node, remote := r.topo.Node, r.topo.Remote
	for _, ns := range []*nettest.NS{node, remote} {
		if err := ns.SetChecksumOffload(nettest.UplinkIf, false); err != nil {
			t.Fatal(err)
		}
	}
	// A veth is handed the frames its peer's XDP program sends back
	// (XDP_TX) at once only when it runs an XDP program of its own: with
	// GRO alone they wait in its ring for the next packet to wake it (a
	// second RST arrived a second late, after the SYN's retransmission).
	// Any program does: XDP_PASS.
	bpftest.AttachXDPLink(t, remote, nettest.UplinkIf, bpftest.NewCounter(t, ebpf.XDP, "peer_pass", xdpPassVerdict).Prog)
	nodeAddr := r.topo.NodeUp4
	if v6 {
		nodeAddr = r.topo.NodeUp6
	}
	// Share 1/s and a burst of 1 on each node: after the first packet,
	// everything is over the limit.
	limit := func(name, action, proto string, port int) string {
		return fmt.Sprintf(`  - name: %s
    rate: 2
    burst: 2
    action: %s
    match:
      protocol: %s
      dstPorts: ["%d"]
`, name, action, proto, port)
	}
	// The per-destination share (every packet here has one source) is
	// wide, so that the flood below meets the node's budget; a
	// destination's first reply still leaves it none until the clock's
	// next tick (TestRejectPerDestination tests the share).
	r.start(fmt.Sprintf("rejectBudget: {rate: %d, burst: %d, perDestination: {rate: 100000, burst: 100000}}\n", budget, burst),
		limit("tcp-reject", "reject", "tcp", rejectPort)+limit("tcp-drop", "drop", "tcp", dropPort)+
			limit("udp-reject", "reject", "udp", rejectPort)+limit("udp-drop", "drop", "udp", dropPort))
	for _, port := range []uint16{rejectPort, dropPort} {
		sink, err := node.ListenTCPSink(netip.AddrPortFrom(netip.IPv6Unspecified(), port), nettest.TCPSinkConfig{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sink.Close() })
		u, err := node.ListenUDP("udp", netip.AddrPortFrom(netip.IPv6Unspecified(), port), 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { u.Close() })
	}

	connect := func(port uint16, timeout time.Duration) (time.Duration, error) {
		var took time.Duration
		var cerr error
		err := remote.Do(func() error {
			began := time.Now()
			c, err := net.DialTimeout("tcp", netip.AddrPortFrom(nodeAddr, port).String(), timeout)
			took, cerr = time.Since(began), err
			if c != nil {
				c.Close()
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return took, cerr
	}
	// The first SYN of each port may find the burst; the next ones are
	// over the limit.
	connect(rejectPort, 300*time.Millisecond)
	connect(dropPort, 300*time.Millisecond)
	// Each connect refused, most within 50 ms: the first SYN's answer, not
	// a retransmission's (1 s later). The bound is on the median: on a
	// loaded machine a veth's softirq can wait its turn.
	var took []time.Duration
	for i := range 7 {
		// Past the clock's tick: the destination's share has a reply
		// again (a new destination starts with one).
		time.Sleep(20 * time.Millisecond)
		d, err := connect(rejectPort, 3*time.Second)
		if !errors.Is(err, syscall.ECONNREFUSED) {
			g := globalStats(t, r)
			t.Fatalf("connect %d to the reject port: %v after %v, want ECONNREFUSED (the data path sent %d RSTs, %d over budget, %d unanswered)",
				i, err, d, g.RejectRST, g.RejectBudget, g.RejectUnanswered)
		}
		took = append(took, d)
	}
	slices.Sort(took)
	median := took[len(took)/2]
	t.Logf("TCP connect to the reject port: ECONNREFUSED %d times of %d, after %v (median), %v at most", len(took), len(took), median, took[len(took)-1])
	if bound := testenv.Timeout(50 * time.Millisecond); median > bound {
		t.Errorf("ECONNREFUSED took %v (median of %v), want within %v", median, took, bound)
	}
	if took, err := connect(dropPort, 300*time.Millisecond); err == nil || errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("connect to the drop port: %v after %v, want a timeout (no answer)", err, took)
	}

	// UDP: a connected socket learns of the port unreachable.
	udpRefused := func(port uint16) error {
		c, err := remote.DialUDP(netip.AddrPortFrom(nodeAddr, port))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		var last error
		for range 3 { // the first datagram may find the burst
			if _, err := c.Write([]byte("hello")); err != nil {
				return err
			}
			c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
			_, last = c.Read(make([]byte, 64))
			if errors.Is(last, syscall.ECONNREFUSED) {
				return last
			}
		}
		return last
	}
	if err := udpRefused(rejectPort); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("connected UDP socket to the reject port: %v, want ECONNREFUSED", err)
	}
	if err := udpRefused(dropPort); errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("connected UDP socket to the drop port: ECONNREFUSED, want no answer")
	}

	// A SYN flood: the replies stay within the budget.
	g0 := globalStats(t, r)
	const floodRate, floodFor = 1000, time.Second
	flood, err := remote.StartConnector(netip.AddrPortFrom(nodeAddr, rejectPort), nettest.ConnectConfig{
		Rate: floodRate, Count: floodRate * int64(floodFor/time.Second), Duration: floodFor, Timeout: testenv.Timeout(200 * time.Millisecond)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(flood.Stop)
	began := time.Now()
	<-flood.Done()
	elapsed := time.Since(began)
	g1 := globalStats(t, r)
	sent, over := g1.RejectRST-g0.RejectRST, g1.RejectBudget-g0.RejectBudget
	f := flood.Failures()
	// The budget runs on jiffies: over elapsed, its rate and a tick more.
	var res unix.Timespec
	if err := unix.ClockGetres(unix.CLOCK_MONOTONIC_COARSE, &res); err != nil {
		t.Fatal(err)
	}
	most := uint64(burst + budget*(elapsed+time.Duration(res.Nano())).Seconds() + 1)
	t.Logf("SYN flood: %d attempts in %v; %d RSTs sent (budget %d/s, burst %d: at most %d), %d over budget; the client saw %d refused, %d timed out, %d other",
		flood.Attempts().Total(), elapsed.Round(time.Millisecond), sent, budget, burst, most, over, f.Refused, f.TimedOut, f.Other)
	if sent > most {
		t.Errorf("%d RSTs sent in %v, above the budget's %d", sent, elapsed, most)
	}
	if sent < burst || over == 0 {
		t.Errorf("%d RSTs sent, %d over budget: the flood did not exhaust the budget, the test proves nothing", sent, over)
	}
	if f.Refused > int64(sent) {
		t.Errorf("the client saw %d refusals, more than the %d RSTs sent", f.Refused, sent)
	}
	if f.Refused < int64(sent)*9/10 {
		t.Errorf("the client saw %d refusals of the %d RSTs sent: replies were lost or not accepted", f.Refused, sent)
	}
}

// xdpPassVerdict is XDP_PASS.
const xdpPassVerdict = 2

// globalStats reads the data path's counters that belong to no limit from
// the rig's pins.
func globalStats(t *testing.T, r *rig) maps.GlobalStats {
	t.Helper()
	g, err := agent.ReadGlobalStats(r.pinDir)
	if err != nil {
		t.Fatal(err)
	}
	return g
}
