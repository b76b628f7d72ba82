package maps

import (
	"net/netip"
	"testing"

	"github.com/rlagent/rlagent/internal/testenv"
)

// TestPortTableFolded: every rl_ports entry carries its class's port-less
// limits (the data path reads one entry per packet), the classifier read
// back holds them apart again, and a pinned port table without them (as an
// older version wrote it) is rewritten by Load.
func TestPortTableFolded(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	opts := Options{PinDir: testenv.BPFFS(t), Clock: ClockTest, CPUs: 1, MaxBuckets: 1024}
	d := loadTest(t, opts)
	mustSetLimit(t, d, 3, Limit{Rate: 10, Burst: 10, Match: Match{Protocol: UDP}})
	mustSetLimit(t, d, 70, Limit{Rate: 10, Burst: 10, Match: Match{Protocol: UDP, DstPorts: ports(PortRange{53, 53})}})

	entry := func(d *Datapath, port int) mask {
		t.Helper()
		var m mask
		if err := d.objs.RlPorts.Lookup(uint32(classUDP*portSpace+port), &m); err != nil {
			t.Fatal(err)
		}
		return m
	}
	if got, want := entry(d, 53), maskOf(3, 70); got != want {
		t.Errorf("rl_ports[udp 53] = limits %v, want %v", idsOf(got), idsOf(want))
	}
	if got, want := entry(d, 54), maskOf(3); got != want {
		t.Errorf("rl_ports[udp 54] = limits %v, want %v", idsOf(got), idsOf(want))
	}
	if c := checkClassifier(t, d); c.unfolded {
		t.Error("classifier read back as unfolded")
	}

	// An older port table: the entries lack the port-less limit 3.
	for _, p := range []int{53, 54} {
		m := andNot(entry(d, p), maskOf(3))
		if err := d.objs.RlPorts.Put(uint32(classUDP*portSpace+p), &m); err != nil {
			t.Fatal(err)
		}
	}
	d2 := loadTest(t, opts)
	if got, want := entry(d2, 53), maskOf(3, 70); got != want {
		t.Errorf("after Load: rl_ports[udp 53] = limits %v, want %v", idsOf(got), idsOf(want))
	}
	if got, want := entry(d2, 54), maskOf(3); got != want {
		t.Errorf("after Load: rl_ports[udp 54] = limits %v, want %v", idsOf(got), idsOf(want))
	}
	checkClassifier(t, d2)
}

// TestPrefixFirstStageRebuilt: the first stage of the IPv4 prefix match is
// written with the tries, and Load rebuilds it from the tries where the
// pinned maps lack it (as after a migration from a version without it,
// which copies the tries and starts the first stage empty).
func TestPrefixFirstStageRebuilt(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	opts := Options{PinDir: testenv.BPFFS(t), Clock: ClockTest, CPUs: 1, MaxBuckets: 1024}
	d := loadTest(t, opts)
	mustSetLimit(t, d, 5, Limit{Rate: 10, Burst: 10, Match: Match{SrcCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}})
	mustSetLimit(t, d, 9, Limit{Rate: 10, Burst: 10, Match: Match{SrcCIDRs: []netip.Prefix{netip.MustParsePrefix("10.1.2.0/24")}}})

	entry := func(d *Datapath, idx int) head4 {
		t.Helper()
		var h head4
		if err := d.objs.RlSrc4Head.Lookup(uint32(idx), &h); err != nil {
			t.Fatal(err)
		}
		return h
	}
	check := func(d *Datapath, when string) {
		t.Helper()
		for _, c := range []struct {
			idx  int
			want head4
		}{
			{10<<8 | 0, head4{M: maskOf(5)}},
			{10<<8 | 1, head4{M: maskOf(5), Deep: 1}}, // 10.1.2.0/24 lies in 10.1/16: ask the trie
			{10<<8 | 255, head4{M: maskOf(5)}},
			{11 << 8, head4{}},
			{9<<8 | 255, head4{}},
		} {
			if got := entry(d, c.idx); got != c.want {
				t.Errorf("%s: rl_src4_head[%d.%d] = %+v, want %+v", when, c.idx>>8, c.idx&255, got, c.want)
			}
		}
		var h head4
		if err := d.objs.RlDst4Head.Lookup(uint32(10<<8), &h); err != nil || h != (head4{}) {
			t.Errorf("%s: rl_dst4_head[10.0] = %+v (%v), want empty", when, h, err)
		}
	}
	check(d, "after SetLimit")
	checkClassifier(t, d)

	// An older layout's maps: the first stage empty.
	zero := make([]head4, head4Entries)
	keys := make([]uint32, head4Entries)
	for i := range keys {
		keys[i] = uint32(i)
	}
	if _, err := d.objs.RlSrc4Head.BatchUpdate(keys, zero, nil); err != nil {
		t.Fatal(err)
	}
	d2 := loadTest(t, opts)
	check(d2, "after Load")
	checkClassifier(t, d2)
}
