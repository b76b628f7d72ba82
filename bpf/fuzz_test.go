package bpf_test

import (
	"encoding/binary"
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/maps"
)

// FuzzParse runs the data path on arbitrary frames. Beyond "no error, pass or
// drop", it checks the verdict and every counter against refParse, a model of
// bpf/include/parse.h written from its comments: a frame the model does not
// parse moves no counter, and a parsed one moves exactly the counters of the
// limits the model says it matches.
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

	d := testDatapath(f)
	install(f, d, fuzzLimits)

	f.Fuzz(func(t *testing.T, frame []byte) {
		// The kernel refuses test_run data shorter than an Ethernet header
		// with EINVAL (TestParseTruncated); above 1500 bytes is past a
		// standard MTU, and the extra bytes are payload to every path but
		// a giant extension header, whose bounds check is the same
		// arithmetic at any length.
		if len(frame) < 14 || len(frame) > 1500 {
			t.Skip()
		}
		r := refParse(frame)
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
		ret, err := d.Program().Run(&ebpf.RunOptions{Data: frame})
		if err != nil {
			t.Fatalf("run: %v", err)
		}
		after := snapshot(t, d)
		if ret != xdpPass && ret != xdpDrop {
			t.Fatalf("verdict %d, want pass (2) or drop (1)", ret)
		}
		want := uint32(xdpPass)
		if drop {
			want = xdpDrop
		}
		if ret != want {
			t.Errorf("verdict %d, want %d (model: %+v, limits %v)", ret, want, r, hit)
		}
		if after.overflow != before.overflow {
			t.Errorf("match_overflow moved with %d limits set", len(fuzzLimits))
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
	})
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
}

// refExtHdrs is RL_MAX_EXTHDRS: the IPv6 extension headers followed; a packet
// with more is not parsed.
const refExtHdrs = 6

// refPacket is what refParse reads of a frame.
type refPacket struct {
	ok       bool
	src, dst netip.Addr
	class    maps.Protocol // TCP, UDP, ICMP, or AnyProtocol for any other
	hasPort  bool
	dport    uint16
}

// refParse is parse_packet in Go.
func refParse(b []byte) (r refPacket) {
	has := func(off, n int) bool { return off+n <= len(b) }
	if !has(0, 14) {
		return r
	}
	etype := binary.BigEndian.Uint16(b[12:])
	off := 14
	for i := 0; i < 2 && (etype == eth8021Q || etype == eth8021A); i++ {
		if !has(off, 4) {
			return r
		}
		etype = binary.BigEndian.Uint16(b[off+2:])
		off += 4
	}

	l4 := true
	var proto uint8
	switch etype {
	case ethIPv4:
		if !has(off, 20) {
			return r
		}
		hlen := int(b[off]&0xf) * 4
		if b[off]>>4 != 4 || hlen < 20 || !has(off, hlen) {
			return r
		}
		r.src = netip.AddrFrom4([4]byte(b[off+12 : off+16]))
		r.dst = netip.AddrFrom4([4]byte(b[off+16 : off+20]))
		l4 = binary.BigEndian.Uint16(b[off+6:])&0x1fff == 0
		proto = b[off+9]
		off += hlen
	case ethIPv6:
		if !has(off, 40) || b[off]>>4 != 6 {
			return r
		}
		r.src = netip.AddrFrom16([16]byte(b[off+8 : off+24]))
		r.dst = netip.AddrFrom16([16]byte(b[off+24 : off+40]))
		proto = b[off+6]
		off += 40
		for n := 0; ; n++ {
			var size int
			switch proto {
			case 0, 43, 60:
				if !has(off, 4) {
					return r
				}
				size = (int(b[off+1]) + 1) * 8
			case 51:
				if !has(off, 4) {
					return r
				}
				size = (int(b[off+1]) + 2) * 4
			case 44:
				if !has(off, 8) {
					return r
				}
				if binary.BigEndian.Uint16(b[off+2:])&0xfff8 != 0 {
					l4 = false
				}
				size = 8
			default:
				size = -1
			}
			if size < 0 {
				break
			}
			if n == refExtHdrs {
				return r
			}
			proto = b[off]
			off += size
		}
	default:
		return r
	}

	switch proto {
	case protoTCP, protoUDP:
		r.class = maps.TCP
		hdr := 20
		if proto == protoUDP {
			r.class, hdr = maps.UDP, 8
		}
		if l4 {
			if !has(off, hdr) {
				return r
			}
			r.dport = binary.BigEndian.Uint16(b[off+2:])
			r.hasPort = true
		}
	case protoICMP, protoICMPv6:
		r.class = maps.ICMP
		if l4 && !has(off, 8) {
			return r
		}
	default:
		r.class = maps.AnyProtocol
	}
	r.ok = true
	return r
}

// refMatch is the classifier in Go: does l apply to r at ingress?
func refMatch(l maps.Limit, r refPacket) bool {
	m := l.Match
	if m.Direction != maps.Ingress {
		return false
	}
	if m.Protocol != maps.AnyProtocol && m.Protocol != r.class {
		return false
	}
	if len(m.DstPorts) > 0 {
		if !r.hasPort || !slices.ContainsFunc(m.DstPorts, func(p maps.PortRange) bool {
			return p.First <= r.dport && r.dport <= p.Last
		}) {
			return false
		}
	}
	// Prefix.Contains is false across families, and an IPv4-mapped IPv6
	// address is IPv6: as in the data path.
	in := func(list []netip.Prefix, a netip.Addr) bool {
		return len(list) == 0 || slices.ContainsFunc(list, func(p netip.Prefix) bool { return p.Contains(a) })
	}
	return in(m.SrcCIDRs, r.src) && in(m.DstCIDRs, r.dst)
}
