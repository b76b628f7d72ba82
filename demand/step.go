package demand

// Applied is what a node enforces of one limit as allocations arrive: the
// smaller of the last two rounds' shares. A decrease applies at once; an
// increase waits one round, until every node has applied the round that
// made room for it. While nodes are at most one round apart (a watch
// delivers the allocation within one report interval), the shares applied
// across the nodes sum to at most the rate of the older of the two rounds
// in play:
//
//	a node that saw round k applies min(s_k, s_k-1) <= s_k-1
//	a node still at k-1 applies min(s_k-1, s_k-2) <= s_k-1
//
// so the sum is at most the sum of round k-1's shares, which Allocate keeps
// within the rate.
//
// The same rule covers the fall back to equal shares when the allocation
// goes stale: every node steps to its equal share when the allocation's age
// passes the limit (at the same time, give or take the age check's period,
// as they all read one allocation), and again one period later.
//
// The zero Applied enforces 0: a node starts with Start.
type Applied struct {
	last uint64 // the latest round's share
	now  uint64 // what is enforced: min(last, the round before)
}

// Start is what a node enforces before its first round counts: a node that
// joins starts at the floor (the round it joined in did not count it); a
// restarted agent, at the share the data path still enforces.
func Start(share uint64) Applied {
	return Applied{last: share, now: share}
}

// Step takes the share of a new round and returns what to enforce.
func (a *Applied) Step(share uint64) uint64 {
	a.now, a.last = min(share, a.last), share
	return a.now
}

// Now is what is enforced.
func (a Applied) Now() uint64 { return a.now }
