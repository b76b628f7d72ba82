package demand

import (
	"math"
	"slices"
)

// Level is one round's allocation of one limit: a node whose reported
// demand is d gets Share(d).
type Level struct {
	// Water is the most any node gets; math.MaxUint64 when the demands
	// together fit in the rate and no node is capped.
	Water uint64
	// Floor is the least any node gets, asked for or not: a node whose
	// demand rises is served at once up to it, before the next round.
	Floor uint64
}

// Share is a node's part under l: max(Floor, min(demand, Water)).
func (l Level) Share(demand uint64) uint64 {
	return max(l.Floor, min(demand, l.Water))
}

// Allocate computes the water level that shares rate among the nodes whose
// demands are given (units/s, one entry a node), each getting at least
// floor. The shares Share(d) of the demands sum to at most rate, provided
// floor x len(demands) <= rate (the floor is then lowered to
// rate / len(demands)); below rate only by rounding, when some node is
// capped, by less than one unit a node.
func Allocate(rate, floor uint64, demands []uint64) Level {
	n := uint64(len(demands))
	if n == 0 {
		return Level{Water: math.MaxUint64, Floor: min(floor, rate)}
	}
	floor = min(floor, rate/n)
	// With Water >= Floor, max(F, min(d, W)) = min(max(d, F), W): fill
	// the raised demands in ascending order until one does not fit in an
	// even split of what is left.
	asks := make([]uint64, len(demands))
	for i, d := range demands {
		asks[i] = max(d, floor)
	}
	slices.Sort(asks)
	left := rate
	for i, a := range asks {
		even := left / (n - uint64(i))
		if a > even {
			return Level{Water: even, Floor: floor}
		}
		left -= a
	}
	return Level{Water: math.MaxUint64, Floor: floor}
}
