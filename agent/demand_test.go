package agent

import (
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/rlagent/rlagent/demand"
)

// TestRefuseDemand: a round the node refuses (demand.Check) is counted once
// a round, and reported (the note the status loop sends as an Event) until
// a round passes again; the node enforces its equal share meanwhile.
func TestRefuseDemand(t *testing.T) {
	a := &Agent{log: slog.New(slog.NewTextHandler(io.Discard, nil)), demand: make(map[string]*demandState)}
	st := &demandState{node: demand.Node{Interval: 5 * time.Second, StaleAfter: 20 * time.Second,
		Bounds: demand.Bounds{Rate: 6000, Count: 3, FloorPerMille: 10}}}
	a.demand["web"] = st
	now := time.Unix(1000, 0)
	step := func(r demand.Allocation) uint64 {
		t.Helper()
		share := st.node.Share(r, 2000, now)
		a.refuseDemand("web", st, r)
		return share
	}
	forged := func(round int64) demand.Allocation {
		return demand.Allocation{Round: round, Level: demand.Level{Water: 6000, Floor: 6000}, Nodes: 3, Time: now}
	}
	for i, r := range []demand.Allocation{forged(3), forged(3), forged(4)} {
		if got := step(r); got != 2000 {
			t.Errorf("forged round %d (#%d): share %d, want the equal share 2000", r.Round, i, got)
		}
	}
	if st.refusals != 2 || a.demandRefusals()["web"] != 2 {
		t.Errorf("%d refusals counted (metric %d), want 2: one a round", st.refusals, a.demandRefusals()["web"])
	}
	if note := a.demandRefused("web"); !strings.Contains(note, "round 4 refused (floor 6000 is above this node's equal share 2000)") {
		t.Errorf("note %q", note)
	}
	step(demand.Allocation{Round: 5, Level: demand.Level{Water: 3000, Floor: 20}, Nodes: 3, Time: now})
	if note := a.demandRefused("web"); note != "" || st.refusals != 2 {
		t.Errorf("an honest round: note %q, %d refusals; want none, 2", note, st.refusals)
	}
}
