package demand

import (
	"math"
	"strings"
	"testing"
	"time"
)

// TestCheck: the rounds a node refuses, each for one reason, and honest
// rounds it follows (the allocator's own, at the edges of the bounds).
func TestCheck(t *testing.T) {
	now := time.Unix(10_000, 0)
	b := Bounds{Rate: 6000, Count: 3, FloorPerMille: 10}
	const equal = 2000
	round := func(water, floor uint64, nodes int32, at time.Duration) Allocation {
		return Allocation{Round: 7, Level: Level{Water: water, Floor: floor}, Nodes: nodes, Time: now.Add(at)}
	}
	for _, tc := range []struct {
		name  string
		a     Allocation
		b     Bounds
		equal uint64
		want  string // in the error; "" for none
	}{
		{"no round", Allocation{}, b, equal, ""},
		{"honest", round(3877, 20, 3, -time.Second), b, equal, ""},
		{"honest, every demand fits", round(math.MaxUint64, 20, 3, 0), b, equal, ""},
		{"the allocator's clock a little ahead", round(3877, 20, 3, ClockSkew), b, equal, ""},
		{"a joiner not counted yet", round(3877, 20, 4, 0), b, equal, ""},
		{"water at the rate", round(6000, 20, 1, 0), b, equal, ""},
		{"floor at the equal share", round(3877, equal, 3, 0), b, equal, ""},
		{"floor 0 where it rounds to 0", round(200, 0, 3, 0), Bounds{Rate: 300, Count: 3, FloorPerMille: 10}, 100, ""},
		{"floor 0 configured", round(3877, 0, 3, 0), Bounds{Rate: 6000, Count: 3}, equal, ""},
		{"no bounds but the equal share", round(1<<40, 20, 1000, 0), Bounds{}, equal, ""},

		{"from the future", round(3877, 20, 3, ClockSkew+time.Second), b, equal, "ahead of this node's clock"},
		{"a year ahead", round(3877, 20, 3, 365*24*time.Hour), b, equal, "ahead of this node's clock"},
		{"water above the rate", round(6001, 20, 3, 0), b, equal, "water level 6001 is above the global rate 6000"},
		{"floor above the equal share", round(3877, equal+1, 3, 0), b, equal, "floor 2001 is above this node's equal share 2000"},
		{"floor above the rate", round(3877, 1<<40, 3, 0), Bounds{}, equal, "is above this node's equal share"},
		{"floor 0", round(3877, 0, 3, 0), b, equal, "floor 0, though floorPerMille is 10"},
		{"too many nodes", round(3877, 20, 5, 0), b, equal, "counts 5 nodes, more than the count 3 and one"},
		{"negative nodes", round(3877, 20, -1, 0), b, equal, "counts -1 nodes"},
	} {
		err := Check(tc.a, tc.b, tc.equal, now)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: refused: %v", tc.name, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: %v, want an error with %q", tc.name, err, tc.want)
		}
	}
}

// TestNodeRefusedSaysWhy: Refused names the check a round failed, and is
// nil again for the next round that passes.
func TestNodeRefusedSaysWhy(t *testing.T) {
	now := time.Unix(1000, 0)
	n := Node{Interval: 10 * time.Second, StaleAfter: 40 * time.Second, Bounds: Bounds{Rate: 6000, Count: 3, FloorPerMille: 10}}
	n.Share(Allocation{Round: 1, Level: Level{Water: 9000, Floor: 20}, Nodes: 3, Time: now}, 2000, now)
	if err := n.Refused(); err == nil || !strings.Contains(err.Error(), "water level 9000 is above the global rate 6000") {
		t.Errorf("a water level above the rate: refused %v", err)
	}
	n.Share(Allocation{Round: 2, Level: Level{Water: 3000, Floor: 20}, Nodes: 3, Time: now}, 2000, now)
	if err := n.Refused(); err != nil {
		t.Errorf("an honest round: refused %v", err)
	}
}
