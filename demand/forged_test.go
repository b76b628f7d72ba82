package demand

import (
	"math"
	"testing"
	"time"
)

// TestNodeShareRefusesForgedRound: a round no honest allocator writes is
// not followed: the node goes on as if the allocation were stale, on its
// equal share (a decrease at once, an increase an interval later), and
// follows the next honest round again. Forged here: a floor above the
// equal share (every node on it would together admit more than the
// rate), and a time in the future (a round that would stay fresh, holding
// off the honest allocator's, until then).
func TestNodeShareRefusesForgedRound(t *testing.T) {
	const interval, staleAfter = 10 * time.Second, 40 * time.Second
	t0 := time.Unix(1000, 0)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	for _, tc := range []struct {
		name   string
		forged func(s int) Allocation
	}{
		{"floor above the equal share", func(s int) Allocation {
			return Allocation{Round: 3, Level: Level{Water: 100, Floor: 50_000}, Time: at(s)}
		}},
		{"a year ahead", func(s int) Allocation {
			return Allocation{Round: 3, Level: Level{Water: 100, Floor: 1}, Time: at(s).Add(365 * 24 * time.Hour)}
		}},
		{"a minute ahead, starving", func(s int) Allocation {
			return Allocation{Round: 3, Level: Level{Water: 1, Floor: 1}, Time: at(s).Add(time.Minute)}
		}},
	} {
		n := Node{Interval: interval, StaleAfter: staleAfter}
		n.Reported(7000, at(0))
		honest := func(k int64, water uint64, s int) Allocation {
			return Allocation{Round: k, Level: Level{Water: water, Floor: 60}, Time: at(s)}
		}
		if got := n.Share(honest(1, 6000, 20), 5000, at(20)); got != 5000 {
			t.Fatalf("%s: the first round: %d, want 5000 (the start, the equal share; the increase deferred)", tc.name, got)
		}
		if got := n.Share(honest(2, 6000, 25), 5000, at(25)); got != 6000 {
			t.Fatalf("%s: the second round: %d, want 6000", tc.name, got)
		}
		for _, s := range []int{26, 30, 35} {
			if got := n.Share(tc.forged(s), 5000, at(s)); got != 5000 {
				t.Errorf("%s: a forged round at %d s: share %d, want the equal share 5000", tc.name, s, got)
			}
		}
		if got := n.Share(honest(4, 6000, 36), 5000, at(36)); got != 5000 {
			t.Errorf("%s: the next honest round: %d, want 5000 (an increase, deferred)", tc.name, got)
		}
		if got := n.Share(honest(5, 6000, 41), 5000, at(41)); got != 6000 {
			t.Errorf("%s: the honest round after: %d, want 6000", tc.name, got)
		}
	}
}

// TestAllocatorNotFrozen: a round in the status that no honest allocator
// wrote does not stop a newly elected one from publishing: one from the
// future is followed at once (not when its time comes), and after a round
// that cannot be counted further the rounds start again at 1.
func TestAllocatorNotFrozen(t *testing.T) {
	const interval, keepAlive = 10 * time.Second, 60 * time.Second
	now := time.Unix(1000, 0)
	level := Level{Water: 5000, Floor: 60}
	for _, tc := range []struct {
		name  string
		last  Allocation
		round int64
	}{
		{"a year ahead", Allocation{Round: 9, Level: Level{Water: 1, Floor: 1}, Time: now.Add(365 * 24 * time.Hour)}, 10},
		{"a minute ahead", Allocation{Round: 9, Level: level, Time: now.Add(time.Minute)}, 10},
		{"the largest round", Allocation{Round: math.MaxInt64, Level: level, Time: now.Add(-interval)}, 1},
		{"the largest round, ahead", Allocation{Round: math.MaxInt64, Level: level, Time: now.Add(time.Hour)}, 1},
		{"a negative round", Allocation{Round: -5, Level: level, Time: now.Add(-interval)}, 1},
		{"a huge round", Allocation{Round: math.MaxInt64 - 1, Level: level, Time: now.Add(-interval)}, math.MaxInt64},
	} {
		a := Allocator{Interval: interval, KeepAlive: keepAlive}
		a.Resume(tc.last)
		r, ok, again := a.Next(level, 1, now)
		if !ok || r.Round != tc.round || !r.Time.Equal(now) {
			t.Errorf("%s: round %d at %v written %v (again at %v), want round %d written now", tc.name, r.Round, r.Time, ok, again, tc.round)
			continue
		}
		a.Published(r)
		// And it goes on as usual: the release round an interval later.
		if r, ok, _ := a.Next(level, 1, now.Add(interval)); !ok || r.Round != tc.round%math.MaxInt64+1 {
			t.Errorf("%s: the release round: %d written %v, want %d", tc.name, r.Round, ok, tc.round%math.MaxInt64+1)
		}
	}
}
