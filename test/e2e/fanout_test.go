package e2e

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/rlagent/rlagent/internal/nettest"
)

// TestFanOutThreeLimits is the seed's fan-out example end to end: three
// limits with their own global values on one backend pod, all with traffic
// at once, enforced at the backend's own interface (attach: endpoints):
//
//	remote ──uplink──┐
//	                 node ── vr-be ── be (backend): receives on 5301-5303, sends to c1, c2 on 5400
//	c1, c2 ──────────┘
//
// The limits:
//   - per-source (ingress, key src-prefix /24 and /64): each source network
//     sending to the backend has a bucket of the share. The remote is a
//     network of its own; the pods c1 and c2 share one, so together they get
//     one share.
//   - per-consumer (egress, key dst-ip): what the backend sends to each
//     consumer (c1, c2) is held to the share per consumer.
//   - sampler (egress, unit bytes, action shadow): the backend's traffic in
//     bytes against a share half of what the per-consumer limit lets out. It
//     counts the excess as would-drop and drops nothing: the consumers still
//     get their full per-consumer share.
//
// Each is measured within 5% of its share: per key at the receivers, and
// from the agent's counters (rlagent status --output json) over the same
// window.
func TestFanOutThreeLimits(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		t.Run(family(v6), func(t *testing.T) { testFanOut(t, v6) })
	}
}

func testFanOut(t *testing.T, v6 bool) {
	const (
		size                 = 500 // UDP payload of every datagram
		remotePort, c1Port   = 5301, 5302
		c2Port, consumerPort = 5303, 5400
	)
	r := newRig(t, nettest.TopologyConfig{Uplink: true, RoutedPods: []string{"be", "c1", "c2"}})
	be, c1, c2 := r.topo.Pod("be"), r.topo.Pod("c1"), r.topo.Pod("c2")

	// Per key, the per-source and per-consumer shares are the same: global
	// globalRate/2, divided by the count of 2.
	keyGlobal := globalRate / 2
	keyShare := float64(keyGlobal / rigCount)
	frame := frameLen(size, v6)
	// The sampler's share: half of what the per-consumer limit lets out
	// to its two consumers.
	samplerShare := uint64(frame) * uint64(keyShare)
	samplerGlobal := samplerShare * rigCount
	r.start("", fmt.Sprintf(`  - name: per-source
    rate: %[1]d
    attach: endpoints
    key: src-prefix
    prefixLength: {ipv4: 24, ipv6: 64}
    match:
      protocol: udp
      dstPorts: ["%[3]d-%[4]d"]
      dstCIDRs: [%[5]s, %[6]s]
  - name: per-consumer
    rate: %[1]d
    attach: endpoints
    key: dst-ip
    match:
      direction: egress
      protocol: udp
      dstPorts: ["%[7]d"]
      srcCIDRs: [%[5]s, %[6]s]
  - name: sampler
    rate: %[2]d
    unit: bytes
    action: shadow
    attach: endpoints
    match:
      direction: egress
      srcCIDRs: [%[5]s, %[6]s]
`, keyGlobal, samplerGlobal, remotePort, c2Port, be.Addr4, be.Addr6, consumerPort))
	r.waitHooks("tc-egress "+be.HostIf+" endpoint-in", "tc-ingress "+be.HostIf+" endpoint-out")

	// Every flow at once, at twice its key's share: the remote alone; c1
	// and c2 at the share each, twice it together in their /24 (/64).
	span := settle + rigWindow + 2*time.Second
	dst := func(p uint16) netip.AddrPort { return netip.AddrPortFrom(be.Addr(v6), p) }
	fromRemote := startStream(t, "remote -> backend (per-source, own network)", r.topo.Remote, dst(remotePort), be.NS, 2*keyShare, size, span)
	fromC1 := startStream(t, "c1 -> backend (per-source, network shared with c2)", c1.NS, dst(c1Port), be.NS, keyShare, size, span)
	fromC2 := startStream(t, "c2 -> backend (per-source, network shared with c1)", c2.NS, dst(c2Port), be.NS, keyShare, size, span)
	toC1 := startStream(t, "backend -> c1 (per-consumer)", be.NS, netip.AddrPortFrom(c1.Addr(v6), consumerPort), c1.NS, 2*keyShare, size, span)
	toC2 := startStream(t, "backend -> c2 (per-consumer)", be.NS, netip.AddrPortFrom(c2.Addr(v6), consumerPort), c2.NS, 2*keyShare, size, span)

	from := fromRemote.send.Sent().Start().Add(settle)
	to := from.Add(rigWindow)
	c0, c1s := r.window(from, to, late)

	// The receivers: per key.
	fromRemote.check(t, from, to, keyShare)
	pods := fromC1.recv.Got().Rate(from, to) + fromC2.recv.Got().Rate(from, to)
	podsOffered := fromC1.send.Sent().Rate(from, to) + fromC2.send.Sent().Rate(from, to)
	t.Logf("c1 and c2 share their network's bucket: c1 got %.0f pkt/s, c2 %.0f", fromC1.recv.Got().Rate(from, to),
		fromC2.recv.Got().Rate(from, to))
	checkNear(t, "c1 + c2 -> backend (per-source, one network): received", pods, keyShare, rigTol,
		fmt.Sprintf("pkt/s (offered %.0f)", podsOffered))
	if podsOffered < 1.3*keyShare {
		t.Errorf("c1 and c2 offered only %.0f pkt/s together against a share of %.0f", podsOffered, keyShare)
	}
	gotC1 := toC1.check(t, from, to, keyShare)
	gotC2 := toC2.check(t, from, to, keyShare)

	// The agent's counters over the same window: the keyed limits admit a
	// share per key, the sampler a share of bytes, and counts the rest as
	// would-drop.
	checkNear(t, "per-source: admitted (status, 2 keys)", counterRate(t, c0, c1s, "per-source", admittedPackets), 2*keyShare, rigTol, "pkt/s")
	checkNear(t, "per-consumer: admitted (status, 2 keys)", counterRate(t, c0, c1s, "per-consumer", admittedPackets), 2*keyShare, rigTol, "pkt/s")
	sampled := counterRate(t, c0, c1s, "sampler", admittedBytes)
	checkNear(t, "sampler: admitted (status)", sampled, float64(samplerShare), rigTol, "B/s")
	for _, name := range []string{"per-source", "per-consumer"} {
		if k := c1s.limit(t, name).Keys; k != 2 {
			t.Errorf("%s has %d buckets, want 2 (one per key)", name, k)
		}
	}
	smp := c1s.limit(t, "sampler")
	if smp.Totals.DroppedPackets != 0 || smp.Action != "shadow" {
		t.Errorf("the sampler (action %s) dropped %d packets, want a shadow limit that drops none", smp.Action,
			smp.Totals.DroppedPackets)
	}
	// Every packet the backend sent that passed was counted by the
	// sampler, as admitted or as would-drop: its would-drops are at least
	// what passed beyond its share. (It also counts as would-drop some of
	// the packets the per-consumer limit dropped: those that met it empty.)
	// It counted no more than the backend offered.
	passed := (gotC1 + gotC2) * float64(frame)
	offered := (toC1.send.Sent().Rate(from, to) + toC2.send.Sent().Rate(from, to)) * float64(frame)
	shadow := counterRate(t, c0, c1s, "sampler", shadowBytes)
	t.Logf("sampler: admitted %.0f B/s, would-drop %.0f B/s (%.0f pkt/s); the consumers received %.0f B/s of %.0f offered",
		sampled, shadow, counterRate(t, c0, c1s, "sampler", shadowPackets), passed, offered)
	if shadow < (1-rigTol)*(passed-sampled) {
		t.Errorf("the sampler counted %.0f B/s as would-drop, want at least the %.0f B/s that passed beyond what it admitted",
			shadow, passed-sampled)
	}
	if sampled+shadow > (1+rigTol)*offered {
		t.Errorf("the sampler counted %.0f B/s, more than the %.0f B/s the backend offered", sampled+shadow, offered)
	}
}
