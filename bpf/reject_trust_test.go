package bpf_test

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"testing"

	"github.com/rlagent/rlagent/maps"
)

// testIfindex is the interface a test run's packet arrives on: test_run
// hands XDP and TC programs the loopback device's rx queue and skb.
const testIfindex = 1

// testMAC is the destination MAC of pkt's frames.
var testMAC = net.HardwareAddr{0x02, 0, 0, 0, 0, 1}

// answerHere makes the test frames' destinations the node's to answer, as
// the agent does for its uplinks and addresses: the test interface's MAC
// is testMAC, and the destinations of the reject tests are local.
func answerHere(tb testing.TB, d *maps.Datapath, dsts ...string) {
	tb.Helper()
	if len(dsts) == 0 {
		dsts = []string{"198.51.100.7", "2001:db8::7", "10.0.0.2"}
	}
	local := make(map[netip.Addr]maps.LocalKind, len(dsts))
	for _, a := range dsts {
		local[netip.MustParseAddr(a)] = maps.LocalNode
	}
	if err := d.SetLocalAddresses(local); err != nil {
		tb.Fatal(err)
	}
	if err := d.SetInterfaceMACs(map[uint32]net.HardwareAddr{testIfindex: testMAC}); err != nil {
		tb.Fatal(err)
	}
}

// TestRejectChecksums: a packet with a bad IPv4 header checksum, a SYN
// with a bad TCP checksum (over its header and options) and a SYN with
// payload are dropped unanswered, counted unanswerable: a corrupted or
// crafted packet buys no reply. A SYN whose checksum field holds its
// pseudo-header's sum (CHECKSUM_PARTIAL, as a local veth peer sends it) is
// answered, as is the same SYN with its checksum complete. On 54615ce every
// one of them was answered.
func TestRejectChecksums(t *testing.T) {
	d := hookDatapath(t)
	answerHere(t, d)
	mustSet(t, d, 1, rejectAll(maps.TCP))
	mustSet(t, d, 2, rejectAll(maps.UDP))
	if err := d.SetRejectBudget(maps.RejectBudget{PerSecond: 100_000, Burst: 100_000}); err != nil {
		t.Fatal(err)
	}
	syn4 := pkt{src: "192.0.2.1", dst: "198.51.100.7", proto: protoTCP, sport: 40001, dport: 22, tcpFlags: tcpSYN, tcpOpts: 20}
	syn6 := pkt{src: "2001:db8::1", dst: "2001:db8::7", proto: protoTCP, sport: 40002, dport: 22, tcpFlags: tcpSYN, tcpOpts: 40}
	udp4 := pkt{src: "192.0.2.1", dst: "198.51.100.7", proto: protoUDP, sport: 40005, dport: 53, payload: 30}
	flip := func(p pkt, at int) []byte { b := p.bytes(); b[at] ^= 0x40; return b }
	// partial sets the TCP checksum field to the pseudo-header's sum, as
	// the sender's stack leaves it for an offload.
	partial := func(p pkt) []byte {
		b := p.bytes()
		off := l4Off(p)
		src, dst := netip.MustParseAddr(p.src), netip.MustParseAddr(p.dst)
		binary.BigEndian.PutUint16(b[off+16:], csumFold(pseudoSum(src, dst, protoTCP, len(b)-off)))
		return b
	}
	withPayload := syn4
	withPayload.payload = 10
	withPayload6 := syn6
	withPayload6.payload = 1

	for _, tc := range []struct {
		name   string
		frame  []byte
		answer bool
	}{
		{"tcp4 syn, options", syn4.bytes(), true},
		{"tcp6 syn, options", syn6.bytes(), true},
		{"tcp4 syn, partial checksum", partial(syn4), true},
		{"tcp6 syn, partial checksum", partial(syn6), true},
		{"udp4", udp4.bytes(), true},
		{"tcp4 syn, bad ip header checksum", flip(syn4, 14+10), false},
		{"tcp4 syn, ip header changed (ttl)", flip(syn4, 14+8), false},
		{"udp4, bad ip header checksum", flip(udp4, 14+11), false},
		{"tcp4 syn, bad tcp checksum", flip(syn4, 14+20+16), false},
		{"tcp4 syn, an option changed", flip(syn4, 14+20+20+3), false},
		{"tcp6 syn, bad tcp checksum", flip(syn6, 14+40+17), false},
		{"tcp6 syn, an option changed", flip(syn6, 14+40+20+39), false},
		{"tcp4 syn with payload", withPayload.bytes(), false},
		{"tcp6 syn with payload", withPayload6.bytes(), false},
	} {
		for _, pr := range []prog{xdpProg, tcProgs[0]} {
			t.Run(tc.name+"/"+pr.name, func(t *testing.T) {
				prog, tx, drop := d.Program(), uint32(xdpTX), uint32(xdpDrop)
				if pr.tc {
					prog, tx, drop = d.TCProgram(pr.hook), tcRedirect, tcShot
				}
				before := mustGlobal(t, d)
				v, _ := runOut(t, prog, tc.frame)
				after := mustGlobal(t, d)
				answered := after.RejectRST + after.RejectICMP - before.RejectRST - before.RejectICMP
				unanswered := after.RejectUnanswered - before.RejectUnanswered
				if tc.answer {
					if v != tx || answered != 1 {
						t.Fatalf("verdict %d, %d replies counted; want %d, answered once", v, answered, tx)
					}
					return
				}
				if v != drop || answered != 0 {
					t.Fatalf("verdict %d, %d replies counted; want %d, dropped unanswered", v, answered, drop)
				}
				if unanswered != 1 {
					t.Errorf("%d counted unanswered, want 1", unanswered)
				}
			})
		}
	}
}

// TestRejectPerDestination: a flood of SYNs from 100,000 distinct spoofed
// sources, each a fresh entry of the per-destination table (which holds
// fewer), interleaved with a victim's address spoofed on every other packet:
// the victim gets at most its per-destination allowance (its burst and its
// rate over the run's time), however the flood churns the table, since an
// entry made anew starts with one reply, never a fresh burst. The node's
// budget, wide open here, would have let every one through: on 54615ce,
// which had no per-destination limit, the victim got all 100,000.
func TestRejectPerDestination(t *testing.T) {
	d := testDatapath(t)
	answerHere(t, d)
	mustSet(t, d, 1, rejectAll(maps.TCP))
	const (
		rate, burst = 100, 10
		sources     = 100_000
		step        = 5_000 // ns a packet: the run spans 1 s of the test clock
	)
	if err := d.SetRejectBudget(maps.RejectBudget{
		PerSecond: maps.MaxRejectRate, Burst: maps.MaxRejectRate,
		PerDestination: maps.ReplyRate{PerSecond: rate, Burst: burst},
	}); err != nil {
		t.Fatal(err)
	}
	setClock(t, d, 1e9, step)
	const victim = "192.0.2.1"
	victimSYN := pkt{src: victim, dst: "198.51.100.7", proto: protoTCP, sport: 40001, dport: 22, tcpFlags: tcpSYN}.bytes()
	toVictim, toFlood := 0, 0
	for i := range sources {
		src := fmt.Sprintf("10.%d.%d.%d", i>>16, i>>8&0xff, i&0xff)
		if v, _ := runOut(t, d.Program(), pkt{src: src, dst: "198.51.100.7", proto: protoTCP, sport: 40001, dport: 22, tcpFlags: tcpSYN}.bytes()); v == xdpTX {
			toFlood++
		}
		if v, _ := runOut(t, d.Program(), victimSYN); v == xdpTX {
			toVictim++
		}
	}
	g := mustGlobal(t, d)
	span := float64(2*sources*step) / 1e9
	most := burst + int(rate*span) + 1
	t.Logf("%d spoofed sources: %d answered; the victim's %d SYNs: %d answered (allowance %d: burst %d, %d/s over %.1f s); %d refused per destination",
		sources, toFlood, sources, toVictim, most, burst, rate, span, g.RejectDestBudget)
	if toVictim > most {
		t.Errorf("the victim got %d replies, more than its per-destination allowance of %d", toVictim, most)
	}
	if toVictim < int(rate*span)-1 {
		t.Errorf("the victim got %d replies, want its rate over %.1f s, %d", toVictim, span, int(rate*span))
	}
	if toFlood != sources {
		t.Errorf("%d of %d fresh sources answered, want each once (a new destination gets one reply)", toFlood, sources)
	}
	if g.RejectDestBudget != uint64(sources-toVictim) {
		t.Errorf("reject_dest_budget counted %d, want %d (the victim's SYNs refused)", g.RejectDestBudget, sources-toVictim)
	}
}

// TestRejectNotLocal: action reject answers only what is the node's: a
// unicast frame to the receiving interface's own MAC, to an address the
// node owns or delivers (the agent's rl_local: its own addresses and its
// local endpoints'). A frame to another host's MAC (a veth or promiscuous
// uplink sees them; the reply would take that host's MAC as its source), a
// packet to an address that is not the node's (the reply would come from
// it) or to a subnet's broadcast address, and any frame on an interface
// whose MAC the agent has not written, are dropped unanswered, counted
// not_local. On 54615ce every one was answered.
func TestRejectNotLocal(t *testing.T) {
	d := hookDatapath(t)
	mustSet(t, d, 1, rejectAll(maps.TCP))
	mustSet(t, d, 2, rejectAll(maps.UDP))
	if err := d.SetRejectBudget(maps.RejectBudget{PerSecond: 100_000, Burst: 100_000}); err != nil {
		t.Fatal(err)
	}
	if err := d.SetLocalAddresses(map[netip.Addr]maps.LocalKind{
		netip.MustParseAddr("198.51.100.7"): maps.LocalNode,
		netip.MustParseAddr("10.244.1.5"):   maps.LocalEndpoint,
		netip.MustParseAddr("2001:db8::7"):  maps.LocalNode,
	}); err != nil {
		t.Fatal(err)
	}
	macs := map[uint32]net.HardwareAddr{testIfindex: testMAC}
	if err := d.SetInterfaceMACs(macs); err != nil {
		t.Fatal(err)
	}
	syn := func(dst string) pkt {
		return pkt{src: "192.0.2.1", dst: dst, proto: protoTCP, sport: 40001, dport: 22, tcpFlags: tcpSYN}
	}
	udp := func(dst string) pkt {
		return pkt{src: "192.0.2.1", dst: dst, proto: protoUDP, sport: 40005, dport: 53, payload: 8}
	}
	otherMAC := func(p pkt) []byte { b := p.bytes(); b[5] = 0x99; return b }
	for _, tc := range []struct {
		name   string
		frame  []byte
		answer bool
	}{
		{"syn to a node address", syn("198.51.100.7").bytes(), true},
		{"syn to a local endpoint", syn("10.244.1.5").bytes(), true},
		{"udp6 to a node address", pkt{src: "2001:db8::1", dst: "2001:db8::7", proto: protoUDP, sport: 40006, dport: 53}.bytes(), true},
		{"syn to another host's MAC", otherMAC(syn("198.51.100.7")), false},
		{"udp to another host's MAC", otherMAC(udp("198.51.100.7")), false},
		{"syn to an address not the node's", syn("198.51.100.8").bytes(), false},
		{"udp to an address not the node's", udp("203.0.113.9").bytes(), false},
		{"udp to the subnet's broadcast address", udp("198.51.100.255").bytes(), false},
		{"syn to an endpoint of another node", syn("10.244.2.5").bytes(), false},
		{"tcp6 syn to an address not the node's", pkt{src: "2001:db8::1", dst: "2001:db8::8", proto: protoTCP, sport: 40002, dport: 22, tcpFlags: tcpSYN}.bytes(), false},
	} {
		for _, pr := range []prog{xdpProg, tcProgs[0]} {
			t.Run(tc.name+"/"+pr.name, func(t *testing.T) {
				prog, tx, drop := d.Program(), uint32(xdpTX), uint32(xdpDrop)
				if pr.tc {
					prog, tx, drop = d.TCProgram(pr.hook), tcRedirect, tcShot
				}
				before := mustGlobal(t, d)
				v, _ := runOut(t, prog, tc.frame)
				after := mustGlobal(t, d)
				answered := after.RejectRST + after.RejectICMP - before.RejectRST - before.RejectICMP
				if tc.answer {
					if v != tx || answered != 1 {
						t.Fatalf("verdict %d, %d replies counted; want %d, answered once", v, answered, tx)
					}
					return
				}
				if v != drop || answered != 0 {
					t.Fatalf("verdict %d, %d replies counted; want %d, dropped unanswered", v, answered, drop)
				}
				if n := after.RejectNotLocal - before.RejectNotLocal; n != 1 {
					t.Errorf("%d counted not_local, want 1", n)
				}
			})
		}
	}
	// An interface whose MAC the agent has not written answers nothing.
	if err := d.SetInterfaceMACs(nil); err != nil {
		t.Fatal(err)
	}
	before := mustGlobal(t, d)
	if v, _ := runOut(t, d.Program(), syn("198.51.100.7").bytes()); v != xdpDrop {
		t.Errorf("no MAC for the interface: verdict %d, want %d (dropped unanswered)", v, xdpDrop)
	}
	if n := mustGlobal(t, d).RejectNotLocal - before.RejectNotLocal; n != 1 {
		t.Errorf("no MAC for the interface: %d counted not_local, want 1", n)
	}
}
