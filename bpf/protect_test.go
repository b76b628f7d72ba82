package bpf_test

import (
	"errors"
	"net/netip"
	"testing"

	"github.com/rlagent/rlagent/maps"
)

// Protected traffic passes before any limit is looked at: a match-all limit
// at a share of 0 (which admits nothing) leaves the node's lifeline alone.
// Issue 8, item 8: before, such a limit cut the node off SSH, the kubelet and
// its API server.
func TestProtect(t *testing.T) {
	d := testDatapath(t)
	// Admits nothing, matches every packet of the direction.
	mustSet(t, d, 0, maps.Limit{})
	rules := []maps.ProtectRule{
		{Protocol: maps.TCP, LocalPorts: []maps.PortRange{{First: 22, Last: 22}}}, // SSH to the node
		{Protocol: maps.TCP, Peers: prefixes("10.9.0.1/32", "2001:db8:9::1/128"),
			RemotePorts: []maps.PortRange{{First: 6443, Last: 6443}}}, // the API server's answers
		{Peers: prefixes("fd00:aa::/64")}, // everything from a management network
	}
	if err := d.SetProtected(rules); err != nil {
		t.Fatal(err)
	}
	nodeAddresses(t, d, dst4, dst6) // the packets arrive at the node
	tiny := with(tcp4p, func(p *pkt) { p.dport = 22 }).bytes()
	tiny = patched(tiny[:ipv4Off+20+8], ipv4Off+6, 0x20, 0x00) // MF, offset 0, 8 bytes of TCP
	tiny = patched(tiny, ipv4Off+2, 0, 28)                     // total length 28

	tests := []struct {
		name      string
		packet    []byte
		protected bool
	}{
		{"ssh to the node", with(tcp4p, func(p *pkt) { p.dport = 22 }).bytes(), true},
		{"ssh over ipv6", with(tcp6p, func(p *pkt) { p.dport = 22 }).bytes(), true},
		{"tcp from port 22 is not ssh to the node", with(tcp4p, func(p *pkt) { p.sport = 22; p.dport = 40000 }).bytes(), false},
		{"udp to 22", with(udp4p, func(p *pkt) { p.dport = 22 }).bytes(), false},
		{"tcp to 23", with(tcp4p, func(p *pkt) { p.dport = 23 }).bytes(), false},
		{"api server answer", pkt{src: "10.9.0.1", dst: dst4, proto: protoTCP, sport: 6443, dport: 51000}.bytes(), true},
		{"api server answer over ipv6", pkt{src: "2001:db8:9::1", dst: dst6, proto: protoTCP, sport: 6443, dport: 51000}.bytes(), true},
		{"another host's port 6443", pkt{src: "10.9.0.2", dst: dst4, proto: protoTCP, sport: 6443, dport: 51000}.bytes(), false},
		{"the api server's other port", pkt{src: "10.9.0.1", dst: dst4, proto: protoTCP, sport: 6444, dport: 51000}.bytes(), false},
		{"management network, icmpv6", pkt{src: "fd00:aa::5", dst: dst6, proto: protoICMPv6}.bytes(), true},
		{"management network, any udp", pkt{src: "fd00:aa::5", dst: dst6, proto: protoUDP, sport: 1, dport: 9}.bytes(), true},
		{"next to the management network", pkt{src: "fd00:ab::5", dst: dst6, proto: protoICMPv6}.bytes(), false},
		// Its ports are unknown, so no port rule can name it: L4-unknown
		// packets are limited like any other (docs/datapath.md).
		{"tiny first fragment to 22", tiny, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before, g0 := mustStats(t, d, 0), mustGlobal(t, d)
			got := mustRun(t, d.Program(), tt.packet)
			after, g1 := mustStats(t, d, 0), mustGlobal(t, d)
			want, wantDrops, wantProt := uint32(xdpDrop), uint64(1), uint64(0)
			if tt.protected {
				want, wantDrops, wantProt = xdpPass, 0, 1
			}
			if got != want {
				t.Errorf("verdict %d, want %d", got, want)
			}
			if d := after.DroppedPackets - before.DroppedPackets; d != wantDrops {
				t.Errorf("the limit counted %d drops, want %d", d, wantDrops)
			}
			if p := g1.Protected - g0.Protected; p != wantProt {
				t.Errorf("protected moved by %d, want %d", p, wantProt)
			}
		})
	}

	// Later fragments follow their first: the datagram to port 22 is
	// protected whole.
	t.Run("fragments of a protected datagram", func(t *testing.T) {
		first := with(tcp4p, func(p *pkt) { p.dport = 22; p.payload = 20 }).bytes() // 40 bytes: 5 units
		first = patched(first, ipv4Off+4, 0x12, 0x34, 0x20, 0x00)                   // id 0x1234, MF
		later := with(tcp4p, func(p *pkt) { p.dport = 22; p.fragOff = 5 }).bytes()
		later = patched(later, ipv4Off+4, 0x12, 0x34)
		for _, b := range [][]byte{first, later} {
			if got := mustRun(t, d.Program(), b); got != xdpPass {
				t.Errorf("verdict %d, want pass", got)
			}
		}
	})

	// Rules are replaced whole; what goes stops being protected at once.
	if err := d.SetProtected(rules[1:]); err != nil {
		t.Fatal(err)
	}
	if got := mustRun(t, d.Program(), with(tcp4p, func(p *pkt) { p.dport = 22 }).bytes()); got != xdpDrop {
		t.Errorf("ssh after its rule went: verdict %d, want drop", got)
	}
	if got := mustRun(t, d.Program(), pkt{src: "10.9.0.1", dst: dst4, proto: protoTCP, sport: 6443, dport: 51000}.bytes()); got != xdpPass {
		t.Errorf("api server answer after another rule went: verdict %d, want pass", got)
	}
	if err := d.SetProtected(nil); err != nil {
		t.Fatal(err)
	}
	if got := mustRun(t, d.Program(), pkt{src: "10.9.0.1", dst: dst4, proto: protoTCP, sport: 6443, dport: 51000}.bytes()); got != xdpDrop {
		t.Errorf("api server answer with no rules: verdict %d, want drop", got)
	}
}

// SetProtected refuses what it cannot hold or what would protect
// everything, and leaves the rules in force as they were.
func TestProtectRejects(t *testing.T) {
	d := testDatapath(t)
	mustSet(t, d, 0, maps.Limit{})
	nodeAddresses(t, d, dst4)
	ssh := maps.ProtectRule{Protocol: maps.TCP, LocalPorts: []maps.PortRange{{First: 22, Last: 22}}}
	if err := d.SetProtected([]maps.ProtectRule{ssh}); err != nil {
		t.Fatal(err)
	}
	many := make([]maps.ProtectRule, maps.MaxProtectRules+1)
	for i := range many {
		many[i] = ssh
	}
	for _, tt := range []struct {
		name  string
		rules []maps.ProtectRule
		full  bool
	}{
		{"nothing named", []maps.ProtectRule{{Protocol: maps.TCP}}, false},
		{"every ipv4 peer without ports", []maps.ProtectRule{{Peers: prefixes("0.0.0.0/0")}}, false},
		{"every ipv6 peer without ports", []maps.ProtectRule{{Peers: prefixes("::/0")}}, false},
		{"icmp has no ports", []maps.ProtectRule{{Protocol: maps.ICMP, LocalPorts: []maps.PortRange{{First: 1, Last: 1}}}}, false},
		{"reversed range", []maps.ProtectRule{{LocalPorts: []maps.PortRange{{First: 9, Last: 8}}}}, false},
		{"more rules than the data path holds", many, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := d.SetProtected(tt.rules)
			if err == nil {
				t.Fatal("accepted")
			}
			if got := errors.Is(err, maps.ErrTableFull); got != tt.full {
				t.Errorf("%v: errors.Is(ErrTableFull) = %v, want %v", err, got, tt.full)
			}
			if got := mustRun(t, d.Program(), with(tcp4p, func(p *pkt) { p.dport = 22 }).bytes()); got != xdpPass {
				t.Errorf("ssh after a rejected change: verdict %d, want pass", got)
			}
		})
	}
}

// nodeAddresses makes addrs the node's own addresses (rl_local), as the
// agent writes them from netlink.
func nodeAddresses(tb testing.TB, d *maps.Datapath, addrs ...string) {
	tb.Helper()
	local := make(map[netip.Addr]maps.LocalKind, len(addrs))
	for _, a := range addrs {
		local[netip.MustParseAddr(a)] = maps.LocalNode
	}
	if err := d.SetLocalAddresses(local); err != nil {
		tb.Fatal(err)
	}
}

// TestProtectNodeOnly: a protect rule exempts the node's own control
// traffic only, per hook and direction. Arriving (XDP, an uplink's TC
// ingress): a packet to one of the node's addresses, not one to a local
// pod's address (on 54615ce a pod's port 22 was unlimitable). Leaving (an
// uplink's TC egress): a packet from a node address (test_run's skb has a
// socket; TestProtectEgressNeedsSocket sends real ones), not one from a
// pod's address that opened its connection from port 22 (on 54615ce it
// escaped every egress limit). At the endpoints' hooks: nothing.
func TestProtectNodeOnly(t *testing.T) {
	const node4, node6, pod4, pod6 = "10.0.0.2", "2001:db8::2", "10.244.1.5", "2001:db8:244::5"
	d := hookDatapath(t)
	if err := d.SetLocalAddresses(map[netip.Addr]maps.LocalKind{
		netip.MustParseAddr(node4): maps.LocalNode,
		netip.MustParseAddr(node6): maps.LocalNode,
		netip.MustParseAddr(pod4):  maps.LocalEndpoint,
		netip.MustParseAddr(pod6):  maps.LocalEndpoint,
	}); err != nil {
		t.Fatal(err)
	}
	for i, pr := range allProgs {
		l := maps.Limit{} // admits nothing
		l.Match.Direction = pr.hook.Direction()
		l.Match.Attach = pr.hook.Attach()
		mustSet(t, d, uint32(i), l)
	}
	if err := d.SetProtected([]maps.ProtectRule{{Protocol: maps.TCP, LocalPorts: []maps.PortRange{{First: 22, Last: 22}}}}); err != nil {
		t.Fatal(err)
	}
	in := func(dst string) []byte {
		src := "192.0.2.1"
		if netip.MustParseAddr(dst).Is6() {
			src = "2001:db8:1::1"
		}
		return pkt{src: src, dst: dst, proto: protoTCP, sport: 40000, dport: 22, tcpFlags: tcpSYN}.bytes()
	}
	out := func(src string) []byte {
		dst := "192.0.2.1"
		if netip.MustParseAddr(src).Is6() {
			dst = "2001:db8:1::1"
		}
		return pkt{src: src, dst: dst, proto: protoTCP, sport: 22, dport: 40000}.bytes()
	}
	for _, pr := range allProgs {
		ingress := pr.hook.Direction() == maps.Ingress
		uplink := pr.hook.Attach() == maps.Uplink
		for _, tc := range []struct {
			name      string
			frame     []byte
			protected bool
		}{
			{"ssh to a node address", in(node4), ingress && uplink},
			{"ssh to a node address over ipv6", in(node6), ingress && uplink},
			{"ssh to a pod", in(pod4), false},
			{"ssh to a pod over ipv6", in(pod6), false},
			{"ssh to an address not the node's", in("10.0.0.3"), false},
			{"from port 22 of a node address", out(node4), !ingress && uplink},
			{"from port 22 of a node address over ipv6", out(node6), !ingress && uplink},
			{"from port 22 of a pod", out(pod4), false},
			{"from port 22 of a pod over ipv6", out(pod6), false},
		} {
			t.Run(pr.name+"/"+tc.name, func(t *testing.T) {
				g0 := mustGlobal(t, d)
				got := pr.run(t, d, tc.frame)
				prot := mustGlobal(t, d).Protected - g0.Protected
				want, wantProt := uint32(xdpDrop), uint64(0)
				if tc.protected {
					want, wantProt = xdpPass, 1
				}
				if got != want || prot != wantProt {
					t.Errorf("verdict %d, protected counted %d; want %d, %d", got, prot, want, wantProt)
				}
			})
		}
	}
}
