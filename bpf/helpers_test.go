package bpf_test

import (
	"encoding/binary"
	"errors"
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/bpf"
	"github.com/rlagent/rlagent/internal/testenv"
	"github.com/rlagent/rlagent/maps"
)

const (
	xdpDrop = 1
	xdpPass = 2
)

// newDatapath loads the data path with the test clock, unpinned.
func newDatapath(tb testing.TB, opts maps.Options) *maps.Datapath {
	tb.Helper()
	testenv.RequireRoot(tb)
	d, err := maps.Load(opts)
	if err != nil {
		tb.Fatalf("load data path: %v", err)
	}
	tb.Cleanup(func() { d.Close() })
	return d
}

// testDatapath loads the XDP programs of the data path with the test
// clock, unpinned (hookDatapath loads the TC programs too).
func testDatapath(tb testing.TB) *maps.Datapath {
	tb.Helper()
	d := newDatapath(tb, maps.Options{Clock: maps.ClockTest, XDPOnly: true})
	setClock(tb, d, 1e9, 0)
	return d
}

func setClock(tb testing.TB, d *maps.Datapath, now, step uint64) {
	tb.Helper()
	if err := d.SetTestClock(now, step); err != nil {
		tb.Fatal(err)
	}
}

func mustSet(tb testing.TB, d *maps.Datapath, id uint32, l maps.Limit) {
	tb.Helper()
	if err := d.SetLimit(id, l); err != nil {
		tb.Fatalf("set limit %d: %v", id, err)
	}
}

func mustStats(tb testing.TB, d *maps.Datapath, id uint32) maps.Stats {
	tb.Helper()
	s, err := d.Stats(id)
	if err != nil {
		tb.Fatal(err)
	}
	return s
}

// mustRun runs prog once on pkt and returns the verdict.
func mustRun(tb testing.TB, prog *ebpf.Program, pkt []byte) uint32 {
	tb.Helper()
	ret, err := prog.Run(&ebpf.RunOptions{Data: pkt})
	if err != nil {
		tb.Fatalf("run: %v", err)
	}
	return ret
}

// mustRepeat runs prog n times on pkt in one test_run call.
func mustRepeat(tb testing.TB, prog *ebpf.Program, pkt []byte, n uint32) {
	tb.Helper()
	if n == 0 {
		return
	}
	if _, err := prog.Run(&ebpf.RunOptions{Data: pkt, Repeat: n}); err != nil {
		tb.Fatalf("run x%d: %v", n, err)
	}
}

// pinCPU runs the calling goroutine on cpu until the returned function is
// called: test_run runs the program on the caller's CPU.
func pinCPU(tb testing.TB, cpu int) func() { return testenv.PinCPU(tb, cpu) }

// Packet building. The IPv4 header checksum and a whole TCP segment's
// checksum are computed (action reject answers only packets whose
// checksums are valid); the rest of the data path does not read them.

const (
	ethIPv4  = 0x0800
	ethIPv6  = 0x86dd
	eth8021Q = 0x8100
	eth8021A = 0x88a8

	protoICMP   = 1
	protoTCP    = 6
	protoUDP    = 17
	protoICMPv6 = 58
	protoGRE    = 47
)

// pkt describes a packet to build.
type pkt struct {
	vlans    []uint16 // outer first; the first uses 802.1ad when there are two or more
	src      string
	dst      string
	proto    uint8
	sport    uint16
	dport    uint16
	tcpFlags uint8 // TCP flags; 0 means ACK
	tcpOpts  int   // TCP options, bytes (multiple of 4)
	ipOpts   int   // IPv4 options, bytes (multiple of 4)
	// IPv6 extension headers, in order, of any type number: 44 is a
	// fragment header (8 bytes, carrying fragOff, mf and fragID), 51 is AH
	// ((hdrlen+2) x 4 bytes), any other type (hdrlen+1) x 8 bytes. hdrlen
	// is extLen[i] where given, else 1.
	ext    []uint8
	extLen []uint8
	// Fragments: IPv4 identification (low 16 bits) or the IPv6 fragment
	// header's, offset in 8-byte units, and the MF (IPv6: M) flag.
	fragID  uint32
	fragOff uint16
	mf      bool
	payload int
	// l4Keep cuts the transport header and payload to this many bytes, with
	// the IP lengths saying so (a tiny fragment): 0 keeps them whole,
	// keepNone keeps none.
	l4Keep int
	// pad is bytes of Ethernet padding after the IP datagram, outside its
	// IP length.
	pad int
}

// keepNone is pkt.l4Keep for no transport bytes at all.
const keepNone = -1

// l4 is the transport header and payload of the whole datagram.
func (p pkt) l4() []byte {
	var l4 []byte
	switch p.proto {
	case protoTCP:
		l4 = make([]byte, 20+p.tcpOpts)
		binary.BigEndian.PutUint16(l4[0:], p.sport)
		binary.BigEndian.PutUint16(l4[2:], p.dport)
		l4[12] = byte(5+p.tcpOpts/4) << 4
		for i := 20; i < len(l4); i++ {
			l4[i] = 1 // NOP options
		}
		l4[13] = 0x10 // ACK
		if p.tcpFlags != 0 {
			l4[13] = p.tcpFlags
		}
	case protoUDP:
		l4 = make([]byte, 8)
		binary.BigEndian.PutUint16(l4[0:], p.sport)
		binary.BigEndian.PutUint16(l4[2:], p.dport)
		binary.BigEndian.PutUint16(l4[4:], uint16(8+p.payload))
	case protoICMP, protoICMPv6:
		l4 = make([]byte, 8)
		l4[0] = 8 // echo request
	}
	return append(l4, make([]byte, p.payload)...)
}

func (p pkt) bytes() []byte {
	data := p.l4()
	switch {
	case p.l4Keep == keepNone:
		data = nil
	case p.l4Keep > 0:
		data = data[:min(p.l4Keep, len(data))]
	case p.proto == protoTCP && p.fragOff == 0 && !p.mf:
		src, dst := netip.MustParseAddr(p.src), netip.MustParseAddr(p.dst)
		binary.BigEndian.PutUint16(data[16:], ^csumFold(pseudoSum(src, dst, protoTCP, len(data))+csumSum(data)))
	}
	return p.frame(data)
}

// csumSum is the one's-complement sum of b in 16-bit words, unfolded.
func csumSum(b []byte) uint32 {
	var s uint32
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	return s
}

// csumFold folds a one's-complement sum into 16 bits.
func csumFold(s uint32) uint16 {
	for s>>16 != 0 {
		s = s&0xffff + s>>16
	}
	return uint16(s)
}

// pseudoSum is the sum of the TCP/UDP pseudo-header of a segment of n bytes.
func pseudoSum(src, dst netip.Addr, proto uint8, n int) uint32 {
	s := csumSum(src.AsSlice()) + csumSum(dst.AsSlice())
	return s + uint32(proto) + uint32(n)
}

// frags splits the datagram into fragments of size bytes of transport data
// (a multiple of 8), in order, each a frame of its own: IPv4 fragments, or
// IPv6 ones with a fragment header at the end of p.ext (added if p.ext has
// none). A datagram without transport bytes is one fragment, MF clear.
func (p pkt) frags(size int) [][]byte {
	data := p.l4()
	if netip.MustParseAddr(p.src).Is6() && !slices.Contains(p.ext, 44) {
		p.ext = append(slices.Clone(p.ext), 44)
	}
	var out [][]byte
	for off := 0; off == 0 || off < len(data); off += size {
		end := min(off+size, len(data))
		q := p
		q.fragOff, q.mf = uint16(off/8), end < len(data)
		out = append(out, q.frame(data[off:end]))
	}
	return out
}

// frame is the Ethernet frame of p with data after the IP header (and the
// IPv6 extension headers), its IP lengths counting data.
func (p pkt) frame(data []byte) []byte {
	src, dst := netip.MustParseAddr(p.src), netip.MustParseAddr(p.dst)
	var l3 []byte
	etype := uint16(ethIPv4)
	if src.Is4() {
		h := make([]byte, 20+p.ipOpts)
		h[0] = 0x40 | byte((20+p.ipOpts)/4)
		binary.BigEndian.PutUint16(h[2:], uint16(len(h)+len(data)))
		binary.BigEndian.PutUint16(h[4:], uint16(p.fragID))
		frag := p.fragOff & 0x1fff
		if p.mf {
			frag |= 0x2000
		}
		binary.BigEndian.PutUint16(h[6:], frag)
		h[8] = 64
		h[9] = p.proto
		s, d := src.As4(), dst.As4()
		copy(h[12:], s[:])
		copy(h[16:], d[:])
		for i := 20; i < len(h); i++ {
			h[i] = 1 // NOP options
		}
		binary.BigEndian.PutUint16(h[10:], ^csumFold(csumSum(h)))
		l3 = h
	} else {
		etype = ethIPv6
		h := make([]byte, 40)
		h[0] = 0x60
		h[7] = 64
		s, d := src.As16(), dst.As16()
		copy(h[8:], s[:])
		copy(h[24:], d[:])
		h[6] = p.proto
		if len(p.ext) > 0 {
			h[6] = p.ext[0]
		}
		exts := p.extHeaders()
		binary.BigEndian.PutUint16(h[4:], uint16(len(exts)+len(data)))
		l3 = append(h, exts...)
	}

	frame := make([]byte, 12, 14+4*len(p.vlans)+len(l3)+len(data)+p.pad)
	frame[0], frame[6] = 0x02, 0x02
	frame[5], frame[11] = 1, 2
	for i, v := range p.vlans {
		tpid := uint16(eth8021Q)
		if i == 0 && len(p.vlans) > 1 {
			tpid = eth8021A
		}
		frame = binary.BigEndian.AppendUint16(frame, tpid)
		frame = binary.BigEndian.AppendUint16(frame, v)
	}
	frame = binary.BigEndian.AppendUint16(frame, etype)
	frame = append(frame, l3...)
	frame = append(frame, data...)
	return append(frame, make([]byte, p.pad)...)
}

// extHeaders is the IPv6 extension header chain of p, each header naming
// the next, the last naming p.proto.
func (p pkt) extHeaders() []byte {
	var out []byte
	next := -1 // where the previous header's next header field is
	for i, e := range p.ext {
		hdrlen := uint8(1)
		if i < len(p.extLen) {
			hdrlen = p.extLen[i]
		}
		var x []byte
		switch e {
		case 44: // fragment
			x = make([]byte, 8)
			fo := p.fragOff << 3
			if p.mf {
				fo |= 1
			}
			binary.BigEndian.PutUint16(x[2:], fo)
			binary.BigEndian.PutUint32(x[4:], p.fragID)
		case 51: // AH
			x = make([]byte, (int(hdrlen)+2)*4)
			x[1] = hdrlen
		default: // hop-by-hop, routing, destination options and the rest
			x = make([]byte, (int(hdrlen)+1)*8)
			x[1] = hdrlen
		}
		if next >= 0 {
			out[next] = e
		}
		next = len(out)
		out = append(out, x...)
	}
	if next >= 0 {
		out[next] = p.proto
	}
	return out
}
func udp4(src, dst string, dport uint16) []byte {
	return pkt{src: src, dst: dst, proto: protoUDP, sport: 40000, dport: dport}.bytes()
}

// Limits used across tests.

func perSecond(rate, burst uint64) maps.Limit {
	return maps.Limit{Rate: rate, Burst: burst, Match: maps.Match{Protocol: maps.UDP, DstPorts: []maps.PortRange{{First: 53, Last: 53}}}}
}

// gstats are the counters of maps.GlobalStats that the parser and
// classifier tests read.
type gstats struct {
	overflow   uint64 // MatchOverflow
	failClosed uint64 // FailClosed
	l4Unknown  uint64 // L4Unknown
	fragFirst  uint64 // FragFirst
	fragUnseen uint64 // FragUnseen
}

func globals(tb testing.TB, d *maps.Datapath) gstats {
	tb.Helper()
	g, err := d.GlobalStats()
	if err != nil {
		tb.Fatal(err)
	}
	return gstats{g.MatchOverflow, g.FailClosed, g.L4Unknown, g.FragFirst, g.FragUnseen}
}

func (a gstats) minus(b gstats) gstats {
	return gstats{a.overflow - b.overflow, a.failClosed - b.failClosed, a.l4Unknown - b.l4Unknown,
		a.fragFirst - b.fragFirst, a.fragUnseen - b.fragUnseen}
}

// fragTable is the fragment table (rl_frags) of d's program, found through
// the program's maps: maps.Datapath does not hand its maps out.
func fragTable(tb testing.TB, d *maps.Datapath) *ebpf.Map {
	tb.Helper()
	return programMap(tb, d, "rl_frags")
}

// programMap is the map called name of d's program, found through the
// program's maps; it is closed when tb ends.
func programMap(tb testing.TB, d *maps.Datapath, name string) *ebpf.Map {
	tb.Helper()
	info, err := d.Program().Info()
	if err != nil {
		tb.Fatal(err)
	}
	ids, _ := info.MapIDs()
	for _, id := range ids {
		m, err := ebpf.NewMapFromID(id)
		if err != nil {
			tb.Fatal(err)
		}
		if mi, err := m.Info(); err == nil && mi.Name == name {
			tb.Cleanup(func() { m.Close() })
			return m
		}
		m.Close()
	}
	tb.Fatalf("the program has no map %s", name)
	return nil
}

// clearTombstones empties d's rl_tombstones, as on a new Datapath.
func clearTombstones(tb testing.TB, d *maps.Datapath) {
	tb.Helper()
	m := programMap(tb, d, "rl_tombstones")
	keys := make([]uint32, m.MaxEntries())
	for i := range keys {
		keys[i] = uint32(i)
	}
	if _, err := m.BatchUpdate(keys, make([]bpf.RatelimitRlTombSet, len(keys)), nil); err != nil {
		tb.Fatalf("clear rl_tombstones: %v", err)
	}
}

// clearMap deletes every entry of a hash map: a fuzz input that starts from
// an empty fragment table is reproducible.
func clearMap(tb testing.TB, m *ebpf.Map) {
	tb.Helper()
	key := make([]byte, m.KeySize())
	var keys [][]byte
	for err := m.NextKey(nil, key); err == nil; err = m.NextKey(key, key) {
		keys = append(keys, slices.Clone(key))
	}
	for _, k := range keys {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			tb.Fatalf("clear %s: %v", m, err)
		}
	}
}
