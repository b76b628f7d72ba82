package demand

import (
	"math"
	"slices"
	"testing"
	"time"
)

// A round counts, of each node, the latest report of the limit that is lag
// old, says when the next one will be, and allocates the rate among them
// with the floor divided by the nodes counted or the count.
func TestRound(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	nodes := []NodeReport{
		{Node: "b", Demands: map[string]uint64{"web": 3000}, Renewed: at(0)},
		{Node: "a", Demands: map[string]uint64{"web": 7000, "api": 50}, Renewed: at(8), Previous: map[string]uint64{"web": 6000}, PrevAt: at(-5)},
		{Node: "c", Demands: map[string]uint64{"web": 0, "api": 2000}, Renewed: at(9)},
		{Node: "d", Demands: map[string]uint64{"api": 10}, Renewed: at(-20)},
	}
	lag := 10 * time.Second
	r := Round(nodes, "web", 6000, 100, 3, at(10), lag)
	// a's latest is 2 s old: its previous counts; c has none old enough.
	if !slices.Equal(r.Demands, []uint64{6000, 3000}) || !r.Countable.Equal(at(18)) || r.Asked != 9000 {
		t.Errorf("web at 10 s: %v (asked %d), next at %v; want [6000 3000] (a's previous, b), 9000, next at 18 s", r.Demands, r.Asked, r.Countable.Sub(t0))
	}
	// 10% of 6000 over max(2 counted, 3 nodes): 200 each; 6000 shared
	// max-min fair between 6000 and 3000: water 3000.
	if r.Level != (Level{Water: 3000, Floor: 200}) {
		t.Errorf("web at 10 s: level %+v, want water 3000, floor 200", r.Level)
	}
	r2 := Round(nodes, "web", 6000, 100, 3, at(19), lag)
	if !slices.Equal(r2.Demands, []uint64{7000, 3000, 0}) || !r2.Countable.IsZero() || r2.Fingerprint == r.Fingerprint {
		t.Errorf("web at 19 s: %v, next at %v, fingerprint changed %v; want [7000 3000 0], none, changed", r2.Demands, r2.Countable, r2.Fingerprint != r.Fingerprint)
	}
	if r := Round(nodes, "api", 6000, 100, 3, at(10), lag); !slices.Equal(r.Demands, []uint64{10}) {
		t.Errorf("api at 10 s: %v, want only d's (a's and c's are too new)", r.Demands)
	}
	// The Leases' order does not change the fingerprint.
	rev := slices.Clone(nodes)
	slices.Reverse(rev)
	if r4 := Round(rev, "web", 6000, 100, 3, at(19), lag); r4.Fingerprint != r2.Fingerprint {
		t.Error("the fingerprint depends on the order of the Leases")
	}
	// A hostile report cannot wrap the sum; with no node counted, the
	// floor is divided by the count.
	huge := []NodeReport{
		{Node: "x", Demands: map[string]uint64{"web": math.MaxUint64 - 1}, Renewed: at(0)},
		{Node: "y", Demands: map[string]uint64{"web": 5}, Renewed: at(0)},
	}
	if r := Round(huge, "web", 6000, 100, 3, at(10), lag); r.Asked != math.MaxUint64 {
		t.Errorf("asked %d, want saturated at MaxUint64", r.Asked)
	}
	if r := Round(nil, "web", 6000, 100, 4, at(10), lag); len(r.Demands) != 0 || r.Level.Floor != 150 {
		t.Errorf("no node counted: %v, floor %d; want none, 600/4", r.Demands, r.Level.Floor)
	}
}
