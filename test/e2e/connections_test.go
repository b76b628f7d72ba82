package e2e

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/rlagent/rlagent/internal/nettest"
)

// TestConnectionsLimit: a limit with unit connections (ingress, tcp, one
// port, enforced at the server pod's interface) charges TCP SYNs only.
// A Connector opens connections from the remote at twice the share, each
// attempt one SYN (a connect timeout of 500 ms is below the kernel's 1 s
// SYN retransmission timeout); the completed attempts per second are the
// share within 5%. Meanwhile a TCP stream from another pod to the same port
// (its SYN was admitted before the connector started) passes in full: its
// data segments are not the limit's, so the limit's counters hold exactly
// one SYN per attempt plus the stream's one, and the stream arrives at the
// rate it was written.
func TestConnectionsLimit(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		t.Run(family(v6), func(t *testing.T) { testConnections(t, v6) })
	}
}

func testConnections(t *testing.T, v6 bool) {
	const srvPort = 8080
	// streamRate is the TCP stream's pace in bytes/s, 16 MiB/s at the
	// default global rate: far above what a limit that charged its
	// segments at the connection share would let through (a few hundred
	// segments a second), well below what the machine carries while the
	// connector runs.
	streamRate := float64(globalRate) * 2048
	r := newRig(t, nettest.TopologyConfig{Uplink: true, RoutedPods: []string{"srv", "cli"}})
	srv, cli := r.topo.Pod("srv"), r.topo.Pod("cli")
	// 1000 connections/s over all replicas (at the default global rate),
	// an even number so the share is whole.
	global := globalRate / 16 * 2
	share := float64(global / rigCount)
	r.start("", fmt.Sprintf(`  - name: conns
    rate: %d
    unit: connections
    attach: endpoints
    match:
      protocol: tcp
      dstPorts: ["%d"]
      dstCIDRs: [%s, %s]
`, global, srvPort, srv.Addr4, srv.Addr6))
	r.waitHooks("tc-egress " + srv.HostIf + " endpoint-in")
	if st := r.counters().limit(t, "conns"); st.Unit != "connections" || st.ShareRate != uint64(share) {
		t.Fatalf("status: unit %q, share %d; want connections, %.0f", st.Unit, st.ShareRate, share)
	}

	sink, err := srv.NS.ListenTCPSink(netip.AddrPortFrom(netip.IPv6Unspecified(), srvPort), nettest.TCPSinkConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sink.Close() })
	dst := netip.AddrPortFrom(srv.Addr(v6), srvPort)

	// The stream first: its SYN finds the bucket full.
	retrans0 := tcpCounter(t, cli.NS, "RetransSegs")
	span := settle + rigWindow + time.Second
	stream, err := cli.NS.StartBulk(dst, nettest.BulkConfig{Bytes: int64(streamRate * span.Seconds()), Duration: span,
		WriteSize: 16 << 10, Rate: streamRate})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stream.Stop)
	const timeout = 500 * time.Millisecond
	conn, err := r.topo.Remote.StartConnector(dst, nettest.ConnectConfig{Rate: 2 * share,
		Count: int64(2*share*span.Seconds()) + 10, Duration: span, Timeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conn.Stop)

	from := conn.Attempts().Start().Add(settle)
	to := from.Add(rigWindow)
	c0, c1 := r.window(from, to, timeout+late) // the window's last attempts have their outcome

	completed, attempted := conn.Completed().Rate(from, to), conn.Attempts().Rate(from, to)
	checkNear(t, "connections completed (by attempt time)", completed, share, rigTol,
		fmt.Sprintf("conn/s (attempted %.0f)", attempted))
	if attempted < 1.3*share {
		t.Errorf("the connector attempted only %.0f conn/s against a share of %.0f: the machine is too busy to measure",
			attempted, share)
	}
	checkNear(t, "conns: admitted (status)", counterRate(t, c0, c1, "conns", admittedPackets), share, rigTol, "SYN/s")
	// The stream, meanwhile, arrived at the rate it was written, far above
	// what it would get if its segments were charged.
	written := stream.Sent().Rate(from, to)
	checkNear(t, "the TCP stream on an established connection: received", sink.Received().Rate(from, to), written,
		rigTol, "B/s, as written")
	if written < streamRate/2 {
		t.Errorf("the TCP stream wrote only %.0f B/s of its %.0f: the machine is too busy to measure", written, streamRate)
	}

	// Everything ends: the counters hold one SYN per attempt and the
	// stream's SYN, nothing of the stream's data; the SYNs dropped are the
	// attempts that timed out, those admitted the ones that completed.
	<-conn.Done()
	stream.Stop()
	if err := stream.Err(); err != nil {
		t.Error(err)
	}
	if !sink.WaitReceived(stream.Sent().Total(), 5*time.Second) {
		t.Errorf("the sink received %d bytes of the %d the stream wrote", sink.Received().Total(), stream.Sent().Total())
	}
	time.Sleep(late)
	// Logged, not checked: the counters below say whether the limit
	// dropped any of the stream, and a loaded VM can see a spurious
	// tail-loss probe.
	retrans := tcpCounter(t, cli.NS, "RetransSegs") - retrans0
	st := r.counters().limit(t, "conns").Totals
	f := conn.Failures()
	attempts, done := conn.Attempts().Total(), conn.Completed().Total()
	t.Logf("in all: %d attempts, %d completed, %d timed out, %d refused, %d other failures; the limit admitted %d SYNs "+
		"and dropped %d; the stream wrote %d bytes, the sink received %d, with %d TCP retransmissions",
		attempts, done, f.TimedOut, f.Refused, f.Other, st.AdmittedPackets, st.DroppedPackets, stream.Sent().Total(),
		sink.Received().Total(), retrans)
	if f.Refused != 0 || f.Other != 0 {
		t.Errorf("%d attempts refused, %d failed otherwise (%v): every attempt should complete or time out", f.Refused, f.Other, f.Err)
	}
	if got, want := st.AdmittedPackets+st.DroppedPackets, uint64(attempts)+1; got != want {
		t.Errorf("the limit was charged %d times, want %d: one SYN per attempt and the stream's one, no data segment", got, want)
	}
	if st.DroppedPackets != uint64(f.TimedOut) {
		t.Errorf("the limit dropped %d SYNs, and %d attempts timed out: want them equal", st.DroppedPackets, f.TimedOut)
	}
	if st.AdmittedPackets != uint64(done)+1 {
		t.Errorf("the limit admitted %d SYNs, and %d attempts completed (and the stream's one): want them equal",
			st.AdmittedPackets, done)
	}
}
