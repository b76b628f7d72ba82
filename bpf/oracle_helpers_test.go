package bpf_test

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
	"github.com/rlagent/rlagent/maps"
)

// The kernel as the oracle: crafted datagrams go over a veth pair into a
// namespace with listening sockets; the data path, attached with XDP to the
// receiving end, counts in shadow probe limits what it charged each frame
// to; the sockets say what the kernel delivered. See oracle_test.go.

// Where the oracle's datagrams go: two UDP ports and a TCP port, listened
// on in the receiving namespace, each with a probe limit of its own.
const (
	orcPortP = 7001 // udp
	orcPortQ = 7002 // udp
	orcPortT = 7003 // tcp
)

// Probe limits, by id. orcAll matches every frame from the spoofed sources
// (the test's frames, markers included, and nothing the kernels send): it
// tells when the data path has seen a frame.
const (
	orcAll = iota
	orcUDPP
	orcUDPQ
	orcTCPT
	orcLimits
)

var orcNet4, orcNet6 = netip.MustParsePrefix("10.203.0.0/24"), netip.MustParsePrefix("fd00:203::/64")

// The sources of the crafted frames: in the subnet, on no interface. The
// receiver answers them (SYN-ACKs, ICMP errors) through a permanent
// neighbor entry to the sender's veth, where the sending namespace drops
// them (not its address, no forwarding) and sends no RST or error back.
var orcSrc4, orcSrc6 = netip.MustParseAddr("10.203.0.9"), netip.MustParseAddr("fd00:203::9")

// orcPayloadMagic starts every UDP payload the generator makes; the marker
// that closes a train starts with orcMarkerMagic. Both are followed by a
// sequence number.
const (
	orcPayloadMagic = "ORCL"
	orcMarkerMagic  = "MARK"
)

// orcEnv is the oracle's world.
type orcEnv struct {
	tb         testing.TB
	pair       *nettest.Pair
	d          *maps.Datapath
	tx         *nettest.PacketConn // in A: sends the frames, receives SYN-ACKs
	macA, macB net.HardwareAddr
	udpP, udpQ *net.UDPConn
	link       link.Link // the XDP attachment

	nextID   uint32 // fragment identification, per datagram
	nextPort uint16 // source port, per datagram
	nextSeq  uint64 // payload tags and markers
}

// newOracleEnv builds the namespaces, loads the data path with the probe
// limits in shadow and attaches it to the receiving veth in mode.
func newOracleEnv(tb testing.TB, mode link.XDPAttachFlags) *orcEnv {
	tb.Helper()
	testenv.RequireRoot(tb)
	e := &orcEnv{tb: tb, nextID: uint32(rand.Uint32()), nextPort: 20000, nextSeq: 1}
	e.pair = nettest.MustPair(tb, nettest.PairConfig{
		NameA: "oracle-tx", NameB: "oracle-rx", IfA: "orc-tx", IfB: "orc-rx",
		Subnet4: orcNet4, Subnet6: orcNet6,
	})
	p := e.pair
	for _, end := range []struct {
		ns *nettest.NS
		If string
	}{{p.A, p.IfA}, {p.B, p.IfB}} {
		if err := end.ns.SetChecksumOffload(end.If, false); err != nil {
			tb.Fatal(err)
		}
	}
	var err error
	if e.macA, err = p.A.MAC(p.IfA); err != nil {
		tb.Fatal(err)
	}
	if e.macB, err = p.B.MAC(p.IfB); err != nil {
		tb.Fatal(err)
	}
	for _, a := range []netip.Addr{orcSrc4, orcSrc6} {
		if err := p.B.AddNeighbor(p.IfB, a, e.macA); err != nil {
			tb.Fatal(err)
		}
	}
	// Trains with a fragment missing leave datagrams in the receiver's
	// reassembly memory until they time out (30 s, 60 s for IPv6); at the
	// default 4 MiB a long run would fill it, and the kernel would refuse
	// every new fragment. This namespace's memory only.
	err = p.B.Do(func() error {
		for _, f := range []string{"/proc/sys/net/ipv4/ipfrag_high_thresh", "/proc/sys/net/ipv6/ip6frag_high_thresh"} {
			if err := os.WriteFile(f, []byte("268435456"), 0); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		tb.Fatalf("reassembly memory of %s: %v", p.B.Name, err)
	}

	e.d = testDatapath(tb)
	// Run counts tell when the program has seen a frame it did not
	// classify; without them such a frame costs the full wait in send.
	if st, err := ebpf.EnableStats(unix.BPF_STATS_RUN_TIME); err != nil {
		tb.Logf("no BPF run counts (%v): a frame the data path does not classify costs %v", err, orcWait)
	} else {
		tb.Cleanup(func() { st.Close() })
	}
	probe := func(proto maps.Protocol, port uint16, src ...netip.Prefix) maps.Limit {
		l := maps.Limit{Rate: 1e9, Burst: 1e9, Action: maps.Shadow, Match: maps.Match{Protocol: proto, SrcCIDRs: src}}
		if port != 0 {
			l.Match.DstPorts = []maps.PortRange{{First: port, Last: port}}
		}
		return l
	}
	mustSet(tb, e.d, orcAll, probe(maps.AnyProtocol, 0, netip.PrefixFrom(orcSrc4, 32), netip.PrefixFrom(orcSrc6, 128)))
	mustSet(tb, e.d, orcUDPP, probe(maps.UDP, orcPortP))
	mustSet(tb, e.d, orcUDPQ, probe(maps.UDP, orcPortQ))
	mustSet(tb, e.d, orcTCPT, probe(maps.TCP, orcPortT))
	tb.Cleanup(func() {
		if e.link != nil {
			e.link.Close()
		}
	})
	e.attach(tb, mode)

	// One dual-stack socket per UDP port; a TCP listener that answers
	// SYNs with SYN-ACKs (nothing is ever accepted).
	for _, s := range []struct {
		c    **net.UDPConn
		port uint16
	}{{&e.udpP, orcPortP}, {&e.udpQ, orcPortQ}} {
		c, err := p.B.ListenUDP("udp", netip.AddrPortFrom(netip.IPv6Unspecified(), s.port), 4<<20)
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { c.Close() })
		*s.c = c
	}
	err = p.B.Do(func() error {
		ln, err := net.Listen("tcp", fmt.Sprintf("[::]:%d", orcPortT))
		if err != nil {
			return err
		}
		tb.Cleanup(func() { ln.Close() })
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
	if e.tx, err = p.A.OpenPacket(p.IfA); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { e.tx.Close() })
	return e
}

// attach attaches the data path to the receiving veth in mode, in place
// of the program attached before, if any.
func (e *orcEnv) attach(tb testing.TB, mode link.XDPAttachFlags) {
	tb.Helper()
	if e.link != nil {
		if err := e.link.Close(); err != nil {
			tb.Fatalf("detach xdp from %s: %v", e.pair.IfB, err)
		}
		e.link = nil
	}
	err := e.pair.B.Do(func() error {
		ifc, err := net.InterfaceByName(e.pair.IfB)
		if err != nil {
			return err
		}
		l, err := link.AttachXDP(link.XDPOptions{Program: e.d.Program(), Interface: ifc.Index, Flags: mode})
		if err != nil {
			return fmt.Errorf("attach xdp to %s: %w", e.pair.IfB, err)
		}
		e.link = l
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
}

// Datagrams.

// orcExt is one IPv6 extension header.
type orcExt struct {
	typ  uint8 // 0 hop-by-hop, 43 routing, 44 fragment (atomic), 51 AH, 60 destination options, other: unknown
	size int   // bytes
}

// orcPiece is one fragment: bytes [off, off+n) of the fragmentable part.
type orcPiece struct {
	off, n int
	mf     bool
}

// orcDgram is one datagram as the generator made it.
type orcDgram struct {
	v6      bool
	proto   uint8 // protoUDP or protoTCP (a SYN)
	sport   uint16
	dport   uint16
	id      uint32 // IP identification (16 bits for IPv4)
	seq     uint64 // tag in the UDP payload
	payload int    // bytes after the transport header
	ipOpts  int    // IPv4 options, bytes
	exts    []orcExt
	nUnfrag int        // fragmented IPv6: exts before the fragment header
	pieces  []orcPiece // nil: not fragmented
	lieNext int        // IPv6: next header written in the fragment header of later fragments; -1: the true one
	badCsum bool       // the transport checksum is wrong (control: never delivered)
	plan    string     // how it was sent, for messages
}

func (g *orcDgram) family() string {
	if g.v6 {
		return "ipv6"
	}
	return "ipv4"
}

func (g *orcDgram) addrs() (src, dst netip.Addr) {
	if g.v6 {
		return orcSrc6, orcNet6.Addr().Next().Next()
	}
	return orcSrc4, orcNet4.Addr().Next().Next()
}

// limit is the probe limit of the datagram's port.
func (g *orcDgram) limit() uint32 {
	switch {
	case g.proto == protoTCP:
		return orcTCPT
	case g.dport == orcPortQ:
		return orcUDPQ
	}
	return orcUDPP
}

func (g *orcDgram) String() string {
	var b strings.Builder
	proto := "udp"
	if g.proto == protoTCP {
		proto = "tcp-syn"
	}
	fmt.Fprintf(&b, "%s %s %d->%d id %#x payload %d", g.family(), proto, g.sport, g.dport, g.id, g.payload)
	if g.ipOpts > 0 {
		fmt.Fprintf(&b, " ip-options %d", g.ipOpts)
	}
	if len(g.exts) > 0 {
		var t []string
		for i, x := range g.exts {
			s := fmt.Sprintf("%d/%d", x.typ, x.size)
			if g.pieces != nil && i == g.nUnfrag {
				t = append(t, "[frag]")
			}
			t = append(t, s)
		}
		if g.pieces != nil && g.nUnfrag == len(g.exts) {
			t = append(t, "[frag]")
		}
		fmt.Fprintf(&b, " exts %s", strings.Join(t, ","))
	}
	if g.pieces != nil {
		var t []string
		for _, p := range g.pieces {
			m := ""
			if p.mf {
				m = "+"
			}
			t = append(t, fmt.Sprintf("%d:%d%s", p.off, p.n, m))
		}
		fmt.Fprintf(&b, " pieces %s", strings.Join(t, " "))
	}
	if g.lieNext >= 0 {
		fmt.Fprintf(&b, " later-next-header %d", g.lieNext)
	}
	if g.badCsum {
		b.WriteString(" bad-checksum")
	}
	if g.plan != "" {
		fmt.Fprintf(&b, " (%s)", g.plan)
	}
	return b.String()
}

// l4 is the transport header and payload, with its checksum.
func (g *orcDgram) l4() []byte {
	src, dst := g.addrs()
	var b []byte
	if g.proto == protoTCP {
		b = make([]byte, 20+g.payload)
		binary.BigEndian.PutUint16(b[0:], g.sport)
		binary.BigEndian.PutUint16(b[2:], g.dport)
		binary.BigEndian.PutUint32(b[4:], uint32(g.seq)*2654435761)
		b[12] = 5 << 4
		b[13] = 0x02 // SYN
		binary.BigEndian.PutUint16(b[14:], 64240)
		fillPayload(b[20:], g.seq)
	} else {
		b = make([]byte, 8+g.payload)
		binary.BigEndian.PutUint16(b[0:], g.sport)
		binary.BigEndian.PutUint16(b[2:], g.dport)
		binary.BigEndian.PutUint16(b[4:], uint16(len(b)))
		fillPayload(b[8:], g.seq)
	}
	sum := l4Checksum(src, dst, g.proto, b)
	if g.badCsum {
		sum ^= 0x5a5a
	}
	if g.proto == protoTCP {
		binary.BigEndian.PutUint16(b[16:], sum)
	} else {
		binary.BigEndian.PutUint16(b[6:], sum)
	}
	return b
}

// fillPayload writes the tag (magic, sequence) and a pattern.
func fillPayload(b []byte, seq uint64) {
	var tag [12]byte
	copy(tag[:], orcPayloadMagic)
	binary.BigEndian.PutUint64(tag[4:], seq)
	n := copy(b, tag[:])
	for i := n; i < len(b); i++ {
		b[i] = byte(i*7 + int(seq))
	}
}

// l4Checksum is the TCP/UDP checksum over the pseudo-header and b, whose
// checksum field is zero. UDP's 0 is sent as 0xffff.
func l4Checksum(src, dst netip.Addr, proto uint8, b []byte) uint16 {
	sum := ^onesSum(onesSum(0, pseudo(src, dst, proto, len(b))), b)
	if sum == 0 && proto == protoUDP {
		sum = 0xffff
	}
	return sum
}

// pseudo is the pseudo-header of an upper-layer packet of length n (RFC 768,
// RFC 8200 section 8.1).
func pseudo(src, dst netip.Addr, proto uint8, n int) []byte {
	var b []byte
	if src.Is4() {
		s, d := src.As4(), dst.As4()
		b = append(append(b, s[:]...), d[:]...)
		return append(b, 0, proto, byte(n>>8), byte(n))
	}
	s, d := src.As16(), dst.As16()
	b = append(append(b, s[:]...), d[:]...)
	return append(b, byte(n>>24), byte(n>>16), byte(n>>8), byte(n), 0, 0, 0, proto)
}

// onesSum adds b to the ones' complement sum s (RFC 1071), folded.
func onesSum(s uint16, b []byte) uint16 {
	acc := uint32(s)
	for i := 0; i+1 < len(b); i += 2 {
		acc += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		acc += uint32(b[len(b)-1]) << 8
	}
	for acc > 0xffff {
		acc = acc&0xffff + acc>>16
	}
	return uint16(acc)
}

// extBytes encodes exts, each pointing to the next and the last to next.
func extBytes(exts []orcExt, next uint8) []byte {
	var out []byte
	for i, x := range exts {
		nh := next
		if i+1 < len(exts) {
			nh = exts[i+1].typ
		}
		h := make([]byte, x.size)
		h[0] = nh
		switch x.typ {
		case 0, 60: // options: (len+1) x 8 bytes
			h[1] = byte(x.size/8 - 1)
			// An unknown option to skip (0x1e, RFC 4727) per 8 bytes past
			// the first 8, then PadN over the last 6: Linux refuses more
			// than 7 bytes of padding in a row.
			o := 2
			for ; o+8 <= x.size-6; o += 8 {
				h[o], h[o+1] = 0x1e, 6
			}
			h[o], h[o+1] = 1, 4
		case 43: // routing, type 0, segments left 0: "ignore and go on" (RFC 8200 4.4)
			h[1] = byte(x.size/8 - 1)
		case 44: // fragment, atomic (offset 0, M 0; RFC 6946)
			binary.BigEndian.PutUint32(h[4:], 0xa70111c)
		case 51: // AH: (len+2) x 4 bytes
			h[1] = byte(x.size/4 - 2)
			binary.BigEndian.PutUint32(h[4:], 0x100)
		default: // an unknown header with the shape of an options header
			h[1] = byte(x.size/8 - 1)
		}
		out = append(out, h...)
	}
	return out
}

func firstType(exts []orcExt, next uint8) uint8 {
	if len(exts) > 0 {
		return exts[0].typ
	}
	return next
}

// fragmentable is what the fragments carry: IPv6 headers after the
// fragment header, the transport header, the payload.
func (g *orcDgram) fragmentable() []byte {
	l4 := g.l4()
	if !g.v6 {
		return l4
	}
	exts := g.exts
	if g.pieces != nil {
		exts = exts[g.nUnfrag:]
	}
	return append(extBytes(exts, g.proto), l4...)
}

// orcMaxFrame is the largest IP packet a frame carries (the veth's MTU).
const orcMaxFrame = 1500

// ipHeaderLen is the bytes before the fragmentable part in every frame.
func (g *orcDgram) ipHeaderLen() int {
	if !g.v6 {
		return 20 + g.ipOpts
	}
	n := 40
	if g.pieces != nil {
		for _, x := range g.exts[:g.nUnfrag] {
			n += x.size
		}
		n += 8
	}
	return n
}

// frame builds the frame of piece i (or of the whole datagram, i < 0),
// with data as its fragmentable bytes.
func (e *orcEnv) frame(g *orcDgram, i int, data []byte) []byte {
	src, dst := g.addrs()
	var l3 []byte
	etype := uint16(ethIPv4)
	if !g.v6 {
		h := make([]byte, 20+g.ipOpts)
		h[0] = 0x40 | byte(len(h)/4)
		binary.BigEndian.PutUint16(h[2:], uint16(len(h)+len(data)))
		binary.BigEndian.PutUint16(h[4:], uint16(g.id))
		if i >= 0 {
			p := g.pieces[i]
			fo := uint16(p.off / 8)
			if p.mf {
				fo |= 0x2000
			}
			binary.BigEndian.PutUint16(h[6:], fo)
		}
		h[8] = 64
		h[9] = g.proto
		s, d := src.As4(), dst.As4()
		copy(h[12:], s[:])
		copy(h[16:], d[:])
		for j := 20; j < len(h); j++ {
			h[j] = 1 // NOP
		}
		binary.BigEndian.PutUint16(h[10:], ^onesSum(0, h))
		l3 = append(h, data...)
	} else {
		etype = ethIPv6
		h := make([]byte, 40)
		h[0] = 0x60
		h[7] = 64
		s, d := src.As16(), dst.As16()
		copy(h[8:], s[:])
		copy(h[24:], d[:])
		var rest []byte
		if i < 0 {
			h[6] = firstType(g.exts, g.proto)
			rest = data
		} else {
			unfrag := g.exts[:g.nUnfrag]
			h[6] = firstType(unfrag, 44)
			rest = extBytes(unfrag, 44)
			p := g.pieces[i]
			fh := make([]byte, 8)
			fh[0] = firstType(g.exts[g.nUnfrag:], g.proto)
			if p.off > 0 && g.lieNext >= 0 {
				fh[0] = uint8(g.lieNext)
			}
			fo := uint16(p.off/8) << 3
			if p.mf {
				fo |= 1
			}
			binary.BigEndian.PutUint16(fh[2:], fo)
			binary.BigEndian.PutUint32(fh[4:], g.id)
			rest = append(append(rest, fh...), data...)
		}
		binary.BigEndian.PutUint16(h[4:], uint16(len(rest)))
		l3 = append(h, rest...)
	}
	f := make([]byte, 0, 14+len(l3))
	f = append(f, e.macB...)
	f = append(f, e.macA...)
	f = binary.BigEndian.AppendUint16(f, etype)
	return append(f, l3...)
}

// orcFrame is one frame of a train.
type orcFrame struct {
	dg    int    // index of its datagram in the train
	piece int    // -1: the whole datagram
	what  string // "piece 2", "dup of piece 0", ...
	bytes []byte
	// used: for a datagram the kernel delivers, this frame's bytes are in
	// it (no earlier frame of the datagram overlapped it; a duplicate is
	// ignored, RFC 5722 errata 3089).
	used bool
}

// orcTrain is datagrams sent as one sequence of frames.
type orcTrain struct {
	dgrams []*orcDgram
	frames []orcFrame
}

func (t *orcTrain) String() string {
	var b strings.Builder
	for i, g := range t.dgrams {
		fmt.Fprintf(&b, "\n  datagram %d: %s", i, g)
	}
	var order []string
	for _, f := range t.frames {
		order = append(order, fmt.Sprintf("%d:%s", f.dg, f.what))
	}
	fmt.Fprintf(&b, "\n  frames: %s", strings.Join(order, ", "))
	return b.String()
}

// markUsed sets used on the frames that carry new bytes of their datagram.
func (t *orcTrain) markUsed() {
	seen := make([][][2]int, len(t.dgrams))
	for i := range t.frames {
		f := &t.frames[i]
		g := t.dgrams[f.dg]
		lo, hi := 0, 1<<30
		if f.piece >= 0 {
			lo, hi = g.pieces[f.piece].off, g.pieces[f.piece].off+g.pieces[f.piece].n
		}
		f.used = lo < hi && !slices.ContainsFunc(seen[f.dg], func(r [2]int) bool { return lo < r[1] && r[0] < hi })
		seen[f.dg] = append(seen[f.dg], [2]int{lo, hi})
	}
}

// Observations.

// orcCharge is what the data path charged one frame.
type orcCharge struct {
	seen      bool // the catch-all probe counted it: the data path classified it
	limits    [orcLimits]bool
	l4Unknown bool
}

// orcResult is what happened to a train.
type orcResult struct {
	charges   []orcCharge
	delivered []bool // by datagram
}

// counters reads every probe limit's decisions and the L4-unknown count.
func (e *orcEnv) counters() (c [orcLimits]uint64, l4u uint64) {
	e.tb.Helper()
	for id := range uint32(orcLimits) {
		s := mustStats(e.tb, e.d, id)
		c[id] = s.AdmittedPackets + s.DroppedPackets + s.ShadowPackets
	}
	g, err := e.d.GlobalStats()
	if err != nil {
		e.tb.Fatal(err)
	}
	return c, g.L4Unknown
}

// How long send waits for the data path to count a frame: at most orcWait;
// orcGrace once the program has run on a frame without counting it (the
// frame was not classified, or it was another frame and ours is still on
// its way).
const (
	orcWait  = 300 * time.Millisecond
	orcGrace = 10 * time.Millisecond
)

// runs is how many times the program has run, or 0 without run counts.
func (e *orcEnv) runs() uint64 {
	st, err := e.d.Program().Stats()
	if err != nil {
		return 0
	}
	return st.RunCount
}

// send sends one frame and waits until the data path has counted it in the
// catch-all probe. A frame it never counts (passed as not IP, or lost) is
// reported unseen after a bounded wait.
func (e *orcEnv) send(frame []byte) orcCharge {
	e.tb.Helper()
	before, l4b := e.counters()
	runs := e.runs()
	if err := e.tx.Send(frame); err != nil {
		e.tb.Fatal(err)
	}
	deadline := time.Now().Add(orcWait)
	for {
		after, l4a := e.counters()
		if now := time.Now(); e.runs() > runs && deadline.After(now.Add(orcGrace)) {
			deadline = now.Add(orcGrace)
		}
		if after[orcAll] > before[orcAll] || time.Now().After(deadline) {
			ch := orcCharge{seen: after[orcAll] > before[orcAll], l4Unknown: l4a > l4b}
			for id := range ch.limits {
				ch.limits[id] = after[id] > before[id]
			}
			return ch
		}
		time.Sleep(20 * time.Microsecond)
	}
}

// run sends a train, then a marker datagram to each UDP port, and reads
// what the kernel delivered: a UDP datagram read from its socket before the
// marker, a SYN answered by a SYN-ACK. The frames are sent from one CPU, so
// the kernel handles them (and the markers) in order.
func (e *orcEnv) run(t *orcTrain) orcResult {
	e.tb.Helper()
	unpin := pinCPU(e.tb, 0)
	defer unpin()
	t.markUsed()
	res := orcResult{charges: make([]orcCharge, len(t.frames)), delivered: make([]bool, len(t.dgrams))}
	for i, f := range t.frames {
		res.charges[i] = e.send(f.bytes)
	}
	bySeq := map[uint64]int{}
	bySport := map[uint16]int{}
	for i, g := range t.dgrams {
		if g.proto == protoUDP {
			bySeq[g.seq] = i
		} else {
			bySport[g.sport] = i
		}
	}
	for _, c := range []*net.UDPConn{e.udpP, e.udpQ} {
		port := uint16(c.LocalAddr().(*net.UDPAddr).Port)
		mark := e.nextSeq
		e.nextSeq++
		e.send(e.marker(port, mark))
		e.readUntil(c, mark, func(seq uint64) {
			if i, ok := bySeq[seq]; ok && t.dgrams[i].dport == port {
				res.delivered[i] = true
			}
		})
	}
	// SYN-ACKs were queued before the markers were handled.
	buf := make([]byte, 2048)
	for {
		n, err := e.tx.Recv(buf, 0)
		if err != nil {
			e.tb.Fatal(err)
		}
		if n == 0 {
			break
		}
		if sport, ok := synAckTo(buf[:n]); ok {
			if i, ok := bySport[sport]; ok {
				res.delivered[i] = true
			}
		}
	}
	return res
}

// marker is an unfragmented IPv4 UDP datagram to port carrying the marker
// tag seq.
func (e *orcEnv) marker(port uint16, seq uint64) []byte {
	l4 := make([]byte, 8+12)
	binary.BigEndian.PutUint16(l4[0:], 9)
	binary.BigEndian.PutUint16(l4[2:], port)
	binary.BigEndian.PutUint16(l4[4:], uint16(len(l4)))
	copy(l4[8:], orcMarkerMagic)
	binary.BigEndian.PutUint64(l4[12:], seq)
	src, dst := orcSrc4, orcNet4.Addr().Next().Next()
	binary.BigEndian.PutUint16(l4[6:], l4Checksum(src, dst, protoUDP, l4))
	g := &orcDgram{proto: protoUDP, id: 1}
	return e.frame(g, -1, l4)
}

// readUntil reads c until the marker seq, calling got with the tag of every
// generator datagram read before it.
func (e *orcEnv) readUntil(c *net.UDPConn, mark uint64, got func(seq uint64)) {
	e.tb.Helper()
	buf := make([]byte, 4096)
	deadline := time.Now().Add(2 * time.Second)
	for {
		c.SetReadDeadline(deadline)
		n, err := c.Read(buf)
		if err != nil {
			e.tb.Fatalf("read %s until marker %d: %v", c.LocalAddr(), mark, err)
		}
		if n < 12 {
			continue
		}
		seq := binary.BigEndian.Uint64(buf[4:12])
		switch string(buf[:4]) {
		case orcMarkerMagic:
			if seq == mark {
				return
			}
		case orcPayloadMagic:
			got(seq)
		}
	}
}

// synAckTo returns the destination port of a TCP SYN-ACK from orcPortT in
// frame.
func synAckTo(frame []byte) (uint16, bool) {
	if len(frame) < 14 {
		return 0, false
	}
	var l4 []byte
	switch binary.BigEndian.Uint16(frame[12:]) {
	case ethIPv4:
		ip := frame[14:]
		if len(ip) < 20 || ip[9] != protoTCP {
			return 0, false
		}
		l4 = ip[int(ip[0]&0xf)*4:]
	case ethIPv6:
		ip := frame[14:]
		if len(ip) < 40 || ip[6] != protoTCP {
			return 0, false
		}
		l4 = ip[40:]
	default:
		return 0, false
	}
	if len(l4) < 20 || binary.BigEndian.Uint16(l4[0:]) != orcPortT || l4[13]&0x12 != 0x12 {
		return 0, false
	}
	return binary.BigEndian.Uint16(l4[2:]), true
}

// Checking.

// orcTally sums up trains.
type orcTally struct {
	trains, datagrams, frames      int
	delivered, charged, chargedAll int
	l4Unknown, unseen              int
	failures                       []string
	// causes counts the mismatches by what their train did that the
	// data path got wrong.
	causes map[string]int
	// kinds counts datagrams sent and delivered by what they were.
	kinds map[string]*[2]int
}

// kinds names what a datagram was, for the tally.
func (g *orcDgram) kinds() []string {
	k := []string{g.family(), map[uint8]string{protoUDP: "udp", protoTCP: "tcp-syn"}[g.proto]}
	switch n := len(g.exts); {
	case n > 8:
		k = append(k, "9-16 ext headers")
	case n > 0:
		k = append(k, "1-8 ext headers")
	}
	if g.pieces != nil {
		k = append(k, "fragmented")
	}
	for _, p := range []string{"tiny first", "overlapping", "first fragment last", "reversed", "shuffled", "missing", "dup of", "copy of", "same id"} {
		if strings.Contains(g.plan, p) {
			k = append(k, p)
		}
	}
	if g.lieNext >= 0 {
		k = append(k, "later next header")
	}
	if g.badCsum {
		k = append(k, "bad checksum")
	}
	return k
}

// Kinds lists the datagrams sent and delivered, by kind.
func (s *orcTally) Kinds() string {
	var out []string
	for k, n := range s.kinds {
		out = append(out, fmt.Sprintf("%s %d/%d", k, n[1], n[0]))
	}
	slices.Sort(out)
	return "delivered/sent by kind: " + strings.Join(out, ", ")
}

func (s *orcTally) String() string {
	var causes []string
	for k, n := range s.causes {
		causes = append(causes, fmt.Sprintf("%s %d", k, n))
	}
	slices.Sort(causes)
	c := ""
	if len(causes) > 0 {
		c = " (" + strings.Join(causes, ", ") + ")"
	}
	return fmt.Sprintf("%d trains, %d datagrams, %d frames (%d L4-unknown, %d not classified); "+
		"%d datagrams delivered: %d charged to their port's limit, %d with every frame charged; %d mismatches%s",
		s.trains, s.datagrams, s.frames, s.l4Unknown, s.unseen, s.delivered, s.charged, s.chargedAll, len(s.failures), c)
}

// cause names what a train with a mismatch on datagram i did.
func (t *orcTrain) cause(i int) string {
	g := t.dgrams[i]
	switch {
	case slices.ContainsFunc(t.dgrams[:i], func(o *orcDgram) bool { return o.v6 == g.v6 && o.id == g.id }):
		return "identification reused"
	case slices.ContainsFunc(t.frames, func(f orcFrame) bool { return f.dg == i && strings.Contains(f.what, "to port") }):
		return "conflicting copy of the first fragment"
	case g.lieNext >= 0:
		return "ipv6 later fragment's next header"
	}
	return "other"
}

// check applies the oracle's properties to a train's result, adds it up and
// returns the failures. For every datagram the kernel delivered:
//   - some frame of it was charged to the limit of its port (never a
//     delivery with no charge);
//   - every frame whose bytes are in it was charged to that limit (item 3:
//     every fragment is charged to the limits its datagram matched, by the
//     first fragment's fields or as L4-unknown).
//
// And a datagram with a bad checksum is never delivered: the kernel really
// checks (if not, the oracle is blind).
func (s *orcTally) check(t *orcTrain, r orcResult) []string {
	s.trains++
	s.datagrams += len(t.dgrams)
	s.frames += len(t.frames)
	for _, c := range r.charges {
		if c.l4Unknown {
			s.l4Unknown++
		}
		if !c.seen {
			s.unseen++
		}
	}
	var fails []string
	if s.kinds == nil {
		s.kinds = map[string]*[2]int{}
	}
	for i, g := range t.dgrams {
		for _, k := range g.kinds() {
			if s.kinds[k] == nil {
				s.kinds[k] = new([2]int)
			}
			s.kinds[k][0]++
			if r.delivered[i] {
				s.kinds[k][1]++
			}
		}
		if !r.delivered[i] {
			continue
		}
		if g.badCsum {
			fails = append(fails, fmt.Sprintf("datagram %d has a bad checksum and was delivered: the kernel does not verify checksums here, the oracle is blind", i))
			continue
		}
		s.delivered++
		lim := g.limit()
		any, all := false, true
		var missed []string
		for j, f := range t.frames {
			if f.dg != i {
				continue
			}
			c := r.charges[j]
			if c.limits[lim] {
				any = true
				continue
			}
			if f.used {
				all = false
				missed = append(missed, fmt.Sprintf("%s (%s)", f.what, c))
			}
		}
		if any {
			s.charged++
		} else {
			fails = append(fails, fmt.Sprintf("datagram %d was delivered to port %d and no frame of it was charged to its limit", i, g.dport))
		}
		if all {
			s.chargedAll++
		} else {
			if s.causes == nil {
				s.causes = map[string]int{}
			}
			s.causes[t.cause(i)]++
		}
		if !all && any {
			fails = append(fails, fmt.Sprintf("datagram %d was delivered to port %d; frames in it not charged to its limit: %s",
				i, g.dport, strings.Join(missed, "; ")))
		}
	}
	if len(fails) > 0 {
		msg := fmt.Sprintf("%s\n  train:%s", strings.Join(fails, "\n  "), t)
		s.failures = append(s.failures, msg)
		return []string{msg}
	}
	return nil
}

func (c orcCharge) String() string {
	if !c.seen {
		return "not classified"
	}
	var hit []string
	for id, name := range []string{"all", "udp/7001", "udp/7002", "tcp/7003"} {
		if c.limits[id] {
			hit = append(hit, name)
		}
	}
	s := "charged to " + strings.Join(hit, ",")
	if c.l4Unknown {
		s += ", L4-unknown"
	}
	return s
}

// Generating.

// orcRand draws the generator's decisions: from knobs while they last (a
// fuzzer steers them), then from a seeded generator.
type orcRand struct {
	knobs []byte
	r     *rand.Rand
}

func newOrcRand(seed uint64, knobs []byte) *orcRand {
	return &orcRand{knobs: knobs, r: rand.New(rand.NewPCG(seed, 0x6f7261636c65))}
}

// intn is in [0, n).
func (r *orcRand) intn(n int) int {
	if n <= 1 {
		return 0
	}
	if len(r.knobs) > 0 {
		v := int(r.knobs[0])
		r.knobs = r.knobs[1:]
		if n > 256 && len(r.knobs) > 0 {
			v = v<<8 | int(r.knobs[0])
			r.knobs = r.knobs[1:]
		}
		return v % n
	}
	return r.r.IntN(n)
}

// chance is true pct times in 100.
func (r *orcRand) chance(pct int) bool { return r.intn(100) < pct }

func (e *orcEnv) newID(v6 bool) uint32 {
	e.nextID++
	if !v6 {
		return e.nextID & 0xffff
	}
	return e.nextID
}

func (e *orcEnv) newPort() uint16 {
	e.nextPort++
	if e.nextPort < 20000 || e.nextPort > 60000 {
		e.nextPort = 20000
	}
	return e.nextPort
}

func (e *orcEnv) newSeq() uint64 {
	e.nextSeq++
	return e.nextSeq
}

// newDgram makes a datagram: family, port, payload size, IPv6 extension
// headers (0-16), fragments.
func (e *orcEnv) newDgram(r *orcRand) *orcDgram {
	g := &orcDgram{v6: r.chance(50), lieNext: -1, sport: e.newPort(), seq: e.newSeq()}
	g.id = e.newID(g.v6)
	switch n := r.intn(10); {
	case n < 4:
		g.proto, g.dport = protoUDP, orcPortP
	case n < 6:
		g.proto, g.dport = protoUDP, orcPortQ
	default:
		g.proto, g.dport = protoTCP, orcPortT
	}
	if g.proto == protoUDP {
		g.payload = 12 + r.intn(2800)
	} else {
		g.payload = r.intn(1200) // data in a SYN: accepted, not acknowledged
	}
	if !g.v6 && r.chance(15) {
		g.ipOpts = 4 * (1 + r.intn(4))
	}
	frag := r.chance(60)
	deliverable := true
	if g.v6 && r.chance(60) {
		// Mostly chains Linux delivers after (hop-by-hop first only, at
		// most one fragment header, no AH without a security association,
		// no unknown header), so that long ones get through too;
		// sometimes any header.
		deliverable = r.chance(75)
		atomic := frag
		for i := range 1 + r.intn(16) {
			x := randExt(r)
			for deliverable && (x.typ == 51 || x.typ == 0 && i > 0 || x.typ > 60 || x.typ == 44 && atomic) {
				x = randExt(r)
			}
			atomic = atomic || x.typ == 44
			g.exts = append(g.exts, x)
		}
	}
	g.badCsum = r.chance(3)
	if !frag && g.ipHeaderLen()+len(g.fragmentable()) > orcMaxFrame {
		frag = true
		g.exts = slices.DeleteFunc(g.exts, func(x orcExt) bool { return deliverable && x.typ == 44 })
	}
	if frag {
		g.pieces = []orcPiece{}
		g.nUnfrag = r.intn(len(g.exts) + 1)
		if deliverable && len(g.exts) > 0 && g.exts[0].typ == 0 {
			g.nUnfrag = max(g.nUnfrag, 1)
		}
	}
	if g.pieces != nil {
		g.cut(r, true)
		if g.v6 && r.chance(12) {
			g.lieNext = []int{protoTCP, protoUDP, protoICMPv6, 59}[r.intn(4)]
		}
	}
	return g
}

// randExt is an IPv6 extension header: mostly those Linux walks and
// delivers after (destination options, routing with no segments left,
// atomic fragments, hop-by-hop when first), some it drops (AH without a
// security association, hop-by-hop elsewhere, unknown ones).
func randExt(r *orcRand) orcExt {
	switch n := r.intn(100); {
	case n < 62:
		return orcExt{60, 8 * (1 + r.intn(3))}
	case n < 74:
		return orcExt{43, 8 * (1 + r.intn(3))}
	case n < 80:
		return orcExt{0, 8 * (1 + r.intn(2))}
	case n < 88:
		return orcExt{44, 8}
	case n < 93:
		return orcExt{51, 4 * (3 + r.intn(4))}
	default:
		return orcExt{[]uint8{253, 135, 139}[r.intn(3)], 8}
	}
}

// cut splits the fragmentable part into pieces (offsets and lengths in
// 8-byte units, each frame within the MTU), sometimes with a tiny first
// piece that holds less than the whole transport header (or IPv6 header
// chain), sometimes (if overlap) with two pieces overlapping.
func (g *orcDgram) cut(r *orcRand, overlap bool) {
	g.pieces = []orcPiece{} // ipHeaderLen counts the fragment header
	total := len(g.fragmentable())
	maxPiece := (orcMaxFrame - g.ipHeaderLen()) &^ 7
	// The bytes through the transport header.
	need := 8
	if g.proto == protoTCP {
		need = 20
	}
	if g.v6 {
		for _, x := range g.exts[g.nUnfrag:] {
			need += x.size
		}
	}
	var first int
	if r.chance(15) {
		first = 8 * r.intn((min(need, total)+7)/8) // tiny: less than need
		g.plan = "tiny first"
	} else {
		first = 8 * (1 + r.intn(min(maxPiece, total-1)/8))
	}
	g.pieces = append(g.pieces, orcPiece{0, first, true})
	for off := first; off < total; {
		rest := total - off
		n := rest
		if rest > maxPiece || r.chance(50) && rest > 8 {
			n = 8 * (1 + r.intn(min(maxPiece, rest-1)/8))
		}
		g.pieces = append(g.pieces, orcPiece{off, n, off+n < total})
		off += n
	}
	if overlap && len(g.pieces) > 2 && r.chance(8) {
		g.overlap(1+r.intn(len(g.pieces)-1), 8*(1+r.intn(2)))
	}
}

// overlap pulls piece i back by back bytes over the end of the one
// before, if the frame still fits, and reports whether it did.
func (g *orcDgram) overlap(i, back int) bool {
	p := &g.pieces[i]
	if i == 0 || g.pieces[i-1].n < back || p.n+back > (orcMaxFrame-g.ipHeaderLen())&^7 {
		return false
	}
	p.off -= back
	p.n += back
	g.plan = strings.TrimPrefix(g.plan+", overlapping", ", ")
	return true
}

// framesOf builds the frames of datagram g (index dg in its train). A clean
// datagram is sent whole, in order, once; otherwise frames may come
// reordered, duplicated, missing, or with a conflicting copy of the first
// fragment (another port; the kernel keeps the first copy it got).
func (e *orcEnv) framesOf(g *orcDgram, dg int, r *orcRand, clean, firstLast bool) []orcFrame {
	data := g.fragmentable()
	if g.pieces == nil {
		return []orcFrame{{dg: dg, piece: -1, what: "whole", bytes: e.frame(g, -1, data)}}
	}
	var fs []orcFrame
	for i, p := range g.pieces {
		fs = append(fs, orcFrame{dg: dg, piece: i, what: fmt.Sprintf("piece %d", i), bytes: e.frame(g, i, data[p.off:p.off+p.n])})
	}
	plan := []string{}
	if g.plan != "" {
		plan = append(plan, g.plan)
	}
	switch n := r.intn(100); {
	case firstLast || !clean && n < 15:
		fs = append(fs[1:], fs[0])
		plan = append(plan, "first fragment last")
	case clean || n < 55:
	case n < 70:
		slices.Reverse(fs)
		plan = append(plan, "reversed")
	default:
		for i := len(fs) - 1; i > 0; i-- {
			j := r.intn(i + 1)
			fs[i], fs[j] = fs[j], fs[i]
		}
		plan = append(plan, "shuffled")
	}
	if !clean {
		if len(fs) > 1 && r.chance(6) {
			i := r.intn(len(fs))
			plan = append(plan, "missing "+fs[i].what)
			fs = slices.Delete(fs, i, i+1)
		}
		if r.chance(10) {
			i := r.intn(len(fs))
			d := fs[i]
			d.what = "dup of " + d.what
			j := i + 1 + r.intn(len(fs)-i)
			fs = slices.Insert(fs, j, d)
			plan = append(plan, d.what)
		}
		if at := g.portOffset(); at >= 0 && r.chance(6) {
			// A copy of the first fragment to another port, somewhere
			// after it.
			other := uint16(orcPortQ)
			if g.dport == orcPortQ {
				other = orcPortP
			}
			d := slices.Clone(data[:g.pieces[0].n])
			binary.BigEndian.PutUint16(d[at:], other)
			c := orcFrame{dg: dg, piece: 0, what: fmt.Sprintf("copy of piece 0 to port %d", other), bytes: e.frame(g, 0, d)}
			i := slices.IndexFunc(fs, func(f orcFrame) bool { return f.piece == 0 })
			if i >= 0 {
				fs = slices.Insert(fs, i+1+r.intn(len(fs)-i), c)
				plan = append(plan, c.what)
			}
		}
	}
	g.plan = strings.Join(plan, ", ")
	return fs
}

// portOffset is where the destination port sits in the first piece, or -1
// if the first piece does not hold it.
func (g *orcDgram) portOffset() int {
	at := 2
	if g.v6 {
		for _, x := range g.exts[g.nUnfrag:] {
			at += x.size
		}
	}
	if g.pieces == nil || g.pieces[0].n < at+2 {
		return -1
	}
	return at
}

// newTrain makes a train: mostly one datagram; sometimes two interleaved;
// sometimes a clean datagram to one port and then another with the same
// IP identification to another, its first fragment last.
func (e *orcEnv) newTrain(r *orcRand) *orcTrain {
	t := &orcTrain{}
	switch n := r.intn(100); {
	case n < 8:
		// The kernel forgets an identification once it has reassembled
		// the datagram or dropped it for overlapping fragments.
		// The first datagram leaves no reassembly behind in the kernel
		// (else fragments of the second could join it, and "the frames
		// the kernel built it from" would be unknowable here): it is
		// whole, or it ends with a fragment that overlaps the one before.
		g0 := e.newDgram(r)
		if g0.pieces == nil {
			g0.pieces = []orcPiece{}
		}
		g0.cut(r, false)
		upTo := len(g0.pieces)
		if i := 1 + r.intn(len(g0.pieces)-1); r.chance(40) && g0.overlap(i, 8) {
			upTo = i + 1
		}
		g0.lieNext, g0.badCsum = -1, false
		g1 := e.newDgram(r)
		g1.v6, g1.id = g0.v6, g0.id
		if !g1.v6 {
			g1.proto, g1.ipOpts, g1.exts = g0.proto, 0, nil
			g1.dport = map[uint16]uint16{orcPortP: orcPortQ, orcPortQ: orcPortP, orcPortT: orcPortT}[g0.dport]
			if g1.proto == protoUDP {
				g1.payload = max(g1.payload, 12)
			}
		}
		if g1.pieces == nil {
			g1.pieces = []orcPiece{}
			g1.nUnfrag = r.intn(len(g1.exts) + 1)
		}
		g1.cut(r, true)
		t.dgrams = []*orcDgram{g0, g1}
		f0 := e.framesOf(g0, 0, r, true, false)
		if upTo < len(f0) {
			g0.plan = strings.TrimPrefix(g0.plan+fmt.Sprintf(", pieces after %d not sent", upTo-1), ", ")
			f0 = f0[:upTo]
		}
		t.frames = append(f0, e.framesOf(g1, 1, r, false, r.chance(50))...)
		g1.plan = strings.TrimPrefix(g1.plan+", same id as datagram 0", ", ")
	case n < 16:
		g0, g1 := e.newDgram(r), e.newDgram(r)
		t.dgrams = []*orcDgram{g0, g1}
		a, b := e.framesOf(g0, 0, r, false, false), e.framesOf(g1, 1, r, false, false)
		for len(a)+len(b) > 0 {
			if len(b) == 0 || len(a) > 0 && r.chance(50) {
				t.frames, a = append(t.frames, a[0]), a[1:]
			} else {
				t.frames, b = append(t.frames, b[0]), b[1:]
			}
		}
	default:
		g := e.newDgram(r)
		t.dgrams = []*orcDgram{g}
		t.frames = e.framesOf(g, 0, r, false, false)
	}
	return t
}

// Hand-made trains.

// mk is a datagram from the spoofed source to the receiver, unfragmented.
func (e *orcEnv) mk(v6 bool, proto uint8, dport uint16, payload int, exts ...orcExt) *orcDgram {
	g := &orcDgram{v6: v6, proto: proto, sport: e.newPort(), dport: dport, seq: e.newSeq(), payload: payload, exts: exts, lieNext: -1}
	g.id = e.newID(v6)
	return g
}

// split fragments g after its first nUnfrag extension headers, with pieces
// starting at 0 and at each of bounds (bytes of the fragmentable part).
func (g *orcDgram) split(nUnfrag int, bounds ...int) *orcDgram {
	g.nUnfrag = nUnfrag
	g.pieces = []orcPiece{}
	total := len(g.fragmentable())
	offs := append([]int{0}, bounds...)
	for i, off := range offs {
		end := total
		if i+1 < len(offs) {
			end = offs[i+1]
		}
		g.pieces = append(g.pieces, orcPiece{off, end - off, end < total})
	}
	return g
}

// bad gives g a wrong transport checksum.
func (g *orcDgram) bad() *orcDgram { g.badCsum = true; return g }

// orcSend is one frame to send: piece of g (-1: whole), to port if not 0
// (a copy with another destination port in its transport header).
type orcSend struct {
	g     *orcDgram
	piece int
	port  uint16
}

// orcPieces sends the given pieces of g (-1: g whole), in that order.
func orcPieces(g *orcDgram, pieces ...int) []orcSend {
	var s []orcSend
	for _, p := range pieces {
		s = append(s, orcSend{g, p, 0})
	}
	return s
}

// orcAllPieces sends g whole, or its pieces in order.
func orcAllPieces(g *orcDgram) []orcSend {
	if g.pieces == nil {
		return orcPieces(g, -1)
	}
	var s []orcSend
	for i := range g.pieces {
		s = append(s, orcSend{g, i, 0})
	}
	return s
}

// train builds the frames of sends, in that order.
func (e *orcEnv) train(sends ...orcSend) *orcTrain {
	t := &orcTrain{}
	idx := map[*orcDgram]int{}
	sent := map[[2]int]bool{}
	for _, s := range sends {
		dg, ok := idx[s.g]
		if !ok {
			dg = len(t.dgrams)
			idx[s.g] = dg
			t.dgrams = append(t.dgrams, s.g)
		}
		data := s.g.fragmentable()
		f := orcFrame{dg: dg, piece: s.piece}
		if s.piece < 0 {
			f.what = "whole"
		} else {
			p := s.g.pieces[s.piece]
			data = slices.Clone(data[p.off : p.off+p.n])
			f.what = fmt.Sprintf("piece %d", s.piece)
		}
		if sent[[2]int{dg, s.piece}] {
			f.what += " again"
		}
		sent[[2]int{dg, s.piece}] = true
		if s.port != 0 {
			at := 2
			if s.piece >= 0 {
				at = s.g.portOffset()
			} else if s.g.v6 {
				at += len(extBytes(s.g.exts, 0))
			}
			binary.BigEndian.PutUint16(data[at:], s.port)
			f.what += fmt.Sprintf(" to port %d", s.port)
		}
		f.bytes = e.frame(s.g, s.piece, data)
		t.frames = append(t.frames, f)
	}
	return t
}
