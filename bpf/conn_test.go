package bpf_test

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"

	"github.com/rlagent/rlagent/maps"
)

// Issue 9, item 3: unit connections. A TCP SYN without ACK, RST or FIN
// costs 1; the limit's other packets are not its at all (neither charged
// nor counted). An L4-unknown packet that could be TCP counts as one
// connection attempt; a packet known not to be TCP never does, whatever the
// limit's protocol. Before, there was no such unit (maps.Validate refused
// it).

const (
	tcpFIN = 0x01
	tcpSYN = 0x02
	tcpRST = 0x04
	tcpPSH = 0x08
	tcpACK = 0x10
	tcpECE = 0x40
	tcpCWR = 0x80
)

// withFlags is p's frame with its TCP flags byte set to flags (the builder
// reads 0 as ACK).
func withFlags(p pkt, flags uint8) []byte {
	b := p.bytes()
	off := 14 + 4*len(p.vlans) + 20 + p.ipOpts
	if netip.MustParseAddr(p.src).Is6() {
		off = 14 + 4*len(p.vlans) + 40 + len(p.extHeaders())
	}
	b[off+13] = flags
	return b
}

// flagNames prints a TCP flag set.
func flagNames(f uint8) string {
	var out []string
	for _, n := range []struct {
		bit  uint8
		name string
	}{{tcpSYN, "SYN"}, {tcpACK, "ACK"}, {tcpRST, "RST"}, {tcpFIN, "FIN"}, {tcpPSH, "PSH"}, {tcpECE, "ECE"}, {tcpCWR, "CWR"}} {
		if f&n.bit != 0 {
			out = append(out, n.name)
		}
	}
	if len(out) == 0 {
		return "none"
	}
	return fmt.Sprint(out)
}

// The 16 combinations of SYN, ACK, RST and FIN, over IPv4 and IPv6 and with
// other flags beside them, through every program, against a connections
// limit of rate 0 on TCP port 22 and one of any protocol: exactly the
// packets whose flags are SYN alone among the four are charged (dropped and
// counted); every other passes and moves no counter of either.
func TestConnectionsFlagMatrix(t *testing.T) {
	d := hookDatapath(t)
	limits := map[uint32]maps.Limit{
		0: {Unit: maps.Connections, Match: maps.Match{Protocol: maps.TCP, DstPorts: ports(22, 22)}},
		1: {Unit: maps.Connections, Match: maps.Match{Protocol: maps.AnyProtocol}},
	}
	syn4 := pkt{src: src4, dst: dst4, proto: protoTCP, sport: 40000, dport: 22}
	syn6 := pkt{src: src6, dst: dst6, proto: protoTCP, sport: 40000, dport: 22}
	forEachProg(t, allProgs, func(t *testing.T, pr prog) {
		install(t, d, pr.atAll(limits))
		for _, base := range []pkt{syn4, syn6, with(syn4, func(p *pkt) { p.vlans = []uint16{3}; p.tcpOpts = 20 }),
			with(syn6, func(p *pkt) { p.ext = []uint8{0, 60} })} {
			for f := range uint8(16) {
				flags := f&1*tcpSYN | f>>1&1*tcpACK | f>>2&1*tcpRST | f>>3&1*tcpFIN
				for _, extra := range []uint8{0, tcpPSH, tcpECE | tcpCWR} {
					flags := flags | extra
					b := withFlags(base, flags)
					attempt := flags&(tcpSYN|tcpACK|tcpRST|tcpFIN) == tcpSYN
					name := fmt.Sprintf("%d-byte %s %s", len(b), map[bool]string{true: "ipv6", false: "ipv4"}[base.src == src6], flagNames(flags))
					t.Run(name, func(t *testing.T) {
						var hit []uint32
						want := uint32(xdpPass)
						if attempt {
							hit, want = []uint32{0, 1}, xdpDrop
						}
						before := snapshot(t, d)
						if got := pr.run(t, d, b); got != want {
							t.Errorf("verdict %d, want %d (a connection attempt: %v)", got, want, attempt)
						}
						checkDropped(t, before, snapshot(t, d), hit, len(b), gNone)
					})
				}
			}
		}
	})
}

// What else is and is not a connection attempt, through every program,
// against connections limits of rate 0 (0: TCP port 22; 1: any protocol)
// and, as a witness that the packet was classified, a packets limit on the
// same hook (2: any protocol; rate 0 too).
func TestConnectionsNotTCP(t *testing.T) {
	d := hookDatapath(t)
	limits := map[uint32]maps.Limit{
		0: {Unit: maps.Connections, Match: maps.Match{Protocol: maps.TCP, DstPorts: ports(22, 22)}},
		1: {Unit: maps.Connections, Match: maps.Match{Protocol: maps.AnyProtocol}},
		2: empty(maps.Match{}),
	}
	syn4 := pkt{src: src4, dst: dst4, proto: protoTCP, sport: 40000, dport: 22, tcpFlags: tcpSYN}
	syn6 := pkt{src: src6, dst: dst6, proto: protoTCP, sport: 40000, dport: 22, tcpFlags: tcpSYN}
	first := func(p pkt, keep int, id uint32) pkt {
		p.mf, p.l4Keep, p.fragID = true, keep, id
		if p.src == src6 {
			p.ext = append(slices.Clone(p.ext), 44)
		}
		return p
	}
	type step struct {
		name string
		b    []byte
		hit  []uint32
		g    gstats
	}
	cases := []struct {
		name  string
		steps []step
	}{
		{"udp to port 22", []step{{"", pkt{src: src4, dst: dst4, proto: protoUDP, sport: 1, dport: 22}.bytes(), []uint32{2}, gNone}}},
		{"udp ipv6", []step{{"", pkt{src: src6, dst: dst6, proto: protoUDP, sport: 1, dport: 22}.bytes(), []uint32{2}, gNone}}},
		{"icmp", []step{{"", icmp4p.bytes(), []uint32{2}, gNone}}},
		{"gre", []step{{"", pkt{src: src6, dst: dst6, proto: protoGRE}.bytes(), []uint32{2}, gNone}}},
		// L4-unknown and known to be UDP: not TCP, so not an attempt.
		{"tiny udp first fragment", []step{{"", first(pkt{src: src4, dst: dst4, proto: protoUDP, sport: 1, dport: 22}, 4, 900).bytes(), []uint32{2}, gFirstL4U}}},
		// L4-unknown and possibly TCP: one attempt.
		{"tiny tcp first fragment", []step{{"", first(syn4, 8, 901).bytes(), []uint32{0, 1, 2}, gFirstL4U}}},
		{"tiny tcp first fragment ipv6", []step{{"", first(syn6, 8, 902).bytes(), []uint32{0, 1, 2}, gFirstL4U}}},
		{"ipv4 tcp at offset 1", []step{{"", with(syn4, func(p *pkt) { p.fragOff, p.fragID = 1, 903 }).bytes(), []uint32{0, 1, 2}, gUnseen}}},
		{"ipv4 later tcp fragment unseen", []step{{"", with(syn4, func(p *pkt) { p.fragOff, p.fragID = 20, 904 }).bytes(), []uint32{0, 1, 2}, gUnseen}}},
		{"ipv6 chain of 9 hides the protocol", []step{{"", with(syn6, func(p *pkt) { p.ext = dstOpts(9) }).bytes(), []uint32{0, 1, 2}, gL4U}}},
		{"5 vlan tags", []step{{"", with(syn4, func(p *pkt) { p.vlans = []uint16{1, 2, 3, 4, 5} }).bytes(), []uint32{0, 1, 2}, gL4U}}},
		// A SYN's datagram in fragments: its first fragment is the attempt,
		// the later ones are not (they are the packets limit's).
		{"fragmented syn", func() []step {
			fr := with(syn4, func(p *pkt) { p.payload, p.fragID = 100, 905 }).frags(48)
			return []step{{"first", fr[0], []uint32{0, 1, 2}, gFirst}, {"second", fr[1], []uint32{2}, gNone}, {"last", fr[2], []uint32{2}, gNone}}
		}()},
		{"fragmented syn ipv6", func() []step {
			fr := with(syn6, func(p *pkt) { p.payload, p.fragID = 100, 906 }).frags(48)
			return []step{{"first", fr[0], []uint32{0, 1, 2}, gFirst}, {"second", fr[1], []uint32{2}, gNone}, {"last", fr[2], []uint32{2}, gNone}}
		}()},
		// A whole SYN to another port: the any-protocol limit's only.
		{"syn to port 23", []step{{"", with(syn4, func(p *pkt) { p.dport = 23 }).bytes(), []uint32{1, 2}, gNone}}},
	}
	forEachProg(t, allProgs, func(t *testing.T, pr prog) {
		install(t, d, pr.atAll(limits))
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				clearMap(t, fragTable(t, d))
				for _, s := range c.steps {
					before := snapshot(t, d)
					if got := pr.run(t, d, s.b); got != xdpDrop {
						t.Errorf("%s: verdict %d, want drop (by the packets limit at least)", s.name, got)
					}
					checkDropped(t, before, snapshot(t, d), s.hit, len(s.b), s.g)
				}
			})
		}
	})
}

// Drop and shadow apply to a connections limit as to any: with burst 3 and
// the clock stopped, 3 of 5 SYNs pass a drop limit and 5 of 5 a shadow one
// (2 counted as shadow); the ACKs and data in between pass, drawing and
// counting nothing. A SYN the connections limit rejects draws nothing from
// a packets limit it also matches (all or nothing), and a keyed
// connections limit counts attempts per source.
func TestConnectionsEnforced(t *testing.T) {
	d := hookDatapath(t)
	syn := pkt{src: src4, dst: dst4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}.bytes()
	ack := pkt{src: src4, dst: dst4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpACK, payload: 100}.bytes()
	conns := maps.Limit{Rate: 1, Burst: 3, Unit: maps.Connections, Match: maps.Match{Protocol: maps.TCP}}
	forEachProg(t, allProgs, func(t *testing.T, pr prog) {
		for _, action := range []maps.Action{maps.Drop, maps.Shadow} {
			t.Run(action.String(), func(t *testing.T) {
				defer pinCPU(t, 0)() // in the subtest's own goroutine
				l := conns
				l.Action = action
				fresh(t, d, 0, pr.at(l))
				fresh(t, d, 1, pr.at(maps.Limit{Rate: 1, Burst: 100})) // packets, any
				var passed int
				for range 5 {
					if pr.run(t, d, syn) == xdpPass {
						passed++
					}
					for range 3 {
						if got := pr.run(t, d, ack); got != xdpPass {
							t.Fatalf("an ACK: verdict %d, want pass", got)
						}
					}
				}
				want, wantStats := 3, maps.Stats{AdmittedPackets: 3, AdmittedBytes: 3 * uint64(len(syn)), DroppedPackets: 2, DroppedBytes: 2 * uint64(len(syn))}
				if action == maps.Shadow {
					want = 5
					wantStats.DroppedPackets, wantStats.DroppedBytes = 0, 0
					wantStats.ShadowPackets, wantStats.ShadowBytes = 2, 2*uint64(len(syn))
				}
				if passed != want {
					t.Errorf("%d of 5 SYNs passed, want %d", passed, want)
				}
				if st := mustStats(t, d, 0); st != wantStats {
					t.Errorf("connections limit counted %s, want %s", nonzero(st), nonzero(wantStats))
				}
				// The packets limit drew for every packet that passed: the
				// SYNs the connections limit dropped drew nothing.
				if st := mustStats(t, d, 1); st.AdmittedPackets != uint64(want+15) || st.DroppedPackets != 0 {
					t.Errorf("packets limit counted %s, want %d admitted", nonzero(st), want+15)
				}
			})
		}
		t.Run("keyed by source", func(t *testing.T) {
			l := conns
			l.Key = maps.KeySrcIP
			fresh(t, d, 0, pr.at(l))
			if slices.Contains(d.IDs(), 1) {
				if err := d.DeleteLimit(1); err != nil {
					t.Fatal(err)
				}
			}
			for _, src := range []string{"10.1.0.1", "10.1.0.2"} {
				s := pkt{src: src, dst: dst4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}.bytes()
				if got := pr.passes(t, d, s, 5); got != 3 {
					t.Errorf("%s: %d of 5 SYNs passed, want its own 3", src, got)
				}
			}
		})
	})
}
