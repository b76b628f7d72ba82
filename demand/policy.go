package demand

import (
	"fmt"
	"hash/fnv"
	"math"
	"slices"
	"strings"
	"time"
)

// NodeReport is one node's demand report as the allocator reads it (from
// the node's Lease): the latest, and the one it replaced.
type NodeReport struct {
	Node     string
	Demands  map[string]uint64 // by limit name, units/s
	Renewed  time.Time
	Previous map[string]uint64 // nil: none
	PrevAt   time.Time
	// Keys are the hot keys of the keyed limits (KeyRound): by limit
	// name, key -> units/s, in the latest report and the one it replaced
	// (of the same times). A keyed limit the node counts with no hot key
	// has an empty map.
	Keys     map[string]map[string]uint64
	PrevKeys map[string]map[string]uint64
}

// RoundInput is what a round of one limit at time t is computed from, and
// its water level.
type RoundInput struct {
	// Demands are the counted demands, one a node, in node order: of each
	// node, the latest report of the limit at least lag old (Counted).
	Demands []uint64
	// Fingerprint identifies the reports counted: a round whose
	// fingerprint and level are the last one's changes nothing.
	Fingerprint uint64
	// Countable is the next time a report becomes lag old (zero: none
	// will): a round is due then.
	Countable time.Time
	// Asked is the counted demands' sum, saturated at math.MaxUint64 (a
	// hostile report cannot wrap it).
	Asked uint64
	// Level is the allocation of rate among Demands, with the floor.
	Level Level
}

// Round computes the input and the level of a round of a limit with global
// rate rate at time t, from the nodes' reports (in any order), counting a
// report once it is lag old. The floor, floorPerMille of the rate, is
// divided among the nodes counted or count (the nodes the limit is divided
// by), whichever is more: a node then finds it at most its equal share
// (Check), and the nodes not counted yet take no more than their equal
// shares' floor together.
func Round(nodes []NodeReport, limit string, rate uint64, floorPerMille uint32, count int, t time.Time, lag time.Duration) RoundInput {
	var in RoundInput
	h := fnv.New64a()
	nodes = slices.SortedFunc(slices.Values(nodes), func(a, b NodeReport) int { return strings.Compare(a.Node, b.Node) })
	for _, n := range nodes {
		var rs []Report
		if d, ok := n.Demands[limit]; ok {
			rs = append(rs, Report{Demand: d, At: n.Renewed})
			if at := n.Renewed.Add(lag); at.After(t) && (in.Countable.IsZero() || at.Before(in.Countable)) {
				in.Countable = at
			}
		}
		if d, ok := n.Previous[limit]; ok {
			rs = append(rs, Report{Demand: d, At: n.PrevAt})
		}
		r, ok := Counted(t, lag, rs...)
		if !ok {
			continue
		}
		in.Demands = append(in.Demands, r.Demand)
		fmt.Fprintf(h, "%s\x00%d\x00%d\x00", n.Node, r.At.UnixNano(), r.Demand)
		if in.Asked > math.MaxUint64-r.Demand {
			in.Asked = math.MaxUint64
		} else {
			in.Asked += r.Demand
		}
	}
	in.Fingerprint = h.Sum64()
	floor := rate * uint64(floorPerMille) / 1000 / uint64(max(1, len(in.Demands), count))
	in.Level = Allocate(rate, floor, in.Demands)
	return in
}
