package demand

import (
	"fmt"
	"math"
	"time"
)

// ClockSkew is how far an allocation's time may be ahead of the clock that
// reads it: the allocator's clock and the nodes' differ by less (NTP keeps
// them within milliseconds), and a round from further ahead would stay
// fresh, whatever it says, until its time came.
const ClockSkew = 2 * time.Second

// Bounds are what a node knows of a limit apart from the allocation: what
// an honest round of it can hold is bounded by them.
type Bounds struct {
	// Rate is the limit's global rate (0: unknown, not checked).
	Rate uint64
	// Count is what the equal share divides the rate by: the ready agents
	// or endpoints (0: unknown, not checked).
	Count int
	// FloorPerMille is the configured floor (demandShares.floorPerMille).
	FloorPerMille uint32
}

// Check says why a cannot be a round an honest allocator published, or nil:
// a round whose time is more than ClockSkew ahead of now (it would stay
// fresh, and hold off every honest round, until then); a water level above
// the global rate; a floor above this node's equal share (the floors alone
// would sum to more than the rate), or of 0 where the configured floor is
// at least a unit (a node not counted would get nothing); more nodes
// counted than the count and one (a node that joined since the count was
// taken). The zero Allocation (no round) passes.
//
// These are what a node can check alone. They do not make a round right:
// a round that passes them still moves capacity between nodes as it says
// (docs/security.md).
func Check(a Allocation, b Bounds, equal uint64, now time.Time) error {
	if a.Time.IsZero() {
		return nil
	}
	if ahead := a.Time.Sub(now); ahead > ClockSkew {
		return fmt.Errorf("allocation time %s is %s ahead of this node's clock (at most %s)",
			a.Time.UTC().Format(time.RFC3339), ahead.Round(time.Second), ClockSkew)
	}
	if b.Rate > 0 && a.Level.Water != math.MaxUint64 && a.Level.Water > b.Rate {
		return fmt.Errorf("water level %d is above the global rate %d", a.Level.Water, b.Rate)
	}
	if a.Level.Floor > equal {
		return fmt.Errorf("floor %d is above this node's equal share %d", a.Level.Floor, equal)
	}
	if b.Count > 0 {
		if a.Nodes < 0 || int64(a.Nodes) > int64(b.Count)+1 {
			return fmt.Errorf("the round counts %d nodes, more than the count %d and one", a.Nodes, b.Count)
		}
		// The smallest floor an honest round of up to Count+1 nodes has
		// (the allocator divides by the nodes it counted or the count,
		// whichever is more); a round at 0 below it is not one.
		if a.Level.Floor == 0 && b.Rate/1000*uint64(b.FloorPerMille)/uint64(b.Count+1) >= 1 {
			return fmt.Errorf("floor 0, though floorPerMille is %d", b.FloorPerMille)
		}
	}
	return nil
}
