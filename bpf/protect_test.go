package bpf_test

import (
	"errors"
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
