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
//
// PerDestination is each destination's share (the rejected packet's
// source: an IPv4 address, an IPv6 /64), checked before the node's: a
// destination not seen lately gets one reply at once, then PerDestination's
// rate up to its burst. Its PerSecond of 0 is no share per destination:
// the node's budget alone (the config always sets one).
type RejectBudget struct {
	PerSecond      uint32
	Burst          uint32
	PerDestination ReplyRate
}

// ReplyRate is a rate of replies, at most Burst at once.
type ReplyRate struct {
	PerSecond uint32
	Burst     uint32
}

func (r ReplyRate) validate(what string) error {
	if r.PerSecond > MaxRejectRate {
		return fmt.Errorf("%s: %d replies/s is more than %d", what, r.PerSecond, MaxRejectRate)
	}
	if r.PerSecond > 0 && (r.Burst < 1 || r.Burst > r.PerSecond) {
		return fmt.Errorf("%s: burst %d is not in 1..%d (the replies of one second)", what, r.Burst, r.PerSecond)
	}
	return nil
}

// gcra returns the interval and tolerance of r: at least a tick of
// tolerance, since the data path's clock moves a tick at a time and within
// a tick a GCRA allows no more than its tolerance.
func (r ReplyRate) gcra(tick uint64) (interval, tolerance uint64) {
	if r.PerSecond == 0 {
		return 0, 0
	}
	interval = uint64(time.Second) / uint64(r.PerSecond)
	return interval, max(uint64(r.Burst)*interval, tick)
}

func (b RejectBudget) validate() error {
	if err := (ReplyRate{b.PerSecond, b.Burst}).validate("reject budget"); err != nil {
		return err
	}
	return b.PerDestination.validate("reject budget per destination")
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
	next.IntervalNs, next.ToleranceNs = ReplyRate{b.PerSecond, b.Burst}.gcra(d.tick)
	next.DestIntervalNs, next.DestToleranceNs = b.PerDestination.gcra(d.tick) // 0, 0: none
	if next == cur {
		return nil
	}
	// tat is the data path's: written back as read, it at most undoes
	// replies sent in between (a few, once per change of the budget).
	if err := d.objs.RlReject.Put(uint32(0), &next); err != nil {
		return fmt.Errorf("write reject budget: %w", err)
	}
	return nil
}
