package bpf_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"
	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/maps"
)

// Issue 14: action reject. An over-limit TCP SYN is answered with a RST/ACK
// and an over-limit UDP datagram with an ICMP (ICMPv6) port unreachable,
// built in place and sent back out of the interface (XDP_TX; at an uplink's
// TC ingress, a redirect to the same interface); every other packet is
// dropped unanswered, and so is everything beyond the node's reply budget.

const (
	xdpTX      = 3 // XDP_TX
	tcRedirect = 7 // TC_ACT_REDIRECT
)

// rejectAll is a limit with action reject that every packet of protocol
// is over: rate 0.
func rejectAll(proto maps.Protocol) maps.Limit {
	return maps.Limit{Action: maps.Reject, Match: maps.Match{Protocol: proto}}
}

// runOut runs prog once on frame and returns the verdict and the packet as
// the program left it.
func runOut(tb testing.TB, prog *ebpf.Program, frame []byte) (uint32, []byte) {
	tb.Helper()
	out := make([]byte, len(frame)+256)
	opts := &ebpf.RunOptions{Data: frame, DataOut: out}
	ret, err := prog.Run(opts)
	if err != nil {
		tb.Fatalf("run: %v", err)
	}
	return ret, opts.DataOut
}

// residue is the ones' complement of the sum of parts (RFC 1071): 0 over a
// message that holds its own checksum. Every part but the last is of even
// length (a pseudo-header), as onesSum's chaining needs.
func residue(parts ...[]byte) uint16 {
	var s uint16
	for _, p := range parts {
		s = onesSum(s, p)
	}
	return ^s
}

// reply is a decoded reply, its checksums verified.
type reply struct {
	pkt gopacket.Packet
	l3  []byte // from the IP header on
}

// decodeReply decodes b, fails tb unless it is a well-formed reply to
// orig (the MAC addresses swapped, the VLAN tags kept, the IP addresses
// swapped, TTL 64, every checksum right from scratch) and returns it.
func decodeReply(tb testing.TB, orig, b []byte) reply {
	tb.Helper()
	p := gopacket.NewPacket(b, layers.LayerTypeEthernet, gopacket.Default)
	if e := p.ErrorLayer(); e != nil {
		tb.Fatalf("the reply does not decode: %v\n% x", e.Error(), b)
	}
	eth := p.Layer(layers.LayerTypeEthernet).(*layers.Ethernet)
	if !bytes.Equal(eth.DstMAC, orig[6:12]) || !bytes.Equal(eth.SrcMAC, orig[0:6]) {
		tb.Errorf("MACs %v -> %v, want the request's swapped", eth.SrcMAC, eth.DstMAC)
	}
	op := gopacket.NewPacket(orig, layers.LayerTypeEthernet, gopacket.Default)
	var tags, otags []uint16
	for _, l := range p.Layers() {
		if v, ok := l.(*layers.Dot1Q); ok {
			tags = append(tags, v.VLANIdentifier)
		}
	}
	for _, l := range op.Layers() {
		if v, ok := l.(*layers.Dot1Q); ok {
			otags = append(otags, v.VLANIdentifier)
		}
	}
	if fmt.Sprint(tags) != fmt.Sprint(otags) {
		tb.Errorf("VLAN tags %v, want the request's %v", tags, otags)
	}
	l2 := 14 + 4*len(otags)
	if len(b) < l2 {
		tb.Fatalf("reply of %d bytes", len(b))
	}
	r := reply{pkt: p, l3: b[l2:]}
	var src, dst, osrc, odst netip.Addr
	var upper []byte
	var proto uint8
	if ip := p.Layer(layers.LayerTypeIPv4); ip != nil {
		v4 := ip.(*layers.IPv4)
		o := op.Layer(layers.LayerTypeIPv4).(*layers.IPv4)
		src, dst = netip.AddrFrom4([4]byte(v4.SrcIP.To4())), netip.AddrFrom4([4]byte(v4.DstIP.To4()))
		osrc, odst = netip.AddrFrom4([4]byte(o.SrcIP.To4())), netip.AddrFrom4([4]byte(o.DstIP.To4()))
		if v4.IHL != 5 || v4.TTL != 64 || int(v4.Length) != len(r.l3) {
			tb.Errorf("IPv4 header: ihl %d, ttl %d, length %d of %d", v4.IHL, v4.TTL, v4.Length, len(r.l3))
		}
		if c := residue(r.l3[:20]); c != 0 {
			tb.Errorf("IPv4 header checksum %#04x is wrong (residue %#04x)", v4.Checksum, c)
		}
		upper, proto = r.l3[20:], uint8(v4.Protocol)
		if proto == protoTCP {
			if c := residue(pseudo(src, dst, proto, len(upper)), upper); c != 0 {
				tb.Errorf("TCP checksum wrong (residue %#04x)", c)
			}
		} else if c := residue(upper); c != 0 {
			tb.Errorf("ICMP checksum wrong (residue %#04x)", c)
		}
	} else if ip := p.Layer(layers.LayerTypeIPv6); ip != nil {
		v6 := ip.(*layers.IPv6)
		o := op.Layer(layers.LayerTypeIPv6).(*layers.IPv6)
		src, dst = netip.AddrFrom16([16]byte(v6.SrcIP)), netip.AddrFrom16([16]byte(v6.DstIP))
		osrc, odst = netip.AddrFrom16([16]byte(o.SrcIP)), netip.AddrFrom16([16]byte(o.DstIP))
		if v6.HopLimit != 64 || int(v6.Length)+40 != len(r.l3) {
			tb.Errorf("IPv6 header: hop limit %d, payload length %d of %d", v6.HopLimit, v6.Length, len(r.l3)-40)
		}
		upper, proto = r.l3[40:], uint8(v6.NextHeader)
		if c := residue(pseudo(src, dst, proto, len(upper)), upper); c != 0 {
			tb.Errorf("%v checksum wrong (residue %#04x)", v6.NextHeader, c)
		}
	} else {
		tb.Fatalf("the reply has no IP layer:\n%v", p)
	}
	if src != odst || dst != osrc {
		tb.Errorf("reply %v -> %v, want %v -> %v", src, dst, odst, osrc)
	}
	return r
}

// checkRST fails tb unless r is the RST/ACK to the SYN orig whose sequence
// number is seq and which carries payload bytes.
func checkRST(tb testing.TB, r reply, orig []byte, seq uint32, payload int) {
	tb.Helper()
	l := r.pkt.Layer(layers.LayerTypeTCP)
	if l == nil {
		tb.Fatalf("no TCP layer in the reply:\n%v", r.pkt)
	}
	tcp := l.(*layers.TCP)
	o := gopacket.NewPacket(orig, layers.LayerTypeEthernet, gopacket.Default).Layer(layers.LayerTypeTCP).(*layers.TCP)
	if !tcp.RST || !tcp.ACK || tcp.SYN || tcp.FIN || tcp.PSH {
		tb.Errorf("flags: RST %v ACK %v SYN %v FIN %v, want RST and ACK only", tcp.RST, tcp.ACK, tcp.SYN, tcp.FIN)
	}
	if tcp.Seq != 0 || tcp.Ack != seq+1+uint32(payload) {
		tb.Errorf("seq %d ack %d, want 0 and %d (the SYN's seq + 1 + %d bytes)", tcp.Seq, tcp.Ack, seq+1+uint32(payload), payload)
	}
	if tcp.SrcPort != o.DstPort || tcp.DstPort != o.SrcPort || tcp.DataOffset != 5 || tcp.Window != 0 || len(tcp.Payload) != 0 {
		tb.Errorf("ports %d -> %d (want %d -> %d), data offset %d, window %d, %d bytes of payload",
			tcp.SrcPort, tcp.DstPort, o.DstPort, o.SrcPort, tcp.DataOffset, tcp.Window, len(tcp.Payload))
	}
}

// checkUnreach fails tb unless r is the port unreachable for the UDP
// datagram orig, quoting its IP header and its UDP header.
func checkUnreach(tb testing.TB, r reply, orig []byte, l2 int) {
	tb.Helper()
	var typ, code uint8
	var quote []byte
	if l := r.pkt.Layer(layers.LayerTypeICMPv4); l != nil {
		ic := l.(*layers.ICMPv4)
		typ, code = ic.TypeCode.Type(), ic.TypeCode.Code()
		quote = r.l3[28:]
		if typ != 3 || code != 3 {
			tb.Errorf("ICMP type %d code %d, want 3/3 (port unreachable)", typ, code)
		}
		if want := orig[l2 : l2+28]; !bytes.Equal(quote, want) {
			tb.Errorf("quoted\n% x\nwant the datagram's IP and UDP headers\n% x", quote, want)
		}
		return
	}
	if l := r.pkt.Layer(layers.LayerTypeICMPv6); l != nil {
		ic := l.(*layers.ICMPv6)
		typ, code = ic.TypeCode.Type(), ic.TypeCode.Code()
		quote = r.l3[48:]
		if typ != 1 || code != 4 {
			tb.Errorf("ICMPv6 type %d code %d, want 1/4 (port unreachable)", typ, code)
		}
		if want := orig[l2 : l2+48]; !bytes.Equal(quote, want) {
			tb.Errorf("quoted\n% x\nwant the datagram's IPv6 and UDP headers\n% x", quote, want)
		}
		return
	}
	tb.Fatalf("no ICMP layer in the reply:\n%v", r.pkt)
}

// withSeq sets the TCP sequence number of p's frame.
func withSeq(b []byte, off int, seq uint32) []byte {
	// The checksum moves with the words replaced (RFC 1624).
	sum := uint32(^binary.BigEndian.Uint16(b[off+16:]))
	sum += uint32(^binary.BigEndian.Uint16(b[off+4:])) + uint32(^binary.BigEndian.Uint16(b[off+6:]))
	binary.BigEndian.PutUint32(b[off+4:], seq)
	sum += uint32(binary.BigEndian.Uint16(b[off+4:])) + uint32(binary.BigEndian.Uint16(b[off+6:]))
	binary.BigEndian.PutUint16(b[off+16:], ^csumFold(sum))
	return b
}

// l4Off is where p's transport header starts in its frame.
func l4Off(p pkt) int {
	if netip.MustParseAddr(p.src).Is6() {
		return 14 + 4*len(p.vlans) + 40 + len(p.extHeaders())
	}
	return 14 + 4*len(p.vlans) + 20 + p.ipOpts
}

// TestRejectReplies: the replies' bytes, from XDP and from an uplink's TC
// ingress, decoded with gopacket and their checksums computed here.
func TestRejectReplies(t *testing.T) {
	d := hookDatapath(t)
	answerHere(t, d)
	mustSet(t, d, 1, rejectAll(maps.TCP))
	mustSet(t, d, 2, rejectAll(maps.UDP))
	mustSet(t, d, 3, rejectAll(maps.ICMP))
	if err := d.SetRejectBudget(maps.RejectBudget{PerSecond: 100_000, Burst: 100_000}); err != nil {
		t.Fatal(err)
	}
	const seq = 0x01020304
	for _, tc := range []struct {
		name    string
		p       pkt
		payload int // a SYN's payload
	}{
		{"tcp4 syn", pkt{src: "192.0.2.1", dst: "198.51.100.7", proto: protoTCP, sport: 40001, dport: 22, tcpFlags: tcpSYN}, 0},
		{"tcp4 syn with options", pkt{src: "192.0.2.1", dst: "198.51.100.7", proto: protoTCP, sport: 40001, dport: 22, tcpFlags: tcpSYN, tcpOpts: 12}, 0},
		{"tcp6 syn", pkt{src: "2001:db8::1", dst: "2001:db8::7", proto: protoTCP, sport: 40002, dport: 443, tcpFlags: tcpSYN}, 0},
		{"tcp4 syn vlan", pkt{vlans: []uint16{7}, src: "192.0.2.1", dst: "198.51.100.7", proto: protoTCP, sport: 40003, dport: 22, tcpFlags: tcpSYN}, 0},
		{"tcp6 syn qinq", pkt{vlans: []uint16{100, 7}, src: "2001:db8::1", dst: "2001:db8::7", proto: protoTCP, sport: 40004, dport: 22, tcpFlags: tcpSYN}, 0},
		{"udp4", pkt{src: "192.0.2.1", dst: "198.51.100.7", proto: protoUDP, sport: 40005, dport: 53, payload: 30}, 0},
		{"udp4 empty", pkt{src: "192.0.2.1", dst: "198.51.100.7", proto: protoUDP, sport: 40005, dport: 53}, 0},
		{"udp6", pkt{src: "2001:db8::1", dst: "2001:db8::7", proto: protoUDP, sport: 40006, dport: 53, payload: 100}, 0},
		{"udp4 vlan", pkt{vlans: []uint16{7}, src: "192.0.2.1", dst: "198.51.100.7", proto: protoUDP, sport: 40007, dport: 53, payload: 3}, 0},
		{"udp6 qinq", pkt{vlans: []uint16{100, 7}, src: "2001:db8::1", dst: "2001:db8::7", proto: protoUDP, sport: 40008, dport: 53, payload: 1400}, 0},
	} {
		for _, pr := range []prog{xdpProg, tcProgs[0]} {
			t.Run(tc.name+"/"+pr.name, func(t *testing.T) {
				frame := tc.p.bytes()
				if tc.p.proto == protoTCP {
					frame = withSeq(frame, l4Off(tc.p), seq)
				}
				before, _ := d.GlobalStats()
				prog := d.Program()
				want := uint32(xdpTX)
				if pr.tc {
					prog, want = d.TCProgram(pr.hook), tcRedirect
				}
				verdict, out := runOut(t, prog, frame)
				if verdict != want {
					t.Fatalf("verdict %d, want %d", verdict, want)
				}
				r := decodeReply(t, frame, out)
				after, _ := d.GlobalStats()
				if tc.p.proto == protoTCP {
					checkRST(t, r, frame, seq, tc.payload)
					if after.RejectRST-before.RejectRST != 1 {
						t.Errorf("reject_rst counted %d, want 1", after.RejectRST-before.RejectRST)
					}
				} else {
					checkUnreach(t, r, frame, 14+4*len(tc.p.vlans))
					if after.RejectICMP-before.RejectICMP != 1 {
						t.Errorf("reject_icmp counted %d, want 1", after.RejectICMP-before.RejectICMP)
					}
				}
			})
		}
	}
}

// TestRejectUnanswered: what a hostile sender could make the node answer
// (an answer to an answer, a reflection to a broadcast or a spoofed
// non-unicast source, a reply to a fragment or to a packet whose headers
// the reply would not carry) is dropped unanswered, and counted; so is
// everything at an endpoint's interface.
func TestRejectUnanswered(t *testing.T) {
	d := hookDatapath(t)
	answerHere(t, d)
	mustSet(t, d, 1, rejectAll(maps.TCP))
	mustSet(t, d, 2, rejectAll(maps.UDP))
	mustSet(t, d, 3, rejectAll(maps.ICMP)) // ICMP and ICMPv6
	if err := d.SetRejectBudget(maps.RejectBudget{PerSecond: 100_000, Burst: 100_000}); err != nil {
		t.Fatal(err)
	}
	syn := pkt{src: "192.0.2.1", dst: "198.51.100.7", proto: protoTCP, sport: 40001, dport: 22, tcpFlags: tcpSYN}
	udp := pkt{src: "192.0.2.1", dst: "198.51.100.7", proto: protoUDP, sport: 40005, dport: 53, payload: 30}
	udp6 := pkt{src: "2001:db8::1", dst: "2001:db8::7", proto: protoUDP, sport: 40006, dport: 53, payload: 30}
	with := func(p pkt, f func(*pkt)) pkt { f(&p); return p }
	frameWith := func(p pkt, f func([]byte)) []byte { b := p.bytes(); f(b); return b }
	cases := []struct {
		name  string
		frame []byte
	}{
		{"tcp ack (data)", with(syn, func(p *pkt) { p.tcpFlags = tcpACK | tcpPSH; p.payload = 100 }).bytes()},
		{"tcp rst", with(syn, func(p *pkt) { p.tcpFlags = tcpRST }).bytes()},
		{"tcp syn-ack", with(syn, func(p *pkt) { p.tcpFlags = tcpSYN | tcpACK }).bytes()},
		{"tcp syn-fin", with(syn, func(p *pkt) { p.tcpFlags = tcpSYN | tcpFIN }).bytes()},
		{"tcp syn-rst", with(syn, func(p *pkt) { p.tcpFlags = tcpSYN | tcpRST }).bytes()},
		{"icmp echo", pkt{src: "192.0.2.1", dst: "198.51.100.7", proto: protoICMP}.bytes()},
		{"icmpv6 echo", pkt{src: "2001:db8::1", dst: "2001:db8::7", proto: protoICMPv6}.bytes()},
		{"icmp port unreachable", frameWith(pkt{src: "192.0.2.1", dst: "198.51.100.7", proto: protoICMP}, func(b []byte) { b[34], b[35] = 3, 3 })},
		{"udp first fragment", with(udp, func(p *pkt) { p.mf = true; p.fragID = 9 }).bytes()},
		{"udp6 first fragment", with(udp6, func(p *pkt) { p.ext = []uint8{44}; p.mf = true; p.fragID = 9 }).bytes()},
		{"udp ipv4 options", with(udp, func(p *pkt) { p.ipOpts = 4 }).bytes()},
		{"tcp syn ipv4 options", with(syn, func(p *pkt) { p.ipOpts = 8 }).bytes()},
		{"udp6 hop-by-hop", with(udp6, func(p *pkt) { p.ext = []uint8{0} }).bytes()},
		{"udp6 destination options", with(udp6, func(p *pkt) { p.ext = []uint8{60} }).bytes()},
		{"udp to broadcast mac", frameWith(udp, func(b []byte) { copy(b[0:6], []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}) })},
		{"udp to multicast mac", frameWith(udp, func(b []byte) { copy(b[0:6], []byte{0x01, 0x00, 0x5e, 0, 0, 1}) })},
		{"udp from multicast mac", frameWith(udp, func(b []byte) { b[6] |= 1 })},
		{"udp to 255.255.255.255", with(udp, func(p *pkt) { p.dst = "255.255.255.255" }).bytes()},
		{"udp to 224.0.0.251", with(udp, func(p *pkt) { p.dst = "224.0.0.251" }).bytes()},
		{"udp from 0.0.0.0", with(udp, func(p *pkt) { p.src = "0.0.0.0" }).bytes()},
		{"udp from 127.0.0.1", with(udp, func(p *pkt) { p.src = "127.0.0.1" }).bytes()},
		{"udp from 224.0.0.1", with(udp, func(p *pkt) { p.src = "224.0.0.1" }).bytes()},
		{"udp from 255.255.255.255", with(udp, func(p *pkt) { p.src = "255.255.255.255" }).bytes()},
		{"tcp syn from 240.0.0.1", with(syn, func(p *pkt) { p.src = "240.0.0.1" }).bytes()},
		{"udp6 from ::", with(udp6, func(p *pkt) { p.src = "::" }).bytes()},
		{"udp6 from ::1", with(udp6, func(p *pkt) { p.src = "::1" }).bytes()},
		{"udp6 from ff02::1", with(udp6, func(p *pkt) { p.src = "ff02::1" }).bytes()},
		{"udp6 from ::ffff:192.0.2.1", with(udp6, func(p *pkt) { p.src = "::ffff:192.0.2.1" }).bytes()},
		{"udp6 to ff02::1", with(udp6, func(p *pkt) { p.dst = "ff02::1" }).bytes()},
		{"udp cut short", with(udp, func(p *pkt) { p.l4Keep = 4 }).bytes()},
		{"tcp syn cut short", with(syn, func(p *pkt) { p.l4Keep = 12 }).bytes()},
	}
	for _, tc := range cases {
		for _, pr := range []prog{xdpProg, tcProgs[0]} {
			t.Run(tc.name+"/"+pr.name, func(t *testing.T) {
				before, _ := d.GlobalStats()
				prog, want := d.Program(), uint32(xdpDrop)
				if pr.tc {
					prog, want = d.TCProgram(pr.hook), tcShot
				}
				verdict, out := runOut(t, prog, tc.frame)
				after, _ := d.GlobalStats()
				if verdict != want {
					t.Fatalf("verdict %d, want %d (dropped unanswered)", verdict, want)
				}
				if !bytes.Equal(out, tc.frame) {
					t.Errorf("the dropped packet was rewritten:\n% x\nwas\n% x", out, tc.frame)
				}
				if sent := after.RejectRST + after.RejectICMP - before.RejectRST - before.RejectICMP; sent != 0 {
					t.Errorf("%d replies counted", sent)
				}
			})
		}
	}
	// At an endpoint's interface the packet is past DNAT: dropped
	// unanswered, counted.
	mustSet(t, d, 5, maps.Limit{Action: maps.Reject, Match: maps.Match{Protocol: maps.UDP, Attach: maps.Endpoints}})
	before, _ := d.GlobalStats()
	if v, _ := runOut(t, d.TCProgram(maps.EndpointIn), udp.bytes()); v != tcShot {
		t.Errorf("at an endpoint's interface: verdict %d, want %d (dropped unanswered)", v, tcShot)
	}
	after, _ := d.GlobalStats()
	if after.RejectUnanswered-before.RejectUnanswered != 1 {
		t.Errorf("at an endpoint's interface: %d counted unanswered, want 1", after.RejectUnanswered-before.RejectUnanswered)
	}
}

// TestRejectBudget: the node's budget bounds the replies, whatever the
// packets: its burst at once, then its rate; beyond it a reject is a drop,
// counted; a rewrite hands out no fresh burst; a budget of 0 sends none.
// On the test clock, which the budget runs on as the limits do, so that
// every count is exact.
func TestRejectBudget(t *testing.T) {
	d := testDatapath(t)
	answerHere(t, d)
	mustSet(t, d, 1, rejectAll(maps.TCP))
	const rate, burst, n = 100, 20, 2000
	if err := d.SetRejectBudget(maps.RejectBudget{PerSecond: rate, Burst: burst}); err != nil {
		t.Fatal(err)
	}
	syn := pkt{src: "192.0.2.1", dst: "198.51.100.7", proto: protoTCP, sport: 40001, dport: 22, tcpFlags: tcpSYN}.bytes()
	count := func(n int) (tx int) {
		for range n {
			if v, _ := runOut(t, d.Program(), syn); v == xdpTX {
				tx++
			} else if v != xdpDrop {
				t.Fatalf("verdict %d", v)
			}
		}
		return tx
	}

	// 2,000 SYNs over 2 s, one a millisecond: the burst, then one reply
	// every 10 ms.
	before := mustGlobal(t, d)
	setClock(t, d, 1e9, 1e6)
	tx := count(n)
	after := mustGlobal(t, d)
	want := burst + n/10
	t.Logf("%d SYNs over 2 s: %d answered (budget %d/s, burst %d), %d over budget", n, tx, rate, burst, after.RejectBudget-before.RejectBudget)
	if tx < want-1 || tx > want+1 {
		t.Errorf("%d answered, want the burst and 2 s of the rate, %d (+-1)", tx, want)
	}
	if got := after.RejectRST - before.RejectRST; got != uint64(tx) {
		t.Errorf("reject_rst counted %d, %d were sent", got, tx)
	}
	if got := after.RejectBudget - before.RejectBudget; got != uint64(n-tx) {
		t.Errorf("reject_budget counted %d, want %d", got, n-tx)
	}
	if s := mustStats(t, d, 1); s.DroppedPackets != n {
		t.Errorf("the limit counted %d dropped, want %d: an answered packet is a dropped one", s.DroppedPackets, n)
	}

	// The clock stands. A rewrite of the budget hands out no fresh burst:
	// at twice the rate, the same burst is half the time, which the
	// replies sent already fill.
	now, err := d.TestClock()
	if err != nil {
		t.Fatal(err)
	}
	setClock(t, d, now, 0)
	if tx := count(burst); tx != 0 {
		t.Errorf("the budget spent and the clock standing: %d answered, want 0", tx)
	}
	if err := d.SetRejectBudget(maps.RejectBudget{PerSecond: 2 * rate, Burst: burst}); err != nil {
		t.Fatal(err)
	}
	if tx := count(10); tx != 0 {
		t.Errorf("answered %d right after the budget was rewritten: the rewrite handed out a fresh burst", tx)
	}
	if err := d.SetRejectBudget(maps.RejectBudget{}); err != nil {
		t.Fatal(err)
	}
	setClock(t, d, 100e9, 1e9)
	for range 10 {
		if v, _ := runOut(t, d.Program(), syn); v != xdpDrop {
			t.Fatalf("budget 0: verdict %d, want %d", v, xdpDrop)
		}
	}
	for _, bad := range []maps.RejectBudget{{PerSecond: 10, Burst: 0}, {PerSecond: 10, Burst: 11}, {PerSecond: maps.MaxRejectRate + 1, Burst: 1}} {
		if err := d.SetRejectBudget(bad); err == nil {
			t.Errorf("SetRejectBudget(%+v) accepted", bad)
		}
	}
}

// TestRejectBudgetTick: on the production clock, which moves a jiffy at a
// time, a budget whose burst is less than a tick of its rate still has the
// whole rate (the burst is raised to a tick of it): 100,000/s with a burst
// of 1 answers a tick's worth of SYNs sent as fast as test_run goes, where a
// GCRA of a 10 us tolerance on a 4 ms clock would answer about one a tick.
// And no more than the rate over the run and that raised burst.
func TestRejectBudgetTick(t *testing.T) {
	d := newDatapath(t, maps.Options{XDPOnly: true})
	answerHere(t, d)
	mustSet(t, d, 1, rejectAll(maps.TCP))
	const rate, n = maps.MaxRejectRate, 2000
	if err := d.SetRejectBudget(maps.RejectBudget{PerSecond: rate, Burst: 1}); err != nil {
		t.Fatal(err)
	}
	var res unix.Timespec
	if err := unix.ClockGetres(unix.CLOCK_MONOTONIC_COARSE, &res); err != nil {
		t.Fatal(err)
	}
	tick := time.Duration(res.Nano())
	tickWorth := int(tick.Seconds() * rate)
	syn := pkt{src: "192.0.2.1", dst: "198.51.100.7", proto: protoTCP, sport: 40001, dport: 22, tcpFlags: tcpSYN}.bytes()
	began := time.Now()
	tx := 0
	for range n {
		if v, _ := runOut(t, d.Program(), syn); v == xdpTX {
			tx++
		}
	}
	wall := time.Since(began)
	most := tickWorth + int((wall+tick).Seconds()*rate) + 1
	t.Logf("%d SYNs in %v (tick %v): %d answered, want at least %d, at most %d", n, wall, tick, tx, min(n, tickWorth), most)
	if tx < min(n, tickWorth) || tx > most {
		t.Errorf("%d answered, want between a tick's worth of the rate %d and %d", tx, min(n, tickWorth), most)
	}
}

// TestRejectPrecedence: of the limits that reject one packet, one with
// action reject makes it answered (the client learns it is limited); a
// packet only a drop limit rejects is dropped unanswered, and one that a
// reject limit admits passes.
func TestRejectPrecedence(t *testing.T) {
	d := testDatapath(t)
	answerHere(t, d)
	if err := d.SetRejectBudget(maps.RejectBudget{PerSecond: 100_000, Burst: 100_000}); err != nil {
		t.Fatal(err)
	}
	syn := func(dport uint16) []byte {
		return pkt{src: "192.0.2.1", dst: "198.51.100.7", proto: protoTCP, sport: 40001, dport: dport, tcpFlags: tcpSYN}.bytes()
	}
	port := func(p uint16) []maps.PortRange { return []maps.PortRange{{First: p, Last: p}} }
	// Port 22: a drop limit and a reject limit, both at rate 0.
	mustSet(t, d, 1, maps.Limit{Action: maps.Drop, Match: maps.Match{Protocol: maps.TCP, DstPorts: port(22)}})
	mustSet(t, d, 2, maps.Limit{Action: maps.Reject, Match: maps.Match{Protocol: maps.TCP, DstPorts: port(22)}})
	// Port 23: a drop limit at rate 0 and a reject limit with tokens.
	mustSet(t, d, 3, maps.Limit{Action: maps.Drop, Match: maps.Match{Protocol: maps.TCP, DstPorts: port(23)}})
	mustSet(t, d, 4, maps.Limit{Action: maps.Reject, Rate: 1000, Burst: 1000, Match: maps.Match{Protocol: maps.TCP, DstPorts: port(23)}})
	// Port 24: a shadow limit at rate 0 and a reject limit at rate 0.
	mustSet(t, d, 5, maps.Limit{Action: maps.Shadow, Match: maps.Match{Protocol: maps.TCP, DstPorts: port(24)}})
	mustSet(t, d, 6, maps.Limit{Action: maps.Reject, Match: maps.Match{Protocol: maps.TCP, DstPorts: port(24)}})
	// Port 25: a reject limit with tokens only.
	mustSet(t, d, 7, maps.Limit{Action: maps.Reject, Rate: 1000, Burst: 1000, Match: maps.Match{Protocol: maps.TCP, DstPorts: port(25)}})
	for _, tc := range []struct {
		port uint16
		want uint32
		why  string
	}{
		{22, xdpTX, "drop and reject both reject: reject wins"},
		{23, xdpDrop, "only the drop limit rejects: dropped unanswered"},
		{24, xdpTX, "shadow and reject over: answered"},
		{25, xdpPass, "the reject limit has the tokens: passed"},
	} {
		if v, _ := runOut(t, d.Program(), syn(tc.port)); v != tc.want {
			t.Errorf("port %d: verdict %d, want %d (%s)", tc.port, v, tc.want, tc.why)
		}
	}
}
