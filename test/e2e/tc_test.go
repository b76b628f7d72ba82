package e2e

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// The TC programs end to end: a limit enforced at the uplink's TC egress,
// and limits enforced at the endpoints, which see the traffic into a pod
// whichever way it came: routed from outside, bridged from a pod on the same
// host, decapsulated from an overlay, DNATed from a service address.

// measure sends the flow at twice want for settle+rigWindow and checks
// that the receiver got want +-5% per second in the window.
func measure(t *testing.T, f flow, want float64) {
	t.Helper()
	s := startFlow(t, f, 2*want, 0, settle+rigWindow+time.Second)
	defer s.stop() // the next flow to this pod binds the port again
	from := s.send.Sent().Start().Add(settle)
	to := from.Add(rigWindow)
	sleepUntil(to.Add(late))
	s.check(t, from, to, want)
}

// TestEgressLimitAtUplink: a limit with direction egress is enforced at the
// uplink's TC egress hook (tcx, or clsact before 6.6): the node's own
// traffic to the remote is held to the share, and the traffic the other way
// is not touched.
func TestEgressLimitAtUplink(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		t.Run(map[bool]string{false: "ipv4", true: "ipv6"}[v6], func(t *testing.T) {
			n := newRig(t, nettest.TopologyConfig{Uplink: true})
			n.start("", fmt.Sprintf(`  - name: out
    rate: %d
    match:
      direction: egress
      protocol: udp
      dstPorts: ["%d"]
`, globalRate, port))
			n.waitHooks("tc-egress "+nettest.UplinkIf+" uplink-out", "xdp "+nettest.UplinkIf+" uplink-in")
			share := float64(globalRate / 2)
			measure(t, flow{name: "node -> remote (egress)", from: n.topo.Node, to: netip.AddrPortFrom(n.topo.RemoteUp(v6), port),
				recv: n.topo.Remote, port: port}, share)
			// The same port the other way is ingress: not this limit's.
			st := n.limit("out")
			before := st.Totals.AdmittedPackets + st.Totals.DroppedPackets
			conn, err := n.topo.Node.ListenUDP("udp", netip.AddrPortFrom(netip.IPv6Unspecified(), port), 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			in, err := n.topo.Remote.DialUDP(netip.AddrPortFrom(n.topo.NodeUp(v6), port))
			if err != nil {
				t.Fatal(err)
			}
			defer in.Close()
			for range 100 {
				in.Write([]byte("ingress"))
			}
			time.Sleep(100 * time.Millisecond)
			st = n.limit("out")
			if after := st.Totals.AdmittedPackets + st.Totals.DroppedPackets; after != before {
				t.Errorf("100 ingress packets changed the egress limit's counters by %d, want 0", after-before)
			}
		})
	}
}

// TestEndpointLimitSeesEveryPath: one limit attached at the endpoints
// (key dst-ip, so that each pod has a bucket of the whole share) sees the
// traffic into a pod whichever way it arrives, each path within 5% of the
// share: routed from the remote, decapsulated from the overlay, DNATed
// from a service address (from the remote and from a pod), bridged from a
// pod on the same bridge, routed from a pod behind a ptp veth. The uplink's
// XDP could see none of these as the pod's traffic: inside the tunnel, the
// address is the node's and the port the service's before DNAT, and
// same-host traffic never crosses it.
func TestEndpointLimitSeesEveryPath(t *testing.T) {
	testenv.HostOnly(t, "the bridge and vxlan modules and the nft binary")
	const podPort = 8080
	for _, v6 := range []bool{false, true} {
		t.Run(map[bool]string{false: "ipv4", true: "ipv6"}[v6], func(t *testing.T) {
			n := newRig(t, nettest.TopologyConfig{Uplink: true, Overlay: true,
				BridgePods: []string{"a", "b"}, RoutedPods: []string{"c", "d"},
				Service: &nettest.ServiceConfig{Pod: "a", Port: 80, TargetPort: podPort}})
			a, b, c, d := n.topo.Pod("a"), n.topo.Pod("b"), n.topo.Pod("c"), n.topo.Pod("d")
			n.start("", fmt.Sprintf(`  - name: pods
    rate: %d
    attach: endpoints
    key: dst-ip
    match:
      protocol: udp
      dstPorts: ["%d"]
      dstCIDRs: [%s, %s, %s, %s]
`, globalRate, podPort, a.Addr4, a.Addr6, c.Addr4, c.Addr6))
			n.waitHooks("tc-egress "+a.HostIf+" endpoint-in", "tc-egress "+c.HostIf+" endpoint-in")
			if st := n.limit("pods"); st.Note != "" {
				t.Errorf("the limit's note: %q, want none (every endpoint has an interface)", st.Note)
			}
			share := float64(globalRate / 2)
			for _, f := range []flow{
				{name: "remote -> bridged pod through the overlay", from: n.topo.Remote, to: netip.AddrPortFrom(a.Addr(v6), podPort)},
				{name: "remote -> service (DNAT) -> bridged pod", from: n.topo.Remote, to: n.topo.Service(v6)},
				{name: "bridged pod -> bridged pod, same host", from: b.NS, to: netip.AddrPortFrom(a.Addr(v6), podPort)},
				{name: "routed pod -> service (DNAT) -> bridged pod, same host", from: d.NS, to: n.topo.Service(v6)},
				{name: "remote -> routed pod through the overlay", from: n.topo.Remote, to: netip.AddrPortFrom(c.Addr(v6), podPort), recv: c.NS},
				{name: "bridged pod -> routed pod, same host", from: b.NS, to: netip.AddrPortFrom(c.Addr(v6), podPort), recv: c.NS},
			} {
				if f.recv == nil {
					f.recv = a.NS
				}
				f.port = podPort
				measure(t, f, share)
			}
		})
	}
}

// TestEndpointFallsBackToUplink: an endpoint address that is the node's own
// (as a hostNetwork pod's is) has no interface of its own: the limit is
// enforced at the uplink instead, and status says why.
func TestEndpointFallsBackToUplink(t *testing.T) {
	n := newRig(t, nettest.TopologyConfig{Uplink: true, RoutedPods: []string{"c"}})
	n.start("", fmt.Sprintf(`  - name: hostnet
    rate: %d
    attach: endpoints
    match:
      protocol: udp
      dstPorts: ["%d"]
      dstCIDRs: [%s]
`, globalRate, port, n.topo.NodeUp4))
	st := n.limit("hostnet")
	t.Logf("status note: %q", st.Note)
	if !strings.Contains(st.Note, "enforced at the uplink") || !strings.Contains(st.Note, n.topo.NodeUp4.String()) {
		t.Errorf("note %q, want it to say the limit is enforced at the uplink because of %s", st.Note, n.topo.NodeUp4)
	}
	measure(t, flow{name: "remote -> node address (hostNetwork endpoint), at the uplink", from: n.topo.Remote,
		to: netip.AddrPortFrom(n.topo.NodeUp4, port), recv: n.topo.Node, port: port}, float64(globalRate/2))
}

// TestEndpointPickedUpWhenPodAppears: a limit whose pod goes away (its
// interface down, its route gone) falls back to the uplink; once the pod's
// interface and route are back, the agent attaches to it and moves the
// limit there within a second.
func TestEndpointPickedUpWhenPodAppears(t *testing.T) {
	n := newRig(t, nettest.TopologyConfig{Uplink: true, RoutedPods: []string{"c"}})
	c := n.topo.Pod("c")
	n.start("", fmt.Sprintf(`  - name: later
    rate: %d
    attach: endpoints
    match:
      protocol: udp
      dstPorts: ["%d"]
      dstCIDRs: [%s]
`, globalRate, port, c.Addr4))
	n.waitHooks("tc-egress " + c.HostIf + " endpoint-in")
	// The pod goes (its route with it) and comes back.
	nl, err := n.topo.Node.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	l, err := nl.LinkByName(c.HostIf)
	if err != nil {
		t.Fatal(err)
	}
	if err := nl.LinkSetDown(l); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(n.limit("later").Note, "enforced at the uplink") {
		if time.Now().After(deadline) {
			t.Fatalf("the pod's interface is down (its route gone) and the limit's note is %q, want a fallback to the uplink", n.limit("later").Note)
		}
		time.Sleep(50 * time.Millisecond)
	}
	up := time.Now()
	if err := nl.LinkSetUp(l); err != nil {
		t.Fatal(err)
	}
	// The routes went with the link: put the pod's /32 back.
	if err := nl.RouteReplace(&netlink.Route{LinkIndex: l.Attrs().Index, Scope: netlink.SCOPE_LINK,
		Dst: &net.IPNet{IP: c.Addr4.AsSlice(), Mask: net.CIDRMask(32, 32)}}); err != nil {
		t.Fatal(err)
	}
	for strings.Contains(n.limit("later").Note, "enforced at the uplink") {
		if time.Since(up) > 5*time.Second {
			t.Fatalf("5 s after the pod's interface and route are back, the limit's note still says %q", n.limit("later").Note)
		}
		time.Sleep(20 * time.Millisecond)
	}
	took := time.Since(up)
	t.Logf("the limit moved to the pod's interface %v after it came back", took.Round(time.Millisecond))
	if took > time.Second {
		t.Errorf("the limit moved to the pod's interface %v after it came back, want within 1 s", took)
	}
	measure(t, flow{name: "remote -> routed pod", from: n.topo.Remote, to: netip.AddrPortFrom(c.Addr4, port), recv: c.NS, port: port},
		float64(globalRate/2))
}

// tcpSegs is a namespace's TCP segment counters (/proc/net/snmp, IPv4 and
// IPv6 together), a GSO packet counted by its segments.
type tcpSegs struct {
	Out     uint64 // sent for the first time (OutSegs leaves retransmissions out)
	Retrans uint64 // sent again (RetransSegs)
}

func (a tcpSegs) sub(b tcpSegs) tcpSegs { return tcpSegs{a.Out - b.Out, a.Retrans - b.Retrans} }

func readTCPSegs(t *testing.T, ns *nettest.NS) tcpSegs {
	t.Helper()
	var s tcpSegs
	err := ns.Do(func() error {
		b, err := os.ReadFile("/proc/thread-self/net/snmp")
		if err != nil {
			return err
		}
		var names []string
		for line := range strings.SplitSeq(string(b), "\n") {
			f := strings.Fields(line)
			if len(f) == 0 || f[0] != "Tcp:" {
				continue
			}
			if names == nil {
				names = f
				continue
			}
			found := 0
			for i, name := range names {
				var dst *uint64
				switch name {
				case "OutSegs":
					dst = &s.Out
				case "RetransSegs":
					dst = &s.Retrans
				}
				if dst == nil || i >= len(f) {
					continue
				}
				if *dst, err = strconv.ParseUint(f[i], 10, 64); err != nil {
					return err
				}
				found++
			}
			if found != 2 {
				return errors.New("no Tcp OutSegs and RetransSegs in /proc/net/snmp")
			}
			return nil
		}
		return errors.New("no Tcp counters in /proc/net/snmp")
	})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// checkSegments holds a packets limit's count against what TCP sent: every
// segment that went through the hook, once each, although the skbs that
// carried them were GRO- or GSO-merged. A segment lost after the hook is
// sent again and counted again, one lost before it only once: with
// retransmissions the count lies between the first sends and all sends
// (a retransmission may also re-cut the segments), without them it is exact.
// quietSegs reads ns's TCP segment counters around read (which reads the
// limits' counters), until they stand still across it: a segment TCP sends
// between the two reads (the last ACK or FIN of a connection that is
// closing) would be counted by one and not the other. At most 5 s.
func quietSegs(t *testing.T, ns *nettest.NS, read func()) tcpSegs {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		before := readTCPSegs(t, ns)
		read()
		after := readTCPSegs(t, ns)
		if before == after || time.Now().After(deadline) {
			return after
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func checkSegments(t *testing.T, counted uint64, sent tcpSegs) {
	t.Helper()
	lo, hi := sent.Out-min(sent.Out, sent.Retrans), sent.Out+sent.Retrans
	if counted < lo || counted > hi {
		t.Errorf("the packets limit counted %d, want the %d segments TCP sent (with %d retransmitted: %d..%d)",
			counted, sent.Out, sent.Retrans, lo, hi)
	}
}

// TestTCPSegmentsCounted: at TC a packet is an skb that may carry many TCP
// segments, GRO-merged on the way in or built by GSO on the way out. A
// packets limit counts segments and a bytes limit the bytes on the wire:
// over a bulk transfer into a pod (GRO on the node's uplink) and out of it
// (GSO in the pod), the endpoint limits (action shadow, so that nothing is
// dropped) count exactly the segments TCP sent and, inbound, the bytes of
// the frames the remote put on the wire, although the pod's interface
// passed far fewer, larger packets.
func TestTCPSegmentsCounted(t *testing.T) {
	const size = 16 << 20
	n := newRig(t, nettest.TopologyConfig{Uplink: true, RoutedPods: []string{"c"}})
	c := n.topo.Pod("c")
	// The remote sends wire-sized frames; the node's uplink merges them.
	for _, off := range []nettest.Offload{nettest.OffloadTSO, nettest.OffloadGSO} {
		if err := n.topo.Remote.SetOffload(nettest.UplinkIf, off, false); err != nil {
			t.Fatal(err)
		}
	}
	if err := n.topo.Node.SetOffload(nettest.UplinkIf, nettest.OffloadGRO, true); err != nil {
		t.Fatal(err)
	}
	var limits strings.Builder
	for _, l := range []struct{ name, unit, dir, side string }{
		{"in-segs", "packets", "ingress", "dstCIDRs"}, {"in-bytes", "bytes", "ingress", "dstCIDRs"},
		{"out-segs", "packets", "egress", "srcCIDRs"},
	} {
		fmt.Fprintf(&limits, `  - name: %s
    rate: 4000000000
    burst: 4000000000
    unit: %s
    action: shadow
    attach: endpoints
    match:
      direction: %s
      protocol: tcp
      %s: [%s, %s]
`, l.name, l.unit, l.dir, l.side, c.Addr4, c.Addr6)
	}
	n.start("", limits.String())
	n.waitHooks("tc-egress "+c.HostIf+" endpoint-in", "tc-ingress "+c.HostIf+" endpoint-out")

	for _, v6 := range []bool{false, true} {
		t.Run(map[bool]string{false: "ipv4", true: "ipv6"}[v6], func(t *testing.T) {
			// In: remote -> pod.
			sink, err := c.NS.ListenTCPSink(netip.AddrPortFrom(c.Addr(v6), 5001), nettest.TCPSinkConfig{})
			if err != nil {
				t.Fatal(err)
			}
			defer sink.Close()
			segs0, bytes0 := n.limit("in-segs").Totals, n.limit("in-bytes").Totals
			remote0, host0 := linkStats(t, n.topo.Remote, nettest.UplinkIf), linkStats(t, n.topo.Node, c.HostIf)
			out0 := readTCPSegs(t, n.topo.Remote)
			bulkTo(t, n.topo.Remote, sink, size)
			time.Sleep(200 * time.Millisecond) // the last ACKs
			var segs, wire uint64
			sent := quietSegs(t, n.topo.Remote, func() {
				segs = n.limit("in-segs").Totals.AdmittedPackets - segs0.AdmittedPackets
				wire = n.limit("in-bytes").Totals.AdmittedBytes - bytes0.AdmittedBytes
			}).sub(out0)
			remote := linkStats(t, n.topo.Remote, nettest.UplinkIf).Sub(remote0)
			host := linkStats(t, n.topo.Node, c.HostIf).Sub(host0)
			t.Logf("in: the remote's TCP sent %d segments (%d more again), its uplink %d frames; the pod's veth passed %d packets (%.0f bytes each); "+
				"the limits counted %d segments, %d bytes", sent.Out, sent.Retrans, remote.TxPackets, host.TxPackets,
				float64(host.TxBytes)/float64(max(host.TxPackets, 1)), segs, wire)
			if host.TxPackets*4 > sent.Out {
				t.Errorf("the pod's veth passed %d packets for %d segments: GRO did not merge them, the test proves nothing", host.TxPackets, sent.Out)
			}
			checkSegments(t, segs, sent)
			// On the wire each segment is an Ethernet frame: 14 bytes, the
			// IP header, a TCP header of 32 bytes (timestamps, on by
			// default) and its share of the payload; every payload byte
			// went through at least once, a retransmitted segment's at most
			// twice. (The uplink's byte counters are no reference: with GRO
			// on, veth counts its NAPI path's bytes without the Ethernet
			// header.)
			hdr := uint64(14 + 20 + 32)
			if v6 {
				hdr = 14 + 40 + 32
			}
			lo := uint64(size) + segs*hdr
			hi := lo + sent.Retrans*(1500-(hdr-14))
			if float64(wire) < 0.999*float64(lo) || float64(wire) > 1.001*float64(hi) {
				t.Errorf("the bytes limit counted %d, want %d..%d (%d payload bytes in %d frames of %d header bytes, %d segments sent again) +-0.1%%",
					wire, lo, hi, size, segs, hdr, sent.Retrans)
			}

			// Out: pod -> remote, GSO packets from the pod.
			rsink, err := n.topo.Remote.ListenTCPSink(netip.AddrPortFrom(n.topo.RemoteUp(v6), 5002), nettest.TCPSinkConfig{})
			if err != nil {
				t.Fatal(err)
			}
			defer rsink.Close()
			out := n.limit("out-segs").Totals
			host0 = linkStats(t, n.topo.Node, c.HostIf)
			pod0 := readTCPSegs(t, c.NS)
			bulkTo(t, c.NS, rsink, size)
			time.Sleep(200 * time.Millisecond)
			sent = quietSegs(t, c.NS, func() {
				segs = n.limit("out-segs").Totals.AdmittedPackets - out.AdmittedPackets
			}).sub(pod0)
			host = linkStats(t, n.topo.Node, c.HostIf).Sub(host0)
			t.Logf("out: the pod's TCP sent %d segments (%d more again) in %d packets (%.0f bytes each); the limit counted %d",
				sent.Out, sent.Retrans, host.RxPackets, float64(host.RxBytes)/float64(max(host.RxPackets, 1)), segs)
			if host.RxPackets*4 > sent.Out {
				t.Errorf("the pod's veth received %d packets for %d segments: no GSO, the test proves nothing", host.RxPackets, sent.Out)
			}
			checkSegments(t, segs, sent)
		})
	}
}

func linkStats(t *testing.T, ns *nettest.NS, ifname string) nettest.LinkStats {
	t.Helper()
	s, err := ns.LinkStats(ifname)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// bulkTo sends size bytes from ns to the sink and waits until they are in.
func bulkTo(t *testing.T, ns *nettest.NS, sink *nettest.TCPSink, size int64) {
	t.Helper()
	b, err := ns.StartBulk(sink.Addr(), nettest.BulkConfig{Bytes: size, Duration: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Stop()
	<-b.Done()
	if err := b.Err(); err != nil {
		t.Fatal(err)
	}
	if !sink.WaitReceived(size, 10*time.Second) {
		t.Fatalf("the sink got %d of %d bytes", sink.Received().Total(), size)
	}
}
