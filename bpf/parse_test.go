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
	ids    []uint32 // ascending
	limits map[uint32]maps.Stats
	g      gstats
}

func snapshot(tb testing.TB, d *maps.Datapath) counters {
	tb.Helper()
	c := counters{ids: d.IDs(), limits: make(map[uint32]maps.Stats)}
	for _, id := range c.ids {
		c.limits[id] = mustStats(tb, d, id)
	}
	c.g = globals(tb, d)
	return c
}

// checkDropped fails tb unless, from before to after, exactly the limits in
// hit counted one dropped packet of n bytes, no limit counted anything else,
// and the global counters moved by g.
func checkDropped(tb testing.TB, before, after counters, hit []uint32, n int, g gstats) {
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
	if got := after.g.minus(before.g); got != g {
		tb.Errorf("global counters moved by %+v, want %+v", got, g)
	}
}

// seq is the ids from, from+1, ..., to-1.
func seq(from, to uint32) []uint32 {
	var out []uint32
	for id := from; id < to; id++ {
		out = append(out, id)
	}
	return out
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
	pUDP                 // UDP, any port
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

// What they see of an L4-unknown packet (parse.h). The packets these are
// used with go to ports 54 and 81, or have none: a hit on pUDP53 or pTCP80
// means "charged whatever its ports", not "port read".
var (
	// TCP or UDP whose ports are unknown: every limit of the protocol.
	anyPortUDP4 = []uint32{pAny, pUDP, pUDP53, pAddr4}
	anyPortTCP4 = []uint32{pAny, pTCP, pTCP80, pAddr4}
	anyPortUDP6 = []uint32{pAny, pUDP, pUDP53, pAddr6}
	anyPortTCP6 = []uint32{pAny, pTCP, pTCP80, pAddr6}
	// IPv6 whose protocol is unknown: every limit of the direction,
	// restricted by the addresses.
	unknownProto6 = []uint32{pAny, pUDP, pTCP, pICMP, pUDP53, pTCP80, pAddr6}
	// More VLAN tags than walked: every limit not restricted to CIDRs.
	unknownNoAddr = []uint32{pAny, pUDP, pTCP, pICMP, pUDP53, pTCP80}
)

// How the global counters move.
var (
	gNone     = gstats{}
	gL4U      = gstats{l4Unknown: 1}
	gFirst    = gstats{fragFirst: 1}
	gFirstL4U = gstats{fragFirst: 1, l4Unknown: 1}
	gUnseen   = gstats{fragUnseen: 1, l4Unknown: 1}
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

// dstOpts is a chain of n destination options headers.
func dstOpts(n int) []uint8 { return slices.Repeat([]uint8{60}, n) }

const (
	ipv4Off  = 14 // IPv4 header of an untagged frame
	ipv6Ext0 = 54 // first IPv6 extension header of an untagged frame
)

// TestParse runs one packet of each kind past the probe limits, through
// every program (the TC programs see an skb: test_run does not move a VLAN
// tag to skb->vlan_tci as the kernel's receive path does, so the tags are
// in the frame here; the parser reads the frame's own). The fragments each
// have an id of their own, and none has its first fragment seen
// (frag_test.go sends whole datagrams).
func TestParse(t *testing.T) {
	d := hookDatapath(t)

	type tc struct {
		name    string
		packet  []byte
		verdict uint32
		hit     []uint32 // probe limits that count the packet as dropped
		g       gstats   // how the global counters move
	}
	tests := []tc{
		// IPv4.
		{"ipv4 udp", udp4p.bytes(), xdpDrop, hitUDP4, gNone},
		{"ipv4 udp other port", with(udp4p, func(p *pkt) { p.dport = 54 }).bytes(), xdpDrop, []uint32{pAny, pUDP, pAddr4}, gNone},
		{"ipv4 tcp", tcp4p.bytes(), xdpDrop, hitTCP4, gNone},
		{"ipv4 tcp other port", with(tcp4p, func(p *pkt) { p.dport = 81 }).bytes(), xdpDrop, []uint32{pAny, pTCP, pAddr4}, gNone},
		{"ipv4 icmp", icmp4p.bytes(), xdpDrop, hitICMP4, gNone},
		{"ipv4 gre is protocol other", pkt{src: src4, dst: dst4, proto: protoGRE}.bytes(), xdpDrop, []uint32{pAny, pAddr4}, gNone},
		{"ipv4 udp with payload", with(udp4p, func(p *pkt) { p.payload = 100 }).bytes(), xdpDrop, hitUDP4, gNone},
		// Ethernet padding after the datagram is not read as part of it.
		{"ipv4 udp in a padded frame", with(udp4p, func(p *pkt) { p.pad = 18 }).bytes(), xdpDrop, hitUDP4, gNone},
		// DF and MF set, offset 0: a first fragment, which has its L4
		// header and is recorded for its later fragments.
		{"ipv4 first fragment, DF|MF", patched(with(udp4p, func(p *pkt) { p.fragID = 101 }).bytes(), ipv4Off+6, 0x60, 0x00), xdpDrop, hitUDP4, gFirst},
		// Reserved flag and DF set, offset 0: flags are not offset bits.
		{"ipv4 flags only", patched(tcp4p.bytes(), ipv4Off+6, 0xc0, 0x00), xdpDrop, hitTCP4, gNone},
		// Later fragments whose first fragment was not seen: L4-unknown,
		// charged to every limit of their protocol. A bypass before
		// (issue 8): they matched the protocol alone, no port limit.
		{"ipv4 non-first fragment udp", with(udp4p, func(p *pkt) { p.fragOff = 185; p.fragID = 102 }).bytes(), xdpDrop, anyPortUDP4, gUnseen},
		// Offset 1 can rewrite the TCP flags (RFC 1858).
		{"ipv4 non-first fragment tcp", with(tcp4p, func(p *pkt) { p.fragOff = 1; p.fragID = 103 }).bytes(), xdpDrop, anyPortTCP4, gUnseen},
		{"ipv4 non-first fragment offset 0x1fff", with(udp4p, func(p *pkt) { p.fragOff = 0x1fff; p.fragID = 104 }).bytes(), xdpDrop, anyPortUDP4, gUnseen},
		{"ipv4 non-first fragment icmp", with(icmp4p, func(p *pkt) { p.fragOff = 3; p.fragID = 105 }).bytes(), xdpDrop, []uint32{pAny, pICMP, pAddr4}, gUnseen},
		// A non-first fragment needs no bytes after the IP header.
		{"ipv4 non-first fragment, no l4 bytes", with(udp4p, func(p *pkt) { p.fragOff = 185; p.fragID = 106 }).bytes()[:ipv4Off+20], xdpDrop, anyPortUDP4, gUnseen},
		// Tiny first fragments (RFC 1858, 3128): the TCP header is cut by
		// the IP length, the ports may even be there. A bypass before.
		{"ipv4 tiny first fragment tcp, 8 bytes", with(tcp4p, func(p *pkt) { p.dport = 81; p.mf = true; p.fragID = 107; p.l4Keep = 8 }).bytes(), xdpDrop, anyPortTCP4, gFirstL4U},
		{"ipv4 tiny first fragment tcp, no tcp byte", with(tcp4p, func(p *pkt) { p.mf = true; p.fragID = 108; p.l4Keep = keepNone }).bytes(), xdpDrop, anyPortTCP4, gFirstL4U},
		{"ipv4 tiny first fragment udp, 4 bytes", with(udp4p, func(p *pkt) { p.dport = 54; p.mf = true; p.fragID = 109; p.l4Keep = 4 }).bytes(), xdpDrop, anyPortUDP4, gFirstL4U},
		// The IP length, not the frame, says where the datagram ends.
		{"ipv4 tcp cut by total length in a padded frame", with(tcp4p, func(p *pkt) { p.dport = 81; p.l4Keep = 16; p.pad = 30 }).bytes(), xdpDrop, anyPortTCP4, gL4U},
		{"ipv4 icmp cut by total length", with(icmp4p, func(p *pkt) { p.l4Keep = 2 }).bytes(), xdpDrop, hitICMP4, gNone},
		{"ipv4 total length below ihl", patched(udp4p.bytes(), ipv4Off+2, 0, 19), xdpPass, nil, gNone},
		{"ipv4 ihl 4", patched(udp4p.bytes(), ipv4Off, 0x44), xdpPass, nil, gNone},
		{"ipv4 ihl 0", patched(udp4p.bytes(), ipv4Off, 0x40), xdpPass, nil, gNone},
		// 20 + 8 bytes after the Ethernet header, ihl says 60.
		{"ipv4 ihl past the end", patched(udp4p.bytes(), ipv4Off, 0x4f), xdpPass, nil, gNone},
		{"ipv4 ethertype, version 6", patched(udp4p.bytes(), ipv4Off, 0x65), xdpPass, nil, gNone},

		// IPv6.
		{"ipv6 udp", udp6p.bytes(), xdpDrop, hitUDP6, gNone},
		{"ipv6 udp other port", with(udp6p, func(p *pkt) { p.dport = 52 }).bytes(), xdpDrop, []uint32{pAny, pUDP, pAddr6}, gNone},
		{"ipv6 tcp", tcp6p.bytes(), xdpDrop, hitTCP6, gNone},
		{"ipv6 icmpv6", icmp6p.bytes(), xdpDrop, hitICMP6, gNone},
		// ICMP (1) in an IPv6 header is not ICMPv6, but the classifier has
		// one class for both.
		{"ipv6 next header 1", pkt{src: src6, dst: dst6, proto: protoICMP}.bytes(), xdpDrop, hitICMP6, gNone},
		{"ipv6 gre is protocol other", pkt{src: src6, dst: dst6, proto: protoGRE}.bytes(), xdpDrop, []uint32{pAny, pAddr6}, gNone},
		{"ipv6 no next header (59)", pkt{src: src6, dst: dst6, proto: 59}.bytes(), xdpDrop, []uint32{pAny, pAddr6}, gNone},
		// Payload length 0 without a hop-by-hop header: the kernel trims
		// the packet to its fixed header (ipv6_rcv) and the parser reads
		// it so, its UDP header cut off: L4-unknown.
		{"ipv6 payload length 0", patched(udp6p.bytes(), 14+4, 0, 0), xdpDrop, []uint32{pAny, pUDP, pUDP53, pAddr6}, gL4U},
		// With a hop-by-hop header it is a jumbogram (RFC 2675): the frame
		// bounds it.
		{"ipv6 payload length 0, hop-by-hop", patched(with(udp6p, func(p *pkt) { p.ext = []uint8{0} }).bytes(), 14+4, 0, 0), xdpDrop, hitUDP6, gNone},
		{"ipv6 hop-by-hop", with(udp6p, func(p *pkt) { p.ext = []uint8{0} }).bytes(), xdpDrop, hitUDP6, gNone},
		{"ipv6 routing", with(tcp6p, func(p *pkt) { p.ext = []uint8{43} }).bytes(), xdpDrop, hitTCP6, gNone},
		{"ipv6 destination options", with(udp6p, func(p *pkt) { p.ext = []uint8{60} }).bytes(), xdpDrop, hitUDP6, gNone},
		// Offset 0, M clear (RFC 6946): a whole datagram, not recorded.
		{"ipv6 atomic fragment", with(udp6p, func(p *pkt) { p.ext = []uint8{44}; p.fragID = 200 }).bytes(), xdpDrop, hitUDP6, gNone},
		// M flag set, offset 0.
		{"ipv6 first fragment, M", with(tcp6p, func(p *pkt) { p.ext = []uint8{44}; p.mf = true; p.fragID = 201 }).bytes(), xdpDrop, hitTCP6, gFirst},
		{"ipv6 ah", with(udp6p, func(p *pkt) { p.ext = []uint8{51} }).bytes(), xdpDrop, hitUDP6, gNone},
		{"ipv6 icmpv6 after ah", with(icmp6p, func(p *pkt) { p.ext = []uint8{51} }).bytes(), xdpDrop, hitICMP6, gNone},
		// An extension header of hdrlen 0 is 8 bytes long, not 16.
		{"ipv6 hop-by-hop hdrlen 0", ipv6HopByHop8(udp6p), xdpDrop, hitUDP6, gNone},
		{"ipv6 hop-by-hop hdrlen 0, builder", with(udp6p, func(p *pkt) { p.ext = []uint8{0}; p.extLen = []uint8{0} }).bytes(), xdpDrop, hitUDP6, gNone},
		{"ipv6 destination options hdrlen 255", with(udp6p, func(p *pkt) { p.ext = []uint8{60}; p.extLen = []uint8{255} }).bytes(), xdpDrop, hitUDP6, gNone},
		{"ipv6 chain of 2", with(udp6p, func(p *pkt) { p.ext = []uint8{0, 60} }).bytes(), xdpDrop, hitUDP6, gNone},
		{"ipv6 chain of 5", with(tcp6p, func(p *pkt) { p.ext = []uint8{0, 43, 44, 51, 60} }).bytes(), xdpDrop, hitTCP6, gNone},
		// RL_MAX_EXTHDRS is 8: eight extension headers are walked.
		{"ipv6 chain of 6", with(udp6p, func(p *pkt) { p.ext = []uint8{0, 60, 43, 44, 51, 60} }).bytes(), xdpDrop, hitUDP6, gNone},
		// Chains of 7 and 8 passed every limit before (issue 8: 200 of 200
		// UDP/53 packets through a 20/s limit); they are walked now.
		{"ipv6 chain of 7", with(udp6p, func(p *pkt) { p.ext = []uint8{0, 60, 43, 44, 51, 60, 60} }).bytes(), xdpDrop, hitUDP6, gNone},
		{"ipv6 chain of 8", with(udp6p, func(p *pkt) { p.ext = []uint8{0, 60, 43, 43, 44, 51, 51, 60} }).bytes(), xdpDrop, hitUDP6, gNone},
		{"ipv6 7 destination options", with(udp6p, func(p *pkt) { p.ext = dstOpts(7) }).bytes(), xdpDrop, hitUDP6, gNone},
		{"ipv6 8 destination options", with(tcp6p, func(p *pkt) { p.ext = dstOpts(8) }).bytes(), xdpDrop, hitTCP6, gNone},
		// Longer chains hide the protocol: L4-unknown, every limit.
		{"ipv6 9 destination options", with(udp6p, func(p *pkt) { p.ext = dstOpts(9) }).bytes(), xdpDrop, unknownProto6, gL4U},
		{"ipv6 16 destination options", with(udp6p, func(p *pkt) { p.ext = dstOpts(16) }).bytes(), xdpDrop, unknownProto6, gL4U},
		{"ipv6 chain of 9, a fragment header last", with(udp6p, func(p *pkt) { p.ext = append(dstOpts(8), 44) }).bytes(), xdpDrop, unknownProto6, gL4U},
		// Extension headers that are not walked (RFC 7045: TCP or UDP may
		// follow them) hide the protocol too.
		{"ipv6 mobility (135)", with(udp6p, func(p *pkt) { p.ext = []uint8{135} }).bytes(), xdpDrop, unknownProto6, gL4U},
		{"ipv6 hip (139) after hop-by-hop", with(tcp6p, func(p *pkt) { p.ext = []uint8{0, 139} }).bytes(), xdpDrop, unknownProto6, gL4U},
		{"ipv6 shim6 (140)", with(udp6p, func(p *pkt) { p.ext = []uint8{140} }).bytes(), xdpDrop, unknownProto6, gL4U},
		{"ipv6 experimental (253)", with(udp6p, func(p *pkt) { p.ext = []uint8{60, 253} }).bytes(), xdpDrop, unknownProto6, gL4U},
		{"ipv6 experimental (254)", with(icmp6p, func(p *pkt) { p.ext = []uint8{254} }).bytes(), xdpDrop, unknownProto6, gL4U},
		// A bypass before (issue 8): matched the protocol alone. A later
		// IPv6 fragment whose first was not seen: its next header is the
		// sender's word only (the first fragment's counts, RFC 8200), so
		// its protocol is unknown: every limit its addresses allow.
		{"ipv6 non-first fragment udp", with(udp6p, func(p *pkt) { p.ext = []uint8{44}; p.fragOff = 100; p.fragID = 202 }).bytes(), xdpDrop, unknownProto6, gUnseen},
		{"ipv6 non-first fragment tcp after hop-by-hop", with(tcp6p, func(p *pkt) { p.ext = []uint8{0, 44}; p.fragOff = 1; p.fragID = 203 }).bytes(), xdpDrop, unknownProto6, gUnseen},
		{"ipv6 non-first fragment offset 0x1fff", with(udp6p, func(p *pkt) { p.ext = []uint8{44}; p.fragOff = 0x1fff; p.fragID = 204 }).bytes(), xdpDrop, unknownProto6, gUnseen},
		{"ipv6 non-first fragment icmpv6", with(icmp6p, func(p *pkt) { p.ext = []uint8{44}; p.fragOff = 7; p.fragID = 205 }).bytes(), xdpDrop, unknownProto6, gUnseen},
		{"ipv6 non-first fragment, no l4 bytes", with(udp6p, func(p *pkt) { p.ext = []uint8{44}; p.fragOff = 100; p.fragID = 206 }).bytes()[:ipv6Ext0+8], xdpDrop, unknownProto6, gUnseen},
		// The header after a fragment header may be an extension header.
		{"ipv6 non-first fragment, destination options next", with(udp6p, func(p *pkt) { p.ext = []uint8{44, 60}; p.fragOff = 100; p.fragID = 207 }).bytes(), xdpDrop, unknownProto6, gUnseen},
		// Tiny first fragments (RFC 7112). A bypass before.
		{"ipv6 tiny first fragment tcp, 8 bytes", with(tcp6p, func(p *pkt) { p.dport = 81; p.ext = []uint8{44}; p.mf = true; p.fragID = 208; p.l4Keep = 8 }).bytes(), xdpDrop, anyPortTCP6, gFirstL4U},
		{"ipv6 tiny first fragment tcp, 19 bytes", with(tcp6p, func(p *pkt) { p.dport = 81; p.ext = []uint8{44}; p.mf = true; p.fragID = 209; p.l4Keep = 19 }).bytes(), xdpDrop, anyPortTCP6, gFirstL4U},
		{"ipv6 udp cut by payload length in a padded frame", with(udp6p, func(p *pkt) { p.dport = 54; p.l4Keep = 4; p.pad = 20 }).bytes(), xdpDrop, anyPortUDP6, gL4U},
		{"ipv6 ethertype, version 4", patched(udp6p.bytes(), 14, 0x45), xdpPass, nil, gNone},

		// VLANs.
		{"802.1Q ipv4 udp", with(udp4p, func(p *pkt) { p.vlans = []uint16{100} }).bytes(), xdpDrop, hitUDP4, gNone},
		{"802.1Q ipv6 tcp", with(tcp6p, func(p *pkt) { p.vlans = []uint16{100} }).bytes(), xdpDrop, hitTCP6, gNone},
		{"802.1ad alone", patched(with(udp4p, func(p *pkt) { p.vlans = []uint16{100} }).bytes(), 12, 0x88, 0xa8), xdpDrop, hitUDP4, gNone},
		{"qinq ipv4 udp", with(udp4p, func(p *pkt) { p.vlans = []uint16{100, 200} }).bytes(), xdpDrop, hitUDP4, gNone},
		{"qinq ipv6 udp with extension headers", with(udp6p, func(p *pkt) { p.vlans = []uint16{100, 200}; p.ext = []uint8{0, 44} }).bytes(), xdpDrop, hitUDP6, gNone},
		// A bypass before (issue 8): matched the protocol alone.
		{"qinq ipv4 non-first fragment", with(udp4p, func(p *pkt) { p.vlans = []uint16{1, 2}; p.fragOff = 9; p.fragID = 301 }).bytes(), xdpDrop, anyPortUDP4, gUnseen},
		{"802.1Q in 802.1Q", patched(with(icmp4p, func(p *pkt) { p.vlans = []uint16{100, 200} }).bytes(), 12, 0x81, 0x00), xdpDrop, hitICMP4, gNone},
		// RL_MAX_VLAN is 4. Three tags passed every limit before (issue 8).
		{"3 vlan tags ipv4", with(udp4p, func(p *pkt) { p.vlans = []uint16{1, 2, 3} }).bytes(), xdpDrop, hitUDP4, gNone},
		{"3 vlan tags ipv6", with(tcp6p, func(p *pkt) { p.vlans = []uint16{1, 2, 3} }).bytes(), xdpDrop, hitTCP6, gNone},
		{"4 vlan tags ipv4", with(udp4p, func(p *pkt) { p.vlans = []uint16{1, 2, 3, 4} }).bytes(), xdpDrop, hitUDP4, gNone},
		// More: L4-unknown without addresses, every limit not restricted
		// to CIDRs.
		{"5 vlan tags ipv4", with(udp4p, func(p *pkt) { p.dport = 54; p.vlans = []uint16{1, 2, 3, 4, 5} }).bytes(), xdpDrop, unknownNoAddr, gL4U},
		{"6 vlan tags ipv6", with(tcp6p, func(p *pkt) { p.vlans = []uint16{1, 2, 3, 4, 5, 6} }).bytes(), xdpDrop, unknownNoAddr, gL4U},
		{"5 vlan tags, frame ends after the fourth", with(udp4p, func(p *pkt) { p.vlans = []uint16{1, 2, 3, 4, 5} }).bytes()[:14+16], xdpDrop, unknownNoAddr, gL4U},
		{"4 vlan tags, then arp", patched(with(udp4p, func(p *pkt) { p.vlans = []uint16{1, 2, 3, 4} }).bytes(), 12+16+2, 0x08, 0x06), xdpPass, nil, gNone},

		// Not IP.
		{"arp", ethFrame(0x0806, 28), xdpPass, nil, gNone},
		{"arp in 802.1Q", patched(with(udp4p, func(p *pkt) { p.vlans = []uint16{100} }).bytes(), 16, 0x08, 0x06), xdpPass, nil, gNone},
		{"lldp", ethFrame(0x88cc, 46), xdpPass, nil, gNone},
		{"802.3 length field", ethFrame(0x0040, 64), xdpPass, nil, gNone},
		// Ethertype 0 is an 802.3 frame of length 0, not IP: it passes
		// untouched, as any other. (Found by FuzzParse: parse_eth's 0,
		// "more VLAN tags than walked", is also what it returns for
		// ethertype 0.)
		{"802.3 length 0", ethFrame(0x0000, 46), xdpPass, nil, gNone},
		{"802.3 length 0 in 802.1Q", patched(with(udp4p, func(p *pkt) { p.vlans = []uint16{100} }).bytes(), 16, 0x00, 0x00), xdpPass, nil, gNone},
		{"ethernet header only", ethFrame(ethIPv4, 0), xdpPass, nil, gNone},
	}
	// Every IPv4 header length with options: the ports are read after them
	// (the NOP options, read as a UDP header, would be port 0x0101).
	for ihl := 6; ihl <= 15; ihl++ {
		tests = append(tests, tc{
			"ipv4 udp ihl " + strconv.Itoa(ihl),
			with(udp4p, func(p *pkt) { p.ipOpts = 4 * (ihl - 5) }).bytes(),
			xdpDrop, hitUDP4, gNone,
		})
	}

	forEachProg(t, allProgs, func(t *testing.T, p prog) {
		install(t, d, p.atAll(probeLimits()))
		clearMap(t, fragTable(t, d))
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				if !p.runnable(tt.packet) {
					t.Skipf("test_run takes no such skb (TestParseTruncated checks the EINVAL)")
				}
				before := snapshot(t, d)
				if got := p.run(t, d, tt.packet); got != tt.verdict {
					t.Errorf("verdict %d, want %d", got, tt.verdict)
				}
				checkDropped(t, before, snapshot(t, d), tt.hit, len(tt.packet), tt.g)
			})
		}
	})
}

// ipv6HopByHop8 is p with a hop-by-hop header of hdrlen 0 (8 bytes), built
// by hand rather than with pkt.extLen, so that a builder bug cannot hide a
// parser bug.
func ipv6HopByHop8(p pkt) []byte {
	b := p.bytes()
	out := slices.Concat(b[:ipv6Ext0], []byte{p.proto, 0, 1, 4, 0, 0, 0, 0}, b[ipv6Ext0:])
	out[14+6] = 0 // next header: hop-by-hop
	binary.BigEndian.PutUint16(out[14+4:], binary.BigEndian.Uint16(out[14+4:])+8)
	return out
}

// TestParseMatch runs packets past sets of limits, through every program.
func TestParseMatch(t *testing.T) {
	d := hookDatapath(t)

	type packet struct {
		name   string
		packet []byte
		hit    []uint32 // limits that count it; the verdict is drop if any
		g      gstats   // how the global counters move
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
	// all53 is allAny on UDP/53 (what udp4p is): a limit on one port
	// rewrites one entry of the port table, a match-all one every entry.
	all53 := func(ids ...uint32) map[uint32]maps.Limit {
		m := make(map[uint32]maps.Limit)
		for _, id := range ids {
			m[id] = empty(maps.Match{Protocol: maps.UDP, DstPorts: ports(53, 53)})
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
				{"udp 999", u4(src4, dst4, 999), nil, gNone},
				{"udp 1000", u4(src4, dst4, 1000), []uint32{0}, gNone},
				{"udp 1500", u4(src4, dst4, 1500), []uint32{0}, gNone},
				{"udp 2000", u4(src4, dst4, 2000), []uint32{0}, gNone},
				{"udp 2001", u4(src4, dst4, 2001), nil, gNone},
				{"tcp 999", t4(src4, dst4, 999), nil, gNone},
				{"tcp 1000", t4(src4, dst4, 1000), []uint32{1}, gNone},
				{"tcp 2000 ipv6", pkt{src: src6, dst: dst6, proto: protoTCP, dport: 2000}.bytes(), []uint32{1}, gNone},
				{"tcp 2001 ipv6", pkt{src: src6, dst: dst6, proto: protoTCP, dport: 2001}.bytes(), nil, gNone},
				{"icmp", icmp4p.bytes(), nil, gNone},
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
				{"udp 52", u4(src4, dst4, 52), nil, gNone},
				{"udp 53", u4(src4, dst4, 53), []uint32{0}, gNone},
				{"udp 54", u4(src4, dst4, 54), nil, gNone},
				{"udp 7999", u4(src4, dst4, 7999), nil, gNone},
				{"udp 8080", u4(src4, dst4, 8080), []uint32{0}, gNone},
				{"udp 8081", u4(src4, dst4, 8081), nil, gNone},
				{"udp 0", u4(src4, dst4, 0), []uint32{1}, gNone},
				{"udp 1", u4(src4, dst4, 1), nil, gNone},
				{"udp 65534", u4(src4, dst4, 65534), nil, gNone},
				{"udp 65535", u4(src4, dst4, 65535), []uint32{1}, gNone},
				{"tcp 0", t4(src4, dst4, 0), []uint32{2}, gNone},
				{"tcp 65535", t4(src4, dst4, 65535), []uint32{2}, gNone},
				// A later fragment whose first fragment was not seen has no
				// port: it is charged to every limit of its protocol. A
				// bypass before (issue 8): it matched no port limit.
				{"tcp non-first fragment", with(tcp4p, func(p *pkt) { p.fragOff = 10; p.fragID = 1 }).bytes(), []uint32{2}, gUnseen},
				{"udp non-first fragment", with(udp4p, func(p *pkt) { p.fragOff = 10; p.fragID = 2 }).bytes(), []uint32{0, 1}, gUnseen},
				// A tiny first fragment to a port no limit names.
				{"udp tiny first fragment to port 7", with(udp4p, func(p *pkt) { p.dport = 7; p.mf = true; p.fragID = 3; p.l4Keep = 4 }).bytes(), []uint32{0, 1}, gFirstL4U},
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
				// A limit at another hook is not enforced by the
				// program (prog.at keeps it at another hook).
				5: empty(maps.Match{Direction: maps.Egress}),
			},
			packets: []packet{
				{"tcp 80", t4(src4, dst4, 80), []uint32{0, 1, 4}, gNone},
				{"tcp 81", t4(src4, dst4, 81), []uint32{0, 1}, gNone},
				{"udp 80", u4(src4, dst4, 80), []uint32{0, 2, 4}, gNone},
				{"icmp", icmp4p.bytes(), []uint32{0, 3}, gNone},
				{"icmpv6", icmp6p.bytes(), []uint32{0, 3}, gNone},
				{"gre", pkt{src: src4, dst: dst4, proto: protoGRE}.bytes(), []uint32{0}, gNone},
				{"sctp", pkt{src: src6, dst: dst6, proto: 132}.bytes(), []uint32{0}, gNone},
				// L4-unknown: every limit of the protocol, or of any
				// protocol, that could match (ingress only).
				{"tcp non-first fragment", with(tcp4p, func(p *pkt) { p.fragOff = 10; p.fragID = 4 }).bytes(), []uint32{0, 1, 4}, gUnseen},
				// An IPv4 ICMP or GRE fragment has no ports whichever
				// fragment it is: the any-protocol limit on port 80
				// (4) cannot match it.
				{"icmp non-first fragment", with(icmp4p, func(p *pkt) { p.fragOff = 10; p.fragID = 5 }).bytes(), []uint32{0, 3}, gUnseen},
				{"gre non-first fragment", pkt{src: src4, dst: dst4, proto: protoGRE, fragOff: 10, fragID: 6}.bytes(), []uint32{0}, gUnseen},
				{"ipv6 9 destination options", with(udp6p, func(p *pkt) { p.ext = dstOpts(9) }).bytes(), []uint32{0, 1, 2, 3, 4}, gL4U},
				{"5 vlan tags", with(icmp4p, func(p *pkt) { p.vlans = []uint16{1, 2, 3, 4, 5} }).bytes(), []uint32{0, 1, 2, 3, 4}, gL4U},
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
				{"in both sources", u4("10.1.2.3", "192.168.1.9", 1), []uint32{0, 1, 2, 3, 5}, gNone},
				{"first of the /16", u4("10.1.0.0", "192.168.1.0", 1), []uint32{0, 1, 2, 3, 5}, gNone},
				{"last of the /16", u4("10.1.255.255", "192.168.1.255", 1), []uint32{0, 1, 2, 3, 5}, gNone},
				{"in the /8 only", u4("10.2.0.1", "192.168.2.0", 1), []uint32{0, 3, 5}, gNone},
				{"below the /16", u4("10.0.255.255", "192.168.0.255", 1), []uint32{0, 3, 5}, gNone},
				{"last of the /8", u4("10.255.255.255", "8.8.8.8", 1), []uint32{0, 3, 5}, gNone},
				{"below the /8", u4("9.255.255.255", "192.168.1.1", 1), []uint32{2, 3, 5}, gNone},
				{"above the /8", u4("11.0.0.0", "0.0.0.0", 1), []uint32{3, 5}, gNone},
				// IPv4 prefixes never match IPv6 packets, even /0, and back.
				{"ipv6", pkt{src: src6, dst: dst6, proto: protoUDP, dport: 1}.bytes(), []uint32{4, 5}, gNone},
				// L4-unknown keeps its addresses: still filtered by them.
				{"ipv4 non-first fragment", pkt{src: "10.1.2.3", dst: "192.168.1.9", proto: protoUDP, fragOff: 10, fragID: 7}.bytes(), []uint32{0, 1, 2, 3, 5}, gUnseen},
				// More VLAN tags than walked: no addresses, only the
				// limits not restricted to CIDRs.
				{"5 vlan tags", with(udp4p, func(p *pkt) { p.src = "10.1.2.3"; p.dst = "192.168.1.9"; p.vlans = []uint16{1, 2, 3, 4, 5} }).bytes(), []uint32{5}, gL4U},
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
				{"in both sources", pkt{src: "2001:db8:1::5", dst: "fd00::1", proto: protoUDP}.bytes(), []uint32{0, 1, 2, 3}, gNone},
				{"upper half of the /48", pkt{src: "2001:db8:1:8000::", dst: "fd00::2", proto: protoUDP}.bytes(), []uint32{0, 1, 3, 5}, gNone},
				{"last of the /48", pkt{src: "2001:db8:1:ffff:ffff:ffff:ffff:ffff", dst: "fd00::", proto: protoTCP}.bytes(), []uint32{0, 1, 3, 5}, gNone},
				{"in the /32 only", pkt{src: "2001:db8:2::1", dst: "fd00::1", proto: protoICMPv6}.bytes(), []uint32{0, 2, 3}, gNone},
				{"outside the /32", pkt{src: "2001:db9::1", dst: "::", proto: protoUDP}.bytes(), []uint32{3}, gNone},
				{"below the /32", pkt{src: "2001:db7:ffff:ffff:ffff:ffff:ffff:ffff", dst: "fd00::1", proto: protoUDP}.bytes(), []uint32{2, 3}, gNone},
				// An IPv4-mapped IPv6 source is an IPv6 address to the
				// classifier: IPv4 prefixes do not match it.
				{"v4-mapped source", pkt{src: "::ffff:10.0.0.1", dst: "fd00::9", proto: protoUDP}.bytes(), []uint32{3}, gNone},
				{"ipv4", u4("10.9.9.9", "10.0.0.2", 1), []uint32{4, 5}, gNone},
				{"chain of 9 in both sources", pkt{src: "2001:db8:1::5", dst: "fd00::1", proto: protoUDP, ext: dstOpts(9)}.bytes(), []uint32{0, 1, 2, 3}, gL4U},
				{"mobility header from outside the /32", pkt{src: "2001:db9::1", dst: "::", proto: protoTCP, ext: []uint8{135}}.bytes(), []uint32{3}, gL4U},
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
				{"all match", u4("10.0.0.1", "192.168.7.7", 53), []uint32{0, 1}, gNone},
				{"wrong port", u4("10.0.0.1", "192.168.0.1", 54), nil, gNone},
				{"wrong protocol", t4("10.0.0.1", "192.168.0.1", 53), nil, gNone},
				{"wrong source", u4("11.0.0.1", "192.168.0.1", 53), nil, gNone},
				{"wrong destination", u4("10.0.0.1", "192.169.0.1", 53), nil, gNone},
				{"mapped prefix, other port", u4("1.1.1.1", "192.168.7.255", 1), []uint32{1}, gNone},
				{"mapped prefix, just outside", u4("1.1.1.1", "192.168.8.0", 1), nil, gNone},
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
				{"all 8", u4("10.1.2.3", "192.168.1.7", 53), []uint32{0, 1, 2, 3, 4, 5, 6, 7}, gNone},
				{"7 of them", u4("10.1.2.3", "192.168.2.7", 53), []uint32{0, 1, 2, 3, 4, 6, 7}, gNone},
				{"3 of them", u4("172.16.0.1", "192.168.2.7", 61), []uint32{0, 1, 6}, gNone},
			},
		},
		{
			name:   "8 limits in both mask words",
			limits: allAny(0, 1, 63, 64, 65, 100, 126, 127),
			packets: []packet{
				{"all 8", udp6p.bytes(), []uint32{0, 1, 63, 64, 65, 100, 126, 127}, gNone},
			},
		},
		{
			name:   "16 limits in both mask words",
			limits: all53(0, 1, 2, 3, 4, 5, 6, 7, 63, 64, 65, 100, 124, 125, 126, 127),
			packets: []packet{
				{"all 16", udp6p.bytes(), []uint32{0, 1, 2, 3, 4, 5, 6, 7, 63, 64, 65, 100, 124, 125, 126, 127}, gNone},
			},
		},
		// RL_MAX_MATCH is 16: a 17th match is not checked; it is counted,
		// and as it is a drop limit the packet fails closed. Each of the
		// 16 checked (rate 0) counts its own drop. Before (issue 8),
		// RL_MAX_MATCH was 8 and the ninth was only counted.
		{
			name:   "17 limits in one word",
			limits: all53(seq(0, 17)...),
			packets: []packet{
				{"first 16 checked", udp4p.bytes(), seq(0, 16), gstats{overflow: 1, failClosed: 1}},
			},
		},
		{
			name:   "17 limits, the 17th in the second word",
			limits: all53(append(seq(0, 16), 127)...),
			packets: []packet{
				{"first 16 checked", udp4p.bytes(), seq(0, 16), gstats{overflow: 1, failClosed: 1}},
			},
		},
		{
			name:   "17 limits across words",
			limits: all53(seq(56, 73)...),
			packets: []packet{
				{"first 16 checked", udp4p.bytes(), seq(56, 72), gstats{overflow: 1, failClosed: 1}},
			},
		},
		{
			// L4-unknown charging reaches more limits than the packet's
			// ports would: the 17 are every UDP limit.
			name: "17 port limits and an L4-unknown packet",
			limits: func() map[uint32]maps.Limit {
				m := make(map[uint32]maps.Limit)
				for id := range uint32(17) {
					m[id] = empty(maps.Match{Protocol: maps.UDP, DstPorts: ports(uint16(1000+id), uint16(1000+id))})
				}
				return m
			}(),
			packets: []packet{
				{"udp 1003", u4(src4, dst4, 1003), []uint32{3}, gNone},
				{"udp non-first fragment", with(udp4p, func(p *pkt) { p.fragOff = 10; p.fragID = 8 }).bytes(), seq(0, 16), gstats{overflow: 1, failClosed: 1, l4Unknown: 1, fragUnseen: 1}},
			},
		},
	}
	forEachProg(t, allProgs, func(t *testing.T, pr prog) {
		clearMap(t, fragTable(t, d))
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				install(t, d, pr.atAll(tt.limits))
				for _, p := range tt.packets {
					t.Run(p.name, func(t *testing.T) {
						want := uint32(xdpPass)
						if len(p.hit) > 0 {
							want = xdpDrop
						}
						before := snapshot(t, d)
						if got := pr.run(t, d, p.packet); got != want {
							t.Errorf("verdict %d, want %d", got, want)
						}
						checkDropped(t, before, snapshot(t, d), p.hit, len(p.packet), p.g)
					})
				}
			})
		}
	})
}

// TestParseTruncated cuts packets at every length. A packet cut inside a
// VLAN tag or its IP header passes untouched (the kernel drops it); cut
// inside its IPv6 extension header chain, its protocol is unknown; cut
// inside its TCP or UDP header, its ports are unknown (L4-unknown, parse.h);
// an ICMP header is not needed; cut in its payload, it is parsed whole.
// Before (issue 8), a packet cut inside its extension headers or its
// transport header passed untouched.
//
// Through every program: an skb cut short is the same cut to the TC
// programs (test_run builds a linear skb of the bytes given).
func TestParseTruncated(t *testing.T) {
	d := hookDatapath(t)

	const payload = 6
	tests := []struct {
		name string
		pkt  pkt
		hit  []uint32 // of the packet with its headers whole
	}{
		{"ipv4 tcp with options", with(tcp4p, func(p *pkt) { p.ipOpts = 12 }), hitTCP4},
		{"ipv4 udp", udp4p, hitUDP4},
		{"ipv4 icmp with options", with(icmp4p, func(p *pkt) { p.ipOpts = 40 }), hitICMP4},
		{"ipv6 udp with extension headers", with(udp6p, func(p *pkt) { p.ext = []uint8{0, 43, 44, 51, 60} }), hitUDP6},
		{"ipv6 tcp after ah", with(tcp6p, func(p *pkt) { p.ext = []uint8{51} }), hitTCP6},
		{"ipv6 udp after 8 destination options", with(udp6p, func(p *pkt) { p.ext = dstOpts(8) }), hitUDP6},
		{"ipv6 udp after 9 destination options", with(udp6p, func(p *pkt) { p.ext = dstOpts(9) }), unknownProto6},
		{"ipv6 udp after a mobility header", with(udp6p, func(p *pkt) { p.ext = []uint8{0, 135} }), unknownProto6},
		{"qinq udp", with(udp4p, func(p *pkt) { p.vlans = []uint16{100, 200} }), hitUDP4},
		{"4 vlan tags udp", with(udp4p, func(p *pkt) { p.vlans = []uint16{1, 2, 3, 4} }), hitUDP4},
		{"5 vlan tags udp", with(udp4p, func(p *pkt) { p.vlans = []uint16{1, 2, 3, 4, 5} }), unknownNoAddr},
		{"qinq ipv6 udp", with(udp6p, func(p *pkt) { p.vlans = []uint16{100, 200}; p.ext = []uint8{60} }), hitUDP6},
		{"icmpv6", icmp6p, hitICMP6},
		{"icmpv6 after destination options", with(icmp6p, func(p *pkt) { p.ext = []uint8{60} }), hitICMP6},
	}
	forEachProg(t, allProgs, func(t *testing.T, p prog) {
		install(t, d, p.atAll(probeLimits()))
		clearMap(t, fragTable(t, d))
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				tt.pkt.payload = payload
				full := tt.pkt.bytes()
				for n := 0; n <= len(full); n++ {
					b := slices.Clone(full[:n])
					before := snapshot(t, d)
					ret, err := p.of(t, d).Run(&ebpf.RunOptions{Data: b})
					after := snapshot(t, d)
					if !p.runnable(b) {
						// The kernel refuses a test_run buffer shorter than
						// an Ethernet header (bpf_test_init: size < ETH_HLEN
						// -> -EINVAL), so the program never sees one; a
						// driver does not hand XDP a frame that short
						// either. For an skb it refuses an IP frame shorter
						// than its IP header too (prog.runnable).
						if !errors.Is(err, unix.EINVAL) {
							t.Errorf("len %d: got verdict %d, error %v; want EINVAL from the kernel", n, ret, err)
						}
						checkDropped(t, before, after, nil, n, gNone)
						continue
					}
					if err != nil {
						t.Fatalf("len %d: %v", n, err)
					}
					hit, g, what := truncated(tt.pkt, tt.hit, n)
					want := uint32(xdpPass)
					if len(hit) > 0 {
						want = xdpDrop
					}
					if got := p.verdict(t, ret); got != want {
						t.Errorf("len %d (%s): verdict %d, want %d", n, what, got, want)
					}
					checkDropped(t, before, after, hit, n, g)
					if t.Failed() {
						t.Fatalf("stopped at len %d of %d (%s)", n, len(full), what)
					}
				}
			})
		}
	})
}

// truncated is what the probe limits see of p cut to n bytes, its headers
// whole hitting hit: the limits, how the global counters move, and where the
// cut falls.
func truncated(p pkt, hit []uint32, n int) ([]uint32, gstats, string) {
	off := 14 + 4*len(p.vlans)
	if len(p.vlans) > refMaxVLAN {
		// The tags past the fourth are not read: a frame that holds four
		// is L4-unknown without addresses.
		if n < 14+4*refMaxVLAN {
			return nil, gNone, "inside a vlan tag"
		}
		return unknownNoAddr, gL4U, "after 4 vlan tags"
	}
	if n < off {
		return nil, gNone, "inside a vlan tag"
	}
	v6 := netip.MustParseAddr(p.src).Is6()
	if !v6 {
		off += 20 + p.ipOpts
	} else {
		off += 40
	}
	if n < off {
		return nil, gNone, "inside the ip header"
	}
	if v6 {
		for i, e := range p.ext {
			if i == refMaxExtHdrs {
				return unknownProto6, gL4U, "chain longer than walked"
			}
			switch e {
			case 135, 139, 140, 253, 254:
				return unknownProto6, gL4U, "header not walked"
			}
			need := 2 // next header and length
			if e == 44 {
				need = 8
			}
			if n < off+need {
				return unknownProto6, gL4U, "inside extension header " + strconv.Itoa(i)
			}
			off += len(with(p, func(q *pkt) { q.ext = q.ext[i : i+1]; q.extLen = nil }).extHeaders())
		}
	}
	need := 0 // ICMP and other protocols: no header needed
	var anyPort []uint32
	switch {
	case p.proto == protoTCP:
		need, anyPort = 20, anyPortTCP4
		if v6 {
			anyPort = anyPortTCP6
		}
	case p.proto == protoUDP:
		need, anyPort = 8, anyPortUDP4
		if v6 {
			anyPort = anyPortUDP6
		}
	}
	if need > 0 && n < off+need {
		return anyPort, gL4U, "inside the transport header"
	}
	if n < off {
		return hit, gNone, "inside the last extension header, its next header read"
	}
	return hit, gNone, "in the payload"
}
