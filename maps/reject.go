package maps

import (
	"fmt"
	"time"

	"github.com/rlagent/rlagent/bpf"
)

// MaxRejectRate is the most replies per second SetRejectBudget allows:
// beyond it a budget no longer keeps a flood of spoofed packets from making
// the node a reflector.
const MaxRejectRate = 100_000

// RejectBudget is the node's budget of replies to packets that limits with
// action Reject dropped, spent by every CPU: at most Burst at once, then
// PerSecond. A PerSecond of 0 sends none (every reject is a drop).
//
// The budget runs on the data path's clock, which moves a jiffy (a tick,
// 1-10 ms) at a time: the burst is at least a tick's worth of the rate
// (PerSecond / HZ: 4 at 1,000/s and HZ 250), and over any time T at most
// PerSecond x (T + a tick) + that burst are sent.
type RejectBudget struct {
	PerSecond uint32
	Burst     uint32
}

func (b RejectBudget) validate() error {
	if b.PerSecond > MaxRejectRate {
		return fmt.Errorf("reject budget: %d replies/s is more than %d", b.PerSecond, MaxRejectRate)
	}
	if b.PerSecond > 0 && (b.Burst < 1 || b.Burst > b.PerSecond) {
		return fmt.Errorf("reject budget: burst %d is not in 1..%d (the replies of one second)", b.Burst, b.PerSecond)
	}
	return nil
}

// SetRejectBudget sets the node's reply budget. What was spent of it
// stays spent: a rewrite never hands out a fresh burst.
func (d *Datapath) SetRejectBudget(b RejectBudget) error {
	if err := b.validate(); err != nil {
		return err
	}
	var cur bpf.RatelimitRlRejectBudget
	if err := d.objs.RlReject.Lookup(uint32(0), &cur); err != nil {
		return fmt.Errorf("read reject budget: %w", err)
	}
	next := cur
	next.IntervalNs, next.ToleranceNs = 0, 0
	if b.PerSecond > 0 {
		next.IntervalNs = uint64(time.Second) / uint64(b.PerSecond)
		// The data path's clock moves a tick at a time, and within a
		// tick a GCRA allows no more than its tolerance: at least a
		// tick of it, so that the whole rate can be had.
		next.ToleranceNs = max(uint64(b.Burst)*next.IntervalNs, d.tick)
	}
	if next.IntervalNs == cur.IntervalNs && next.ToleranceNs == cur.ToleranceNs {
		return nil
	}
	// tat is the data path's: written back as read, it at most undoes
	// replies sent in between (a few, once per change of the budget).
	if err := d.objs.RlReject.Put(uint32(0), &next); err != nil {
		return fmt.Errorf("write reject budget: %w", err)
	}
	return nil
}
