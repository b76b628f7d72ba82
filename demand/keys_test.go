package demand

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"
)

func TestKeyRound(t *testing.T) {
	t0 := time.Unix(10_000, 0)
	const rate, lag = 1000, 10 * time.Second
	report := func(node string, keys map[string]uint64) NodeReport {
		return NodeReport{Node: node, Renewed: t0.Add(-lag), Keys: map[string]map[string]uint64{"l": keys}}
	}
	hot := func(n int, d uint64) map[string]uint64 {
		m := make(map[string]uint64)
		for i := range n {
			m[fmt.Sprintf("k%02d", i)] = d + uint64(i)
		}
		return m
	}
	for _, tc := range []struct {
		name  string
		nodes []NodeReport
		count int
		k     int
		want  map[string]Level // by key
	}{{
		name:  "one node reports a key: it gets all but the others' floors",
		nodes: []NodeReport{report("a", map[string]uint64{"10.0.0.1": 2000}), report("b", map[string]uint64{})},
		count: 4, k: 8,
		// floor 10/1000 of 1000 over 4 nodes: 2; three others keep 6.
		want: map[string]Level{"10.0.0.1": {Water: 994, Floor: 2}},
	}, {
		name: "every node reports it: max-min fair",
		nodes: []NodeReport{
			report("a", map[string]uint64{"x": 100}), report("b", map[string]uint64{"x": 600}),
			report("c", map[string]uint64{"x": 900}), report("d", map[string]uint64{"x": 900}),
		},
		count: 4, k: 8,
		// 100 fits; the other three split 900.
		want: map[string]Level{"x": {Water: 300, Floor: 2}},
	}, {
		name:  "demands that fit: no cap",
		nodes: []NodeReport{report("a", map[string]uint64{"x": 100}), report("b", map[string]uint64{"x": 200})},
		count: 4, k: 8,
		want: map[string]Level{"x": {Water: math.MaxUint64, Floor: 2}},
	}, {
		name: "at most k keys, those asked the most",
		nodes: []NodeReport{
			report("a", map[string]uint64{"x": 10, "y": 300, "z": 50}),
			report("b", map[string]uint64{"x": 10, "y": 300, "z": 50}),
		},
		count: 2, k: 2,
		// floor 5 a node; both report both keys: the demands fit.
		want: map[string]Level{"y": {Water: math.MaxUint64, Floor: 5}, "z": {Water: math.MaxUint64, Floor: 5}},
	}, {
		name:  "a node that reports too many keys: its top k only",
		nodes: []NodeReport{report("a", hot(10_000, 5))},
		count: 2, k: 3,
		// Each capped at the rate, the other node's floor kept out.
		want: map[string]Level{"k9999": {Water: 995, Floor: 5}, "k9998": {Water: 995, Floor: 5}, "k9997": {Water: 995, Floor: 5}},
	}, {
		name:  "an absurd demand: no more than the key's rate",
		nodes: []NodeReport{report("a", map[string]uint64{"x": math.MaxUint64}), report("b", map[string]uint64{"x": math.MaxUint64})},
		count: 2, k: 4,
		want: map[string]Level{"x": {Water: 500, Floor: 5}},
	}, {
		name: "a report younger than the lag: not counted",
		nodes: []NodeReport{
			{Node: "a", Renewed: t0.Add(-time.Second), Keys: map[string]map[string]uint64{"l": {"x": 900}}},
		},
		count: 2, k: 4,
		want: map[string]Level{},
	}, {
		name: "the previous report counts, with its own keys",
		nodes: []NodeReport{{
			Node: "a", Renewed: t0.Add(-time.Second), Keys: map[string]map[string]uint64{"l": {"x": 900}},
			PrevAt: t0.Add(-20 * time.Second), PrevKeys: map[string]map[string]uint64{"l": {"y": 700}},
		}},
		count: 2, k: 4,
		want: map[string]Level{"y": {Water: math.MaxUint64, Floor: 5}},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			in := KeyRound(tc.nodes, "l", rate, 10, tc.count, tc.k, t0, lag)
			got := make(map[string]Level)
			for _, kl := range in.Keys {
				got[kl.Key] = kl.Level
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Errorf("levels %v, want %v", got, tc.want)
			}
			if len(in.Keys) > tc.k {
				t.Errorf("%d keys, more than k %d", len(in.Keys), tc.k)
			}
			for _, kl := range in.Keys {
				// Every key's shares: the reporters' and the others'
				// floors, at most the rate.
				var sum uint64
				for _, n := range tc.nodes {
					if d, ok := n.Keys["l"][kl.Key]; ok && !n.Renewed.After(t0.Add(-lag)) {
						sum += kl.Level.Share(min(d, rate))
					}
				}
				sum += uint64(max(tc.count, len(tc.nodes))-int(kl.Nodes)) * kl.Level.Floor
				if sum > rate {
					t.Errorf("key %s: shares sum to %d, above the rate %d", kl.Key, sum, rate)
				}
			}
		})
	}
}

// TestKeyedSumThroughTransitions runs the allocator and the nodes of a
// keyed limit together, a second at a time, for an hour: every minute each
// node's hot keys change (of 12 keys, k = 4 published: keys enter, leave
// and are displaced), each report reaches the allocator a moment late and
// each round reaches each node up to one interval late, a node joins, and
// the allocator is away for five minutes. At every second, for every key,
// the shares applied over the nodes (the equal share where a node follows
// nothing of the key) sum to at most the key's rate plus the floor of each
// node the last round did not count yet.
func TestKeyedSumThroughTransitions(t *testing.T) {
	const (
		rate          = 12_000
		floorPerMille = 10
		k             = 4
		keys          = 12
		interval      = 10 * time.Second
		keepAlive     = 30 * time.Second
		staleAfter    = 45 * time.Second
		hour          = 3600
	)
	r := rand.New(rand.NewPCG(7, 8))
	t0 := time.Unix(10_000, 0)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	key := func(i int) string { return fmt.Sprintf("10.0.0.%d", i) }
	type round struct {
		a    Allocation
		keys []KeyLevel
	}
	type node struct {
		KeyNodes
		name    string
		joined  int
		demands map[string]uint64
		lease   NodeReport // what the allocator holds of this node
		made    []Report   // the reports made, for Counted
		seenAt  []int      // when each round reaches this node
	}
	var nodes []*node
	var rounds []round
	join := func(s int) {
		n := &node{
			KeyNodes: KeyNodes{Interval: interval, StaleAfter: staleAfter},
			name:     fmt.Sprintf("node-%d", len(nodes)), joined: s,
		}
		// An agent that starts reads the status with its first list:
		// it has seen every round so far.
		for range rounds {
			n.seenAt = append(n.seenAt, s)
		}
		nodes = append(nodes, n)
	}
	for range 5 {
		join(0)
	}
	alloc := Allocator{Interval: interval, KeepAlive: keepAlive}
	var entered, left, maxKeys, stale, maxUncounted int
	var maxFloor uint64
	inAlloc := make(map[string]bool)
	for s := 0; s < hour; s++ {
		if s == 900 {
			join(s)
		}
		count := len(nodes)
		equal := uint64(rate / count)
		for _, n := range nodes {
			if (s-n.joined)%60 == 0 {
				// A few hot keys a node, most of them above the equal
				// share: keys compete for the k places.
				n.demands = make(map[string]uint64)
				for range r.IntN(5) {
					n.demands[key(r.IntN(keys))] = uint64(rate/10 + r.IntN(rate))
				}
			}
			if (s-n.joined)%10 == 0 {
				// The node reports its top k, and records what it
				// reported.
				rep := make(map[string]uint64)
				for _, key := range topKeys(n.demands, k) {
					rep[key] = n.demands[key]
				}
				n.Reported(rep, at(s))
				n.made = append(n.made, Report{At: at(s)})
				prev := n.lease
				n.lease = NodeReport{
					Node: n.name, Renewed: at(s), Keys: map[string]map[string]uint64{"l": rep},
					PrevAt: prev.Renewed, PrevKeys: prev.Keys,
				}
			}
		}
		// The allocator, away from 1800 s to 2100 s; it reads the
		// Leases a second late (the reports of this second not yet).
		if s < 1800 || s >= 2100 {
			var reports []NodeReport
			for _, n := range nodes {
				if l := n.lease; !l.Renewed.IsZero() && l.Renewed.Before(at(s)) {
					reports = append(reports, l)
				} else if !l.PrevAt.IsZero() {
					reports = append(reports, NodeReport{Node: n.name, Renewed: l.PrevAt, Keys: l.PrevKeys})
				}
			}
			in := KeyRound(reports, "l", rate, floorPerMille, count, k, at(s), interval)
			if a, ok, _ := alloc.Next(Level{}, in.Fingerprint, at(s)); ok {
				alloc.Published(a)
				rounds = append(rounds, round{a, in.Keys})
				maxFloor = max(maxFloor, in.Floor)
				now := make(map[string]bool)
				for _, kl := range in.Keys {
					now[kl.Key] = true
					if !inAlloc[kl.Key] {
						entered++
					}
				}
				for key := range inAlloc {
					if !now[key] {
						left++
					}
				}
				inAlloc = now
				maxKeys = max(maxKeys, len(in.Keys))
				for _, n := range nodes {
					n.seenAt = append(n.seenAt, s+r.IntN(int(interval/time.Second)))
				}
			}
		}
		sums := make(map[string]uint64)
		uncounted := 0
		for _, n := range nodes {
			var seen round
			for i := len(n.seenAt) - 1; i >= 0; i-- {
				if n.seenAt[i] <= s {
					seen = rounds[i+len(rounds)-len(n.seenAt)]
					break
				}
			}
			shares := n.Shares(seen.a, seen.keys, equal, at(s))
			for i := range keys {
				share, ok := shares[key(i)]
				if !ok {
					share = equal
				}
				sums[key(i)] += share
			}
			if seen.a.Time.IsZero() || at(s).Sub(seen.a.Time) > staleAfter {
				stale++
				for key, share := range shares {
					if seen.a.Time.IsZero() {
						continue
					}
					if share != equal {
						t.Fatalf("at %d s: %s's round is %v old, past staleAfter, and its share of %s is %d, not the equal share %d",
							s, n.name, at(s).Sub(seen.a.Time), key, share, equal)
					}
				}
			}
			if _, ok := Counted(seen.a.Time, interval, n.made...); seen.a.Time.IsZero() || !ok {
				uncounted++
			}
		}
		maxUncounted = max(maxUncounted, uncounted)
		for key, sum := range sums {
			if bound := uint64(rate) + uint64(uncounted)*maxFloor; sum > bound {
				t.Fatalf("at %d s: the shares of %s sum to %d, above its rate and %d uncounted floors (%d)", s, key, sum, uncounted, bound)
			}
		}
	}
	if entered < 20 || left < 20 || maxKeys != k || stale == 0 {
		t.Errorf("%d keys entered and %d left the allocation, at most %d at once, %d node-seconds stale: the transitions were not exercised",
			entered, left, maxKeys, stale)
	}
	t.Logf("%d rounds; %d keys entered, %d left; at most %d uncounted node(s); %d node-seconds stale", len(rounds), entered, left, maxUncounted, stale)
}

// TestKeyNodesStartedBeforeParameters: a restarted agent starts its keys'
// Nodes from what the data path holds before it knows the parameters (or
// they change with a reload): each key's Node follows the parameters of
// the latest Shares, so a fresh round is followed, not taken as stale.
func TestKeyNodesStartedBeforeParameters(t *testing.T) {
	t0 := time.Unix(10_000, 0)
	var ks KeyNodes
	ks.Start("10.0.0.1", 1000, t0)
	ks.Interval, ks.StaleAfter = 500*time.Millisecond, 5*time.Second
	ks.Bounds = Bounds{Rate: 3000, Count: 3, FloorPerMille: 10}
	a := Allocation{Round: 7, Time: t0, Level: Level{Water: math.MaxUint64, Floor: 10}}
	keys := []KeyLevel{{Key: "10.0.0.1", Level: Level{Water: 2980, Floor: 10}, Nodes: 1}}
	// Not a reporter of the key in this round (none recorded): the floor,
	// at once, as the round says; a stale round would leave the equal share.
	if got := ks.Shares(a, keys, 1000, t0.Add(time.Second))["10.0.0.1"]; got != 10 {
		t.Errorf("the key's share after a fresh round: %d, want the floor 10 (a Node without parameters takes every round as stale)", got)
	}
}
