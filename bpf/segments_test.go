package bpf_test

import (
	"fmt"
	"testing"

	"github.com/rlagent/rlagent/maps"
)

// Issue 9, item 1: at TC a packet is an skb that may carry many segments
// (GSO on egress, GRO on ingress). A packets limit is charged each segment
// (gso_segs) and a bytes limit what the segments put on the wire: skb->len
// plus, for each segment after the first, the headers up to the end of the
// transport header, which every segment repeats. The per-limit counters
// count the same. BPF_PROG_TEST_RUN takes gso_segs and gso_size from the
// __sk_buff context (skbCtx). Before, a GSO packet cost 1 and its skb->len.

// segCase is a GSO or GRO packet: a frame, what the __sk_buff says of its
// segments, and what it puts on the wire.
type segCase struct {
	name           string
	frame          []byte
	gsoSegs        uint32
	gsoSize        uint32
	hdr            int // bytes each segment repeats: to the end of the transport header
	wantSegs       uint64
	wantWireLength uint64
}

func segCases() []segCase {
	mk := func(name string, p pkt, gsoSegs, gsoSize uint32, hdr int) segCase {
		b := p.bytes()
		segs := uint64(max(gsoSegs, 1))
		if gsoSegs == 0 && gsoSize > 0 {
			segs = uint64((len(b) - hdr + int(gsoSize) - 1) / int(gsoSize))
		}
		return segCase{name, b, gsoSegs, gsoSize, hdr, segs, uint64(len(b)) + (segs-1)*uint64(hdr)}
	}
	tcp4 := pkt{src: src4, dst: dst4, proto: protoTCP, sport: 40000, dport: 80, payload: 2896}
	return []segCase{
		// 14 + 20 + 20 bytes of headers, 2 x 1448 of payload.
		mk("ipv4 tcp, 2 segments", tcp4, 2, 1448, 14+20+20),
		// The TCP options (timestamps, here 12 bytes of NOPs) repeat too.
		mk("ipv4 tcp with options, 3 segments", with(tcp4, func(p *pkt) { p.tcpOpts = 12; p.payload = 3 * 1000 }), 3, 1000, 14+20+32),
		mk("ipv4 tcp with ip options in 802.1Q", with(tcp4, func(p *pkt) { p.ipOpts = 8; p.vlans = []uint16{5} }), 2, 1448, 14+4+28+20),
		mk("ipv6 tcp after extension headers", pkt{src: src6, dst: dst6, proto: protoTCP, sport: 1, dport: 80, ext: []uint8{0, 60}, payload: 2800}, 4, 700, 14+40+16+16+20),
		// UDP GSO (UDP_L4) or a GRO'd UDP train: the UDP header repeats.
		mk("ipv6 udp, 3 segments", pkt{src: src6, dst: dst6, proto: protoUDP, sport: 1, dport: 53, payload: 3000}, 3, 1000, 14+40+8),
		// gso_segs 0 with a gso_size: a sender that did not count its
		// segments (SKB_GSO_DODGY: a VM, a packet socket). The count comes
		// from the payload, as in the kernel's qdisc_pkt_len_init.
		mk("ipv4 tcp, segments not counted by the sender", with(tcp4, func(p *pkt) { p.payload = 2500 }), 0, 1000, 14+20+20),
		mk("ipv4 tcp, one segment", tcp4, 1, 2896, 14+20+20),
		mk("ipv4 tcp, not gso", tcp4, 0, 0, 14+20+20),
	}
}

func (c segCase) ctx(tb testing.TB) []byte {
	return skbCtx(tb, map[string]uint32{"gso_segs": c.gsoSegs, "gso_size": c.gsoSize})
}

// One admitted GSO packet: the counters of a packets limit and of a bytes
// limit count its segments and wire bytes, at every hook.
func TestSegments(t *testing.T) {
	d := hookDatapath(t)
	defer pinCPU(t, 0)()
	cases := segCases()
	forEachProg(t, tcProgs, func(t *testing.T, pr prog) {
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				if c.wantSegs < 1 || c.wantWireLength < uint64(len(c.frame)) {
					t.Fatalf("bad case: %d segments, %d wire bytes", c.wantSegs, c.wantWireLength)
				}
				fresh(t, d, 0, pr.at(maps.Limit{Rate: 1e6, Burst: 1e6}))
				fresh(t, d, 1, pr.at(maps.Limit{Rate: 1e6, Burst: 1e6, Unit: maps.Bytes}))
				if got := pr.runSkb(t, d, c.frame, c.ctx(t)); got != xdpPass {
					t.Fatalf("verdict %d, want pass", got)
				}
				want := maps.Stats{AdmittedPackets: c.wantSegs, AdmittedBytes: c.wantWireLength}
				for id := range uint32(2) {
					if got := mustStats(t, d, id); got != want {
						t.Errorf("limit %d counted %s, want %s (%d segments of %d header bytes)",
							id, nonzero(got), nonzero(want), c.wantSegs, c.hdr)
					}
				}
			})
		}
	})
}

// What a GSO packet costs: a packets limit of burst 10 admits two packets
// of 4 segments (8) and not a third (2 left); a bytes limit of twice the
// wire length admits two and not a third (the clock stopped). The XDP
// program charges a frame 1 and its length, with no skb to say more.
func TestSegmentsCost(t *testing.T) {
	d := hookDatapath(t)
	defer pinCPU(t, 0)()
	c := segCases()[3] // 4 segments
	if c.wantSegs != 4 {
		t.Fatalf("case %q has %d segments, want 4", c.name, c.wantSegs)
	}
	forEachProg(t, tcProgs, func(t *testing.T, pr prog) {
		for _, l := range []maps.Limit{
			{Rate: 1, Burst: 10},
			{Rate: 100, Burst: 2 * c.wantWireLength, Unit: maps.Bytes},
		} {
			t.Run(l.Unit.String(), func(t *testing.T) {
				fresh(t, d, 0, pr.at(l))
				var got []uint32
				for range 3 {
					got = append(got, pr.runSkb(t, d, c.frame, c.ctx(t)))
				}
				if fmt.Sprint(got) != fmt.Sprint([]uint32{xdpPass, xdpPass, xdpDrop}) {
					t.Errorf("verdicts %v, want pass, pass, drop", got)
				}
				st := mustStats(t, d, 0)
				if st.AdmittedPackets != 8 || st.DroppedPackets != 4 || st.AdmittedBytes != 2*c.wantWireLength || st.DroppedBytes != c.wantWireLength {
					t.Errorf("limit counted %s; want 8 segments and %d bytes admitted, 4 and %d dropped",
						nonzero(st), 2*c.wantWireLength, c.wantWireLength)
				}
			})
		}
	})
	t.Run("xdp", func(t *testing.T) {
		fresh(t, d, 0, maps.Limit{Rate: 1, Burst: 10})
		if got := xdpProg.run(t, d, c.frame); got != xdpPass {
			t.Fatalf("verdict %d, want pass", got)
		}
		if st := mustStats(t, d, 0); st != (maps.Stats{AdmittedPackets: 1, AdmittedBytes: uint64(len(c.frame))}) {
			t.Errorf("limit counted %s, want 1 packet of %d bytes", nonzero(st), len(c.frame))
		}
	})
}
