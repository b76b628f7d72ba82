package demand

import (
	"cmp"
	"fmt"
	"hash/fnv"
	"maps"
	"math"
	"slices"
	"strings"
	"time"
)

// Keyed limits: every key (a source address, a destination, a port) has
// the limit's rate as its own global rate, and equal shares give it
// rate / count on every node, right only when the key's traffic spreads
// over the nodes as the count does. With demand shares a node reports the
// keys that run out of their equal share (hot keys, at most K of a limit),
// and the allocator applies the key-less allocation to each reported key:
// max-min fair over the nodes that report it, the floor on the others.
// Keys nobody reports keep rate / count: the safe bound, and nothing is
// published for them.
//
// A key's round is a key-less round of its own (KeyLevel, with the
// limit's round number and time), and a node follows it with a Node of
// its own (KeyNodes): a decrease at once, an increase a round later, the
// equal share when the allocation goes stale. A key that enters the
// allocation takes the nodes that did not report it down to the floor at
// once; a key that leaves it (cooled, or displaced by the K bound) steps
// every node back to the equal share, the increases a round later. So,
// for every key, the shares over the nodes sum to at most its rate, plus
// the floor of each node the round did not count (one that joined since).

// KeyLevel is one key's allocation in a round of a keyed limit.
type KeyLevel struct {
	Key   string
	Level Level
	// Nodes is how many nodes' reports of the key the round counted, and
	// Asked what they asked for together (saturated).
	Nodes int32
	Asked uint64
}

// KeyRoundInput is a round of a keyed limit: the keys' levels, at most k,
// sorted by key, and what Round's input says of the reports.
type KeyRoundInput struct {
	Keys []KeyLevel
	// Fingerprint identifies the reports counted and the levels: a round
	// whose fingerprint is the last one's changes nothing.
	Fingerprint uint64
	// Countable is the next time a report becomes lag old (zero: none
	// will): a round is due then.
	Countable time.Time
	// Floor is the least a node gets of a key in the allocation.
	Floor uint64
	// Nodes is how many nodes' reports the round counted (with or without
	// hot keys), and Asked what the keys published asked for together
	// (saturated).
	Nodes int
	Asked uint64
}

// KeyRound computes the round of a keyed limit whose keys each have the
// global rate rate, at time t, from the nodes' reports of their hot keys
// (NodeReport.Keys and PrevKeys). Of each node it counts the latest report
// at least lag old, as Round does, and of that report at most k keys, those
// with the highest demands (a node that reports more is not followed
// further); a key's demand above rate counts as rate. It publishes at most
// k keys, those asked the most over the nodes (ties: by key). Each key's
// floor is floorPerMille of rate over count or the nodes counted,
// whichever is more, and the nodes that did not report the key keep their
// floors out of what the reporters share: a key's shares sum to at most
// rate over every node of the count.
func KeyRound(nodes []NodeReport, limit string, rate uint64, floorPerMille uint32, count, k int, t time.Time, lag time.Duration) KeyRoundInput {
	var in KeyRoundInput
	nodes = slices.SortedFunc(slices.Values(nodes), func(a, b NodeReport) int { return strings.Compare(a.Node, b.Node) })
	demands := make(map[string][]uint64)
	counted := 0
	h := fnv.New64a()
	for _, n := range nodes {
		latest, hasLatest := n.Keys[limit]
		if hasLatest {
			if at := n.Renewed.Add(lag); at.After(t) && (in.Countable.IsZero() || at.Before(in.Countable)) {
				in.Countable = at
			}
		}
		// Which of the node's two reports counts, the latest lag old;
		// then the keys of that report (none: the node reports no hot
		// key, and gets the floor of every key in the allocation).
		var rs []Report
		if hasLatest {
			rs = append(rs, Report{At: n.Renewed})
		}
		if _, ok := n.PrevKeys[limit]; ok {
			rs = append(rs, Report{At: n.PrevAt})
		}
		r, ok := Counted(t, lag, rs...)
		if !ok {
			continue
		}
		counted++
		keys := latest
		if !hasLatest || !r.At.Equal(n.Renewed) {
			keys = n.PrevKeys[limit]
		}
		fmt.Fprintf(h, "%s\x00%d\x00", n.Node, r.At.UnixNano())
		for _, key := range topKeys(keys, k) {
			d := min(keys[key], rate)
			demands[key] = append(demands[key], d)
			fmt.Fprintf(h, "%s\x00%d\x00", key, d)
		}
	}
	nodesOf := max(1, count, counted)
	in.Floor = rate * uint64(floorPerMille) / 1000 / uint64(nodesOf)
	for key, ds := range demands {
		kl := KeyLevel{Key: key, Nodes: int32(min(len(ds), math.MaxInt32))}
		for _, d := range ds {
			kl.Asked = satAdd(kl.Asked, d)
		}
		// The nodes that did not report the key keep the floor: the
		// reporters share what is left.
		others := uint64(nodesOf - len(ds))
		kl.Level = Allocate(rate-min(rate, in.Floor*others), in.Floor, ds)
		in.Keys = append(in.Keys, kl)
	}
	// At most k keys: those asked the most.
	slices.SortFunc(in.Keys, func(a, b KeyLevel) int {
		return cmp.Or(cmp.Compare(b.Asked, a.Asked), strings.Compare(a.Key, b.Key))
	})
	in.Keys = in.Keys[:min(len(in.Keys), max(k, 0))]
	slices.SortFunc(in.Keys, func(a, b KeyLevel) int { return strings.Compare(a.Key, b.Key) })
	in.Nodes = counted
	for _, kl := range in.Keys {
		in.Asked = satAdd(in.Asked, kl.Asked)
		fmt.Fprintf(h, "=%s\x00%d\x00%d\x00", kl.Key, kl.Level.Water, kl.Level.Floor)
	}
	in.Fingerprint = h.Sum64()
	return in
}

// topKeys is at most k of the keys, those with the highest demands (ties:
// by key), in that order.
func topKeys(keys map[string]uint64, k int) []string {
	out := slices.SortedFunc(maps.Keys(keys), func(a, b string) int {
		return cmp.Or(cmp.Compare(keys[b], keys[a]), strings.Compare(a, b))
	})
	return out[:min(len(out), max(k, 0))]
}

func satAdd(a, b uint64) uint64 {
	if a > math.MaxUint64-b {
		return math.MaxUint64
	}
	return a + b
}

// KeyNodes is one node's side of a keyed demand-shared limit: a Node for
// every key in the allocation or in this node's recent reports, each
// stepping as a key-less limit's Node does. Keys it holds no Node for are
// at the equal share (the data path's rate for a key without an override).
type KeyNodes struct {
	// Interval, StaleAfter and Bounds are each key's Node's.
	Interval   time.Duration
	StaleAfter time.Duration
	Bounds     Bounds

	nodes map[string]*Node
}

// Reported records a report of this node's hot keys published at: each
// key's Node records its demand, and every other key's Node a demand of 0
// (the allocator then counts the node as not reporting it: the floor).
func (ks *KeyNodes) Reported(demands map[string]uint64, at time.Time) {
	if ks.nodes == nil {
		ks.nodes = make(map[string]*Node)
	}
	for key := range demands {
		ks.node(key)
	}
	for key, n := range ks.nodes {
		n.Reported(demands[key], at)
	}
}

func (ks *KeyNodes) node(key string) *Node {
	n := ks.nodes[key]
	if n == nil {
		n = &Node{Interval: ks.Interval, StaleAfter: ks.StaleAfter, Bounds: ks.Bounds}
		ks.nodes[key] = n
	}
	return n
}

// Shares steps every key's Node with the latest round seen (a: its round
// and time; keys: its levels, the zero Allocation and none before any) and
// returns the share of each key this node follows, equal included. A key
// absent from a fresh round steps to the equal share; a Node that is
// settled there, out of the allocation and out of this node's last
// reports, is dropped (its key is back to the data path's default).
func (ks *KeyNodes) Shares(a Allocation, keys []KeyLevel, equal uint64, now time.Time) map[string]uint64 {
	if ks.nodes == nil {
		ks.nodes = make(map[string]*Node)
	}
	in := make(map[string]KeyLevel, len(keys))
	for _, kl := range keys {
		in[kl.Key] = kl
		if ks.nodes[kl.Key] == nil {
			// A key this node neither reported nor followed: the round
			// gives it the floor here (a node that joined since may not
			// take its equal share of a key the others share out).
			ks.node(kl.Key).Start(min(kl.Level.Floor, equal), now)
		}
	}
	out := make(map[string]uint64, len(ks.nodes))
	for key, n := range ks.nodes {
		// The parameters as they are now: a Node started before they
		// were set (Start, for a restarted agent) or before a reload.
		n.Interval, n.StaleAfter, n.Bounds = ks.Interval, ks.StaleAfter, ks.Bounds
		ka := Allocation{}
		if !a.Time.IsZero() {
			ka = Allocation{Round: a.Round, Time: a.Time, Level: Level{Water: equal, Floor: equal}}
			if kl, ok := in[key]; ok {
				ka.Level, ka.Nodes = kl.Level, kl.Nodes
			}
		}
		share := n.Share(ka, equal, now)
		if _, ok := in[key]; !ok {
			if share > equal {
				// Out of the allocation a key's share is the equal
				// share, which falls at once when the count grows.
				share = n.applied.Step(equal)
			}
			if n.settled(equal) {
				delete(ks.nodes, key)
				continue
			}
		}
		out[key] = share
	}
	return out
}

// Start has key's Node begin at share: what the data path enforces of
// it, for an agent that restarts.
func (ks *KeyNodes) Start(key string, share uint64, now time.Time) {
	if ks.nodes == nil {
		ks.nodes = make(map[string]*Node)
	}
	ks.node(key).Start(share, now)
}

// LastReport is the last demand of key recorded with Reported (ok false:
// none).
func (ks *KeyNodes) LastReport(key string) (Report, bool) {
	if n := ks.nodes[key]; n != nil {
		return n.LastReport()
	}
	return Report{}, false
}

// Len is the number of keys with a Node.
func (ks *KeyNodes) Len() int { return len(ks.nodes) }

// settled says whether n enforces equal and steps to nothing else: its
// last two steps were equal and its last reports ask for nothing.
func (n *Node) settled(equal uint64) bool {
	if n.applied.last != equal || n.applied.now != equal {
		return false
	}
	for _, r := range n.reports {
		if r.Demand != 0 {
			return false
		}
	}
	return true
}
