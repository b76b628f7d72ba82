package maps

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"
)

// installedSet wraps limits the way SetLimit keeps them.
func installedSet(ls map[uint32]Limit) map[uint32]*installed {
	out := make(map[uint32]*installed, len(ls))
	for id, l := range ls {
		out[id] = &installed{limit: l}
	}
	return out
}

func maskOf(ids ...uint32) (m mask) {
	for _, id := range ids {
		setBit(&m, id)
	}
	return m
}

func idsOf(m mask) []uint32 {
	var ids []uint32
	for id := uint32(0); id < MaxLimits; id++ {
		if hasBit(&m, id) {
			ids = append(ids, id)
		}
	}
	return ids
}

func ports(rs ...PortRange) []PortRange { return rs }

func prefixes(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}

func TestBuildClassifier(t *testing.T) {
	limits := installedSet(map[uint32]Limit{
		3:   {Match: Match{Protocol: TCP, DstPorts: ports(PortRange{80, 81}, PortRange{443, 443}), SrcCIDRs: prefixes("10.0.0.0/8")}},
		5:   {Match: Match{Protocol: UDP, DstPorts: ports(PortRange{53, 53}), DstCIDRs: prefixes("2001:db8::/32")}},
		7:   {Match: Match{Protocol: AnyProtocol, DstPorts: ports(PortRange{1000, 1002})}},
		64:  {Match: Match{Direction: Egress, Protocol: TCP, DstPorts: ports(PortRange{80, 80})}}, // second mask word
		65:  {Match: Match{Protocol: UDP, DstPorts: ports(PortRange{0, 0}, PortRange{65535, 65535})}},
		9:   {Match: Match{Protocol: AnyProtocol}},
		10:  {Match: Match{Protocol: ICMP}},
		11:  {Match: Match{Protocol: TCP}},
		12:  {Match: Match{Direction: Egress, Protocol: UDP}},
		127: {Match: Match{Direction: Egress, SrcCIDRs: prefixes("::/0"), DstCIDRs: prefixes("0.0.0.0/0")}},
		// At the endpoints, each direction.
		20: {Match: Match{Attach: Endpoints, Protocol: ICMP}},
		21: {Match: Match{Attach: Endpoints, Direction: Egress, Protocol: UDP, DstPorts: ports(PortRange{5353, 5353})}},
		// Connections: TCP only, whatever the protocol says, and in the
		// conn mask.
		30: {Unit: Connections, Match: Match{Protocol: AnyProtocol, DstPorts: ports(PortRange{22, 22})}},
		31: {Unit: Connections, Match: Match{Attach: Endpoints, Protocol: TCP}},
	})
	c := buildClassifier(limits, nil, 42)

	wantPorts := map[int]mask{
		classTCP*portSpace + 80:    maskOf(3, 64),
		classTCP*portSpace + 81:    maskOf(3),
		classTCP*portSpace + 443:   maskOf(3),
		classTCP*portSpace + 1000:  maskOf(7),
		classTCP*portSpace + 1001:  maskOf(7),
		classTCP*portSpace + 1002:  maskOf(7),
		classTCP*portSpace + 22:    maskOf(30),
		classUDP*portSpace + 5353:  maskOf(21),
		classUDP*portSpace + 53:    maskOf(5),
		classUDP*portSpace + 1000:  maskOf(7),
		classUDP*portSpace + 1001:  maskOf(7),
		classUDP*portSpace + 1002:  maskOf(7),
		classUDP*portSpace + 0:     maskOf(65),
		classUDP*portSpace + 65535: maskOf(65),
	}
	if len(c.ports) != 2*portSpace {
		t.Fatalf("port table has %d entries, want %d", len(c.ports), 2*portSpace)
	}
	for i, got := range c.ports {
		if want := wantPorts[i]; got != want {
			t.Errorf("ports[class %d, port %d] = limits %v, want %v", i/portSpace, i%portSpace, idsOf(got), idsOf(want))
		}
	}

	wantAny := [...]mask{
		classTCP:   maskOf(9, 11, 127, 31),
		classUDP:   maskOf(9, 12, 127),
		classICMP:  maskOf(9, 10, 127, 20),
		classOther: maskOf(9, 127),
		// Every limit of the class whatever its ports: what an L4-unknown
		// packet of the class could match. The connections limits only
		// in TCP's.
		anyPort + classTCP:     maskOf(3, 7, 9, 11, 64, 127, 30, 31),
		anyPort + classUDP:     maskOf(5, 7, 9, 12, 65, 127, 21),
		anyPort + classICMP:    maskOf(9, 10, 127, 20),
		anyPort + classOther:   maskOf(9, 127),
		classUnknown:           maskOf(3, 5, 7, 9, 10, 11, 12, 64, 65, 127, 20, 21, 30, 31),
		anyPort + classUnknown: maskOf(3, 5, 7, 9, 10, 11, 12, 64, 65, 127, 20, 21, 30, 31),
	}
	for cl, want := range wantAny {
		if got := c.protoAny[cl]; got != want {
			t.Errorf("protoAny[class %d] = limits %v, want %v", cl, idsOf(got), idsOf(want))
		}
	}

	for _, tt := range []struct {
		name      string
		got, want mask
	}{
		{"hook[uplink-in]", c.cfg.Hook[UplinkIn], maskOf(3, 5, 7, 9, 10, 11, 65, 30)},
		{"hook[uplink-out]", c.cfg.Hook[UplinkOut], maskOf(12, 64, 127)},
		{"hook[endpoint-in]", c.cfg.Hook[EndpointIn], maskOf(20, 31)},
		{"hook[endpoint-out]", c.cfg.Hook[EndpointOut], maskOf(21)},
		{"conn", c.cfg.Conn, maskOf(30, 31)},
		{"src_cidr", c.cfg.SrcCidr, maskOf(3, 127)},
		{"dst_cidr", c.cfg.DstCidr, maskOf(5, 127)},
	} {
		if tt.got != tt.want {
			t.Errorf("%s = limits %v, want %v", tt.name, idsOf(tt.got), idsOf(tt.want))
		}
	}
	if c.cfg.LastGen != 42 {
		t.Errorf("last_gen = %d, want 42", c.cfg.LastGen)
	}
	wantSrc := map[netip.Prefix]mask{
		netip.MustParsePrefix("10.0.0.0/8"): maskOf(3),
		netip.MustParsePrefix("::/0"):       maskOf(127),
	}
	wantDst := map[netip.Prefix]mask{
		netip.MustParsePrefix("2001:db8::/32"): maskOf(5), // 127 has only the IPv4 default route
		netip.MustParsePrefix("0.0.0.0/0"):     maskOf(127),
	}
	checkPrefixMasks(t, "src", c.src, wantSrc)
	checkPrefixMasks(t, "dst", c.dst, wantDst)

	// No limits: every table is empty.
	empty := buildClassifier(nil, nil, 7)
	if empty.cfg.Hook != [NumHooks]mask{} || empty.cfg.Conn != (mask{}) || empty.protoAny != [len(empty.protoAny)]mask{} || len(empty.src)+len(empty.dst) != 0 {
		t.Errorf("classifier of no limits is not empty: %+v", empty.cfg)
	}
	for i, m := range empty.ports {
		if m != (mask{}) {
			t.Fatalf("classifier of no limits: ports[%d] = %v", i, idsOf(m))
		}
	}
}

func checkPrefixMasks(t *testing.T, side string, got, want map[netip.Prefix]mask) {
	t.Helper()
	for p, w := range want {
		g, ok := got[p]
		if !ok {
			t.Errorf("%s prefix %s missing, want limits %v", side, p, idsOf(w))
			continue
		}
		if g != w {
			t.Errorf("%s prefix %s = limits %v, want %v", side, p, idsOf(g), idsOf(w))
		}
	}
	for p, g := range got {
		if _, ok := want[p]; !ok {
			t.Errorf("%s prefix %s = limits %v, want no entry", side, p, idsOf(g))
		}
	}
}

func TestPrefixMasks(t *testing.T) {
	limits := installedSet(map[uint32]Limit{
		1:  {Match: Match{SrcCIDRs: prefixes("10.0.0.0/8")}},
		2:  {Match: Match{SrcCIDRs: prefixes("10.1.0.0/16", "2001:db8::/32")}},
		3:  {Match: Match{SrcCIDRs: prefixes("::/0")}},
		4:  {Match: Match{SrcCIDRs: prefixes("0.0.0.0/0"), DstCIDRs: prefixes("10.1.0.0/16")}},
		70: {Match: Match{SrcCIDRs: prefixes("10.1.2.3/8", "10.1.2.0/24")}}, // unmasked input; /24 inside its own /8
	})
	src := prefixMasks(limits, func(m *Match) []netip.Prefix { return m.SrcCIDRs })
	checkPrefixMasks(t, "src", src, map[netip.Prefix]mask{
		netip.MustParsePrefix("10.0.0.0/8"):  maskOf(1, 4, 70),
		netip.MustParsePrefix("10.1.0.0/16"): maskOf(1, 2, 4, 70), // both 10/8 and 10.1/16
		netip.MustParsePrefix("10.1.2.0/24"): maskOf(1, 2, 4, 70),
		netip.MustParsePrefix("0.0.0.0/0"):   maskOf(4), // not ::/0's limit 3
		// IPv6 entries get no IPv4 limit, even 0.0.0.0/0's.
		netip.MustParsePrefix("2001:db8::/32"): maskOf(2, 3),
		netip.MustParsePrefix("::/0"):          maskOf(3),
	})
	dst := prefixMasks(limits, func(m *Match) []netip.Prefix { return m.DstCIDRs })
	checkPrefixMasks(t, "dst", dst, map[netip.Prefix]mask{
		netip.MustParsePrefix("10.1.0.0/16"): maskOf(4), // sources do not leak into destinations
	})

	// Longest-prefix match on the result finds exactly the limits whose list
	// contains the address.
	for _, a := range []string{"10.1.2.3", "10.1.9.9", "10.2.0.1", "192.0.2.1", "2001:db8::1", "2001:db9::1"} {
		addr := netip.MustParseAddr(a)
		var best netip.Prefix
		for p := range src {
			if p.Contains(addr) && (!best.IsValid() || p.Bits() > best.Bits()) {
				best = p
			}
		}
		var want mask
		for id, in := range limits {
			for _, p := range in.limit.Match.SrcCIDRs {
				if p.Contains(addr) {
					setBit(&want, id)
				}
			}
		}
		if got := src[best]; got != want {
			t.Errorf("LPM(%s) -> %s = limits %v, want %v", a, best, idsOf(got), idsOf(want))
		}
	}
}

// canonPorts merges ranges into the sorted, disjoint, non-adjacent form.
func canonPorts(rs []PortRange) []PortRange {
	var in [portSpace + 1]bool
	for _, r := range rs {
		for p := int(r.First); p <= int(r.Last); p++ {
			in[p] = true
		}
	}
	var out []PortRange
	for p := 0; p < portSpace; p++ {
		if in[p] && (p == 0 || !in[p-1]) {
			q := p
			for in[q+1] {
				q++
			}
			out = append(out, PortRange{uint16(p), uint16(q)})
		}
	}
	return out
}

// canonPrefixes drops prefixes covered by another one of the list and sorts
// the rest by address.
func canonPrefixes(ps []netip.Prefix) []netip.Prefix {
	sorted := slices.Clone(ps)
	slices.SortFunc(sorted, func(a, b netip.Prefix) int { return a.Bits() - b.Bits() })
	var out []netip.Prefix
	for _, p := range sorted {
		p = p.Masked()
		if !slices.ContainsFunc(out, func(q netip.Prefix) bool { return q.Contains(p.Addr()) }) {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) })
	return out
}

// canonMatch is the form matchOf returns for an equivalent match.
func canonMatch(m Match) Match {
	return Match{
		Attach:    m.Attach,
		Direction: m.Direction,
		Protocol:  m.Protocol,
		DstPorts:  canonPorts(m.DstPorts),
		SrcCIDRs:  canonPrefixes(m.SrcCIDRs),
		DstCIDRs:  canonPrefixes(m.DstCIDRs),
	}
}

func matchString(m Match) string {
	return fmt.Sprintf("{attach %d dir %d proto %d ports %v src %v dst %v}", m.Attach, m.Direction, m.Protocol, m.DstPorts, m.SrcCIDRs, m.DstCIDRs)
}

func TestMatchOf(t *testing.T) {
	tests := map[uint32]struct{ in, want Match }{
		0: {in: Match{Protocol: AnyProtocol}, want: Match{Protocol: AnyProtocol}},
		1: {in: Match{Protocol: TCP}, want: Match{Protocol: TCP}},
		2: {in: Match{Protocol: UDP, Direction: Egress}, want: Match{Protocol: UDP, Direction: Egress}},
		3: {in: Match{Protocol: ICMP}, want: Match{Protocol: ICMP}},
		// Overlapping and adjacent ranges merge; a gap splits.
		4: {
			in:   Match{Protocol: TCP, DstPorts: ports(PortRange{443, 443}, PortRange{80, 81}, PortRange{82, 90}, PortRange{85, 100})},
			want: Match{Protocol: TCP, DstPorts: ports(PortRange{80, 100}, PortRange{443, 443})},
		},
		// Ports at both ends of the space, on both protocols.
		5: {
			in:   Match{Protocol: AnyProtocol, DstPorts: ports(PortRange{65000, 65535}, PortRange{0, 0})},
			want: Match{Protocol: AnyProtocol, DstPorts: ports(PortRange{0, 0}, PortRange{65000, 65535})},
		},
		6: {
			in:   Match{Protocol: UDP, DstPorts: ports(PortRange{0, 65535})},
			want: Match{Protocol: UDP, DstPorts: ports(PortRange{0, 65535})},
		},
		// CIDRs inside another CIDR of the same limit fold into it; a CIDR of
		// another limit (id 8) inside this limit's does not show up.
		7: {
			in: Match{
				SrcCIDRs: prefixes("10.1.0.0/16", "2001:db8:1::/48", "10.0.0.0/8", "192.168.1.0/24", "2001:db8::/32"),
				DstCIDRs: prefixes("0.0.0.0/0", "::/0"),
			},
			want: Match{
				SrcCIDRs: prefixes("10.0.0.0/8", "192.168.1.0/24", "2001:db8::/32"),
				DstCIDRs: prefixes("0.0.0.0/0", "::/0"),
			},
		},
		8: {
			in:   Match{Protocol: TCP, DstPorts: ports(PortRange{81, 81}), SrcCIDRs: prefixes("10.2.3.0/24", "10.1.0.0/16", "172.16.0.0/12")},
			want: Match{Protocol: TCP, DstPorts: ports(PortRange{81, 81}), SrcCIDRs: prefixes("10.1.0.0/16", "10.2.3.0/24", "172.16.0.0/12")},
		},
		100: {
			in:   Match{Direction: Egress, Protocol: UDP, DstPorts: ports(PortRange{53, 53}), DstCIDRs: prefixes("2001:db8::/32")},
			want: Match{Direction: Egress, Protocol: UDP, DstPorts: ports(PortRange{53, 53}), DstCIDRs: prefixes("2001:db8::/32")},
		},
		// Each hook reads back as its attach point and direction.
		101: {in: Match{Attach: Endpoints, Protocol: UDP}, want: Match{Attach: Endpoints, Protocol: UDP}},
		102: {in: Match{Attach: Endpoints, Direction: Egress, Protocol: TCP}, want: Match{Attach: Endpoints, Direction: Egress, Protocol: TCP}},
		// A connections limit of any protocol sees TCP only, and reads
		// back so (limit 103 has unit connections below).
		103: {
			in:   Match{Attach: Endpoints, Protocol: AnyProtocol, DstPorts: ports(PortRange{22, 22})},
			want: Match{Attach: Endpoints, Protocol: TCP, DstPorts: ports(PortRange{22, 22})},
		},
	}
	ls := make(map[uint32]Limit)
	for id, tt := range tests {
		ls[id] = Limit{Match: tt.in}
	}
	ls[103] = Limit{Unit: Connections, Match: tests[103].in}
	c := buildClassifier(installedSet(ls), nil, 1)
	for id, tt := range tests {
		if got := c.matchOf(id); matchString(got) != matchString(tt.want) {
			t.Errorf("limit %d: matchOf = %s, want %s", id, matchString(got), matchString(tt.want))
		}
	}
	if got := c.matchOf(50); matchString(got) != matchString(Match{}) {
		t.Errorf("matchOf(no such limit) = %s, want the zero match", matchString(got))
	}
}

// TestMatchOfRandom round-trips random sets of limits whose ports and CIDRs
// overlap within and across limits.
func TestMatchOfRandom(t *testing.T) {
	pool := prefixes("0.0.0.0/0", "10.0.0.0/8", "10.1.0.0/16", "10.1.2.0/24", "10.1.2.3/32", "10.2.0.0/16",
		"192.168.0.0/16", "192.168.1.0/24", "::/0", "2001:db8::/32", "2001:db8:1::/48", "2001:db8:1:2::/64", "fd00::/8")
	r := rand.New(rand.NewPCG(5, 6))
	randPorts := func() []PortRange {
		var out []PortRange
		for range r.IntN(4) {
			base := []int{0, 50, 65500}[r.IntN(3)]
			a, b := base+r.IntN(36), base+r.IntN(36)
			out = append(out, PortRange{uint16(min(a, b)), uint16(max(a, b))})
		}
		return out
	}
	randPrefixes := func() []netip.Prefix {
		var out []netip.Prefix
		for range r.IntN(4) {
			out = append(out, pool[r.IntN(len(pool))])
		}
		return out
	}
	for round := range 20 {
		ls := make(map[uint32]Limit)
		for range 1 + r.IntN(30) {
			m := Match{
				Attach:    Attach(r.IntN(2)),
				Direction: Direction(r.IntN(2)),
				Protocol:  Protocol(r.IntN(4)),
				SrcCIDRs:  randPrefixes(),
				DstCIDRs:  randPrefixes(),
			}
			if m.Protocol != ICMP {
				m.DstPorts = randPorts()
			}
			ls[uint32(r.IntN(int(MaxLimits)))] = Limit{Match: m}
		}
		c := buildClassifier(installedSet(ls), nil, 1)
		for id, l := range ls {
			got, want := matchString(c.matchOf(id)), matchString(canonMatch(l.Match))
			if got != want {
				t.Fatalf("round %d, limit %d of %s: matchOf = %s, want %s", round, id, matchString(l.Match), got, want)
			}
		}
	}
}

// The config apply writes before the tables change: a limit that moves to
// another hook is at neither while the tables change, never at both (so no
// packet is charged at two hooks for it); one that becomes a connections
// limit (or stops being one) is at no hook meanwhile; one that stays, stays.
func TestInterimConfig(t *testing.T) {
	cur := buildClassifier(installedSet(map[uint32]Limit{
		1: {Match: Match{Protocol: UDP}},                                       // moves to the endpoints
		2: {Match: Match{Attach: Endpoints, Direction: Egress}},                // stays
		3: {Match: Match{Direction: Egress}},                                   // goes
		5: {Match: Match{Protocol: TCP}},                                       // becomes a connections limit
		6: {Unit: Connections, Match: Match{Attach: Endpoints}},                // stays a connections limit
		7: {Match: Match{Attach: Endpoints, SrcCIDRs: prefixes("10.0.0.0/8")}}, // loses its CIDRs
	}), nil, 1)
	next := buildClassifier(installedSet(map[uint32]Limit{
		1: {Match: Match{Attach: Endpoints, Protocol: UDP}},
		2: {Match: Match{Attach: Endpoints, Direction: Egress}},
		4: {Match: Match{Direction: Egress, DstCIDRs: prefixes("10.0.0.0/8")}}, // comes
		5: {Unit: Connections, Match: Match{Protocol: TCP}},
		6: {Unit: Connections, Match: Match{Attach: Endpoints}},
		7: {Match: Match{Attach: Endpoints}},
	}), nil, 1)
	in := interimConfig(&cur.cfg, &next.cfg)
	for h, want := range map[Hook]mask{
		UplinkIn:    {},
		UplinkOut:   {},
		EndpointIn:  maskOf(6, 7),
		EndpointOut: maskOf(2),
	} {
		if got := in.Hook[h]; got != want {
			t.Errorf("interim hook[%v] = limits %v, want %v", h, idsOf(got), idsOf(want))
		}
	}
	for i := range in.Hook {
		for j := i + 1; j < len(in.Hook); j++ {
			if both := and(in.Hook[i], in.Hook[j]); both != (mask{}) {
				t.Errorf("limits %v at hooks %v and %v at once", idsOf(both), Hook(i), Hook(j))
			}
		}
	}
	if got, want := in.Conn, maskOf(5, 6); got != want {
		t.Errorf("interim conn = limits %v, want %v", idsOf(got), idsOf(want))
	}
	if got, want := in.SrcCidr, maskOf(7); got != want {
		t.Errorf("interim src_cidr = limits %v, want %v (restricted until its prefixes are gone)", idsOf(got), idsOf(want))
	}
	if got, want := in.DstCidr, maskOf(4); got != want {
		t.Errorf("interim dst_cidr = limits %v, want %v", idsOf(got), idsOf(want))
	}
}

// TestHeads4Random: for random sets of nested IPv4 and IPv6 prefixes, the
// first stage answers for every /16 exactly the limits whose prefixes
// contain its addresses when no longer prefix lies in it, and is deep
// exactly when one does.
func TestHeads4Random(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	out := make([]head4, head4Entries)
	for round := range 50 {
		ls := map[uint32]Limit{}
		var all []netip.Prefix
		for id := range uint32(1 + r.IntN(12)) {
			var ps []netip.Prefix
			for range 1 + r.IntN(3) {
				var p netip.Prefix
				if r.IntN(8) == 0 {
					var a [16]byte
					a[0], a[1] = 0x20, 0x01
					p = netip.PrefixFrom(netip.AddrFrom16(a), r.IntN(129)).Masked()
				} else {
					// Mostly inside 10/8, to nest.
					v := r.Uint32()
					if r.IntN(2) == 0 {
						v = 10<<24 | v&0x00ffffff
					}
					a := netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
					p = netip.PrefixFrom(a, r.IntN(33)).Masked()
				}
				ps = append(ps, p)
				all = append(all, p)
			}
			ls[id] = Limit{Match: Match{SrcCIDRs: ps}}
		}
		heads4(prefixMasks(installedSet(ls), func(m *Match) []netip.Prefix { return m.SrcCIDRs }), out)
		for i := range head4Entries {
			block := netip.PrefixFrom(netip.AddrFrom4([4]byte{byte(i >> 8), byte(i)}), 16)
			deep := false
			for _, p := range all {
				deep = deep || p.Addr().Is4() && p.Bits() > 16 && block.Contains(p.Addr())
			}
			if got := out[i].Deep == 1; got != deep {
				t.Fatalf("round %d: %s deep %v, want %v (prefixes %v)", round, block, got, deep, all)
			}
			if deep {
				continue
			}
			var want mask
			for id, l := range ls {
				for _, p := range l.Match.SrcCIDRs {
					if p.Addr().Is4() && p.Bits() <= 16 && p.Contains(block.Addr()) {
						setBit(&want, id)
					}
				}
			}
			if out[i].M != want {
				t.Fatalf("round %d: %s answers limits %v, want %v (prefixes %v)", round, block, idsOf(out[i].M), idsOf(want), all)
			}
		}
	}
}
