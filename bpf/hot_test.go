package bpf_test

import (
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/rlagent/rlagent/maps"
)

// Hot keys (keycache.h, rl_hot_note) through Program.Run on the test
// clock: a key whose bucket is short in two consecutive ticks is recorded
// once, with the units it turned away in the first; a key within its share,
// or short in one tick only, is not; a flood of keys that each send a
// packet records nothing; and what a flood of hot keys writes stays within
// the rings.

// hotShift makes a tick 2^20 ns (about 1 ms) of the test clock.
const hotShift = 20

func tickAt(n uint64) uint64 { return n << hotShift }

// hotLimit is a keyed limit (src-ip) that records its hot keys.
func hotLimit(rate, burst uint64) maps.Limit {
	l := perSecond(rate, burst)
	l.Key = maps.KeySrcIP
	l.Hot = true
	return l
}

func hotDatapath(t *testing.T) *maps.Datapath {
	t.Helper()
	d := testDatapath(t)
	if err := d.SetHotTick(hotShift); err != nil {
		t.Fatal(err)
	}
	return d
}

func mustHot(t *testing.T, d *maps.Datapath) []maps.HotKey {
	t.Helper()
	hs, err := d.HotKeys(0)
	if err != nil {
		t.Fatal(err)
	}
	return hs
}

// send runs n packets from src at tick (the clock fixed there), and returns
// how many were dropped.
func send(t *testing.T, d *maps.Datapath, src string, tick, n uint64) uint64 {
	t.Helper()
	setClock(t, d, tickAt(tick)+1000, 0)
	pkt := udp4(src, "10.9.0.1", 53)
	var dropped uint64
	for range n {
		if mustRun(t, d.Program(), pkt) == xdpDrop {
			dropped++
		}
	}
	return dropped
}

func TestHotKeys(t *testing.T) {
	defer pinCPU(t, 0)()
	d := hotDatapath(t)
	// 1,000 units/s, burst 10: within a tick of about 1 ms a key earns
	// about one unit.
	mustSet(t, d, 1, hotLimit(1000, 10))

	const t0 = 5000
	// hot: short in ticks t0 and t0+1: recorded once, for t0.
	droppedT0 := send(t, d, "10.0.0.1", t0, 100)
	// once: short in t0 only, then quiet.
	send(t, d, "10.0.0.2", t0, 100)
	// within: never short (5 packets a tick, burst 10 and a unit a tick).
	send(t, d, "10.0.0.3", t0, 5)
	if hs := mustHot(t, d); len(hs) != 0 {
		t.Fatalf("after one tick: %v, want no hot key yet", hs)
	}
	send(t, d, "10.0.0.1", t0+1, 50)
	send(t, d, "10.0.0.3", t0+1, 1)
	send(t, d, "10.0.0.2", t0+3, 100) // short again, but not in t0+1 or t0+2

	hs := mustHot(t, d)
	if len(hs) != 1 {
		t.Fatalf("hot keys %+v, want one: 10.0.0.1", hs)
	}
	h := hs[0]
	if h.ID != 1 || h.Key.Addr != netip.MustParseAddr("10.0.0.1") || h.Tick != t0 {
		t.Errorf("hot key %+v, want limit 1, 10.0.0.1, tick %d", h, t0)
	}
	if droppedT0 < 80 || h.Short != droppedT0 {
		t.Errorf("recorded %d units turned away in tick %d; the program dropped %d of 100", h.Short, t0, droppedT0)
	}

	// Still short in t0+2: a record a tick, not a packet.
	send(t, d, "10.0.0.1", t0+2, 50)
	send(t, d, "10.0.0.1", t0+2, 50)
	if hs := mustHot(t, d); len(hs) != 2 || hs[1].Tick != t0+1 {
		t.Errorf("after ticks t0..t0+2: %+v, want the records of t0 and t0+1", hs)
	}
	// From a tick on: HotKeys(since).
	if hs, err := d.HotKeys(t0 + 1); err != nil || len(hs) != 1 {
		t.Errorf("HotKeys(t0+1) = %+v, %v; want the record of t0+1 only", hs, err)
	}

	// A limit without Hot records nothing.
	cold := hotLimit(1000, 10)
	cold.Hot = false
	cold.Match.DstPorts = []maps.PortRange{{First: 54, Last: 54}}
	mustSet(t, d, 2, cold)
	pkt := udp4("10.0.0.9", "10.9.0.1", 54)
	for tick := uint64(t0 + 10); tick < t0+14; tick++ {
		setClock(t, d, tickAt(tick)+1000, 0)
		for range 50 {
			mustRun(t, d.Program(), pkt)
		}
	}
	for _, h := range mustHot(t, d) {
		if h.ID == 2 {
			t.Errorf("limit 2 (not hot) recorded %+v", h)
		}
	}
}

// TestHotKeysFlood: keys that send a packet each (short or not) record
// nothing, however many; keys that are all hot write at most the ring a
// CPU holds.
func TestHotKeysFlood(t *testing.T) {
	defer pinCPU(t, 0)()
	d := hotDatapath(t)
	// Rate 0: every packet is turned away.
	mustSet(t, d, 1, hotLimit(0, 0))
	keys := 1_000_000
	if testing.Short() {
		keys = 100_000
	}
	pkt := udp4("10.0.0.1", "10.9.0.1", 53)
	src := func(i int) {
		binary.BigEndian.PutUint32(pkt[26:30], 0x0a000000+uint32(i)) // 10.x.y.z
	}
	before := mustGlobal(t, d).HotRecords
	// One packet a key, a new tick every 1,000 keys: each key is short in
	// one tick only.
	for i := range keys {
		if i%1000 == 0 {
			setClock(t, d, tickAt(uint64(7000+i/1000))+1000, 0)
		}
		src(i)
		mustRun(t, d.Program(), pkt)
	}
	if n := mustGlobal(t, d).HotRecords - before; n != 0 {
		t.Errorf("%d keys sending one packet each: %d hot records, want 0", keys, n)
	}
	if hs := mustHot(t, d); len(hs) != 0 {
		t.Errorf("%d hot keys read, want none", len(hs))
	}

	// 3 x HotRing keys, each short in two consecutive ticks: few enough to
	// keep their cache slots (4,096 sets of two ways), too many for the
	// ring.
	hot := 3 * maps.HotRing
	for tick := range 2 {
		setClock(t, d, tickAt(uint64(20_000+tick))+1000, 0)
		for i := range hot {
			src(i)
			mustRun(t, d.Program(), pkt)
		}
	}
	recorded := mustGlobal(t, d).HotRecords - before
	hs := mustHot(t, d)
	if recorded < uint64(hot)/2 {
		t.Errorf("%d keys short in two ticks: %d recorded, want most of them", hot, recorded)
	}
	if len(hs) > maps.HotRing {
		t.Errorf("%d hot keys read from one CPU's ring of %d", len(hs), maps.HotRing)
	}
	seen := make(map[netip.Addr]bool)
	for _, h := range hs {
		if seen[h.Key.Addr] || h.Tick != 20_000 || h.Short != 1 {
			t.Fatalf("record %+v: want each key once, tick 20000, 1 unit short", h)
		}
		seen[h.Key.Addr] = true
	}
	t.Logf("%d keys of one packet: 0 records; %d hot keys: %d recorded, %d kept in the ring", keys, hot, recorded, len(hs))
}
