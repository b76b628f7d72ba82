package bpf_test

import (
	"encoding/binary"
	"errors"
	"fmt"
	stdmaps "maps"
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/maps"
)

// keySet mirrors rl_hash of include/keycache.h for a source-address key: the set of
// the per-CPU key cache that the bucket of (limit id, generation, addr) takes.
// If it drifts from the C, TestKeyCacheSetCollision finds no collision in
// the data path and fails on its CacheBypass check.
func keySet(seed [2]uint64, id, gen uint32, addr netip.Addr) uint32 {
	b := addr.As16()
	var a [4]uint64
	for i := range a {
		a[i] = uint64(binary.LittleEndian.Uint32(b[4*i:]))
	}
	hi := a[0]<<32 | a[1]
	lo := a[2]<<32 | a[3]
	lg := uint64(id)<<32 | uint64(gen)
	h := hi*(seed[0]|1) + lo*(seed[1]|1) + lg*((seed[0]^seed[1])|1) + seed[0]>>1
	h ^= h >> 32
	h *= 0xd6e8feb86659fd93
	h ^= h >> 32
	return uint32(h >> 52)
}

// Three keyed limits whose buckets for one source fall in one cache set of
// two ways (two at 10/s and one wide open, checked in between): the third
// checked must not take a way that the first two hold for the same packet. Before (issue 8, item 5) it did, the first limit's draw then
// landed on the third's way and wrapped its tokens to ~2^64: 2,000 of 2,000
// packets passed two 10/s drop limits. Each limit must hold its rate.
//
// The reference object (1acc742, bpf/testdata) fails the same test with
// its own (unkeyed) hash aimed at: the subtest asserts that it does, so that
// this test is known to catch the bug.
func TestKeyCacheSetCollision(t *testing.T) {
	seed := [2]uint64{0x9e3779b97f4a7c15, 0xc2b2ae3d27d4eb4f}
	t.Run("rl_decide", func(t *testing.T) {
		d := newDatapath(t, maps.Options{Clock: maps.ClockTest, HashSeed: seed})
		passed, limit := collide(t, d, d.Program, func(id, gen uint32, a netip.Addr) uint32 { return keySet(seed, id, gen, a) })
		if passed > limit {
			t.Errorf("%d packets passed, want at most %d", passed, limit)
		}
		if g := mustGlobal(t, d); g.CacheBypass == 0 {
			t.Errorf("no check found its set held by the same packet (cache_bypass 0): keySet no longer mirrors rl_hash")
		}
	})
	t.Run("reference 1acc742", func(t *testing.T) {
		// The reference has a test clock of its own, which nothing sets:
		// it runs on jiffies, and the 2,000 packets take a few ms, so the
		// limits admit little more than their burst.
		d := newDatapath(t, maps.Options{})
		// The reference reads a copy of the classifier config taken when
		// it is loaded: after the limits are set.
		ref := func() *ebpf.Program {
			p, err := d.LoadReference(refObject, "xdp_ratelimit")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { p.Close() })
			return p
		}
		passed, limit := collide(t, d, ref, keySet1acc742)
		if passed <= limit {
			t.Errorf("the reference passed %d packets (at most %d allowed): the test no longer reproduces the bug it guards against", passed, limit)
		}
	})
}

// keySet1acc742 is the set rl_hash of 1acc742 picked: unkeyed.
func keySet1acc742(id, gen uint32, addr netip.Addr) uint32 {
	b := addr.As16()
	var a [4]uint64
	for i := range a {
		a[i] = uint64(binary.LittleEndian.Uint32(b[4*i:]))
	}
	x := ((a[0]^a[2])<<32 | (a[1] ^ a[3])) ^ ((uint64(id)<<32 | uint64(gen)) * 0x9E3779B97F4A7C15)
	h := x * 0xFF51AFD7ED558CCD
	return uint32(h^h>>32) & 4095
}

// collide sets three keyed limits (two 10/s, one wide open) on d whose buckets for one source
// share a cache set under setOf, runs 2,000 packets of that source through
// the program prog returns (once the limits are set) over 2 s, and returns how many passed and how many may.
func collide(t *testing.T, d *maps.Datapath, prog func() *ebpf.Program, setOf func(id, gen uint32, a netip.Addr) uint32) (passed, limit uint64) {
	const (
		rate, burst = 10, 10
		packets     = 2000
		step        = 1_000_000 // 1 ms a packet: 2 s in all
	)
	if err := d.SetTestClock(1e9, step); err != nil && !errors.Is(err, maps.ErrNoTestClock) {
		t.Fatal(err)
	}

	// One source's buckets of a few limits spread over the sets (the
	// multiplier spaces them out), but generations move: every new limit
	// takes the next one. Find three (id, generation) pairs that share a set
	// for one source, then hand generations out until each limit gets its.
	src := netip.MustParseAddr("10.0.0.1")
	a := netip.AddrFrom16(src.As16())
	const scratch = maps.MaxLimits - 1
	type bucket struct{ id, gen uint32 }
	bySet := make(map[uint32][]bucket)
	var want []bucket
search:
	for gen := uint32(1); gen < 4096; gen++ {
		for id := range uint32(scratch) {
			set := setOf(id, gen, a)
			for i, b := range bySet[set] {
				for _, c := range bySet[set][i+1:] {
					if b.gen < c.gen && b.id != c.id && b.id != id && c.id != id {
						want = []bucket{b, c, {id, gen}}
						break search
					}
				}
			}
			bySet[set] = append(bySet[set], bucket{id, gen})
		}
	}
	if want == nil {
		t.Fatal("no three buckets of one source share a set")
	}
	t.Logf("source %s, buckets (limit, generation) %v share a cache set", src, want)
	keyed := perSecond(rate, burst)
	keyed.Key = maps.KeySrcIP
	other := keyed
	other.Key = maps.KeyDstIP
	// The limit checked second (the middle id) is wide open: then, in
	// 1acc742, the third takes the first's way before the first draws, the
	// first's draw lands on the third's tokens and wraps them, and neither
	// 10/s limit ever runs dry.
	sorted := []uint32{want[0].id, want[1].id, want[2].id}
	slices.Sort(sorted)
	last := sorted[1]
	open := keyed
	open.Rate, open.Burst = 1e6, 1e6
	gen, flip, scratched := uint32(0), false, false
	for _, b := range want {
		// Each fresh limit takes the next generation; a scratch limit
		// whose key flips is a fresh limit every time.
		for ; gen+1 < b.gen; gen++ {
			l := keyed
			if flip {
				l = other
			}
			flip, scratched = !flip, true
			mustSet(t, d, scratch, l)
		}
		if b.id == last {
			mustSet(t, d, b.id, open)
		} else {
			mustSet(t, d, b.id, keyed)
		}
		gen++
	}
	if scratched {
		if err := d.DeleteLimit(scratch); err != nil {
			t.Fatal(err)
		}
	}
	ids := []uint32{want[0].id, want[1].id, want[2].id}

	p := pkt{src: src.String(), dst: dst4, proto: protoUDP, sport: 1, dport: 53}.bytes()
	mustRepeat(t, prog(), p, packets)

	// Over 2 s a limit admits at most burst + 2 s x rate, and a packet
	// passes, and is counted admitted by each limit, only when all three
	// admit it.
	passed = mustStats(t, d, ids[0]).AdmittedPackets
	for _, id := range ids {
		if s := mustStats(t, d, id); s.AdmittedPackets != passed {
			t.Errorf("limit %d counted %d admitted, limit %d %d: a packet passes for all or none", id, s.AdmittedPackets, ids[0], passed)
		}
	}
	t.Logf("%d of %d packets passed two %d/s limits (burst %d) and a wide one in 2 s", passed, packets, rate, burst)
	return passed, uint64(burst + 2*rate + 1)
}

// The seed keys the hash: with another seed, the same three buckets no
// longer share a set (which is what makes sets hard to aim at), and the
// data path follows the seed it was given.
func TestKeyCacheSeed(t *testing.T) {
	a := netip.MustParseAddr("::ffff:10.1.2.3")
	s1 := [2]uint64{1, 2}
	s2 := [2]uint64{0x9e3779b97f4a7c15, 0xc2b2ae3d27d4eb4f}
	same := 0
	for id := range uint32(64) {
		if keySet(s1, id, id+1, a) == keySet(s2, id, id+1, a) {
			same++
		}
	}
	if same > 2 {
		t.Errorf("%d of 64 buckets kept their set under another seed: the seed does not key the hash", same)
	}
}

func mustGlobal(tb testing.TB, d *maps.Datapath) maps.GlobalStats {
	tb.Helper()
	g, err := d.GlobalStats()
	if err != nil {
		tb.Fatal(err)
	}
	return g
}

// One source's buckets of several limits must not share a cache set for
// every source: which sources two limits share a set for must be as random
// as which sources share one within a limit. 54615ce's hash was linear in
// the limit id and generation (a term lg x C added to the address's), so a
// source's sets in two limits differed by a constant of the seed, the same
// for every source: under a seed whose C has few bits (the first case
// below, C = 1) every limit took the same set for every source, and under
// any seed about one or two pairs of 128 limits did. Sixteen keyed limits
// that one packet matches (ids spaced by 8, as a config of regularly
// spaced limits gets) then fought over the two ways of one set on every
// packet: 14 of 16 checks bypassed the cache (cache_bypass), each one a
// compare-and-swap on the shared pool. Mixed, three of sixteen buckets
// share a set about once in 30,000 packets.
func TestKeyCacheLimitsSpread(t *testing.T) {
	for _, seed := range [][2]uint64{
		{0x5bd1e9955bd1e995, 0x5bd1e9955bd1e995}, // C = (seed[0] ^ seed[1]) | 1 = 1
		{0x9e3779b97f4a7c15, 0xc2b2ae3d27d4eb4f},
		{1, 2},
	} {
		t.Run(fmt.Sprintf("seed %x", seed), func(t *testing.T) {
			const (
				limits  = 16
				sources = 256
			)
			d := newDatapath(t, maps.Options{Clock: maps.ClockTest, XDPOnly: true, HashSeed: seed})
			setClock(t, d, 1e9, 1000)
			open := perSecond(1e6, 1e6)
			open.Key = maps.KeySrcIP
			for i := range uint32(limits) {
				mustSet(t, d, 8*i, open)
			}
			for s := range sources {
				src := fmt.Sprintf("10.9.%d.%d", s/256, s%256)
				if v := mustRun(t, d.Program(), udp4(src, dst4, 53)); v != xdpPass {
					t.Fatalf("source %s: verdict %d, want pass (every limit is wide open)", src, v)
				}
			}
			checks := uint64(limits * sources)
			bypass := mustGlobal(t, d).CacheBypass
			t.Logf("%d of %d keyed checks (%d limits x %d sources) found their cache set held by the same packet", bypass, checks, limits, sources)
			if bypass > checks/100 {
				t.Errorf("%d of %d keyed checks bypassed the cache, want at most 1%%: a source's buckets of different limits share cache sets", bypass, checks)
			}
		})
	}
}

// TestKeyCacheWayDraws: a key that takes a way of its CPU's cache draws
// its packet's cost straight from its bucket and leases nothing into the
// way; its next packet leases a chunk. A way that leased gives what it
// holds back to its bucket when another key takes it; one that only drew
// holds nothing to give. Four sources whose buckets share a cache set of
// two ways, one CPU, a clock that stands still (no refill): each bucket's
// pool is counted to the token.
func TestKeyCacheWayDraws(t *testing.T) {
	seed := [2]uint64{0x9e3779b97f4a7c15, 0xc2b2ae3d27d4eb4f}
	d := newDatapath(t, maps.Options{Clock: maps.ClockTest, HashSeed: seed})
	setClock(t, d, 1e9, 0)
	const rate, burst = 1_000_000, 1_000_000
	l := perSecond(rate, burst)
	l.Key = maps.KeySrcIP
	mustSet(t, d, 0, l) // the first limit of a fresh Datapath: generation 1

	// Four sources in one set of limit 0, generation 1.
	bySet := map[uint32][]netip.Addr{}
	var srcs []netip.Addr
	for i := 0; srcs == nil && i < 1<<16; i++ {
		a := netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)})
		s := keySet(seed, 0, 1, netip.AddrFrom16(a.As16()))
		if bySet[s] = append(bySet[s], a); len(bySet[s]) == 4 {
			srcs = bySet[s]
		}
	}
	if srcs == nil {
		t.Fatal("no four sources share a cache set")
	}
	a, b, c, e := srcs[0], srcs[1], srcs[2], srcs[3]
	t.Logf("sources %v share a cache set", srcs)

	defer pinCPU(t, 0)()
	send := func(src netip.Addr) {
		t.Helper()
		if v := mustRun(t, d.Program(), pkt{src: src.String(), dst: dst4, proto: protoUDP, sport: 1, dport: 53}.bytes()); v != xdpPass {
			t.Fatalf("a packet of %s: verdict %d, want pass", src, v)
		}
	}
	pools := func() map[netip.Addr]uint64 {
		t.Helper()
		bs, err := d.Buckets(0)
		if err != nil {
			t.Fatal(err)
		}
		out := map[netip.Addr]uint64{}
		for _, bk := range bs {
			out[bk.Addr.Unmap()] = bk.Tokens
		}
		return out
	}
	chunk := uint64(rate / 1000) // rate x 1 ms, well under burst / (8 x nCPU)
	steps := []struct {
		what string
		src  netip.Addr
		want map[netip.Addr]uint64
	}{
		{"a's first packet: drawn, nothing leased", a, map[netip.Addr]uint64{a: burst - 1}},
		{"a's second packet: a chunk leased", a, map[netip.Addr]uint64{a: burst - 1 - chunk}},
		{"b takes the set's empty way", b, map[netip.Addr]uint64{a: burst - 1 - chunk, b: burst - 1}},
		{"c takes a's way, which gives back what it holds", c, map[netip.Addr]uint64{a: burst - 2, b: burst - 1, c: burst - 1}},
		{"b's second packet: a chunk leased", b, map[netip.Addr]uint64{a: burst - 2, b: burst - 1 - chunk, c: burst - 1}},
		{"e takes c's way, which only drew", e, map[netip.Addr]uint64{a: burst - 2, b: burst - 1 - chunk, c: burst - 1, e: burst - 1}},
	}
	for _, s := range steps {
		send(s.src)
		if got := pools(); !stdmaps.Equal(got, s.want) {
			t.Fatalf("%s: pools %v, want %v", s.what, got, s.want)
		}
	}
}
