// Package demand divides a global rate among nodes by what each one asks
// for (share: demand), where equal shares (rate / count) would leave a busy
// node short while an idle one holds capacity it does not use.
//
// The allocation is max-min fair with a floor: every node gets
// max(F, min(d, W)) of its demand d, the water level W chosen so that the
// shares sum to at most the global rate (every node asking for less than W
// gets all it asks for; the others split the rest evenly). Only the two
// numbers W and F are published, never a list of nodes: each node computes
// its own share from the demand it reported, so the allocation costs the
// same to publish at 5 nodes as at 5,000.
//
// Shares change between rounds without over-admitting: a node applies the
// smaller of its last two allocations (Step), so a decrease takes effect at
// once and an increase one round later, by which time every node has seen
// the round that made room for it.
//
// Allocator says when a round is worth publishing (a change, the round
// that releases its increases, a keep-alive; at most one an interval), and
// Node is one node's side: the rounds it sees, its own reports and the
// clock in, the share to enforce out, falling back to the equal share when
// the allocation goes stale. The bounds they keep, with every node at most
// one interval behind: the applied shares sum to at most the rate, plus
// the floor of each node that joined since the last round.
//
// The package is arithmetic only: measuring demand, publishing it, electing
// the allocator and watching the allocation are the agent's and the
// watcher's.
package demand
