/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Token buckets: a shared pool per bucket, and per-CPU caches that lease
 * tokens from it in chunks.
 *
 * The pool is one u64, v_empty, on the limit's virtual clock V (struct
 * rl_params): the bucket holds min(burst, V(now) - v_empty) tokens. Refill is
 * implicit, so nothing ever writes a refill and there is no refill race; a
 * lease of n tokens is one compare-and-swap that moves v_empty forward by n.
 *
 * A CPU spends its leased tokens with a plain decrement: no clock, no atomic.
 * It asks the pool again only when its cache runs short, for
 * max(shortfall, chunk) tokens. Tokens sitting in other CPUs' caches are
 * bounded by nCPU x chunk (user space keeps chunk <= burst / (8 x nCPU)), and
 * that is the whole error against an exact bucket. A lease older than
 * RL_STALE_NS first hands its remainder back, in the same compare-and-swap.
 *
 * When the pool is short, the CPU remembers when a whole chunk will have
 * accrued (retry_ns) and drops until then without touching the pool's cache
 * line. A parameter change (seq) cancels that wait.
 *
 * Every function here takes now as an argument and reads no clock.
 */
#ifndef RL_BUCKET_H
#define RL_BUCKET_H

#include "common.h"

static __always_inline __u64 rl_min(__u64 a, __u64 b) { return a < b ? a : b; }
static __always_inline __u64 rl_max(__u64 a, __u64 b) { return a > b ? a : b; }

/* V(now). dt is split in seconds and nanoseconds so that dt x rate cannot
 * overflow: rate <= RL_MAX_RATE keeps (dt % 1e9) x rate below 2^64. */
static __always_inline __u64 rl_vclock(const struct rl_params *p, __u64 now)
{
	__u64 dt = now > p->base_ns ? now - p->base_ns : 0;

	return p->base_v + (dt / NSEC_PER_SEC) * p->rate +
	       ((dt % NSEC_PER_SEC) * p->rate) / NSEC_PER_SEC;
}

/* Nanoseconds until n more tokens accrue. */
static __always_inline __u64 rl_accrual_ns(const struct rl_params *p, __u64 n)
{
	if (!p->rate)
		return ~0ULL;
	return (n / p->rate) * NSEC_PER_SEC + ((n % p->rate) * NSEC_PER_SEC) / p->rate;
}

enum rl_lease_result {
	RL_LEASE_OK,		/* the cache holds at least cost tokens */
	RL_LEASE_SHORT,		/* the pool does not have them (yet) */
	RL_LEASE_CONTENDED,	/* RL_CAS_TRIES compare-and-swaps lost to other CPUs */
};

/* Makes the cache hold at least cost tokens, leasing from pool. */
static __always_inline enum rl_lease_result rl_lease(struct rl_pool *pool, struct rl_cache *c,
				     const struct rl_params *p, __u32 seq,
				     __u64 cost, __u64 now)
{
	__u64 v, floor, give = 0, held = c->tokens, short_by, want;

	if (c->retry_ns > now && c->seq == seq)
		return RL_LEASE_SHORT;

	v = rl_vclock(p, now);
	/* The pool never holds more than burst: v_empty >= V - burst. */
	floor = v > p->burst ? v - p->burst : 0;
	if (held && now - c->lease_ns > RL_STALE_NS) {
		give = held;
		held = 0;
	}
	short_by = cost - held;
	want = rl_max(short_by, p->chunk);

	for (int i = 0; i < RL_CAS_TRIES; i++) {
		__u64 old = READ_ONCE_U64(pool->v_empty);
		__u64 base = rl_max(old > give ? old - give : 0, floor);
		__u64 avail = v > base ? v - base : 0;
		__u64 take;

		if (avail < short_by) {
			/* Saturating: a share of 0 never accrues (~0). */
			c->retry_ns = now + rl_min(rl_accrual_ns(p, rl_min(want, p->burst) - avail),
						   ~0ULL - now);
			c->seq = seq;
			return RL_LEASE_SHORT;
		}
		take = rl_min(want, avail);
		if (__sync_val_compare_and_swap(&pool->v_empty, old, base + take) == old) {
			c->tokens = held + take;
			c->lease_ns = now;
			c->retry_ns = 0;
			return RL_LEASE_OK;
		}
	}
	return RL_LEASE_CONTENDED;
}

/* Draws cost tokens straight from the pool, with no cache: for a packet
 * that found no cache way to lease into. */
static __always_inline enum rl_lease_result rl_draw(struct rl_pool *pool, const struct rl_params *p,
						    __u64 cost, __u64 now)
{
	__u64 v = rl_vclock(p, now);
	__u64 floor = v > p->burst ? v - p->burst : 0;

	for (int i = 0; i < RL_CAS_TRIES; i++) {
		__u64 old = READ_ONCE_U64(pool->v_empty);
		__u64 base = rl_max(old, floor);

		if (v < base + cost)
			return RL_LEASE_SHORT;
		if (__sync_val_compare_and_swap(&pool->v_empty, old, base + cost) == old)
			return RL_LEASE_OK;
	}
	return RL_LEASE_CONTENDED;
}

/* Reserves cost tokens from the pool for a packet that may wait (a paced
 * limit): the reservation is one compare-and-swap that moves v_empty by cost,
 * as a draw, but v_empty may run ahead of V(now) by up to horizon_ns of
 * refill. *wait is how long until the reserved tokens accrue: 0 while the
 * pool holds them (the burst), then cost / rate more for each packet. A
 * packet whose wait would exceed horizon_ns reserves nothing
 * (RL_LEASE_SHORT). The wait is computed from the v_empty the swap replaced,
 * so it is the one the reservation got, whatever other CPUs did. */
static __always_inline enum rl_lease_result rl_reserve(struct rl_pool *pool, const struct rl_params *p,
						       __u64 cost, __u64 now, __u64 horizon_ns,
						       __u64 *wait)
{
	__u64 v = rl_vclock(p, now);
	__u64 floor = v > p->burst ? v - p->burst : 0;

	for (int i = 0; i < RL_CAS_TRIES; i++) {
		__u64 old = READ_ONCE_U64(pool->v_empty);
		__u64 next = rl_max(old, floor) + cost;
		__u64 w = next > v ? rl_accrual_ns(p, next - v) : 0;

		if (w > horizon_ns)
			return RL_LEASE_SHORT;
		if (__sync_val_compare_and_swap(&pool->v_empty, old, next) == old) {
			*wait = w;
			return RL_LEASE_OK;
		}
	}
	return RL_LEASE_CONTENDED;
}

/* Hands tokens a CPU holds back to the pool (a cache slot taken over by
 * another key). Best effort: on contention the tokens are forfeited, which
 * can only make the bucket stricter. */
static __always_inline void rl_give_back(struct rl_pool *pool, __u64 tokens)
{
	__u64 old = READ_ONCE_U64(pool->v_empty);

	__sync_val_compare_and_swap(&pool->v_empty, old, old > tokens ? old - tokens : 0);
}

#endif /* RL_BUCKET_H */
