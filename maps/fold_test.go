package maps

import (
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
