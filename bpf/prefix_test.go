package bpf_test

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"testing"

	"github.com/rlagent/rlagent/maps"
)

// prefixModel is what a set of CIDR limits selects: limit id -> its source
// and destination prefixes (empty: that side is not restricted).
type prefixModel map[uint32][2][]netip.Prefix

// matches are the limits whose prefixes contain src and dst.
func (m prefixModel) matches(src, dst netip.Addr) []uint32 {
	var ids []uint32
	for id := range uint32(len(m)) {
		ok := true
		for side, a := range []netip.Addr{src, dst} {
			ps := m[id][side]
			if len(ps) == 0 {
				continue
			}
			in := false
			for _, p := range ps {
				in = in || p.Contains(a)
			}
			ok = ok && in
		}
		if ok {
			ids = append(ids, id)
		}
	}
	return ids
}

// TestPrefixFirstStage: the IPv4 prefix match through its first stage (one
// entry per /16) and the tries behind it selects exactly the limits whose
// prefixes contain a packet's addresses, for prefixes shorter than, equal to
// and longer than /16 nested in each other and across /16 boundaries, on
// the source and the destination side, at the edges of every prefix and at
// random addresses; and again after the limits change (a /16 stops and
// another starts being deep, a short prefix goes), so that the first
// stage's changes are written and the entries left behind are cleared.
func TestPrefixFirstStage(t *testing.T) {
	d := testDatapath(t)
	pf := netip.MustParsePrefix
	rounds := []prefixModel{
		{
			0: {{pf("10.0.0.0/8")}, nil},
			1: {{pf("10.1.0.0/16")}, nil},
			2: {{pf("10.1.2.0/24")}, nil},
			3: {{pf("10.1.2.3/32"), pf("192.168.128.0/17")}, nil},
			4: {{pf("0.0.0.0/0")}, {pf("172.16.0.0/12")}},
			5: {nil, {pf("172.16.5.0/24"), pf("10.0.0.0/7")}},
			6: {{pf("11.255.0.0/16"), pf("12.0.0.0/15")}, {pf("0.0.0.0/1")}},
		},
		{
			0: {{pf("10.0.0.0/8")}, nil},
			1: {{pf("10.1.0.0/16")}, nil},
			2: {{pf("10.1.16.0/20")}, nil}, // 10.1.2.0/24 goes: 10.1/16 is still deep
			3: {{pf("10.2.2.3/32")}, nil},  // 10.1.2.3/32 and 192.168.128.0/17 go
			4: {{pf("128.0.0.0/1")}, {pf("172.16.0.0/12")}},
			5: {nil, {pf("10.0.0.0/7")}}, // 172.16.5.0/24 goes: 172.16/16 stops being deep
			6: {{pf("11.255.0.0/16")}, {pf("0.0.0.0/1")}},
		},
	}
	r := rand.New(rand.NewPCG(12, 34))
	for round, model := range rounds {
		for id := range uint32(len(model)) {
			l := perSecond(1e9, 1e9)
			l.Action = maps.Shadow
			l.Match = maps.Match{SrcCIDRs: model[id][0], DstCIDRs: model[id][1]}
			mustSet(t, d, id, l)
		}
		// Every prefix's first and last address and their neighbours, then
		// random addresses, mostly in 10/8 and 172.16/12.
		var addrs []netip.Addr
		for id := range uint32(len(model)) {
			for _, side := range model[id] {
				for _, p := range side {
					first := p.Masked().Addr()
					last := lastAddr(p)
					addrs = append(addrs, first, last, first.Prev(), last.Next())
				}
			}
		}
		for range 300 {
			var b [4]byte
			v := r.Uint32()
			b[0], b[1], b[2], b[3] = byte(v>>24), byte(v>>16), byte(v>>8), byte(v)
			switch r.IntN(3) {
			case 0:
				b[0] = 10
			case 1:
				b[0], b[1] = 172, 16+b[1]%16
			}
			addrs = append(addrs, netip.AddrFrom4(b))
		}
		for i, a := range addrs {
			if !a.IsValid() {
				continue
			}
			// Each address as the source and, with another one, as the
			// destination.
			other := addrs[(i*7+3)%len(addrs)]
			if !other.IsValid() {
				other = netip.MustParseAddr("172.16.5.5")
			}
			for _, pair := range [][2]netip.Addr{{a, other}, {other, a}} {
				before := make([]uint64, len(model))
				for id := range uint32(len(model)) {
					s := mustStats(t, d, id)
					before[id] = s.AdmittedPackets + s.ShadowPackets
				}
				mustRun(t, d.Program(), udp4(pair[0].String(), pair[1].String(), 53))
				var got []uint32
				for id := range uint32(len(model)) {
					s := mustStats(t, d, id)
					if s.AdmittedPackets+s.ShadowPackets != before[id] {
						got = append(got, id)
					}
				}
				if want := model.matches(pair[0], pair[1]); fmt.Sprint(got) != fmt.Sprint(want) {
					t.Errorf("round %d: %s -> %s charged limits %v, want %v", round, pair[0], pair[1], got, want)
				}
			}
		}
		if t.Failed() {
			return
		}
	}
}

// lastAddr is the last address of p.
func lastAddr(p netip.Prefix) netip.Addr {
	b := p.Masked().Addr().As4()
	v := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
	v |= uint32(uint64(1)<<(32-p.Bits()) - 1)
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}
