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
		r, ok, _ := a.Next(l, 1, t0.Add(at))
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
	b.Resume(Allocation{Round: a.last.Round, Level: a.last.Level, Time: a.last.Time}) // as the status holds it
	if _, ok, again := b.Next(l2, 1, t0.Add(145*time.Second)); ok || !again.Equal(t0.Add(150*time.Second)) {
		t.Errorf("a resumed allocator: written %v within the interval, again at %v, want at 150 s", ok, again.Sub(t0))
	}
	r, ok, _ := b.Next(l2, 1, t0.Add(150*time.Second))
	if !ok || r.Round != 6 {
		t.Fatalf("resumed: round %d written %v, want 6", r.Round, ok)
	}
	b.Published(r)
	// Which reports the old leader counted is not in the status: one more
	// round releases what this one may have changed, then it is steady.
	r, ok, _ = b.Next(l2, 1, t0.Add(160*time.Second))
	if !ok {
		t.Fatal("a resumed allocator wrote no release round after its first")
	}
	b.Published(r)
	if _, ok, again := b.Next(l2, 1, t0.Add(165*time.Second)); ok || !again.Equal(t0.Add(160*time.Second+keepAlive)) {
		t.Errorf("a resumed allocator: a steady level written %v, again at %v, want at the keep-alive", ok, again.Sub(t0))
	}
	// Other reports counted under the same level: a round (a node's share
	// follows its own report), and its release round.
	var at []int64
	for _, s := range []int{170, 175, 180, 190, 200} {
		counted := uint64(1)
		if s >= 170 {
			counted = 2
		}
		if r, ok, _ := b.Next(l2, counted, t0.Add(time.Duration(s)*time.Second)); ok {
			b.Published(r)
			at = append(at, int64(s))
		}
	}
	if want := []int64{170, 180}; !equalInts(at, want) {
		t.Errorf("other reports counted: rounds at %v s, want %v", at, want)
	}
}

func TestCounted(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	reports := []Report{{100, at(0)}, {200, at(10)}, {300, at(20)}}
	for _, tc := range []struct {
		round int
		want  uint64 // 0: none counted
	}{{5, 0}, {9, 0}, {10, 100}, {19, 100}, {20, 200}, {29, 200}, {30, 300}, {100, 300}} {
		r, ok := Counted(at(tc.round), 10*time.Second, reports...)
		if got := map[bool]uint64{true: r.Demand}[ok]; got != tc.want {
			t.Errorf("a round at %d s counts %d, want %d", tc.round, got, tc.want)
		}
	}
	// The order of the reports does not matter; zero times are none.
	if r, ok := Counted(at(25), 10*time.Second, reports[2], Report{}, reports[1], reports[0]); !ok || r.Demand != 200 {
		t.Errorf("out of order: %v %v, want 200", r, ok)
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
	// to StaleAfter less an interval), rather than fall back to the equal
	// share: its increase would land on top of their allocation.
	for _, s := range []int{1, 12, 30} {
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
		{round(4, 4000, 16), 5000, 21, 6000},   // the same round number: no step
		{round(44, 4000, 21), 5000, 21, 4000},  // a decrease: at once
		{round(5, 6500, 31), 5000, 31, 4000},   // an increase: deferred
		{round(5, 6500, 31), 5000, 61, 4000},   // 30 s old: still fresh
		{round(5, 6500, 31), 5000, 62, 5000},   // an interval before stale: the equal share, below round 5's, at once
		{round(5, 6500, 31), 2500, 66, 2500},   // the count doubled: the equal share falls at once
		{round(5, 6500, 31), 5000, 69, 2500},   // and back: within the interval
		{round(5, 6500, 31), 5000, 76, 2500},   // an interval later: an increase, deferred
		{round(5, 6500, 31), 5000, 86, 5000},   // 55 s old: equal, since staleAfter (71 s) at the latest
		{round(6, 6500, 110), 5000, 110, 5000}, // the allocator is back: an increase, deferred
		{round(7, 6500, 120), 5000, 120, 6500},
	} {
		if got := n.Share(tc.a, tc.equal, at(tc.now)); got != tc.want {
			t.Fatalf("step %d (round %d at %d s, equal %d): share %d, want %d", i, tc.a.Round, tc.now, tc.equal, got, tc.want)
		}
	}
	// A round counts the latest report an interval older than itself.
	n.Reported(3000, at(125))
	if got := n.Share(round(8, 6500, 130), 2500, at(130)); got != 6500 {
		t.Errorf("a round 5 s after a report of 3000: %d, want 6500 (of the report of 7000, which it counted)", got)
	}
	if got := n.Share(round(9, 6500, 135), 2500, at(135)); got != 3000 {
		t.Errorf("a round counting the report of 3000: %d, want 3000 (a decrease, at once)", got)
	}
	n.Reported(9000, at(140))
	if got := n.Share(round(10, 6500, 145), 2500, at(145)); got != 3000 {
		t.Errorf("a round 5 s after a report of 9000: %d, want 3000", got)
	}
	if got := n.Share(round(11, 6500, 150), 2500, at(150)); got != 3000 {
		t.Errorf("the round counting the report of 9000: %d, want 3000 (an increase, deferred)", got)
	}
	if got := n.Share(round(12, 6500, 160), 2500, at(160)); got != 6500 {
		t.Errorf("the round after: %d, want the water level 6500 (one report of 9000 is enough)", got)
	}
	// A round seen late, after two more reports, still counts the one
	// its time says.
	n.Reported(1000, at(170))
	n.Reported(2000, at(180))
	if got := n.Share(Allocation{Round: 13, Level: Level{Water: 8000, Floor: 60}, Time: at(165)}, 2500, at(185)); got != 6500 {
		t.Errorf("round 13 of 165 s, seen at 185 s: %d, want 6500 (of the report of 9000 at 140 s)", got)
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
		joined int
		demand uint64
		// lease are the reports the allocator holds of this node: the
		// Lease's latest and the one before, each a second after it was
		// made.
		lease  []Report
		made   []Report
		seenAt []int // when each round reaches this node
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
	var stale, fellBack, maxSum, maxUncounted int
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
			// The report: once an interval, in the allocator's cache a
			// second later.
			if (s-n.joined)%10 == 0 {
				n.Reported(n.demand, at(s))
				n.made = append(n.made, Report{n.demand, at(s)})
			}
			if (s-n.joined)%10 == 1 {
				n.lease = n.made[max(0, len(n.made)-2):]
			}
		}
		// The allocator, away from 1800 s to 2100 s.
		if s < 1800 || s >= 2100 {
			var ds []uint64
			var counted uint64
			for i, n := range nodes {
				if rep, ok := Counted(at(s), interval, n.lease...); ok {
					ds = append(ds, rep.Demand)
					counted = counted*31 + uint64(i)<<32 + uint64(rep.At.Unix())
				}
			}
			if a, ok, _ := alloc.Next(Allocate(rate, floor, ds), counted, at(s)); ok {
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
				} else if !a.Time.IsZero() {
					t.Fatalf("at %d s: a node's round is %v old, past staleAfter %v, and its share %d is not the equal share %d",
						s, at(s).Sub(a.Time), staleAfter, share, equal)
				}
			}
			if _, ok := Counted(a.Time, interval, n.made...); a.Time.IsZero() || !ok {
				uncounted++
			}
		}
		if bound := uint64(rate) + uint64(uncounted)*floor; sum > bound {
			t.Fatalf("at %d s: applied shares sum to %d, above the rate and %d uncounted floors (%d)", s, sum, uncounted, bound)
		}
		maxSum = max(maxSum, int(sum))
		maxUncounted = max(maxUncounted, uncounted)
	}
	if stale == 0 || fellBack == 0 {
		t.Errorf("the allocator's absence left %d node-seconds stale, %d of them at the equal share: the fall back was not exercised", stale, fellBack)
	}
	t.Logf("%d rounds; the applied sum peaked at %d of %d; %d node-seconds stale, %d at the equal share; at most %d node(s) uncounted at once",
		len(rounds), maxSum, rate, stale, fellBack, maxUncounted)
}

// TestNodeShareWithoutAllocator: with no round at all (no allocator has
// ever written one), a node that started at the floor is at the equal
// share once StaleAfter has passed, the step an Interval earlier keeping
// the floor (an increase waits a step).
func TestNodeShareWithoutAllocator(t *testing.T) {
	t0 := time.Unix(1000, 0)
	n := Node{Interval: 10 * time.Second, StaleAfter: 45 * time.Second}
	n.Start(50, t0)
	for _, tc := range []struct {
		s    int
		want uint64
	}{{0, 50}, {35, 50}, {36, 50}, {45, 50}, {46, 5000}, {100, 5000}} {
		if got := n.Share(Allocation{}, 5000, t0.Add(time.Duration(tc.s)*time.Second)); got != tc.want {
			t.Errorf("at %d s: %d, want %d", tc.s, got, tc.want)
		}
	}
}

// TestNodeShareStaleByStaleAfter: with an interval that is not a multiple
// of the agent's 1 s tick, the fall back still ends by StaleAfter (to the
// tick): a node above its equal share steps down once the round is older
// than StaleAfter less the interval, and a node below it steps up at the
// first tick past StaleAfter, not an interval after a late first step.
func TestNodeShareStaleByStaleAfter(t *testing.T) {
	const interval, staleAfter = 2500 * time.Millisecond, 15 * time.Second
	t0 := time.Unix(1000, 0)
	a := Allocation{Round: 7, Level: Level{Water: 3900, Floor: 20}, Time: t0}
	busy := Node{Interval: interval, StaleAfter: staleAfter}
	idle := Node{Interval: interval, StaleAfter: staleAfter}
	busy.Reported(5000, t0.Add(-10*time.Second))
	idle.Reported(0, t0.Add(-10*time.Second))
	busy.Start(3900, t0.Add(-20*time.Second))
	idle.Start(20, t0.Add(-20*time.Second))
	const equal = 2000
	var down, up time.Duration
	for tick := t0.Add(300 * time.Millisecond); tick.Before(t0.Add(30 * time.Second)); tick = tick.Add(time.Second) {
		if got := busy.Share(a, equal, tick); got == equal && down == 0 {
			down = tick.Sub(t0)
		}
		if got := idle.Share(a, equal, tick); got == equal && up == 0 {
			up = tick.Sub(t0)
		}
	}
	if down <= staleAfter-interval || down > staleAfter-interval+time.Second {
		t.Errorf("the busy node stepped down %v after the round, want within a tick of %v", down, staleAfter-interval)
	}
	if up <= staleAfter || up > staleAfter+time.Second {
		t.Errorf("the idle node stepped up %v after the round, want within a tick of %v", up, staleAfter)
	}
	t.Logf("down %v, up %v after the round (staleAfter %v, interval %v)", down, up, staleAfter, interval)
}
