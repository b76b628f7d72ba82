package demand

import (
	"math"
	"time"
)

// Allocation is one round of one limit, as the allocator publishes it and
// the nodes read it.
type Allocation struct {
	// Round counts the allocator's writes: a node steps its share once
	// per round it sees.
	Round int64
	Level Level
	// Nodes is how many nodes' reports the round counted.
	Nodes int32
	// Time is when the round was computed: which of a node's reports it
	// counted (Counted), and its age. A node that sees no round younger
	// than its stale age goes back to equal shares.
	Time time.Time

	counted uint64 // the allocator's fingerprint of the reports it counted
}

// Report is a demand a node published, and when.
type Report struct {
	Demand uint64
	At     time.Time
}

// Counted is the report of a node that a round computed at t counts: the
// latest of its reports published at least lag before t, lag being the time
// a report may take to reach the allocator (until then it may hold the one
// before). The allocator and the node both apply this rule, the allocator
// to the reports a node's Lease holds (its latest and the one before), the
// node to the reports it made, and so agree on what the round gave the
// node without a list of nodes in the round. ok is false when no report is
// that old: the round did not count the node, which may take the floor
// only.
func Counted(t time.Time, lag time.Duration, reports ...Report) (r Report, ok bool) {
	cut := t.Add(-lag)
	for _, x := range reports {
		if !x.At.IsZero() && !x.At.After(cut) && (!ok || x.At.After(r.At)) {
			r, ok = x, true
		}
	}
	return r, ok
}

// Allocator decides, for one limit, when a new round is worth a write: at
// most one an Interval; when the level or the reports it counted changed
// (a node's share follows its own report, even under the same level); one
// Interval after such a round (its increases wait for that round: Applied);
// and when the last round is KeepAlive old, so that a steady allocation
// does not go stale at the nodes. The writes then follow the changes of
// demand, not the clock, but for one every KeepAlive.
type Allocator struct {
	Interval  time.Duration
	KeepAlive time.Duration // below the nodes' stale age

	last    Allocation
	pending bool // the last round changed something: the next releases its increases
}

// Resume continues from a round another allocator published (a new leader
// reads it from the status): its increases may still wait, so the next
// round is written one Interval after it whatever the level.
func (a *Allocator) Resume(last Allocation) {
	a.last, a.pending = last, true
}

// Last is the last round published (the zero Allocation before any).
func (a *Allocator) Last() Allocation { return a.last }

// Next returns the round to publish for level, computed at now over the
// reports whose fingerprint is counted, and whether to publish it; if not,
// again is when the same inputs would make a round. The caller records a
// round with Published once written.
//
// A last round that no honest allocator wrote does not hold it up: one
// from more than ClockSkew ahead of now is followed at once (waiting for
// its time would leave its level in force until then), and after a round
// that cannot be counted further (math.MaxInt64, or below 1) the rounds
// start again at 1 (the admission policy lets the holder of the status
// Lease move the round by 0 or 1, or back to 1).
func (a *Allocator) Next(level Level, counted uint64, now time.Time) (r Allocation, write bool, again time.Time) {
	first := a.last.Time.IsZero() || a.last.Time.Sub(now) > ClockSkew
	changed := first || level != a.last.Level || counted != a.last.counted || a.pending
	switch {
	case !first && now.Sub(a.last.Time) < a.Interval:
		if changed {
			return a.last, false, a.last.Time.Add(a.Interval)
		}
		return a.last, false, a.last.Time.Add(a.KeepAlive)
	case changed || now.Sub(a.last.Time) >= a.KeepAlive:
		round := a.last.Round + 1
		if a.last.Round < 0 || a.last.Round == math.MaxInt64 {
			round = 1
		}
		return Allocation{Round: round, Level: level, Time: now, counted: counted}, true, time.Time{}
	}
	return a.last, false, a.last.Time.Add(a.KeepAlive)
}

// Published records a round that was written.
func (a *Allocator) Published(r Allocation) {
	a.pending = a.last.Time.IsZero() || r.Level != a.last.Level || r.counted != a.last.counted
	a.last = r
}

// Node is one node's side of one demand-shared limit: from the rounds it
// sees, its own published demands and the clock, the share it enforces.
type Node struct {
	// Interval is the report interval: the time a report may take to
	// reach the allocator (Counted's lag), and while the allocation is
	// stale, the fall back to the equal share steps once an interval.
	Interval time.Duration
	// StaleAfter is the allocation's age at which every node is back on
	// its equal share; a round stops counting one Interval earlier
	// (Fresh).
	StaleAfter time.Duration
	// Bounds are what the node knows of the limit to Check a round by
	// (the zero Bounds: the time and the floor only).
	Bounds Bounds

	applied Applied
	refused error     // why the latest round was refused (Check), or nil
	round   int64     // the last round stepped
	stale   time.Time // when the last stale step was taken; zero while fresh
	// reports are the last three this node published, oldest first: a
	// round seen up to an interval late counts one of them, the latest at
	// least an Interval older than the round, and reports are at least an
	// Interval apart.
	reports [3]Report
	started time.Time
}

// Start begins at share at now: the floor for a node that joins, the share
// the data path holds for a restarted agent.
func (n *Node) Start(share uint64, now time.Time) {
	n.applied, n.started = Start(share), now
}

// Reported records a demand this node published at: the time the Lease
// says, to the microsecond it holds. A write that failed may still have
// reached the API server: record then the smaller of the demand tried and
// the one before, which is no more than the allocator counts either way.
func (n *Node) Reported(d uint64, at time.Time) {
	copy(n.reports[:], n.reports[1:])
	n.reports[len(n.reports)-1] = Report{Demand: d, At: at}
}

// LastReport is the last demand recorded with Reported (ok false: none).
func (n *Node) LastReport() (Report, bool) {
	r := n.reports[len(n.reports)-1]
	return r, !r.At.IsZero()
}

// Share is what to enforce at now, given the latest round seen (a zero
// Allocation: none yet) and the equal share (rate / count, as without
// demand shares). A new round steps to the share of the report it counted
// (Counted), or to its floor if it counted none (the floor being all a node
// outside the allocation may take). A round that is no longer Fresh steps
// to the equal share once an Interval, and at once when the equal share
// falls below what is enforced (the count grew); so does no round at all,
// once StaleAfter less an Interval has passed since Start (before, the
// node waits for the round the others have). In all, a decrease applies at
// once and an increase one step later: at StaleAfter. A round that fails
// Check counts as stale from the start (Refused says why).
//
// The zero Node starts at the equal share on its first call.
func (n *Node) Share(a Allocation, equal uint64, now time.Time) uint64 {
	if n.started.IsZero() {
		n.Start(equal, now)
	}
	n.refused = Check(a, n.Bounds, equal, now)
	if a.Time.IsZero() && now.Sub(n.started) <= n.staleAge() {
		return n.applied.Now()
	}
	// A round that fails the checks counts as stale: an honest allocator
	// wrote none such, so what it says is not followed.
	fresh := n.Fresh(a, now) && n.refused == nil
	switch {
	case fresh && a.Round != n.round:
		n.round, n.stale = a.Round, time.Time{}
		share := a.Level.Floor
		if r, ok := Counted(a.Time, n.Interval, n.reports[:]...); ok {
			share = a.Level.Share(r.Demand)
		}
		n.applied.Step(share)
	case !fresh && (n.stale.IsZero() || now.Sub(n.stale) >= n.Interval || equal < n.applied.Now() || n.reaches(a, now)):
		n.stale = now
		n.applied.Step(equal)
	}
	return n.applied.Now()
}

// Refused is why the round of the latest Share failed Check (and the node
// went on as if the allocation were stale), or nil.
func (n *Node) Refused() error { return n.refused }

// Fresh says whether a still counts at now. A round stops counting one
// Interval before StaleAfter: the fall back to the equal share takes two
// steps an Interval apart (the decreases, then the increases), and every
// node is on its equal share once the allocation is StaleAfter old.
func (n *Node) Fresh(a Allocation, now time.Time) bool {
	return !a.Time.IsZero() && now.Sub(a.Time) <= n.staleAge()
}

func (n *Node) staleAge() time.Duration { return max(n.StaleAfter-n.Interval, 0) }

// reaches says whether the allocation a (no round: the node's start)
// reached StaleAfter since the last stale step: the step that releases the
// increases is due then, not an Interval after a step that came late.
func (n *Node) reaches(a Allocation, now time.Time) bool {
	since := a.Time
	if since.IsZero() {
		since = n.started
	}
	return n.stale.Sub(since) <= n.StaleAfter && now.Sub(since) > n.StaleAfter
}

// Now is what is enforced, as the last Share returned it.
func (n *Node) Now() uint64 { return n.applied.Now() }
