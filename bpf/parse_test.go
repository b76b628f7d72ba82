package bpf_test

import (
	"encoding/binary"
	"errors"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/maps"
)

// The tests in this file see the parser and the classifier through the
// counters. Every limit has rate 0 ("admits nothing"): its bucket is empty
// for good, so a packet that parses and matches it is dropped and counted in
// its dropped_packets, every time and in any order, while a packet that does
// not parse or matches nothing passes and moves no counter.

const (
	src4 = "10.0.0.1"
	dst4 = "10.0.0.2"
	src6 = "2001:db8::1"
	dst6 = "2001:db8::2"
)

// empty is a limit on m whose bucket never holds a token.
func empty(m maps.Match) maps.Limit {
	return maps.Limit{Rate: 0, Burst: 0, Match: m}
}

func prefixes(s ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(s))
	for i, p := range s {
		out[i] = netip.MustParsePrefix(p)
	}
	return out
}

func ports(r ...uint16) []maps.PortRange {
	out := make([]maps.PortRange, 0, len(r)/2)
	for i := 0; i+1 < len(r); i += 2 {
		out = append(out, maps.PortRange{First: r[i], Last: r[i+1]})
	}
	return out
}

// install replaces the limits of d with limits.
func install(tb testing.TB, d *maps.Datapath, limits map[uint32]maps.Limit) {
	tb.Helper()
	for _, id := range d.IDs() {
		if err := d.DeleteLimit(id); err != nil {
			tb.Fatalf("delete limit %d: %v", id, err)
		}
	}
	for id, l := range limits {
		mustSet(tb, d, id, l)
	}
}

type counters struct {
	ids      []uint32 // ascending
	limits   map[uint32]maps.Stats
	overflow uint64
}

func snapshot(tb testing.TB, d *maps.Datapath) counters {
	tb.Helper()
	c := counters{ids: d.IDs(), limits: make(map[uint32]maps.Stats)}
	for _, id := range c.ids {
		c.limits[id] = mustStats(tb, d, id)
	}
	g, err := d.GlobalStats()
	if err != nil {
		tb.Fatal(err)
	}
	c.overflow = g.MatchOverflow
	return c
}

// checkDropped fails tb unless, from before to after, exactly the limits in
// hit counted one dropped packet of n bytes, no limit counted anything else,
// and match_overflow moved by overflow.
func checkDropped(tb testing.TB, before, after counters, hit []uint32, n int, overflow uint64) {
	tb.Helper()
	for _, id := range after.ids {
		a, b := after.limits[id], before.limits[id]
		want := maps.Stats{}
		if slices.Contains(hit, id) {
			want = maps.Stats{DroppedPackets: 1, DroppedBytes: uint64(n)}
		}
		got := maps.Stats{
			AdmittedPackets: a.AdmittedPackets - b.AdmittedPackets,
			AdmittedBytes:   a.AdmittedBytes - b.AdmittedBytes,
			DroppedPackets:  a.DroppedPackets - b.DroppedPackets,
			DroppedBytes:    a.DroppedBytes - b.DroppedBytes,
			ShadowPackets:   a.ShadowPackets - b.ShadowPackets,
			ShadowBytes:     a.ShadowBytes - b.ShadowBytes,
			NewKeys:         a.NewKeys - b.NewKeys,
			ReturnedKeys:    a.ReturnedKeys - b.ReturnedKeys,
		}
		if got != want {
			tb.Errorf("limit %d counted %s, want %s", id, nonzero(got), nonzero(want))
		}
	}
	if got := after.overflow - before.overflow; got != overflow {
		tb.Errorf("match_overflow moved by %d, want %d", got, overflow)
	}
}

// nonzero prints the counters of s that are not zero.
func nonzero(s maps.Stats) string {
	var out []string
	for _, f := range []struct {
		name string
		v    uint64
	}{
		{"admitted", s.AdmittedPackets}, {"admitted_bytes", s.AdmittedBytes},
		{"dropped", s.DroppedPackets}, {"dropped_bytes", s.DroppedBytes},
		{"shadow", s.ShadowPackets}, {"shadow_bytes", s.ShadowBytes},
		{"new_keys", s.NewKeys}, {"returned_keys", s.ReturnedKeys},
	} {
		if f.v != 0 {
			out = append(out, f.name+"="+strconv.FormatUint(f.v, 10))
		}
	}
	if len(out) == 0 {
		return "nothing"
	}
	return strings.Join(out, " ")
}

// Probe limits of TestParse: which of them a packet hits tells what the
// parser read of it.
const (
	pAny   uint32 = iota // any protocol: every packet that parses as IP
	pUDP                 // UDP, any port: also non-first fragments
	pTCP                 // TCP, any port
	pICMP                // ICMP and ICMPv6
	pUDP53               // UDP to port 53: the UDP header was read
	pTCP80               // TCP to port 80: the TCP header was read
	pAddr4               // 10.0.0.1 -> 10.0.0.2: IPv4 addresses read at the right offset
	pAddr6               // 2001:db8::1 -> 2001:db8::2: IPv6 addresses read at the right offset
)

func probeLimits() map[uint32]maps.Limit {
	return map[uint32]maps.Limit{
		pAny:   empty(maps.Match{}),
		pUDP:   empty(maps.Match{Protocol: maps.UDP}),
		pTCP:   empty(maps.Match{Protocol: maps.TCP}),
		pICMP:  empty(maps.Match{Protocol: maps.ICMP}),
		pUDP53: empty(maps.Match{Protocol: maps.UDP, DstPorts: ports(53, 53)}),
		pTCP80: empty(maps.Match{Protocol: maps.TCP, DstPorts: ports(80, 80)}),
		pAddr4: empty(maps.Match{SrcCIDRs: prefixes(src4 + "/32"), DstCIDRs: prefixes(dst4 + "/32")}),
		pAddr6: empty(maps.Match{SrcCIDRs: prefixes(src6 + "/128"), DstCIDRs: prefixes(dst6 + "/128")}),
	}
}

// What the probe limits see of a whole packet of each kind.
var (
	hitUDP4  = []uint32{pAny, pUDP, pUDP53, pAddr4}
	hitTCP4  = []uint32{pAny, pTCP, pTCP80, pAddr4}
	hitICMP4 = []uint32{pAny, pICMP, pAddr4}
	hitUDP6  = []uint32{pAny, pUDP, pUDP53, pAddr6}
	hitTCP6  = []uint32{pAny, pTCP, pTCP80, pAddr6}
	hitICMP6 = []uint32{pAny, pICMP, pAddr6}
)

var (
	udp4p  = pkt{src: src4, dst: dst4, proto: protoUDP, sport: 40000, dport: 53}
	tcp4p  = pkt{src: src4, dst: dst4, proto: protoTCP, sport: 40000, dport: 80}
	icmp4p = pkt{src: src4, dst: dst4, proto: protoICMP}
	udp6p  = pkt{src: src6, dst: dst6, proto: protoUDP, sport: 40000, dport: 53}
	tcp6p  = pkt{src: src6, dst: dst6, proto: protoTCP, sport: 40000, dport: 80}
	icmp6p = pkt{src: src6, dst: dst6, proto: protoICMPv6}
)

// with returns a copy of p changed by f.
func with(p pkt, f func(*pkt)) pkt {
	f(&p)
	return p
}

// patched returns a copy of b with bytes v at off.
func patched(b []byte, off int, v ...byte) []byte {
	b = slices.Clone(b)
	copy(b[off:], v)
	return b
}

// ethFrame is an untagged frame of etype with n zero bytes after the header.
func ethFrame(etype uint16, n int) []byte {
	b := make([]byte, 14+n)
	b[0], b[6] = 0x02, 0x02
	binary.BigEndian.PutUint16(b[12:], etype)
	return b
}

const (
	ipv4Off  = 14 // IPv4 header of an untagged frame
	ipv6Ext0 = 54 // first IPv6 extension header of an untagged frame
)

func TestParse(t *testing.T) {
	d := testDatapath(t)
	install(t, d, probeLimits())

	type tc struct {
		name    string
		packet  []byte
		verdict uint32
		hit     []uint32 // probe limits that count the packet as dropped
	}
	tests := []tc{
		// IPv4.
		{"ipv4 udp", udp4p.bytes(), xdpDrop, hitUDP4},
		{"ipv4 udp other port", with(udp4p, func(p *pkt) { p.dport = 54 }).bytes(), xdpDrop, []uint32{pAny, pUDP, pAddr4}},
		{"ipv4 tcp", tcp4p.bytes(), xdpDrop, hitTCP4},
		{"ipv4 tcp other port", with(tcp4p, func(p *pkt) { p.dport = 81 }).bytes(), xdpDrop, []uint32{pAny, pTCP, pAddr4}},
		{"ipv4 icmp", icmp4p.bytes(), xdpDrop, hitICMP4},
		{"ipv4 gre is protocol other", pkt{src: src4, dst: dst4, proto: protoGRE}.bytes(), xdpDrop, []uint32{pAny, pAddr4}},
		{"ipv4 udp with payload", with(udp4p, func(p *pkt) { p.payload = 100 }).bytes(), xdpDrop, hitUDP4},
		// DF and MF set, offset 0: a first fragment, which has its L4 header.
		{"ipv4 first fragment, DF|MF", patched(udp4p.bytes(), ipv4Off+6, 0x60, 0x00), xdpDrop, hitUDP4},
		// Reserved flag and DF set, offset 0: flags are not offset bits.
		{"ipv4 flags only", patched(tcp4p.bytes(), ipv4Off+6, 0xc0, 0x00), xdpDrop, hitTCP4},
		// No L4 header: the protocol matches, ports do not.
		{"ipv4 non-first fragment udp", with(udp4p, func(p *pkt) { p.fragOff = 185 }).bytes(), xdpDrop, []uint32{pAny, pUDP, pAddr4}},
		{"ipv4 non-first fragment tcp", with(tcp4p, func(p *pkt) { p.fragOff = 1 }).bytes(), xdpDrop, []uint32{pAny, pTCP, pAddr4}},
		{"ipv4 non-first fragment offset 0x1fff", with(udp4p, func(p *pkt) { p.fragOff = 0x1fff }).bytes(), xdpDrop, []uint32{pAny, pUDP, pAddr4}},
		{"ipv4 non-first fragment icmp", with(icmp4p, func(p *pkt) { p.fragOff = 3 }).bytes(), xdpDrop, []uint32{pAny, pICMP, pAddr4}},
		// A non-first fragment needs no bytes after the IP header.
		{"ipv4 non-first fragment, no l4 bytes", with(udp4p, func(p *pkt) { p.fragOff = 185 }).bytes()[:ipv4Off+20], xdpDrop, []uint32{pAny, pUDP, pAddr4}},
		{"ipv4 ihl 4", patched(udp4p.bytes(), ipv4Off, 0x44), xdpPass, nil},
		{"ipv4 ihl 0", patched(udp4p.bytes(), ipv4Off, 0x40), xdpPass, nil},
		// 20 + 8 bytes after the Ethernet header, ihl says 60.
		{"ipv4 ihl past the end", patched(udp4p.bytes(), ipv4Off, 0x4f), xdpPass, nil},
		{"ipv4 ethertype, version 6", patched(udp4p.bytes(), ipv4Off, 0x65), xdpPass, nil},

		// IPv6.
		{"ipv6 udp", udp6p.bytes(), xdpDrop, hitUDP6},
		{"ipv6 udp other port", with(udp6p, func(p *pkt) { p.dport = 52 }).bytes(), xdpDrop, []uint32{pAny, pUDP, pAddr6}},
		{"ipv6 tcp", tcp6p.bytes(), xdpDrop, hitTCP6},
		{"ipv6 icmpv6", icmp6p.bytes(), xdpDrop, hitICMP6},
		// ICMP (1) in an IPv6 header is not ICMPv6, but the classifier has
		// one class for both.
		{"ipv6 next header 1", pkt{src: src6, dst: dst6, proto: protoICMP}.bytes(), xdpDrop, hitICMP6},
		{"ipv6 gre is protocol other", pkt{src: src6, dst: dst6, proto: protoGRE}.bytes(), xdpDrop, []uint32{pAny, pAddr6}},
		{"ipv6 no next header (59)", pkt{src: src6, dst: dst6, proto: 59}.bytes(), xdpDrop, []uint32{pAny, pAddr6}},
		{"ipv6 hop-by-hop", with(udp6p, func(p *pkt) { p.ext = []uint8{0} }).bytes(), xdpDrop, hitUDP6},
		{"ipv6 routing", with(tcp6p, func(p *pkt) { p.ext = []uint8{43} }).bytes(), xdpDrop, hitTCP6},
		{"ipv6 destination options", with(udp6p, func(p *pkt) { p.ext = []uint8{60} }).bytes(), xdpDrop, hitUDP6},
		{"ipv6 first fragment", with(udp6p, func(p *pkt) { p.ext = []uint8{44} }).bytes(), xdpDrop, hitUDP6},
		// M flag set, offset 0.
		{"ipv6 first fragment, M", patched(with(tcp6p, func(p *pkt) { p.ext = []uint8{44} }).bytes(), ipv6Ext0+3, 0x01), xdpDrop, hitTCP6},
		{"ipv6 ah", with(udp6p, func(p *pkt) { p.ext = []uint8{51} }).bytes(), xdpDrop, hitUDP6},
		{"ipv6 icmpv6 after ah", with(icmp6p, func(p *pkt) { p.ext = []uint8{51} }).bytes(), xdpDrop, hitICMP6},
		// An extension header of hdrlen 0 is 8 bytes long, not 16.
		{"ipv6 hop-by-hop hdrlen 0", ipv6HopByHop8(udp6p), xdpDrop, hitUDP6},
		{"ipv6 chain of 2", with(udp6p, func(p *pkt) { p.ext = []uint8{0, 60} }).bytes(), xdpDrop, hitUDP6},
		{"ipv6 chain of 5", with(tcp6p, func(p *pkt) { p.ext = []uint8{0, 43, 44, 51, 60} }).bytes(), xdpDrop, hitTCP6},
		// RL_MAX_EXTHDRS is 6: six extension headers are followed.
		{"ipv6 chain of 6", with(udp6p, func(p *pkt) { p.ext = []uint8{0, 60, 43, 44, 51, 60} }).bytes(), xdpDrop, hitUDP6},
		{"ipv6 chain of 7", with(udp6p, func(p *pkt) { p.ext = []uint8{0, 60, 43, 44, 51, 60, 60} }).bytes(), xdpPass, nil},
		{"ipv6 chain of 8", with(udp6p, func(p *pkt) { p.ext = []uint8{0, 60, 43, 43, 44, 51, 51, 60} }).bytes(), xdpPass, nil},
		{"ipv6 non-first fragment udp", with(udp6p, func(p *pkt) { p.ext = []uint8{44}; p.fragOff = 100 }).bytes(), xdpDrop, []uint32{pAny, pUDP, pAddr6}},
		{"ipv6 non-first fragment tcp after hop-by-hop", with(tcp6p, func(p *pkt) { p.ext = []uint8{0, 44}; p.fragOff = 1 }).bytes(), xdpDrop, []uint32{pAny, pTCP, pAddr6}},
		{"ipv6 non-first fragment offset 0x1fff", with(udp6p, func(p *pkt) { p.ext = []uint8{44}; p.fragOff = 0x1fff }).bytes(), xdpDrop, []uint32{pAny, pUDP, pAddr6}},
		{"ipv6 non-first fragment icmpv6", with(icmp6p, func(p *pkt) { p.ext = []uint8{44}; p.fragOff = 7 }).bytes(), xdpDrop, []uint32{pAny, pICMP, pAddr6}},
		{"ipv6 non-first fragment, no l4 bytes", with(udp6p, func(p *pkt) { p.ext = []uint8{44}; p.fragOff = 100 }).bytes()[:ipv6Ext0+8], xdpDrop, []uint32{pAny, pUDP, pAddr6}},
		{"ipv6 ethertype, version 4", patched(udp6p.bytes(), 14, 0x45), xdpPass, nil},

		// VLANs.
		{"802.1Q ipv4 udp", with(udp4p, func(p *pkt) { p.vlans = []uint16{100} }).bytes(), xdpDrop, hitUDP4},
		{"802.1Q ipv6 tcp", with(tcp6p, func(p *pkt) { p.vlans = []uint16{100} }).bytes(), xdpDrop, hitTCP6},
		{"802.1ad alone", patched(with(udp4p, func(p *pkt) { p.vlans = []uint16{100} }).bytes(), 12, 0x88, 0xa8), xdpDrop, hitUDP4},
		{"qinq ipv4 udp", with(udp4p, func(p *pkt) { p.vlans = []uint16{100, 200} }).bytes(), xdpDrop, hitUDP4},
		{"qinq ipv6 udp with extension headers", with(udp6p, func(p *pkt) { p.vlans = []uint16{100, 200}; p.ext = []uint8{0, 44} }).bytes(), xdpDrop, hitUDP6},
		{"qinq ipv4 non-first fragment", with(udp4p, func(p *pkt) { p.vlans = []uint16{1, 2}; p.fragOff = 9 }).bytes(), xdpDrop, []uint32{pAny, pUDP, pAddr4}},
		{"802.1Q in 802.1Q", patched(with(icmp4p, func(p *pkt) { p.vlans = []uint16{100, 200} }).bytes(), 12, 0x81, 0x00), xdpDrop, hitICMP4},
		{"3 vlan tags ipv4", with(udp4p, func(p *pkt) { p.vlans = []uint16{1, 2, 3} }).bytes(), xdpPass, nil},
		{"3 vlan tags ipv6", with(tcp6p, func(p *pkt) { p.vlans = []uint16{1, 2, 3} }).bytes(), xdpPass, nil},

		// Not IP.
		{"arp", ethFrame(0x0806, 28), xdpPass, nil},
		{"arp in 802.1Q", patched(with(udp4p, func(p *pkt) { p.vlans = []uint16{100} }).bytes(), 16, 0x08, 0x06), xdpPass, nil},
		{"lldp", ethFrame(0x88cc, 46), xdpPass, nil},
		{"802.3 length field", ethFrame(0x0040, 64), xdpPass, nil},
		{"ethernet header only", ethFrame(ethIPv4, 0), xdpPass, nil},
	}
	// Every IPv4 header length with options: the ports are read after them
	// (the NOP options, read as a UDP header, would be port 0x0101).
	for ihl := 6; ihl <= 15; ihl++ {
		tests = append(tests, tc{
			"ipv4 udp ihl " + strconv.Itoa(ihl),
			with(udp4p, func(p *pkt) { p.ipOpts = 4 * (ihl - 5) }).bytes(),
			xdpDrop, hitUDP4,
		})
	}

	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := snapshot(t, d)
			if got := mustRun(t, d.Program(), tt.packet); got != tt.verdict {
				t.Errorf("verdict %d, want %d", got, tt.verdict)
			}
			checkDropped(t, before, snapshot(t, d), tt.hit, len(tt.packet), 0)
		})
	}
}

// ipv6HopByHop8 is p with a hop-by-hop header of hdrlen 0 (8 bytes), which
// the pkt builder does not make.
func ipv6HopByHop8(p pkt) []byte {
	b := p.bytes()
	out := slices.Concat(b[:ipv6Ext0], []byte{p.proto, 0, 1, 4, 0, 0, 0, 0}, b[ipv6Ext0:])
	out[14+6] = 0 // next header: hop-by-hop
	binary.BigEndian.PutUint16(out[14+4:], binary.BigEndian.Uint16(out[14+4:])+8)
	return out
}

func TestParseMatch(t *testing.T) {
	d := testDatapath(t)

	type packet struct {
		name     string
		packet   []byte
		hit      []uint32 // limits that count it; the verdict is drop if any
		overflow uint64   // match_overflow
	}
	u4 := func(src, dst string, dport uint16) []byte {
		return pkt{src: src, dst: dst, proto: protoUDP, sport: 1, dport: dport}.bytes()
	}
	t4 := func(src, dst string, dport uint16) []byte {
		return pkt{src: src, dst: dst, proto: protoTCP, sport: 1, dport: dport}.bytes()
	}
	allAny := func(ids ...uint32) map[uint32]maps.Limit {
		m := make(map[uint32]maps.Limit)
		for _, id := range ids {
			m[id] = empty(maps.Match{})
		}
		return m
	}
	tests := []struct {
		name    string
		limits  map[uint32]maps.Limit
		packets []packet
	}{
		{
			name: "port range",
			limits: map[uint32]maps.Limit{
				0: empty(maps.Match{Protocol: maps.UDP, DstPorts: ports(1000, 2000)}),
				1: empty(maps.Match{Protocol: maps.TCP, DstPorts: ports(1000, 2000)}),
			},
			packets: []packet{
				{"udp 999", u4(src4, dst4, 999), nil, 0},
				{"udp 1000", u4(src4, dst4, 1000), []uint32{0}, 0},
				{"udp 1500", u4(src4, dst4, 1500), []uint32{0}, 0},
				{"udp 2000", u4(src4, dst4, 2000), []uint32{0}, 0},
				{"udp 2001", u4(src4, dst4, 2001), nil, 0},
				{"tcp 999", t4(src4, dst4, 999), nil, 0},
				{"tcp 1000", t4(src4, dst4, 1000), []uint32{1}, 0},
				{"tcp 2000 ipv6", pkt{src: src6, dst: dst6, proto: protoTCP, dport: 2000}.bytes(), []uint32{1}, 0},
				{"tcp 2001 ipv6", pkt{src: src6, dst: dst6, proto: protoTCP, dport: 2001}.bytes(), nil, 0},
				{"icmp", icmp4p.bytes(), nil, 0},
			},
		},
		{
			name: "several ranges and the ends of the port space",
			limits: map[uint32]maps.Limit{
				0: empty(maps.Match{Protocol: maps.UDP, DstPorts: ports(53, 53, 8000, 8080)}),
				1: empty(maps.Match{Protocol: maps.UDP, DstPorts: ports(0, 0, 65535, 65535)}),
				2: empty(maps.Match{Protocol: maps.TCP, DstPorts: ports(0, 65535)}),
			},
			packets: []packet{
				{"udp 52", u4(src4, dst4, 52), nil, 0},
				{"udp 53", u4(src4, dst4, 53), []uint32{0}, 0},
				{"udp 54", u4(src4, dst4, 54), nil, 0},
				{"udp 7999", u4(src4, dst4, 7999), nil, 0},
				{"udp 8080", u4(src4, dst4, 8080), []uint32{0}, 0},
				{"udp 8081", u4(src4, dst4, 8081), nil, 0},
				{"udp 0", u4(src4, dst4, 0), []uint32{1}, 0},
				{"udp 1", u4(src4, dst4, 1), nil, 0},
				{"udp 65534", u4(src4, dst4, 65534), nil, 0},
				{"udp 65535", u4(src4, dst4, 65535), []uint32{1}, 0},
				{"tcp 0", t4(src4, dst4, 0), []uint32{2}, 0},
				{"tcp 65535", t4(src4, dst4, 65535), []uint32{2}, 0},
				// All ports is not the protocol alone: a fragment has no port.
				{"tcp non-first fragment", with(tcp4p, func(p *pkt) { p.fragOff = 10 }).bytes(), nil, 0},
			},
		},
		{
			name: "protocols",
			limits: map[uint32]maps.Limit{
				0: empty(maps.Match{Protocol: maps.AnyProtocol}),
				1: empty(maps.Match{Protocol: maps.TCP}),
				2: empty(maps.Match{Protocol: maps.UDP}),
				3: empty(maps.Match{Protocol: maps.ICMP}),
				// Ports with any protocol: TCP and UDP on those ports.
				4: empty(maps.Match{Protocol: maps.AnyProtocol, DstPorts: ports(80, 80)}),
				// Egress limits are not enforced by the XDP (ingress) program.
				5: empty(maps.Match{Direction: maps.Egress}),
			},
			packets: []packet{
				{"tcp 80", t4(src4, dst4, 80), []uint32{0, 1, 4}, 0},
				{"tcp 81", t4(src4, dst4, 81), []uint32{0, 1}, 0},
				{"udp 80", u4(src4, dst4, 80), []uint32{0, 2, 4}, 0},
				{"icmp", icmp4p.bytes(), []uint32{0, 3}, 0},
				{"icmpv6", icmp6p.bytes(), []uint32{0, 3}, 0},
				{"gre", pkt{src: src4, dst: dst4, proto: protoGRE}.bytes(), []uint32{0}, 0},
				{"sctp", pkt{src: src6, dst: dst6, proto: 132}.bytes(), []uint32{0}, 0},
			},
		},
		{
			name: "ipv4 prefixes",
			limits: map[uint32]maps.Limit{
				0: empty(maps.Match{SrcCIDRs: prefixes("10.0.0.0/8")}),
				1: empty(maps.Match{SrcCIDRs: prefixes("10.1.0.0/16")}), // inside 0's
				2: empty(maps.Match{DstCIDRs: prefixes("192.168.1.0/24")}),
				3: empty(maps.Match{DstCIDRs: prefixes("0.0.0.0/0")}),
				4: empty(maps.Match{SrcCIDRs: prefixes("::/0")}),
				5: empty(maps.Match{}), // restricted by nothing: never lost to a prefix miss
			},
			packets: []packet{
				{"in both sources", u4("10.1.2.3", "192.168.1.9", 1), []uint32{0, 1, 2, 3, 5}, 0},
				{"first of the /16", u4("10.1.0.0", "192.168.1.0", 1), []uint32{0, 1, 2, 3, 5}, 0},
				{"last of the /16", u4("10.1.255.255", "192.168.1.255", 1), []uint32{0, 1, 2, 3, 5}, 0},
				{"in the /8 only", u4("10.2.0.1", "192.168.2.0", 1), []uint32{0, 3, 5}, 0},
				{"below the /16", u4("10.0.255.255", "192.168.0.255", 1), []uint32{0, 3, 5}, 0},
				{"last of the /8", u4("10.255.255.255", "8.8.8.8", 1), []uint32{0, 3, 5}, 0},
				{"below the /8", u4("9.255.255.255", "192.168.1.1", 1), []uint32{2, 3, 5}, 0},
				{"above the /8", u4("11.0.0.0", "0.0.0.0", 1), []uint32{3, 5}, 0},
				// IPv4 prefixes never match IPv6 packets, even /0, and back.
				{"ipv6", pkt{src: src6, dst: dst6, proto: protoUDP, dport: 1}.bytes(), []uint32{4, 5}, 0},
			},
		},
		{
			name: "ipv6 prefixes",
			limits: map[uint32]maps.Limit{
				0: empty(maps.Match{SrcCIDRs: prefixes("2001:db8::/32")}),
				1: empty(maps.Match{SrcCIDRs: prefixes("2001:db8:1::/48")}),
				2: empty(maps.Match{DstCIDRs: prefixes("fd00::1/128")}),
				3: empty(maps.Match{DstCIDRs: prefixes("::/0")}),
				4: empty(maps.Match{SrcCIDRs: prefixes("0.0.0.0/0")}),
				// Both families in one list.
				5: empty(maps.Match{SrcCIDRs: prefixes("10.0.0.0/8", "2001:db8:1:8000::/49")}),
			},
			packets: []packet{
				{"in both sources", pkt{src: "2001:db8:1::5", dst: "fd00::1", proto: protoUDP}.bytes(), []uint32{0, 1, 2, 3}, 0},
				{"upper half of the /48", pkt{src: "2001:db8:1:8000::", dst: "fd00::2", proto: protoUDP}.bytes(), []uint32{0, 1, 3, 5}, 0},
				{"last of the /48", pkt{src: "2001:db8:1:ffff:ffff:ffff:ffff:ffff", dst: "fd00::", proto: protoTCP}.bytes(), []uint32{0, 1, 3, 5}, 0},
				{"in the /32 only", pkt{src: "2001:db8:2::1", dst: "fd00::1", proto: protoICMPv6}.bytes(), []uint32{0, 2, 3}, 0},
				{"outside the /32", pkt{src: "2001:db9::1", dst: "::", proto: protoUDP}.bytes(), []uint32{3}, 0},
				{"below the /32", pkt{src: "2001:db7:ffff:ffff:ffff:ffff:ffff:ffff", dst: "fd00::1", proto: protoUDP}.bytes(), []uint32{2, 3}, 0},
				// An IPv4-mapped IPv6 source is an IPv6 address to the
				// classifier: IPv4 prefixes do not match it.
				{"v4-mapped source", pkt{src: "::ffff:10.0.0.1", dst: "fd00::9", proto: protoUDP}.bytes(), []uint32{3}, 0},
				{"ipv4", u4("10.9.9.9", "10.0.0.2", 1), []uint32{4, 5}, 0},
			},
		},
		{
			name: "prefixes ports and protocol together",
			limits: map[uint32]maps.Limit{
				0: empty(maps.Match{Protocol: maps.UDP, DstPorts: ports(53, 53),
					SrcCIDRs: prefixes("10.0.0.0/8"), DstCIDRs: prefixes("192.168.0.0/16")}),
				// An IPv4-mapped prefix is taken as the IPv4 prefix.
				1: empty(maps.Match{DstCIDRs: prefixes("::ffff:192.168.7.0/120")}),
			},
			packets: []packet{
				{"all match", u4("10.0.0.1", "192.168.7.7", 53), []uint32{0, 1}, 0},
				{"wrong port", u4("10.0.0.1", "192.168.0.1", 54), nil, 0},
				{"wrong protocol", t4("10.0.0.1", "192.168.0.1", 53), nil, 0},
				{"wrong source", u4("11.0.0.1", "192.168.0.1", 53), nil, 0},
				{"wrong destination", u4("10.0.0.1", "192.169.0.1", 53), nil, 0},
				{"mapped prefix, other port", u4("1.1.1.1", "192.168.7.255", 1), []uint32{1}, 0},
				{"mapped prefix, just outside", u4("1.1.1.1", "192.168.8.0", 1), nil, 0},
			},
		},
		{
			name: "8 limits match one packet",
			limits: map[uint32]maps.Limit{
				0: empty(maps.Match{}),
				1: empty(maps.Match{Protocol: maps.UDP}),
				2: empty(maps.Match{Protocol: maps.UDP, DstPorts: ports(53, 53)}),
				3: empty(maps.Match{DstPorts: ports(50, 60)}),
				4: empty(maps.Match{SrcCIDRs: prefixes("10.0.0.0/8")}),
				5: empty(maps.Match{DstCIDRs: prefixes("192.168.1.0/24")}),
				6: empty(maps.Match{SrcCIDRs: prefixes("0.0.0.0/0")}),
				7: empty(maps.Match{Protocol: maps.UDP, DstPorts: ports(53, 53),
					SrcCIDRs: prefixes("10.1.0.0/16"), DstCIDRs: prefixes("192.168.0.0/16")}),
			},
			packets: []packet{
				{"all 8", u4("10.1.2.3", "192.168.1.7", 53), []uint32{0, 1, 2, 3, 4, 5, 6, 7}, 0},
				{"7 of them", u4("10.1.2.3", "192.168.2.7", 53), []uint32{0, 1, 2, 3, 4, 6, 7}, 0},
				{"3 of them", u4("172.16.0.1", "192.168.2.7", 61), []uint32{0, 1, 6}, 0},
			},
		},
		{
			name:   "8 limits in both mask words",
			limits: allAny(0, 1, 63, 64, 65, 100, 126, 127),
			packets: []packet{
				{"all 8", udp6p.bytes(), []uint32{0, 1, 63, 64, 65, 100, 126, 127}, 0},
			},
		},
		// RL_MAX_MATCH is 8: a ninth match is not enforced, and counted.
		{
			name:   "9 limits in one word",
			limits: allAny(0, 1, 2, 3, 4, 5, 6, 7, 8),
			packets: []packet{
				{"first 8 enforced", udp4p.bytes(), []uint32{0, 1, 2, 3, 4, 5, 6, 7}, 1},
			},
		},
		{
			name:   "9 limits, the ninth in the second word",
			limits: allAny(0, 1, 2, 3, 4, 5, 6, 7, 127),
			packets: []packet{
				{"first 8 enforced", udp4p.bytes(), []uint32{0, 1, 2, 3, 4, 5, 6, 7}, 1},
			},
		},
		{
			name:   "9 limits across words",
			limits: allAny(60, 61, 62, 63, 64, 65, 66, 67, 68),
			packets: []packet{
				{"first 8 enforced", udp4p.bytes(), []uint32{60, 61, 62, 63, 64, 65, 66, 67}, 1},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			install(t, d, tt.limits)
			for _, p := range tt.packets {
				t.Run(p.name, func(t *testing.T) {
					want := uint32(xdpPass)
					if len(p.hit) > 0 {
						want = xdpDrop
					}
					before := snapshot(t, d)
					if got := mustRun(t, d.Program(), p.packet); got != want {
						t.Errorf("verdict %d, want %d", got, want)
					}
					checkDropped(t, before, snapshot(t, d), p.hit, len(p.packet), p.overflow)
				})
			}
		})
	}
}

// TestParseTruncated cuts packets at every length: a packet cut inside a
// header must pass untouched, one cut in its payload is still parsed.
func TestParseTruncated(t *testing.T) {
	d := testDatapath(t)
	install(t, d, probeLimits())

	const payload = 6
	tests := []struct {
		name string
		pkt  pkt
		hit  []uint32 // of the packet with its headers whole
	}{
		{"ipv4 tcp with options", with(tcp4p, func(p *pkt) { p.ipOpts = 12 }), hitTCP4},
		{"ipv4 icmp with options", with(icmp4p, func(p *pkt) { p.ipOpts = 40 }), hitICMP4},
		{"ipv6 udp with extension headers", with(udp6p, func(p *pkt) { p.ext = []uint8{0, 43, 44, 51, 60} }), hitUDP6},
		{"ipv6 tcp after ah", with(tcp6p, func(p *pkt) { p.ext = []uint8{51} }), hitTCP6},
		{"qinq udp", with(udp4p, func(p *pkt) { p.vlans = []uint16{100, 200} }), hitUDP4},
		{"qinq ipv6 udp", with(udp6p, func(p *pkt) { p.vlans = []uint16{100, 200}; p.ext = []uint8{60} }), hitUDP6},
		{"icmpv6", icmp6p, hitICMP6},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.pkt.payload = payload
			full := tt.pkt.bytes()
			headers := len(full) - payload
			for n := 0; n <= len(full); n++ {
				b := slices.Clone(full[:n])
				before := snapshot(t, d)
				ret, err := d.Program().Run(&ebpf.RunOptions{Data: b})
				after := snapshot(t, d)
				switch {
				case n < 14:
					// The kernel refuses a test_run buffer shorter than an
					// Ethernet header (bpf_test_init: size < ETH_HLEN ->
					// -EINVAL), so the program never sees one; a driver
					// does not hand XDP a frame that short either.
					if !errors.Is(err, unix.EINVAL) {
						t.Errorf("len %d: got verdict %d, error %v; want EINVAL from the kernel", n, ret, err)
					}
					checkDropped(t, before, after, nil, n, 0)
				case n < headers:
					if err != nil {
						t.Fatalf("len %d: %v", n, err)
					}
					if ret != xdpPass {
						t.Errorf("len %d (headers end at %d): verdict %d, want pass", n, headers, ret)
					}
					checkDropped(t, before, after, nil, n, 0)
				default:
					if err != nil {
						t.Fatalf("len %d: %v", n, err)
					}
					if ret != xdpDrop {
						t.Errorf("len %d (headers end at %d): verdict %d, want drop", n, headers, ret)
					}
					checkDropped(t, before, after, tt.hit, n, 0)
				}
				if t.Failed() {
					t.Fatalf("stopped at len %d of %d", n, len(full))
				}
			}
		})
	}
}
