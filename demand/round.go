package demand

import "time"

// Allocation is one round of one limit, as the allocator publishes it and
// the nodes read it.
type Allocation struct {
	// Round counts the allocator's writes: a node steps its share once
	// per round it sees.
	Round int64
	Level Level
	// Time is when the round was computed. A node that sees no round
	// younger than its stale age goes back to equal shares.
	Time time.Time
}

// Allocator decides, for one limit, when a new round is worth a write: at
// most one an Interval; when the level changed; one Interval after a round
// that changed it (its increases wait for that round: Applied); and when
// the last round is KeepAlive old, so that a steady allocation does not go
// stale at the nodes. The writes then follow the changes of demand, not the
// clock, but for one every KeepAlive.
type Allocator struct {
	Interval  time.Duration
	KeepAlive time.Duration // below the nodes' stale age

	last    Allocation
	pending bool // the last round changed the level: the next releases its increases
}

// Resume continues from a round another allocator published (a new leader
// reads it from the status): its increases may still wait, so the next
// round is written one Interval after it whatever the level.
func (a *Allocator) Resume(last Allocation) {
	a.last, a.pending = last, true
}

// Next returns the round to publish for level at now, and whether to
// publish it. The caller records it with Published once written.
func (a *Allocator) Next(level Level, now time.Time) (Allocation, bool) {
	if !a.last.Time.IsZero() && now.Sub(a.last.Time) < a.Interval {
		return a.last, false
	}
	if a.last.Time.IsZero() || level != a.last.Level || a.pending || now.Sub(a.last.Time) >= a.KeepAlive {
		return Allocation{Round: a.last.Round + 1, Level: level, Time: now}, true
	}
	return a.last, false
}

// Published records a round that was written.
func (a *Allocator) Published(r Allocation) {
	a.pending = r.Level != a.last.Level || a.last.Time.IsZero()
	a.last = r
}

// Node is one node's side of one demand-shared limit: from the rounds it
// sees, its own published demands and the clock, the share it enforces.
type Node struct {
	// Interval is the report interval: while the allocation is stale, the
	// fall back to the equal share steps once an interval.
	Interval time.Duration
	// StaleAfter is the age past which a round no longer counts.
	StaleAfter time.Duration

	applied Applied
	round   int64     // the last round stepped
	stale   time.Time // when the last stale step was taken; zero while fresh
	demand  [2]uint64 // the last two demands this node published
	first   time.Time // when it published its first
	started time.Time
}

// Start begins at share at now: the floor for a node that joins, the share
// the data path holds for a restarted agent.
func (n *Node) Start(share uint64, now time.Time) {
	n.applied, n.started = Start(share), now
}

// Reported records a demand this node published at. A round's share is of
// the smaller of the last two: the allocator may have read either.
func (n *Node) Reported(d uint64, at time.Time) {
	if n.first.IsZero() {
		n.first, n.demand[1] = at, d
	}
	n.demand[0], n.demand[1] = n.demand[1], d
}

// Share is what to enforce at now, given the latest round seen (a zero
// Allocation: none yet) and the equal share (rate / count, as without
// demand shares). A new round steps to its share, or to its floor if it may
// not have counted this node: computed before one Interval had passed since
// the node's first report (the time the report takes to reach the
// allocator, at most), the floor being all a node outside the allocation
// may take. A stale round steps to the equal share once an Interval, and at
// once when the equal share falls below what is enforced (the count grew);
// so does no round at all, once StaleAfter has passed since Start (before,
// the node waits for the round the others have). In all, a decrease applies
// at once and an increase one step later.
//
// The zero Node starts at the equal share on its first call.
func (n *Node) Share(a Allocation, equal uint64, now time.Time) uint64 {
	if n.started.IsZero() {
		n.Start(equal, now)
	}
	if a.Time.IsZero() && now.Sub(n.started) <= n.StaleAfter {
		return n.applied.Now()
	}
	fresh := !a.Time.IsZero() && now.Sub(a.Time) <= n.StaleAfter
	switch {
	case fresh && a.Round != n.round:
		n.round, n.stale = a.Round, time.Time{}
		share := a.Level.Share(min(n.demand[0], n.demand[1]))
		if n.first.IsZero() || a.Time.Before(n.first.Add(n.Interval)) {
			share = a.Level.Floor
		}
		n.applied.Step(share)
	case !fresh && (n.stale.IsZero() || now.Sub(n.stale) >= n.Interval || equal < n.applied.Now()):
		n.stale = now
		n.applied.Step(equal)
	}
	return n.applied.Now()
}
