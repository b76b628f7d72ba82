package e2e

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"

	"github.com/rlagent/rlagent/agent"
	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// TestEndpointSourceForged (issue 22, item 4): a pod with CAP_NET_RAW
// writes Ethernet frames with any source address onto its interface. Its
// egress limit (attach endpoints, keyed by source) charges them as the
// pod's all the same: a source outside the limit's srcCIDRs does not take
// the pod out of its limit, and its neighbour's address does not draw on
// the neighbour's bucket; each is counted
// (rlagent_datapath_endpoint_src_mismatch_total). With endpointSourceCheck
// drop they are dropped before any limit, and the pod's own packets still
// pass. Real frames from the pod's namespace over its veth (AF_PACKET), the
// agent's own discovery of the pods' interfaces and addresses.
//
// On 54615ce the frames from outside the srcCIDRs were charged to nothing
// and the neighbour's bucket paid for the forgeries.
func TestEndpointSourceForged(t *testing.T) {
	const burst = 20 // each pod's bucket: the share of burst 40 over rigCount 2
	n := newRig(t, nettest.TopologyConfig{Uplink: true, RoutedPods: []string{"c", "d"}})
	c, d := n.topo.Pod("c"), n.topo.Pod("d")
	limits := fmt.Sprintf(`  - name: pods-out
    rate: 2
    burst: %d
    attach: endpoints
    key: src-ip
    match:
      direction: egress
      protocol: udp
      srcCIDRs: [%s, %s, %s, %s]
`, 2*burst, c.Addr4, c.Addr6, d.Addr4, d.Addr6)
	n.start("", limits)
	n.waitHooks("tc-ingress "+c.HostIf+" endpoint-out", "tc-ingress "+d.HostIf+" endpoint-out")

	// send writes k frames from pod p's namespace with source src, and
	// returns how many the limit admitted and dropped, and how many
	// mismatches the data path counted.
	send := func(p *nettest.Pod, src netip.Addr, k int) (admitted, dropped, mismatch uint64) {
		t.Helper()
		before, g0 := n.podsOut(), n.mismatches()
		pc, err := p.NS.OpenPacket(nettest.PodIf)
		if err != nil {
			t.Fatal(err)
		}
		defer pc.Close()
		hostMAC, err := n.topo.Node.MAC(p.HostIf)
		if err != nil {
			t.Fatal(err)
		}
		frame := udpFrame(t, p.MAC, hostMAC, src, n.topo.RemoteUp(src.Is6()), 9999)
		for range k {
			if err := pc.Send(frame); err != nil {
				t.Fatal(err)
			}
		}
		// The veth hands each frame to the host's TC ingress as it is
		// sent; the counters are read once it has run.
		deadline := time.Now().Add(testenv.Timeout(5 * time.Second))
		for {
			after, g1 := n.podsOut(), n.mismatches()
			admitted, dropped = after.AdmittedPackets-before.AdmittedPackets, after.DroppedPackets-before.DroppedPackets
			mismatch = g1 - g0
			if admitted+dropped+mismatch >= uint64(k) || time.Now().After(deadline) {
				return admitted, dropped, mismatch
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	for _, v6 := range []bool{false, true} {
		t.Run(family(v6), func(t *testing.T) {
			outside := netip.MustParseAddr("198.51.100.7")
			if v6 {
				outside = netip.MustParseAddr("2001:db8:dead::7")
			}
			// Forged: half from outside the limit, half as the neighbour.
			a1, d1, m1 := send(c, outside, burst/2)
			a2, d2, m2 := send(c, d.Addr(v6), burst/2+5)
			t.Logf("pod c forging %s and %s: admitted %d, dropped %d, source mismatches %d",
				outside, d.Addr(v6), a1+a2, d1+d2, m1+m2)
			if got := a1 + d1 + a2 + d2; got != burst+5 {
				t.Errorf("the limit was charged %d of the %d forged frames, want all (as pod c's)", got, burst+5)
			}
			if m1+m2 != burst+5 {
				t.Errorf("source mismatches counted %d, want %d", m1+m2, burst+5)
			}
			// Pod c's own bucket paid: its own frames find it empty
			// (a token or two may have accrued: 1 a second).
			if a, _, m := send(c, c.Addr(v6), 10); a > 3 || m != 0 {
				t.Errorf("pod c's own frames after its forgeries: %d of 10 admitted, want at most 3 (its bucket paid for them); %d mismatches, want 0", a, m)
			}
			// The neighbour's bucket did not.
			if a, _, _ := send(d, d.Addr(v6), burst); a < burst-1 {
				t.Errorf("pod d's own frames: %d of %d admitted: its bucket paid for pod c's forgeries", a, burst)
			}
		})
	}

	// endpointSourceCheck drop: forged frames are dropped before any
	// limit (and counted), the pod's own pass as before.
	applied := strings.Count(n.agent.Log(), "config applied")
	n.writeConfig("endpointSourceCheck: drop\n", limits)
	timeout := testenv.Timeout(10 * time.Second)
	deadline := time.Now().Add(timeout)
	for strings.Count(n.agent.Log(), "config applied") == applied {
		if time.Now().After(deadline) {
			t.Fatalf("the config change was not applied within %v:\n%s", timeout, n.agent.Log())
		}
		time.Sleep(50 * time.Millisecond)
	}
	for _, v6 := range []bool{false, true} {
		a, dr, m := send(d, c.Addr(v6), 10)
		if a+dr != 0 || m != 10 {
			t.Errorf("%s, drop: pod d forging pod c's address: the limit charged %d, mismatches %d; want 0 and 10 (dropped first)", family(v6), a+dr, m)
		}
		if a, dr, m := send(d, d.Addr(v6), 3); a+dr != 3 || m != 0 {
			t.Errorf("%s, drop: pod d's own frames: charged %d of 3, mismatches %d; want 3 and 0", family(v6), a+dr, m)
		}
	}
}

// podsOut is the limit pods-out's counters, read from the pins.
func (r *rig) podsOut() agentTotals {
	r.t.Helper()
	st, err := agent.ReadStatus(r.pinDir)
	if err != nil {
		r.t.Fatal(err)
	}
	for _, s := range st {
		if s.Name == "pods-out" {
			return agentTotals{s.Totals.AdmittedPackets, s.Totals.DroppedPackets}
		}
	}
	r.t.Fatal("no limit pods-out")
	return agentTotals{}
}

type agentTotals struct{ AdmittedPackets, DroppedPackets uint64 }

// mismatches is the data path's count of endpoint source mismatches.
func (r *rig) mismatches() uint64 {
	r.t.Helper()
	g, err := agent.ReadGlobalStats(r.pinDir)
	if err != nil {
		r.t.Fatal(err)
	}
	return g.EndpointSrcMismatch
}

// udpFrame is an Ethernet frame of a UDP datagram from src to dst:port,
// with valid lengths and checksums.
func udpFrame(t testing.TB, from, to net.HardwareAddr, src, dst netip.Addr, port uint16) []byte {
	t.Helper()
	eth := &layers.Ethernet{SrcMAC: from, DstMAC: to, EthernetType: layers.EthernetTypeIPv4}
	udp := &layers.UDP{SrcPort: 40000, DstPort: layers.UDPPort(port)}
	var ip gopacket.SerializableLayer
	if src.Is6() {
		eth.EthernetType = layers.EthernetTypeIPv6
		ip6 := &layers.IPv6{Version: 6, HopLimit: 64, NextHeader: layers.IPProtocolUDP, SrcIP: src.AsSlice(), DstIP: dst.AsSlice()}
		udp.SetNetworkLayerForChecksum(ip6)
		ip = ip6
	} else {
		ip4 := &layers.IPv4{Version: 4, TTL: 64, Protocol: layers.IPProtocolUDP, SrcIP: src.AsSlice(), DstIP: dst.AsSlice()}
		udp.SetNetworkLayerForChecksum(ip4)
		ip = ip4
	}
	buf := gopacket.NewSerializeBuffer()
	opts := gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}
	if err := gopacket.SerializeLayers(buf, opts, eth, ip, udp, gopacket.Payload(make([]byte, 32))); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}
