package bpf_test

import (
	"testing"
	"time"

	"github.com/rlagent/rlagent/maps"
)

// Issue 8, item 3: fragments. A first fragment leaves its transport fields in
// rl_frags for its datagram's later fragments (frag.h), so that every
// fragment is charged to the limits its datagram matches, each its own frame
// length for a byte limit and 1 for a packet limit. Every datagram here has a
// fragment id of its own: the table is shared by the whole Datapath. Every
// test runs through every program (issue 9: the TC ones too).

// Fragmented UDP against a byte limit on its port: the bytes that pass, over
// first and later fragments, stay within the limit (burst + rate x T), and
// the limit counts every fragment. Before (issue 8) only first fragments
// were charged: a 20 KB/s limit let 208 KB/s through, up to ~44x with 64 KB
// datagrams (the reference subtest measures the factor).
func TestFragmentedByteLimit(t *testing.T) {
	const (
		rate, burst = 20_000, 20_000 // bytes/s, bytes
		seconds     = 2
		overload    = 10 // offered / rate
		fragData    = 1480
	)
	limit := maps.Limit{Rate: rate, Burst: burst, Unit: maps.Bytes,
		Match: maps.Match{Protocol: maps.UDP, DstPorts: ports(5000, 5000)}}
	type stream struct {
		frames [][]byte
		bytes  uint64
		dgrams int
	}
	// mk is the fragments of enough datagrams of payload bytes to offer
	// overload x rate over seconds.
	mk := func(base pkt, payload int, id0 uint32) stream {
		var s stream
		for i := 0; s.bytes < overload*rate*seconds; i++ {
			p := base
			p.payload, p.fragID = payload, id0+uint32(i)
			for _, f := range p.frags(fragData) {
				s.frames = append(s.frames, f)
				s.bytes += uint64(len(f))
			}
			s.dgrams++
		}
		return s
	}
	u4 := pkt{src: src4, dst: dst4, proto: protoUDP, sport: 40000, dport: 5000}
	u6 := pkt{src: src6, dst: dst6, proto: protoUDP, sport: 40000, dport: 5000}
	cases := []struct {
		name string
		s    stream
	}{
		{"ipv4 8 KB datagrams", mk(u4, 8000, 1000)},
		{"ipv4 64 KB datagrams", mk(u4, 65000, 2000)},
		{"ipv6 8 KB datagrams", mk(u6, 8000, 3000)},
		{"ipv6 64 KB datagrams", mk(u6, 65000, 4000)},
	}
	d := hookDatapath(t)
	forEachProg(t, allProgs, func(t *testing.T, pr prog) {
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				defer pinCPU(t, 0)()
				fresh(t, d, 0, pr.at(limit))
				step := uint64(seconds*1e9) / uint64(len(tc.s.frames))
				setClock(t, d, 1e9, step)
				before := globals(t, d)
				var passed uint64
				for _, f := range tc.s.frames {
					if pr.run(t, d, f) == xdpPass {
						passed += uint64(len(f))
					}
				}
				elapsed := step * uint64(len(tc.s.frames))
				want := burst + rate*elapsed/1e9
				t.Logf("%d datagrams, %d fragments, %d bytes offered in %.2f s: %d bytes passed (%.2fx the limit's %d)",
					tc.s.dgrams, len(tc.s.frames), tc.s.bytes, float64(elapsed)/1e9, passed, float64(passed)/float64(want), want)
				// Never above the exact figure. Below it by less than two
				// frames: whole frames only, and a CPU whose pool was
				// short asks again once the frame's cost has accrued
				// (bucket.h), so up to a frame's worth sits in the pool at
				// the end.
				const maxFrame = 14 + 40 + 8 + fragData
				if passed > want || want-passed > 2*maxFrame {
					t.Errorf("%d bytes passed, want %d less at most two frames (%d)", passed, want, 2*maxFrame)
				}
				st := mustStats(t, d, 0)
				if st.AdmittedBytes != passed || st.AdmittedBytes+st.DroppedBytes != tc.s.bytes ||
					st.AdmittedPackets+st.DroppedPackets != uint64(len(tc.s.frames)) {
					t.Errorf("limit counted %d+%d bytes in %d+%d packets; %d bytes passed of %d in %d frames: every fragment is charged its own length",
						st.AdmittedBytes, st.DroppedBytes, st.AdmittedPackets, st.DroppedPackets, passed, tc.s.bytes, len(tc.s.frames))
				}
				if g := globals(t, d).minus(before); g != (gstats{fragFirst: uint64(tc.s.dgrams)}) {
					t.Errorf("global counters moved by %+v, want %d first fragments and nothing else", g, tc.s.dgrams)
				}
			})
		}
	})
	t.Run("reference 1acc742", func(t *testing.T) {
		ref := reference(t, limit)
		for _, tc := range cases {
			start := time.Now()
			var passed uint64
			for _, f := range tc.s.frames {
				if mustRun(t, ref, f) == xdpPass {
					passed += uint64(len(f))
				}
			}
			// The reference runs on jiffies: at most this long passed.
			elapsed := time.Since(start) + 10*time.Millisecond
			bound := burst + rate*uint64(elapsed)/1e9
			t.Logf("reference, %s: %d of %d bytes passed in %v, %.1fx the limit's %d",
				tc.name, passed, tc.s.bytes, elapsed.Round(time.Millisecond), float64(passed)/float64(bound), bound)
			if passed < 3*bound {
				t.Errorf("the reference passed %d bytes, the limit allows %d: the test no longer reproduces the bypass", passed, bound)
			}
		}
	})
}

// Every fragment of a datagram costs 1 in a packet limit: 10 datagrams of 6
// fragments against a burst of 30 packets (clock stopped) pass 30
// fragments, not 10 datagrams' worth (before: 30 first fragments and every
// later one).
func TestFragmentedPacketLimit(t *testing.T) {
	d := hookDatapath(t)
	forEachProg(t, allProgs, func(t *testing.T, pr prog) {
		defer pinCPU(t, 0)() // in the subtest's own goroutine
		fresh(t, d, 0, pr.at(maps.Limit{Rate: 1, Burst: 30, Match: maps.Match{Protocol: maps.UDP, DstPorts: ports(5000, 5000)}}))
		passed, sent := 0, 0
		for i := range 10 {
			p := pkt{src: src4, dst: dst4, proto: protoUDP, sport: 1, dport: 5000, payload: 8000, fragID: 5000 + uint32(i)}
			for _, f := range p.frags(1480) {
				sent++
				if pr.run(t, d, f) == xdpPass {
					passed++
				}
			}
		}
		if passed != 30 {
			t.Errorf("%d of %d fragments passed a 30-packet burst, want 30", passed, sent)
		}
		if st := mustStats(t, d, 0); st.AdmittedPackets != 30 || st.DroppedPackets != uint64(sent-30) {
			t.Errorf("limit counted %d admitted, %d dropped; want 30 and %d", st.AdmittedPackets, st.DroppedPackets, sent-30)
		}
	})
}

// The fragment table, fragment by fragment, against rate-0 probe limits:
// which limits count each fragment tells what the data path made of it.
func TestFragmentTable(t *testing.T) {
	d := hookDatapath(t)
	const (
		l53   uint32 = iota // UDP/53
		l54                 // UDP/54
		lT80                // TCP/80
		lT81                // TCP/81
		lAny                // anything
		lSrc                // anything from 10.0.0.0/8 or 2001:db8::/32
		lICMP               // ICMP
	)
	limits := map[uint32]maps.Limit{
		l53:   empty(maps.Match{Protocol: maps.UDP, DstPorts: ports(53, 53)}),
		l54:   empty(maps.Match{Protocol: maps.UDP, DstPorts: ports(54, 54)}),
		lT80:  empty(maps.Match{Protocol: maps.TCP, DstPorts: ports(80, 80)}),
		lT81:  empty(maps.Match{Protocol: maps.TCP, DstPorts: ports(81, 81)}),
		lAny:  empty(maps.Match{}),
		lSrc:  empty(maps.Match{SrcCIDRs: prefixes("10.0.0.0/8", "2001:db8::/32")}),
		lICMP: empty(maps.Match{Protocol: maps.ICMP}),
	}
	// What a whole datagram of each kind hits, and one whose ports are
	// unknown (every limit of its protocol).
	var (
		udp53    = []uint32{l53, lAny, lSrc}
		anyUDP   = []uint32{l53, l54, lAny, lSrc}
		tcp80    = []uint32{lT80, lAny, lSrc}
		anyTCP   = []uint32{lT80, lT81, lAny, lSrc}
		allLimit = []uint32{l53, l54, lT80, lT81, lAny, lSrc, lICMP}
	)
	type step struct {
		frame []byte
		hit   []uint32
		g     gstats
	}
	train := pkt.frags
	u4 := pkt{src: src4, dst: dst4, proto: protoUDP, sport: 1, dport: 53, payload: 100}
	u6 := pkt{src: src6, dst: dst6, proto: protoUDP, sport: 1, dport: 53, payload: 100}
	t4 := pkt{src: src4, dst: dst4, proto: protoTCP, sport: 1, dport: 80, payload: 100}
	id := uint32(6000)
	next := func(p pkt) pkt { id++; p.fragID = id; return p }

	type tc struct {
		name  string
		steps []step
	}
	var tests []tc
	for _, base := range []pkt{u4, u6} {
		fam := "ipv4"
		// A later fragment that cannot be trusted is L4-unknown: an IPv4
		// one keeps its protocol (in its own IP header, which the kernel
		// matches on), an IPv6 one does not (its next header is the
		// sender's word: the first fragment's counts, RFC 8200).
		unknownLater := anyUDP
		if base.src == src6 {
			fam = "ipv6"
			unknownLater = allLimit
		}
		// In order: the first is recorded, the later ones take its ports.
		fr := train(next(base), 48)
		tests = append(tests, tc{fam + " in order", []step{
			{fr[0], udp53, gFirst}, {fr[1], udp53, gNone}, {fr[2], udp53, gNone},
		}})
		// Reversed: the later ones come first and are L4-unknown, then
		// the first is recorded; a later one that does not follow on
		// from it (here the last, again) is out of order: L4-unknown.
		fr = train(next(base), 48)
		tests = append(tests, tc{fam + " reversed", []step{
			{fr[2], unknownLater, gUnseen}, {fr[1], unknownLater, gUnseen}, {fr[0], udp53, gFirst}, {fr[2], unknownLater, gL4U},
		}})
		// A tiny first fragment: its later ones are L4-unknown too.
		p := next(base)
		fr = train(p, 48)
		tiny := p
		tiny.mf, tiny.l4Keep = true, 4
		if base.src == src6 {
			tiny.ext = []uint8{44}
		}
		tests = append(tests, tc{fam + " tiny first fragment", []step{
			{tiny.bytes(), anyUDP, gFirstL4U}, {fr[1], unknownLater, gL4U}, {fr[2], unknownLater, gL4U},
		}})
		// Another source, same id: another datagram.
		p = next(base)
		fr = train(p, 48)
		other := p
		if base.src == src6 {
			other.src = "2001:db8::99"
		} else {
			other.src = "10.0.0.99"
		}
		tests = append(tests, tc{fam + " same id from another source", []step{
			{fr[0], udp53, gFirst}, {train(other, 48)[1], unknownLater, gUnseen},
		}})
		// A fragment overlapping the first (offset 1 = byte 8: the UDP
		// payload) makes the kernel drop the datagram; a datagram that
		// reuses the id after it must not inherit the record: it and the
		// fragments after it are L4-unknown.
		p = next(base)
		fr = train(p, 48)
		over := p
		over.fragOff, over.mf = 1, true
		if base.src == src6 {
			over.ext = []uint8{44}
		}
		tests = append(tests, tc{fam + " overlapping fragment", []step{
			{fr[0], udp53, gFirst}, {over.frame(make([]byte, 16)), unknownLater, gL4U}, {fr[1], unknownLater, gL4U},
		}})
	}
	// IPv4: the protocol is part of a datagram's identity; a later
	// fragment of the same id with another protocol is another datagram.
	p := next(u4)
	fr := train(p, 48)
	tcpLater := with(p, func(q *pkt) { q.proto = protoTCP; q.fragOff = 6 })
	tests = append(tests, tc{"ipv4 same id, another protocol", []step{
		{fr[0], udp53, gFirst}, {tcpLater.frame(make([]byte, 8)), anyTCP, gUnseen},
	}})
	// IPv6: it is not (RFC 8200); the header after the fragment header of
	// a later fragment may even be an extension header.
	p = next(u6)
	fr = train(p, 48)
	dstLater := with(p, func(q *pkt) { q.ext = []uint8{44, 60}; q.fragOff = 6 })
	tests = append(tests, tc{"ipv6 later fragment, destination options after the fragment header", []step{
		{dstLater.bytes(), allLimit, gUnseen}, {fr[0], udp53, gFirst}, {dstLater.bytes(), udp53, gNone},
	}})
	// An atomic IPv6 fragment (offset 0, M clear) is a whole datagram:
	// not recorded.
	p = next(u6)
	p.ext = []uint8{44}
	tests = append(tests, tc{"ipv6 atomic fragment", []step{{p.bytes(), udp53, gNone}}})
	// IPv4 TCP at offset 1 rewrites the flags of the header it overlaps
	// (RFC 1858): L4-unknown even after its first fragment, and out of
	// order, so the datagram's later fragments are L4-unknown too.
	p = next(t4)
	fr = train(p, 48)
	off1 := with(p, func(q *pkt) { q.fragOff = 1; q.mf = true })
	tests = append(tests, tc{"ipv4 tcp offset 1 after its first fragment", []step{
		{fr[0], tcp80, gFirst}, {off1.frame(make([]byte, 16)), anyTCP, gL4U}, {fr[1], anyTCP, gL4U},
	}})
	// Before its first fragment: every TCP limit.
	p = next(t4)
	off1 = with(p, func(q *pkt) { q.fragOff = 1; q.mf = true })
	tests = append(tests, tc{"ipv4 tcp offset 1 alone", []step{{off1.frame(make([]byte, 16)), anyTCP, gUnseen}}})
	// The first fragment of an IPv6 datagram whose chain hides the
	// protocol: its later fragments are charged as it is, to every limit.
	p = next(u6)
	p.ext = []uint8{44, 135}
	p.mf = true
	unk := p.bytes()
	later := with(p, func(q *pkt) { q.ext = []uint8{44}; q.fragOff = 20; q.mf = false }).frame(make([]byte, 8))
	tests = append(tests, tc{"ipv6 first fragment hides the protocol", []step{
		{unk, allLimit, gFirstL4U}, {later, allLimit, gL4U},
	}})

	forEachProg(t, allProgs, func(t *testing.T, pr prog) {
		install(t, d, pr.atAll(limits))
		clearMap(t, fragTable(t, d))
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				for i, s := range tt.steps {
					before := snapshot(t, d)
					want := uint32(xdpPass)
					if len(s.hit) > 0 {
						want = xdpDrop
					}
					if got := pr.run(t, d, s.frame); got != want {
						t.Errorf("fragment %d: verdict %d, want %d", i, got, want)
					}
					checkDropped(t, before, snapshot(t, d), s.hit, len(s.frame), s.g)
					if t.Failed() {
						t.Fatalf("at fragment %d of %d", i, len(tt.steps))
					}
				}
			})
		}
	})
}
