package bpf_test

import (
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

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

func testDatapath(tb testing.TB) *maps.Datapath {
	tb.Helper()
	d := newDatapath(tb, maps.Options{Clock: maps.ClockTest})
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

// Packet building. No checksums: the data path does not read them.

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
	vlans   []uint16 // outer first; the first uses 802.1ad when there are two
	src     string
	dst     string
	proto   uint8
	sport   uint16
	dport   uint16
	ipOpts  int     // IPv4 options, bytes (multiple of 4)
	ext     []uint8 // IPv6 extension headers, in order (0, 43, 60, 44, 51)
	fragOff uint16  // fragment offset in 8-byte units (IPv4 or the v6 fragment header)
	payload int
}

func (p pkt) bytes() []byte {
	src, dst := netip.MustParseAddr(p.src), netip.MustParseAddr(p.dst)
	var l4 []byte
	switch p.proto {
	case protoTCP:
		l4 = make([]byte, 20)
		binary.BigEndian.PutUint16(l4[0:], p.sport)
		binary.BigEndian.PutUint16(l4[2:], p.dport)
		l4[12] = 5 << 4
		l4[13] = 0x10 // ACK
	case protoUDP:
		l4 = make([]byte, 8)
		binary.BigEndian.PutUint16(l4[0:], p.sport)
		binary.BigEndian.PutUint16(l4[2:], p.dport)
		binary.BigEndian.PutUint16(l4[4:], uint16(8+p.payload))
	case protoICMP, protoICMPv6:
		l4 = make([]byte, 8)
		l4[0] = 8 // echo request
	default:
		l4 = nil
	}
	l4 = append(l4, make([]byte, p.payload)...)

	var l3 []byte
	etype := uint16(ethIPv4)
	if src.Is4() {
		h := make([]byte, 20+p.ipOpts)
		h[0] = 0x40 | byte((20+p.ipOpts)/4)
		binary.BigEndian.PutUint16(h[2:], uint16(len(h)+len(l4)))
		binary.BigEndian.PutUint16(h[6:], p.fragOff&0x1fff)
		h[8] = 64
		h[9] = p.proto
		s, d := src.As4(), dst.As4()
		copy(h[12:], s[:])
		copy(h[16:], d[:])
		for i := 20; i < len(h); i++ {
			h[i] = 1 // NOP options
		}
		l3 = h
	} else {
		etype = ethIPv6
		h := make([]byte, 40)
		h[0] = 0x60
		h[7] = 64
		s, d := src.As16(), dst.As16()
		copy(h[8:], s[:])
		copy(h[24:], d[:])
		next := &h[6]
		var exts []byte
		for _, e := range p.ext {
			*next = e
			var x []byte
			switch e {
			case 44: // fragment
				x = make([]byte, 8)
				binary.BigEndian.PutUint16(x[2:], p.fragOff<<3)
			case 51: // AH: (len+2) x 4 bytes
				x = make([]byte, 12)
				x[1] = 1
			default: // hop-by-hop, routing, destination options: (len+1) x 8
				x = make([]byte, 16)
				x[1] = 1
			}
			exts = append(exts, x...)
			next = &exts[len(exts)-len(x)]
		}
		*next = p.proto
		binary.BigEndian.PutUint16(h[4:], uint16(len(exts)+len(l4)))
		l3 = append(h, exts...)
	}

	frame := make([]byte, 12, 14+4*len(p.vlans)+len(l3)+len(l4))
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
	return append(frame, l4...)
}

func udp4(src, dst string, dport uint16) []byte {
	return pkt{src: src, dst: dst, proto: protoUDP, sport: 40000, dport: dport}.bytes()
}

// Limits used across tests.

func perSecond(rate, burst uint64) maps.Limit {
	return maps.Limit{Rate: rate, Burst: burst, Match: maps.Match{Protocol: maps.UDP, DstPorts: []maps.PortRange{{First: 53, Last: 53}}}}
}
