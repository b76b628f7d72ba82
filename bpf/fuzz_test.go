package bpf_test

import (
	"encoding/binary"
	"net/netip"
	"slices"
	"strconv"
	"testing"

	"github.com/rlagent/rlagent/maps"
)

// FuzzParse runs the data path on arbitrary frames, through the XDP program
// and through tc_uplink_in, which enforce the same limits (the uplink-in
// hook; the other TC programs differ from it by that constant only). Beyond
// "no error, pass or drop", it checks the verdict and every counter against
// refModel, a model of
// bpf/include/parse.h, frag.h and the classifier written from their comments
// (the NOTE of parse.h is the spec): a frame the model does not parse moves
// no counter, and a parsed one moves exactly the counters of the limits the
// model says it matches, and the global L4-unknown and fragment counters.
// The fragment table is emptied before every frame, so that a frame's
// verdict does not depend on the frames fuzzed before it: a later fragment
// is always one whose first was not seen (FuzzChains sends whole trains).
//
// `go test ./bpf/` runs the seeds; `make test-fuzz` fuzzes.
func FuzzParse(f *testing.F) {
	for _, p := range []pkt{
		udp4p,
		with(tcp4p, func(p *pkt) { p.ipOpts = 12; p.payload = 5 }),
		icmp4p,
		with(udp4p, func(p *pkt) { p.fragOff = 185 }),
		with(udp4p, func(p *pkt) { p.vlans = []uint16{100, 200}; p.src = "10.9.8.7"; p.dport = 1500 }),
		{src: "172.16.0.1", dst: "192.168.1.1", proto: protoTCP, dport: 443},
		with(udp6p, func(p *pkt) { p.ext = []uint8{0, 43, 44, 51, 60} }),
		with(tcp6p, func(p *pkt) { p.ext = []uint8{44}; p.fragOff = 3 }),
		with(icmp6p, func(p *pkt) { p.src = "2001:db8:1::7"; p.vlans = []uint16{7} }),
		{src: "fd00::1", dst: "2001:db8::80", proto: protoTCP, dport: 80, payload: 20},
		{src: src6, dst: dst6, proto: protoGRE},
		with(udp4p, func(p *pkt) { p.vlans = []uint16{1, 2, 3} }),
	} {
		f.Add(p.bytes())
	}
	f.Add(ethFrame(0x0806, 28))
	// The bypasses of issue 8, each a frame that passed every limit before.
	for _, b := range bypassSeeds() {
		f.Add(b)
	}

	d := hookDatapath(f)
	install(f, d, fuzzLimits)
	frags := fragTable(f, d)

	f.Fuzz(func(t *testing.T, frame []byte) {
		// The kernel refuses test_run data shorter than an Ethernet header
		// with EINVAL (TestParseTruncated); above 1500 bytes is past a
		// standard MTU, and the extra bytes are payload to every path but
		// a giant extension header, whose bounds check is the same
		// arithmetic at any length.
		if len(frame) < 14 || len(frame) > 1500 {
			t.Skip()
		}
		for _, p := range fuzzProgs {
			if !p.runnable(frame) {
				continue
			}
			clearMap(t, frags)
			checkModel(t, d, p, newRefModel(), frame)
		}
	})
}

// FuzzChains builds packets from fuzzed parameters rather than bytes, so
// that the fuzzer spends its time on what parse.h and frag.h decide: IPv6
// extension header chains of 0-20 headers of any type (walkable, unwalkable
// and arbitrary numbers, of several lengths), 0-6 VLAN tags, IPv4 options,
// fragment trains (in order, reversed, without their first fragment, with a
// tiny first fragment, overlapping, with a later fragment of another
// protocol, IPv6 atomic fragments), IP lengths shorter than the frame
// (padding, tiny transport headers) and a frame cut anywhere. Every packet of
// a train is checked against refModel, which follows the fragment table
// through the train (emptied before each input).
//
// It also checks the policy itself, independently of the model: a packet
// that is not cut short, with at most RL_MAX_VLAN tags and no arbitrary
// header type, is charged to every limit that its datagram, as built,
// matches. That is "no packet walks around a limit".
func FuzzChains(f *testing.F) {
	// v6, proto, exts, vlans, fragMode, fragSize, id, cut, pad, keep, dport, payload
	f.Add(true, uint8(1), []byte{2, 2, 2, 2, 2, 2, 2}, uint8(0), uint8(0), uint8(0), uint32(1), uint16(0), uint8(0), uint8(0), uint16(53), uint8(0))
	f.Add(true, uint8(1), []byte{2, 2, 2, 2, 2, 2, 2, 2, 2}, uint8(0), uint8(0), uint8(0), uint32(1), uint16(0), uint8(0), uint8(0), uint16(53), uint8(0))
	f.Add(true, uint8(0), []byte{0, 5}, uint8(1), uint8(0), uint8(0), uint32(2), uint16(0), uint8(0), uint8(0), uint16(80), uint8(0))
	f.Add(false, uint8(0), []byte{}, uint8(0), uint8(4), uint8(0), uint32(3), uint16(0), uint8(0), uint8(8), uint16(80), uint8(40))
	f.Add(true, uint8(0), []byte{}, uint8(0), uint8(4), uint8(1), uint32(4), uint16(0), uint8(0), uint8(8), uint16(80), uint8(40))
	f.Add(false, uint8(1), []byte{}, uint8(0), uint8(1), uint8(2), uint32(5), uint16(0), uint8(0), uint8(0), uint16(53), uint8(200))
	f.Add(true, uint8(1), []byte{0}, uint8(2), uint8(2), uint8(2), uint32(6), uint16(0), uint8(0), uint8(0), uint16(53), uint8(200))
	f.Add(false, uint8(1), []byte{}, uint8(0), uint8(3), uint8(2), uint32(7), uint16(0), uint8(0), uint8(0), uint16(53), uint8(200))
	f.Add(false, uint8(0), []byte{}, uint8(0), uint8(6), uint8(3), uint32(8), uint16(0), uint8(0), uint8(0), uint16(80), uint8(60))
	f.Add(false, uint8(1), []byte{}, uint8(0), uint8(7), uint8(1), uint32(9), uint16(0), uint8(0), uint8(0), uint16(1500), uint8(60))
	f.Add(true, uint8(1), []byte{}, uint8(0), uint8(5), uint8(0), uint32(10), uint16(0), uint8(0), uint8(0), uint16(53), uint8(0))
	f.Add(false, uint8(1), []byte{}, uint8(5), uint8(0), uint8(0), uint32(0), uint16(0), uint8(0), uint8(0), uint16(53), uint8(0))
	f.Add(true, uint8(2), []byte{}, uint8(6), uint8(0), uint8(0), uint32(0), uint16(0), uint8(0), uint8(0), uint16(0), uint8(0))
	f.Add(false, uint8(1), []byte{}, uint8(0), uint8(0), uint8(0), uint32(0), uint16(0), uint8(30), uint8(4), uint16(53), uint8(0))
	f.Add(true, uint8(0), []byte{0, 1, 3, 4}, uint8(0), uint8(0), uint8(0), uint32(0), uint16(70), uint8(0), uint8(0), uint16(80), uint8(0))
	f.Add(true, uint8(3), []byte{7, 8, 9, 6, 10}, uint8(3), uint8(1), uint8(0), uint32(11), uint16(0), uint8(0), uint8(0), uint16(0), uint8(30))
	f.Add(true, uint8(1), []byte{0x12, 0x21, 0x32, 0x03, 0x30}, uint8(4), uint8(1), uint8(0), uint32(12), uint16(0), uint8(0), uint8(0), uint16(53), uint8(50))

	d := hookDatapath(f)
	install(f, d, fuzzLimits)
	frags := fragTable(f, d)

	f.Fuzz(func(t *testing.T, v6 bool, proto uint8, exts []byte, vlans, fragMode, fragSize uint8,
		id uint32, cut uint16, pad, keep uint8, dport uint16, payload uint8) {
		c := chainCase(v6, proto, exts, vlans, fragMode, fragSize, id, cut, pad, keep, dport, payload)
		// The whole train through one program, then through the other,
		// each from an empty fragment table.
		for _, p := range fuzzProgs {
			clearMap(t, frags)
			m := newRefModel()
			for i, frame := range c.frames {
				if !p.runnable(frame) {
					continue
				}
				got := checkModel(t, d, p, m, frame)
				if c.truth != nil && c.truth[i] != nil {
					checkTruth(t, *c.truth[i], got, frame)
				}
				if t.Failed() {
					t.Fatalf("%s, packet %d of %d (%s): %x", p.name, i+1, len(c.frames), c.desc, frame)
				}
			}
		}
	})
}

// chain is what FuzzChains sends: frames, and for the frames the policy
// check applies to, the datagram each belongs to.
type chain struct {
	desc   string
	frames [][]byte
	truth  []*pkt
}

// chainTypes are the extension header types FuzzChains picks from; index
// len(chainTypes) takes the fuzzed byte itself as the type.
var chainTypes = []uint8{0, 43, 60, 51, 44, 135, 139, 140, 253, 254}

func chainCase(v6 bool, proto uint8, exts []byte, vlans, fragMode, fragSize uint8,
	id uint32, cut uint16, pad, keep uint8, dport uint16, payload uint8) chain {
	p := pkt{src: "10.1.2.3", dst: "192.168.1.1", sport: 40000, dport: dport, fragID: id, payload: int(payload)}
	if v6 {
		p.src, p.dst = "2001:db8:1::7", "2001:db8::80"
	}
	exact := true // every header type is one parse.h knows
	switch proto % 8 {
	case 0:
		p.proto = protoTCP
	case 1:
		p.proto = protoUDP
	case 2:
		p.proto = protoICMP
		if v6 {
			p.proto = protoICMPv6
		}
	case 3:
		p.proto = protoGRE
	case 4:
		p.proto = 132 // SCTP
	default:
		p.proto, exact = proto, false
	}
	if len(exts) > 20 {
		exts = exts[:20]
	}
	if v6 {
		for _, b := range exts {
			t := b % uint8(len(chainTypes)+1)
			if int(t) == len(chainTypes) {
				p.ext = append(p.ext, b)
				exact = false
			} else {
				p.ext = append(p.ext, chainTypes[t])
			}
			p.extLen = append(p.extLen, b>>5) // 0-7
		}
	} else {
		p.ipOpts = 4 * (len(exts) % 11)
	}
	p.vlans = make([]uint16, vlans%7)
	for i := range p.vlans {
		p.vlans[i] = uint16(i + 1)
	}
	p.pad = int(pad % 64)

	size := 8 * (int(fragSize%16) + 1)
	whole := p
	c := chain{desc: "whole"}
	var fr [][]byte
	switch fragMode % 8 {
	case 0: // a whole datagram, its transport header cut by the IP length if keep says so
		q := p
		if keep%32 != 0 {
			q.l4Keep = int(keep % 32)
		}
		fr = [][]byte{q.bytes()}
	case 1: // a train in order
		c.desc = "train"
		fr = p.frags(size)
	case 2: // reversed: every later fragment comes before the first
		c.desc = "reversed train"
		fr = p.frags(size)
		slices.Reverse(fr)
	case 3: // the first fragment never arrives
		c.desc = "train without its first fragment"
		fr = p.frags(size)[1:]
	case 4: // a tiny first fragment, then the rest
		c.desc = "tiny first fragment"
		first := int(keep % 32)
		q := p
		q.l4Keep, q.mf = keepNone, true
		if first > 0 {
			q.l4Keep = first
		}
		if v6 && !slices.Contains(q.ext, 44) {
			q.ext = append(slices.Clone(q.ext), 44)
		}
		fr = [][]byte{q.bytes()}
		fr = append(fr, p.frags(size)[1:]...)
	case 5: // an IPv6 atomic fragment (offset 0, M clear); IPv4: a whole datagram
		c.desc = "atomic fragment"
		q := p
		if v6 && !slices.Contains(q.ext, 44) {
			q.ext = append(slices.Clone(q.ext), 44)
		}
		fr = [][]byte{q.bytes()}
	case 6: // a first fragment, one at offset 1 over it, and the rest
		c.desc = "overlapping fragments"
		fr = p.frags(size)
		q := p
		q.fragOff, q.mf = 1, true
		if v6 && !slices.Contains(q.ext, 44) {
			q.ext = append(slices.Clone(q.ext), 44)
		}
		data := p.l4()
		over := q.frame(data[min(8, len(data)):min(8+size, len(data))])
		fr = slices.Insert(fr, 1, over)
	case 7: // a later fragment of the same id but another protocol
		c.desc = "later fragment of another protocol"
		fr = p.frags(size)
		q := p
		q.proto = protoGRE
		if q.proto == p.proto {
			q.proto = protoUDP
		}
		q.fragOff, q.mf = uint16(size/8), false
		if v6 && !slices.Contains(q.ext, 44) {
			q.ext = append(slices.Clone(q.ext), 44)
		}
		fr = append(fr, q.frame(make([]byte, 8)))
		// That fragment claims another datagram: it has no truth of its own.
		c.truth = make([]*pkt, len(fr))
		for i := range fr[:len(fr)-1] {
			c.truth[i] = &whole
		}
	}
	if len(fr) > 64 {
		fr = fr[:64]
	}
	cutAt := -1
	if cut != 0 && len(fr) > 0 {
		i := int(cut>>12) % len(fr)
		n := 14 + int(cut&0xfff)%max(1, len(fr[i])-13)
		if n < len(fr[i]) {
			fr[i] = fr[i][:n]
			cutAt = i
		}
	}
	c.frames = fr
	if !exact || len(p.vlans) > 4 {
		c.truth = nil // arbitrary header types, or VLAN tags not walked: no truth
		return c
	}
	if c.truth == nil {
		c.truth = make([]*pkt, len(fr))
		for i := range fr {
			c.truth[i] = &whole
		}
	}
	if cutAt >= 0 {
		c.truth[cutAt] = nil
	}
	return c
}

// fuzzProgs are the programs the fuzz targets check: fuzzLimits are at the
// uplink-in hook, which both enforce.
var fuzzProgs = []prog{xdpProg, tcProgs[0]}

// checkModel runs frame through program p of d, checks the verdict and every
// counter against m, and returns the model's packet.
func checkModel(t *testing.T, d *maps.Datapath, p prog, m *refModel, frame []byte) refPacket {
	t.Helper()
	r, wantG := m.packet(frame)
	var hit []uint32
	drop := false
	if r.ok {
		for id, l := range fuzzLimits {
			if refMatch(l, r) {
				hit = append(hit, id)
				drop = drop || l.Action == maps.Drop
			}
		}
	}

	before := snapshot(t, d)
	ret := p.run(t, d, frame)
	after := snapshot(t, d)
	want := uint32(xdpPass)
	if drop {
		want = xdpDrop
	}
	if ret != want {
		t.Errorf("verdict %d, want %d (model: %+v, limits %v)", ret, want, r, hit)
	}
	if g := after.g.minus(before.g); g != wantG {
		t.Errorf("global counters moved by %+v, want %+v (model: %+v)", g, wantG, r)
	}
	n := uint64(len(frame))
	for id, a := range after.limits {
		b := before.limits[id]
		dAdm, dDrop, dShadow := a.AdmittedPackets-b.AdmittedPackets, a.DroppedPackets-b.DroppedPackets, a.ShadowPackets-b.ShadowPackets
		dBytes := (a.AdmittedBytes - b.AdmittedBytes) + (a.DroppedBytes - b.DroppedBytes) + (a.ShadowBytes - b.ShadowBytes)
		dKeys := (a.NewKeys - b.NewKeys) + (a.ReturnedKeys - b.ReturnedKeys)
		l := fuzzLimits[id]
		switch {
		case !slices.Contains(hit, id):
			if a != b {
				t.Errorf("limit %d does not match (model: %+v) but counted %+v -> %+v", id, r, b, a)
			}
		case l.Action == maps.Drop: // rate 0: always rejects
			if dDrop != 1 || dAdm != 0 || dShadow != 0 || dBytes != n {
				t.Errorf("limit %d matches, counted admitted %d dropped %d shadow %d bytes %d; want 1 drop of %d bytes", id, dAdm, dDrop, dShadow, dBytes, n)
			}
		case ret == xdpPass: // shadow: admitted or shadow-counted
			if dAdm+dShadow != 1 || dDrop != 0 || dBytes != n {
				t.Errorf("limit %d matches a passed packet, counted admitted %d dropped %d shadow %d bytes %d", id, dAdm, dDrop, dShadow, dBytes)
			}
		default: // shadow, packet dropped by another limit: draws nothing
			if dAdm != 0 || dDrop != 0 || dShadow > 1 {
				t.Errorf("limit %d matches a dropped packet, counted admitted %d dropped %d shadow %d", id, dAdm, dDrop, dShadow)
			}
		}
		if (l.Key == maps.KeyNone && dKeys != 0) || dKeys > 1 {
			t.Errorf("limit %d (key %v) counted %d new or returned keys", id, l.Key, dKeys)
		}
	}
	return r
}

// checkTruth fails t unless every limit that the datagram truth matches (by
// its real protocol, port and addresses) is one the model, checked against
// the data path just before, charged the packet with.
func checkTruth(t *testing.T, truth pkt, r refPacket, frame []byte) {
	t.Helper()
	tr := truthPacket(truth)
	for id, l := range fuzzLimits {
		if refMatch(l, tr) && (!r.ok || !refMatch(l, r)) {
			t.Errorf("limit %d matches the datagram (%s %s -> %s port %d) but this packet of it walked around it (parsed as %+v)",
				id, protoName(truth.proto), truth.src, truth.dst, truth.dport, r)
		}
	}
}

// truthPacket is what the classifier would read of p's datagram whole.
func truthPacket(p pkt) refPacket {
	r := refPacket{ok: true, src: netip.MustParseAddr(p.src), dst: netip.MustParseAddr(p.dst), proto: p.proto}
	r.family = 4
	if r.src.Is6() {
		r.family = 6
	}
	switch p.proto {
	case protoTCP, protoUDP:
		r.class = rcTCP
		if p.proto == protoUDP {
			r.class = rcUDP
		}
		r.hasPort, r.sport, r.dport = true, p.sport, p.dport
	case protoICMP, protoICMPv6:
		r.class = rcICMP
	default:
		r.class = rcOther
	}
	return r
}

func protoName(p uint8) string {
	switch p {
	case protoTCP:
		return "tcp"
	case protoUDP:
		return "udp"
	case protoICMP:
		return "icmp"
	case protoICMPv6:
		return "icmpv6"
	}
	return "protocol " + strconv.Itoa(int(p))
}

// bypassSeeds are the frames of issue 8 that passed every limit before, for
// FuzzParse.
func bypassSeeds() [][]byte {
	dst := func(n int) []uint8 { return slices.Repeat([]uint8{60}, n) }
	syn := with(tcp4p, func(p *pkt) { p.tcpFlags = 0x02; p.mf = true; p.fragID = 7 })
	syn6 := with(tcp6p, func(p *pkt) { p.tcpFlags = 0x02; p.mf = true; p.fragID = 7; p.ext = []uint8{44} })
	var out [][]byte
	for _, p := range []pkt{
		// Item 1: chains of 7, 8, 9 and 16 destination options headers,
		// and headers the parser does not walk.
		with(udp6p, func(p *pkt) { p.ext = dst(7) }),
		with(udp6p, func(p *pkt) { p.ext = dst(8) }),
		with(udp6p, func(p *pkt) { p.ext = dst(9) }),
		with(udp6p, func(p *pkt) { p.ext = dst(16) }),
		with(udp6p, func(p *pkt) { p.ext = []uint8{0, 135} }),
		with(tcp6p, func(p *pkt) { p.ext = []uint8{139} }),
		with(udp6p, func(p *pkt) { p.ext = []uint8{60, 253, 60} }),
		// Item 2: tiny first fragments (8 bytes of TCP, no TCP byte at
		// all, cut by the IP length inside a padded frame) and TCP at
		// offset 1.
		with(syn, func(p *pkt) { p.l4Keep = 8 }),
		with(syn, func(p *pkt) { p.l4Keep = keepNone }),
		with(syn, func(p *pkt) { p.l4Keep = 16; p.pad = 10 }),
		with(syn6, func(p *pkt) { p.l4Keep = 8 }),
		with(syn6, func(p *pkt) { p.l4Keep = 19 }),
		with(tcp4p, func(p *pkt) { p.fragOff = 1; p.fragID = 8 }),
		with(udp4p, func(p *pkt) { p.mf = true; p.l4Keep = 4; p.fragID = 9 }),
		// Item 3: later fragments (here their first is not seen).
		with(udp4p, func(p *pkt) { p.fragOff = 185; p.fragID = 10; p.payload = 100 }),
		with(udp6p, func(p *pkt) { p.ext = []uint8{44}; p.fragOff = 185; p.fragID = 10; p.payload = 100 }),
		// Item 4: 3 to 6 VLAN tags.
		with(udp4p, func(p *pkt) { p.vlans = []uint16{1, 2, 3} }),
		with(udp4p, func(p *pkt) { p.vlans = []uint16{1, 2, 3, 4} }),
		with(udp4p, func(p *pkt) { p.vlans = []uint16{1, 2, 3, 4, 5} }),
		with(tcp6p, func(p *pkt) { p.vlans = []uint16{1, 2, 3, 4, 5, 6} }),
	} {
		out = append(out, p.bytes())
	}
	return out
}

// fuzzLimits cover ports, prefixes of both families and keyed buckets. The
// drop limits have rate 0, so the verdict does not depend on bucket state;
// the keyed ones are shadow limits with a real rate, which never drop.
var fuzzLimits = map[uint32]maps.Limit{
	0: empty(maps.Match{Protocol: maps.UDP, DstPorts: ports(53, 53, 1000, 2000)}),
	1: empty(maps.Match{Protocol: maps.TCP, DstPorts: ports(80, 80, 443, 443),
		DstCIDRs: prefixes("192.168.0.0/16", "2001:db8::/32")}),
	2: empty(maps.Match{SrcCIDRs: prefixes("10.0.0.0/8", "fd00::/8")}),
	3: empty(maps.Match{Protocol: maps.ICMP, SrcCIDRs: prefixes("2001:db8:1::/48", "0.0.0.0/0")}),
	4: {Rate: 1, Burst: 1, Key: maps.KeySrcIP, Action: maps.Shadow, Match: maps.Match{Protocol: maps.UDP}},
	5: {Rate: 1000, Burst: 2000, Unit: maps.Bytes, Key: maps.KeyDstPort, Action: maps.Shadow,
		Match: maps.Match{DstCIDRs: prefixes("::/0")}},
	6: empty(maps.Match{Protocol: maps.TCP, DstPorts: ports(0, 1023)}),
	// Ports with any protocol: TCP and UDP to 53.
	7: empty(maps.Match{DstPorts: ports(53, 53)}),
}

// The model's RL_MAX_VLAN and RL_MAX_EXTHDRS: tags and IPv6 extension
// headers walked.
const (
	refMaxVLAN    = 4
	refMaxExtHdrs = 8
)

// refClass is enum rl_proto_class.
type refClass uint8

const (
	rcTCP refClass = iota
	rcUDP
	rcICMP
	rcOther
	rcUnknown // the protocol could not be found
)

// refFragKind is enum rl_frag.
type refFragKind uint8

const (
	rfNone  refFragKind = iota // a whole datagram
	rfFirst                    // offset 0, more to come
	rfLater                    // offset > 0, more to come
	rfLast                     // offset > 0, the last
)

// later reports whether a fragment carries no transport header.
func (k refFragKind) later() bool { return k == rfLater || k == rfLast }

// refPacket is what the model reads of a frame.
type refPacket struct {
	ok        bool // IP the classifier sees; false: passes untouched
	family    int  // 4, 6, or 0 when the IP header was not reached (VLAN tags)
	src, dst  netip.Addr
	class     refClass
	proto     uint8
	hasPort   bool
	sport     uint16
	dport     uint16
	l4Unknown bool
	frag      refFragKind
	fragID    uint32
	fragStart uint16 // offset, 8-byte units
	fragLen   uint16 // bytes of the datagram this fragment carries
}

// refFragKey is a datagram's identity: IPv4 (src, dst, id, protocol), IPv6
// (src, dst, id).
type refFragKey struct {
	src, dst netip.Addr
	id       uint32
	family   int
	proto    uint8
}

// refFragInfo is what a first fragment leaves for its datagram's later ones.
type refFragInfo struct {
	sport, dport       uint16
	class              refClass
	hasPort, l4Unknown bool
	next               uint16 // where the next fragment in order starts; refFragDone after the last
}

const refFragDone = 0xffff

// refModel is the data path's parser, fragment table and classifier in Go.
// It remembers the first fragments it has seen, as rl_frags does (which
// never evicts in a fuzz input: it holds 16384 datagrams).
type refModel struct {
	frags map[refFragKey]refFragInfo
}

func newRefModel() *refModel { return &refModel{frags: make(map[refFragKey]refFragInfo)} }

// packet is rl_decide up to the classifier: parse, then the fragment table.
// It returns the packet and how the global counters move.
func (m *refModel) packet(b []byte) (refPacket, gstats) {
	var g gstats
	r := refParse(b)
	if !r.ok {
		return r, g
	}
	if r.frag != rfNone {
		k := refFragKey{src: r.src, dst: r.dst, id: r.fragID, family: r.family}
		if r.family == 4 {
			k.proto = r.proto
		}
		fi, seen := m.frags[k]
		if r.frag == rfFirst {
			v := refFragInfo{r.sport, r.dport, r.class, r.hasPort, r.l4Unknown, r.fragLen >> 3}
			// Two first fragments that disagree: neither is trusted.
			if seen && (fi.sport != v.sport || fi.dport != v.dport || fi.class != v.class ||
				fi.hasPort != v.hasPort || fi.l4Unknown != v.l4Unknown) {
				v.hasPort, v.l4Unknown = false, true
				if fi.class != v.class {
					v.class = rcUnknown
				}
			}
			m.frags[k] = v
			g.fragFirst++
		} else if seen {
			// Out of order (or after the last): no longer trusted.
			if r.fragStart != fi.next {
				fi.hasPort, fi.l4Unknown = false, true
				if r.family == 6 {
					fi.class = rcUnknown
				}
			}
			fi.next = r.fragStart + r.fragLen>>3
			if r.frag == rfLast {
				fi.next = refFragDone
			}
			m.frags[k] = fi
			r.sport, r.dport, r.class, r.hasPort = fi.sport, fi.dport, fi.class, fi.hasPort
			r.l4Unknown = r.l4Unknown || fi.l4Unknown
		} else {
			r.l4Unknown = true
			// An IPv6 datagram's protocol is the one its first fragment
			// names: a later fragment's next header says nothing.
			if r.family == 6 {
				r.class = rcUnknown
			}
			g.fragUnseen++
		}
	}
	if r.l4Unknown {
		g.l4Unknown++
	}
	return r, g
}

func isVLAN(etype uint16) bool { return etype == eth8021Q || etype == eth8021A }

// refParse is parse_packet in Go.
func refParse(b []byte) (r refPacket) {
	has := func(off, n int) bool { return off+n <= len(b) }
	if !has(0, 14) {
		return r
	}
	etype := binary.BigEndian.Uint16(b[12:])
	off := 14
	for i := 0; i < refMaxVLAN && isVLAN(etype); i++ {
		if !has(off, 4) {
			return r
		}
		etype = binary.BigEndian.Uint16(b[off+2:])
		off += 4
	}
	if isVLAN(etype) {
		// More tags than walked: L4-unknown, and no addresses either.
		r.ok, r.class, r.l4Unknown = true, rcUnknown, true
		return r
	}

	l3End := int(^uint32(0)) // where the IP datagram ends, by its length field
	var proto uint8
	switch etype {
	case ethIPv4:
		if !has(off, 20) {
			return r
		}
		hlen := int(b[off]&0xf) * 4
		tot := int(binary.BigEndian.Uint16(b[off+2:]))
		if b[off]>>4 != 4 || hlen < 20 || tot < hlen || !has(off, hlen) {
			return r
		}
		r.family = 4
		r.src = netip.AddrFrom4([4]byte(b[off+12 : off+16]))
		r.dst = netip.AddrFrom4([4]byte(b[off+16 : off+20]))
		r.fragID = uint32(binary.BigEndian.Uint16(b[off+4:]))
		proto = b[off+9]
		fo := binary.BigEndian.Uint16(b[off+6:])
		r.fragStart, r.fragLen = fo&0x1fff, uint16(tot-hlen)
		switch {
		case fo&0x1fff != 0:
			r.frag = rfLater
			if fo&0x2000 == 0 {
				r.frag = rfLast
			}
			// Offset 1 overlaps the TCP flags (RFC 1858).
			if fo&0x1fff == 1 && proto == protoTCP {
				r.l4Unknown = true
			}
		case fo&0x2000 != 0:
			r.frag = rfFirst
		}
		l3End = off + tot
		off += hlen
	case ethIPv6:
		if !has(off, 40) || b[off]>>4 != 6 {
			return r
		}
		r.family = 6
		r.src = netip.AddrFrom16([16]byte(b[off+8 : off+24]))
		r.dst = netip.AddrFrom16([16]byte(b[off+24 : off+40]))
		// Payload length 0 is a jumbogram if a hop-by-hop header follows
		// (bounded by the frame); otherwise the packet is its fixed header
		// alone, as ipv6_rcv trims it.
		if plen := int(binary.BigEndian.Uint16(b[off+4:])); plen != 0 {
			l3End = off + 40 + plen
		} else if b[off+6] != 0 {
			l3End = off + 40
		}
		proto = b[off+6]
		off += 40
		found := false
		for i := 0; i < refMaxExtHdrs && !found; i++ {
			switch proto {
			case 0, 43, 60:
				if !has(off, 2) {
					return unknown6(r)
				}
				proto = b[off]
				off += (int(b[off+1]) + 1) * 8
			case 51:
				if !has(off, 2) {
					return unknown6(r)
				}
				proto = b[off]
				off += (int(b[off+1]) + 2) * 4
			case 44:
				if !has(off, 8) {
					return unknown6(r)
				}
				proto = b[off]
				fo := binary.BigEndian.Uint16(b[off+2:])
				if fo&0xfff8 != 0 {
					r.frag = rfLater
					if fo&1 == 0 {
						r.frag = rfLast
					}
				} else if fo&1 != 0 {
					r.frag = rfFirst
				}
				r.fragID = binary.BigEndian.Uint32(b[off+4:])
				off += 8
				r.fragStart = fo >> 3
				if l3End > off {
					r.fragLen = uint16(l3End - off)
				} else {
					r.fragLen = 0
				}
			case 135, 139, 140, 253, 254:
				return unknown6(r)
			default:
				found = true
			}
			if r.frag.later() {
				found = true // what follows is payload
			}
		}
		if !found {
			switch proto {
			case 0, 43, 60, 51, 44, 135, 139, 140, 253, 254:
				return unknown6(r) // the chain goes on past refMaxExtHdrs
			}
		}
	default:
		return r
	}

	r.ok, r.proto = true, proto
	need := 0
	switch proto {
	case protoTCP:
		r.class, need = rcTCP, 20
	case protoUDP:
		r.class, need = rcUDP, 8
	case protoICMP, protoICMPv6:
		r.class = rcICMP
		return r
	default:
		r.class = rcOther
		return r
	}
	if r.frag.later() {
		return r // no header here: the fragment table finds the datagram's
	}
	if !has(off, need) || off+need > l3End {
		r.l4Unknown = true // a tiny (first) fragment, or cut short
		return r
	}
	r.sport = binary.BigEndian.Uint16(b[off:])
	r.dport = binary.BigEndian.Uint16(b[off+2:])
	r.hasPort = true
	return r
}

// unknown6 is an IPv6 packet whose extension header chain hides its
// transport protocol.
func unknown6(r refPacket) refPacket {
	r.ok, r.class, r.l4Unknown, r.proto = true, rcUnknown, true, 0
	return r
}

// refClasses are the protocol classes a limit's protocol selects.
func refClasses(p maps.Protocol) []refClass {
	switch p {
	case maps.TCP:
		return []refClass{rcTCP}
	case maps.UDP:
		return []refClass{rcUDP}
	case maps.ICMP:
		return []refClass{rcICMP}
	}
	return []refClass{rcTCP, rcUDP, rcICMP, rcOther}
}

// refMatch is the classifier in Go: does l apply to r at ingress? An
// L4-unknown packet is charged to every limit whose match could include it:
// of any protocol when its protocol is unknown, whatever the ports when they
// are unknown; a limit restricted to CIDRs needs the packet's addresses.
func refMatch(l maps.Limit, r refPacket) bool {
	m := l.Match
	if m.Direction != maps.Ingress {
		return false
	}
	if r.class != rcUnknown && !slices.Contains(refClasses(m.Protocol), r.class) {
		return false
	}
	switch {
	case r.hasPort:
		// Also an IPv4 TCP fragment at offset 1 whose first fragment was
		// seen: L4-unknown, but its datagram's ports are known.
		if len(m.DstPorts) > 0 && !slices.ContainsFunc(m.DstPorts, func(p maps.PortRange) bool {
			return p.First <= r.dport && r.dport <= p.Last
		}) {
			return false
		}
	case !r.l4Unknown || (r.class != rcTCP && r.class != rcUDP && r.class != rcUnknown):
		// A packet without ports (ICMP, other protocols, also when its
		// first fragment was not seen) matches no port-restricted limit.
		if len(m.DstPorts) > 0 {
			return false
		}
	}
	// Prefix.Contains is false across families, and an IPv4-mapped IPv6
	// address is IPv6: as in the data path. A frame whose addresses were
	// not reached (family 0) matches no CIDR-restricted limit.
	in := func(list []netip.Prefix, a netip.Addr) bool {
		return len(list) == 0 || r.family != 0 && slices.ContainsFunc(list, func(p netip.Prefix) bool { return p.Contains(a) })
	}
	return in(m.SrcCIDRs, r.src) && in(m.DstCIDRs, r.dst)
}
