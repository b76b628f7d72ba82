package demand

import (
	"math/rand/v2"
	"testing"
)

func TestAppliedStep(t *testing.T) {
	a := Start(100)
	for i, tc := range []struct{ share, want uint64 }{
		{60, 60},   // a decrease applies at once
		{90, 60},   // an increase waits a round
		{90, 90},   // and then applies
		{200, 90},  // again
		{50, 50},   // a decrease right after an increase's round
		{300, 50},  //
		{300, 300}, //
	} {
		if got := a.Step(tc.share); got != tc.want || a.Now() != tc.want {
			t.Fatalf("round %d: share %d applied as %d (Now %d), want %d", i, tc.share, got, a.Now(), tc.want)
		}
	}
}

// TestAppliedSumWithLaggingNodes simulates rounds of random demand among
// nodes that see each round at different times (at most one round late):
// at every moment the shares applied sum to at most the rate. Applying
// each round's share at once, as a reference, does exceed it.
func TestAppliedSumWithLaggingNodes(t *testing.T) {
	const rate, floor, nodes, rounds = 100_000, 100, 8, 2000
	r := rand.New(rand.NewPCG(3, 4))
	var levels []Level
	demand := func() []uint64 {
		d := make([]uint64, nodes)
		for i := range d {
			d[i] = uint64(r.IntN(2 * rate / nodes))
		}
		return d
	}
	var demands [][]uint64
	applied := make([]Applied, nodes)
	seen := make([]int, nodes) // the last round each node applied
	for i := range applied {
		applied[i] = Start(floor)
		seen[i] = -1
	}
	overNaive := false
	for k := 0; k < rounds; k++ {
		demands = append(demands, demand())
		levels = append(levels, Allocate(rate, floor, demands[k]))
		see := func(i int) {
			seen[i]++
			applied[i].Step(levels[seen[i]].Share(demands[seen[i]][i]))
			var sum, naive uint64
			for j := range applied {
				sum += applied[j].Now()
				if seen[j] >= 0 {
					naive += levels[seen[j]].Share(demands[seen[j]][j])
				}
			}
			if sum > rate {
				t.Fatalf("round %d, node %d: applied shares sum to %d, above the rate %d", k, i, sum, rate)
			}
			overNaive = overNaive || naive > rate
		}
		// Round k is published: the nodes still at k-2 see k-1 first (a
		// node is at most one round late), then some see k, in a random
		// order; the others see it only after round k+1 is out.
		for _, i := range r.Perm(nodes) {
			if seen[i] < k-1 {
				see(i)
			}
		}
		for _, i := range r.Perm(nodes)[:r.IntN(nodes+1)] {
			see(i)
		}
	}
	if !overNaive {
		t.Error("applying each round at once never exceeded the rate: the simulation does not test the deferral")
	}
}
