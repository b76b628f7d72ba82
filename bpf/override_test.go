package bpf_test

import (
	"net/netip"
	"testing"

	"github.com/rlagent/rlagent/maps"
)

// TestKeyShares: a key with a share of its own (rl_overrides) refills at
// its rate up to its burst, the limit's other keys at the limit's; a live
// bucket takes a change of its share at its next lease, and goes back to
// the limit's share when its own is removed. Through Program.Run on the
// test clock, 100 ms at a time.
func TestKeyShares(t *testing.T) {
	defer pinCPU(t, 0)()
	d := testDatapath(t)
	l := perSecond(1000, 100)
	l.Key = maps.KeySrcIP
	mustSet(t, d, 1, l)
	own := maps.Bucket{Addr: netip.MustParseAddr("10.0.0.1")}
	setShares := func(s map[maps.Bucket]maps.KeyShare) {
		t.Helper()
		if err := d.SetKeyShares(1, s); err != nil {
			t.Fatal(err)
		}
		got, err := d.KeyShares(1)
		if err != nil || len(got) != len(s) {
			t.Fatalf("KeyShares = %v, %v; want %v", got, err, s)
		}
		for b, ks := range s {
			if got[b] != ks {
				t.Fatalf("KeyShares = %v; want %v", got, s)
			}
		}
	}
	setShares(map[maps.Bucket]maps.KeyShare{own: {Rate: 5000, Burst: 500}})

	now := uint64(1e9)
	admitted := func(src string) uint64 {
		t.Helper()
		setClock(t, d, now, 0)
		pkt := udp4(src, "10.9.0.1", 53)
		var n uint64
		for range 2000 {
			if mustRun(t, d.Program(), pkt) == xdpPass {
				n++
			}
		}
		return n
	}
	within := func(what string, got, want uint64) {
		t.Helper()
		// A CPU's leased chunk and the clock's rounding: a few units.
		if got+5 < want || got > want+5 {
			t.Errorf("%s: %d admitted, want %d", what, got, want)
		}
	}
	// New buckets start full: the key's burst, and the limit's.
	within("10.0.0.1 at first (its burst 500)", admitted("10.0.0.1"), 500)
	within("10.0.0.2 at first (the limit's burst 100)", admitted("10.0.0.2"), 100)
	for range 3 {
		now += 100e6
		within("10.0.0.1 over 100 ms at 5,000/s", admitted("10.0.0.1"), 500)
		within("10.0.0.2 over 100 ms at 1,000/s", admitted("10.0.0.2"), 100)
	}
	// What the key took of its own share, leased a chunk at a time: its
	// burst and three refills (2,000), to a chunk (5); the key without
	// one has no usage.
	use, err := d.KeyUsage()
	if err != nil {
		t.Fatal(err)
	}
	if got := use[1][own]; got+5 < 2000 || got > 2000+5 {
		t.Errorf("KeyUsage of 10.0.0.1 = %d, want the 2000 admitted under its share", got)
	}
	if len(use[1]) != 1 {
		t.Errorf("KeyUsage of limit 1 = %v, want 10.0.0.1's alone", use[1])
	}

	// A change, to a bucket that is live in this CPU's cache.
	setShares(map[maps.Bucket]maps.KeyShare{own: {Rate: 2000, Burst: 500}})
	now += 100e6
	within("10.0.0.1 over 100 ms at 2,000/s", admitted("10.0.0.1"), 200)
	within("10.0.0.2 over 100 ms, unchanged", admitted("10.0.0.2"), 100)

	// Removed: the limit's share again.
	setShares(map[maps.Bucket]maps.KeyShare{})
	now += 100e6
	within("10.0.0.1 over 100 ms, its share removed", admitted("10.0.0.1"), 100)

	// Another key's share, set while 10.0.0.2's bucket is live.
	setShares(map[maps.Bucket]maps.KeyShare{{Addr: netip.MustParseAddr("10.0.0.2")}: {Rate: 0, Burst: 0}})
	now += 100e6
	within("10.0.0.2 over 100 ms at a share of 0", admitted("10.0.0.2"), 0)
	within("10.0.0.1 over 100 ms at the limit's share", admitted("10.0.0.1"), 100)

	// A limit that is set anew (a new key kind: new buckets) loses them.
	l.Key = maps.KeyDstIP
	mustSet(t, d, 1, l)
	if got, err := d.KeyShares(1); err != nil || len(got) != 0 {
		t.Errorf("after the limit started over: KeyShares = %v, %v; want none", got, err)
	}
}
