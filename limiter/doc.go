// Package limiter enforces rlagent's global rate limits per request, inside
// a service's own processes: the in-process half of the limit model whose
// other half, packets, bytes and connections, the node agent enforces in
// the kernel (docs/library.md says when to use which).
//
// A Limiter holds named limits, each with this process's share of a global
// limit (LimitConfig) and its policy: fail a request at once when its
// bucket is empty, or make it wait, up to MaxWait. Its limits come from a
// Source that watches and divides (package spec: limits in code or a file,
// divided by a count; package kube: the cluster's RateLimits with unit
// requests, divided by the ready endpoints of the process's own Service),
// or from Apply.
//
// A Set is the limits one request draws from, in order: Allow, AllowN,
// Wait, WaitN, Reserve. A draw is all or nothing: a request one limit
// refuses draws from none. Packages httplimit and grpclimit put a Set in
// front of an HTTP handler or a gRPC server, and package throttle is the
// client side (adaptive throttling).
//
// How a draw works, as the data path does it per CPU: a key-less limit is
// a GCRA pool (one atomic "theoretical arrival time") from which shards,
// one per processor, lease tokens in chunks of clamp(rate x 1 ms, 1, burst
// / (8 x shards)); a draw takes a token from its shard's cache with one
// atomic add, and reads the clock and swaps the pool only when the cache
// is empty. The tokens stranded in the caches are at most shards x (chunk
// - 1) <= burst / 8. A call picks its shard through a sync.Pool of shard
// pointers, whose per-P private slot hands each processor the same shard
// again. A keyed limit holds a pool and a cache per key in a bounded table
// (Options.MaxKeys), sharded by a seeded hash; an evicted key that still
// owes leaves a tombstone, and comes back owing, not with a fresh burst.
//
// Everything here is safe for concurrent use. A draw allocates nothing.
package limiter
