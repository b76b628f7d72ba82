package demand

import (
	"math/rand/v2"
	"testing"
	"time"
)

func TestAllocatorRounds(t *testing.T) {
	const interval, keepAlive = 10 * time.Second, 60 * time.Second
	a := Allocator{Interval: interval, KeepAlive: keepAlive}
	t0 := time.Unix(1000, 0)
	l1 := Level{Water: 5000, Floor: 60}
	l2 := Level{Water: 6000, Floor: 60}
	var writes []int64
	step := func(at time.Duration, l Level) {
		t.Helper()
		r, ok := a.Next(l, t0.Add(at))
		if ok {
			a.Published(r)
			writes = append(writes, int64(at/time.Second))
		}
	}
	step(0, l1)               // the first round
	step(5*time.Second, l2)   // within the interval: waits
	step(10*time.Second, l2)  // changed
	step(20*time.Second, l2)  // releases the increases of the round before
	step(30*time.Second, l2)  // steady: nothing
	step(79*time.Second, l2)  // 59 s old
	step(80*time.Second, l2)  // KeepAlive old
	step(90*time.Second, l2)  // a keep-alive changed nothing: no release round
	step(140*time.Second, l2) // the next keep-alive
	if want := []int64{0, 10, 20, 80, 140}; !equalInts(writes, want) {
		t.Errorf("rounds written at %v s, want %v", writes, want)
	}
	if a.last.Round != 5 {
		t.Errorf("round %d after 5 writes", a.last.Round)
	}
	// A new leader resumes from the status: one round an interval later
	// whatever the level, then steady.
	b := Allocator{Interval: interval, KeepAlive: keepAlive}
	b.Resume(a.last)
	if _, ok := b.Next(l2, t0.Add(145*time.Second)); ok {
		t.Error("a resumed allocator wrote within the interval")
	}
	r, ok := b.Next(l2, t0.Add(150*time.Second))
	if !ok || r.Round != 6 {
		t.Fatalf("resumed: round %d written %v, want 6", r.Round, ok)
	}
	b.Published(r)
	if _, ok := b.Next(l2, t0.Add(160*time.Second)); ok {
		t.Error("a resumed allocator wrote a steady level twice")
	}
}

func equalInts(a, b []int64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestNodeShare follows one node through a join, rounds that raise and
// lower its share, a stale allocation and its return.
func TestNodeShare(t *testing.T) {
	const interval, staleAfter = 10 * time.Second, 40 * time.Second
	t0 := time.Unix(1000, 0)
	n := Node{Interval: interval, StaleAfter: staleAfter}
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	n.Start(60, at(0)) // joins at the floor
	// Before any round, it waits for the round the others have (for up
	// to StaleAfter), rather than fall back to the equal share: its
	// increase would land on top of their allocation.
	for _, s := range []int{1, 12, 40} {
		if got := n.Share(Allocation{}, 5000, at(s)); got != 60 {
			t.Fatalf("before any round, at %d s: %d, want the start", s, got)
		}
	}
	if got := n.Share(Allocation{Round: 1, Level: Level{Water: 6000, Floor: 60}, Time: at(0)}, 5000, at(1)); got != 60 {
		t.Fatalf("a round from before the node's first report: %d, want the floor", got)
	}
	n.Reported(7000, at(2))
	if got := n.Share(Allocation{Round: 2, Level: Level{Water: 6000, Floor: 60}, Time: at(11)}, 5000, at(11)); got != 60 {
		t.Fatalf("a round less than an interval after the node's first report: %d, want the floor", got)
	}
	round := func(k int64, water uint64, s int) Allocation {
		return Allocation{Round: k, Level: Level{Water: water, Floor: 60}, Time: at(s)}
	}
	for i, tc := range []struct {
		a     Allocation
		equal uint64
		now   int
		want  uint64
	}{
		{round(3, 6000, 12), 5000, 12, 60}, // the first round that counts it: an increase, deferred
		{round(3, 6000, 12), 5000, 15, 60}, // the same round again: no step
		{round(4, 6000, 16), 5000, 16, 6000},
		{round(4, 4000, 16), 5000, 21, 6000},  // the same round number: no step
		{round(44, 4000, 21), 5000, 21, 4000}, // a decrease: at once
		{round(5, 6500, 31), 5000, 31, 4000},  // an increase: deferred
		{round(5, 6500, 31), 5000, 71, 4000},  // 40 s old: still fresh
		{round(5, 6500, 31), 5000, 72, 5000},  // stale: the equal share, below round 5's, at once
		{round(5, 6500, 31), 2500, 83, 2500},  // the count doubled: the equal share falls at once
		{round(5, 6500, 31), 5000, 86, 2500},  // and back: within the interval
		{round(5, 6500, 31), 5000, 93, 2500},  // an interval later: an increase, deferred
		{round(5, 6500, 31), 5000, 103, 5000},
		{round(6, 6500, 110), 5000, 110, 5000}, // the allocator is back: an increase, deferred
		{round(7, 6500, 120), 5000, 120, 6500},
	} {
		if got := n.Share(tc.a, tc.equal, at(tc.now)); got != tc.want {
			t.Fatalf("step %d (round %d at %d s, equal %d): share %d, want %d", i, tc.a.Round, tc.now, tc.equal, got, tc.want)
		}
	}
	// The share is of the smaller of the last two reports.
	n.Reported(3000, at(125))
	if got := n.Share(round(8, 6500, 130), 2500, at(130)); got != 3000 {
		t.Errorf("after a report of 3000: %d, want 3000", got)
	}
	n.Reported(9000, at(135))
	if got := n.Share(round(9, 6500, 140), 2500, at(140)); got != 3000 {
		t.Errorf("after a report of 9000 (the allocator may have read 3000): %d, want 3000", got)
	}
	if got := n.Share(round(10, 6500, 150), 2500, at(150)); got != 3000 {
		t.Errorf("round 10: %d, want 3000 (round 9's share, deferred)", got)
	}
	n.Reported(9000, at(155))
	n.Share(round(11, 6500, 160), 2500, at(160))
	if got := n.Share(round(12, 6500, 170), 2500, at(170)); got != 6500 {
		t.Errorf("two reports of 9000 later: %d, want the water level 6500", got)
	}
}

// TestNodesSumThroughTransitions runs an allocator and nodes together, a
// second at a time, for an hour: demands change every minute, each node's
// report reaches the allocator a moment late and each round reaches each
// node up to one interval late, a node joins, and the allocator is away
// for five minutes (every node falls back to equal shares, then comes
// back). At every second the shares applied sum to at most the rate plus
// the floor of each node the last round did not count yet.
func TestNodesSumThroughTransitions(t *testing.T) {
	const (
		rate       = 100_000
		interval   = 10 * time.Second
		keepAlive  = 30 * time.Second
		staleAfter = 45 * time.Second
		hour       = 3600
	)
	r := rand.New(rand.NewPCG(5, 6))
	t0 := time.Unix(10_000, 0)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	type node struct {
		Node
		joined   int
		demand   uint64
		reported uint64 // what the allocator reads
		seenAt   []int  // when each round reaches this node
	}
	var nodes []*node
	join := func(s int) {
		n := &node{Node: Node{Interval: interval, StaleAfter: staleAfter}, joined: s}
		nodes = append(nodes, n)
	}
	for range 6 {
		join(0)
	}
	alloc := Allocator{Interval: interval, KeepAlive: keepAlive}
	var rounds []Allocation
	var stale, fellBack, maxSum int
	for s := 0; s < hour; s++ {
		if s == 900 {
			join(s)
		}
		count := uint64(len(nodes))
		equal := uint64(rate) / count
		floor := equal / 100
		for _, n := range nodes {
			if s == n.joined {
				n.Start(floor, at(s))
			}
			if (s-n.joined)%60 == 0 {
				// Mostly above the equal share: the demands sum
				// past the rate, and the allocation is tight.
				n.demand = uint64(rate/12 + r.IntN(rate/3))
			}
			// The report: once an interval, read by the allocator a
			// second later.
			if (s-n.joined)%10 == 0 {
				n.Reported(n.demand, at(s))
			}
			if (s-n.joined)%10 == 1 {
				n.reported = n.demand
			}
		}
		// The allocator, away from 1800 s to 2100 s.
		if s < 1800 || s >= 2100 {
			var ds []uint64
			for _, n := range nodes {
				if s > n.joined+1 {
					ds = append(ds, n.reported)
				}
			}
			if a, ok := alloc.Next(Allocate(rate, floor, ds), at(s)); ok {
				alloc.Published(a)
				rounds = append(rounds, a)
				for _, n := range nodes {
					n.seenAt = append(n.seenAt, s+r.IntN(int(interval/time.Second)))
				}
			}
		}
		var sum uint64
		uncounted := 0
		for _, n := range nodes {
			// The latest round that reached this node.
			var a Allocation
			for k := len(n.seenAt) - 1; k >= 0; k-- {
				if n.seenAt[k] <= s && k < len(rounds) {
					a = rounds[k+len(rounds)-len(n.seenAt)]
					break
				}
			}
			share := n.Share(a, equal, at(s))
			sum += share
			if a.Time.IsZero() || at(s).Sub(a.Time) > staleAfter {
				stale++
				if share == equal {
					fellBack++
				}
			}
			if a.Time.IsZero() || a.Time.Before(at(n.joined+2)) {
				uncounted++
			}
		}
		if bound := uint64(rate) + uint64(uncounted)*floor; sum > bound {
			t.Fatalf("at %d s: applied shares sum to %d, above the rate and %d uncounted floors (%d)", s, sum, uncounted, bound)
		}
		maxSum = max(maxSum, int(sum))
	}
	if stale == 0 || fellBack == 0 {
		t.Errorf("the allocator's absence left %d node-seconds stale, %d of them at the equal share: the fall back was not exercised", stale, fellBack)
	}
	t.Logf("%d rounds; the applied sum peaked at %d of %d; %d node-seconds stale, %d at the equal share", len(rounds), maxSum, rate, stale, fellBack)
}

// TestNodeShareWithoutAllocator: with no round at all (no allocator has
// ever written one), a node that started at the floor is at the equal
// share one Interval after StaleAfter has passed.
func TestNodeShareWithoutAllocator(t *testing.T) {
	t0 := time.Unix(1000, 0)
	n := Node{Interval: 10 * time.Second, StaleAfter: 45 * time.Second}
	n.Start(50, t0)
	for _, tc := range []struct {
		s    int
		want uint64
	}{{0, 50}, {45, 50}, {46, 50}, {55, 50}, {56, 5000}, {100, 5000}} {
		if got := n.Share(Allocation{}, 5000, t0.Add(time.Duration(tc.s)*time.Second)); got != tc.want {
			t.Errorf("at %d s: %d, want %d", tc.s, got, tc.want)
		}
	}
}
