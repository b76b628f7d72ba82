/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The keyed buckets: where each key's bucket is found and how it starts.
 *
 * A keyed limit's bucket is one entry of rl_buckets (the shared pool),
 * found by a hash of the limit, its generation and the key (rl_hash, with
 * rl_config.seed). Each CPU caches the buckets it uses in rl_key_cache, a
 * set-associative cache picked by the hash's top bits (rl_key_find), so
 * that a packet of a key it saw finds its leased tokens without a lookup.
 * A bucket rl_buckets evicts leaves a tombstone (rl_tombstones): when its
 * key comes back its bucket starts where the evicted one would be now
 * (rl_bucket_pool), not full, so an eviction hands out at most one burst.
 *
 * A keyed bucket that is short in two consecutive ticks on a CPU is a hot
 * key: rl_hot_note records it in rl_hot, once a tick.
 *
 * A key may have a share of its own (rl_overrides, rl_key_override): its
 * bucket then runs on the override's params instead of the limit's.
 *
 * Owns: rl_hash, the keys (rl_prefix_key, rl_bucket_key), the cache's
 * lookup, the tombstones, the creation of a pool, the hot keys and the
 * keys' overrides. Relies on maps.h
 * (the maps), bucket.h (the virtual clock) and the packet of parse.h. Which
 * cache way a packet may take is the decision's (rl_key_victim in
 * ratelimit.c: it depends on what the packet's other limits hold). Every
 * function here takes now as an argument and reads no clock.
 */
#ifndef RL_KEYCACHE_H
#define RL_KEYCACHE_H

#include "common.h"
#include "parse.h"
#include "maps.h"
#include "bucket.h"
#include "clock.h"
#include "classify.h"

/* Size of rl_tombstones minus one; set by user space with the map's size. */
volatile const __u32 rl_tombstone_mask = 65535;
/* Sets of rl_buckets minus one; set by user space with the map's size. */
volatile const __u32 rl_bucket_mask = 8191;

/* The hash of a keyed bucket: picks its cache set (the top bits), its
 * tombstone and the tombstone's fingerprint. Multiply-shift with a random
 * multiplier per address half (rl_config.seed, kept with the pins): the top
 * bits of a product depend on every bit below them through the carries, so
 * a sender who does not know the seed cannot pick addresses that share a
 * set. The limit and generation are a term of their own, with a multiplier
 * of the seed's too, so that two keys cannot share a hash by a choice of
 * address (XORed into the address bits, address a ^ g ^ g' in generation g'
 * hashed as a did in g).
 *
 * The sum is then mixed (xorshift-multiply, a bijection): without it the
 * hash is linear, and one address's buckets of two limits (or generations)
 * differ by a constant that does not depend on the address, so that a pair
 * of limits whose constant has no high bits (regularly spaced ids or
 * generations under some seeds; one or two pairs of 128 limits under a
 * random seed) shares one set for every key, and their buckets evict each other for
 * every source. Mixed, which keys two limits share a set for is as random
 * as which keys share one within a limit. */
static __always_inline __u64 rl_hash(const __u64 seed[2], __u32 id, __u32 gen, const __u32 a[4])
{
	__u64 hi = ((__u64)a[0] << 32) | a[1];
	__u64 lo = ((__u64)a[2] << 32) | a[3];
	__u64 lg = ((__u64)id << 32) | gen;
	__u64 h = hi * (seed[0] | 1) + lo * (seed[1] | 1) + lg * ((seed[0] ^ seed[1]) | 1) + (seed[0] >> 1);

	h ^= h >> 32;
	h *= 0xd6e8feb86659fd93ULL;
	return h ^ (h >> 32);
}

#define RL_SET_SHIFT (64 - 12)
_Static_assert(RL_KEY_CACHE_SETS == 1 << 12, "RL_SET_SHIFT takes 12 bits for the set");

/* An address masked to the limit's prefix of its family. */
static __always_inline void rl_prefix_key(const struct rl_limit *lim, __u8 family, const __u32 a[4],
					  __u32 out[4])
{
	if (family == 4) {
		out[2] = a[2];
		out[3] = a[3] & lim->prefix4;
	} else {
		out[0] = a[0] & lim->prefix6[0];
		out[1] = a[1] & lim->prefix6[1];
		out[2] = a[2] & lim->prefix6[2];
		out[3] = a[3] & lim->prefix6[3];
	}
}

static __always_inline void rl_bucket_key(const struct rl_limit *lim, const struct pkt *p,
					  struct rl_bucket_key *k)
{
	switch (lim->key_kind) {
	case RL_KEY_SRC_IP:
		__builtin_memcpy(k->addr, p->src, sizeof(k->addr));
		break;
	case RL_KEY_DST_IP:
		__builtin_memcpy(k->addr, p->dst, sizeof(k->addr));
		break;
	case RL_KEY_SRC_PREFIX:
		rl_prefix_key(lim, p->family, p->src, k->addr);
		break;
	case RL_KEY_DST_PREFIX:
		rl_prefix_key(lim, p->family, p->dst, k->addr);
		break;
	case RL_KEY_DST_PORT:
		k->addr[0] = p->pclass;
		k->addr[1] = p->has_ports ? p->dport : 0x10000;
		break;
	case RL_KEY_NONE:
		break;	/* not keyed: never asked */
	}
}

static __always_inline bool rl_key_equal(const struct rl_bucket_key *a,
					 const struct rl_bucket_key *b)
{
	return !((a->limit ^ b->limit) | (a->gen ^ b->gen) |
		 (a->addr[0] ^ b->addr[0]) | (a->addr[1] ^ b->addr[1]) |
		 (a->addr[2] ^ b->addr[2]) | (a->addr[3] ^ b->addr[3]));
}

/* Where a keyed limit's bucket for a packet sits in this CPU's cache. */
struct rl_key_ref {
	struct rl_bucket_key k;
	struct rl_key_set *set;
	__u64 h;
	__u32 si;	/* the set */
	__u32 way;	/* the way holding k, or RL_KEY_CACHE_WAYS */
};

_Static_assert(RL_KEY_CACHE_WAYS == 2, "rl_key_find and rl_key_victim handle two ways");

static __always_inline bool rl_key_find(const struct rl_limit *lim, __u32 id, const struct pkt *p,
					const __u64 seed[2], struct rl_key_ref *r)
{
	r->k.limit = id;
	r->k.gen = lim->gen;
	rl_bucket_key(lim, p, &r->k);
	r->h = rl_hash(seed, id, lim->gen, r->k.addr);
	r->si = r->h >> RL_SET_SHIFT;
	r->set = bpf_map_lookup_elem(&rl_key_cache, &r->si);
	if (!r->set)
		return false;
	/* The hashes first (the set's first line); a way's key only where
	 * its hash is the packet's. */
	if (r->set->tag[0] == r->h && rl_key_equal(&r->set->way[0].key, &r->k))
		r->way = 0;
	else if (r->set->tag[1] == r->h && rl_key_equal(&r->set->way[1].key, &r->k))
		r->way = 1;
	else
		r->way = RL_KEY_CACHE_WAYS;
	return true;
}

/* A keyed bucket's set of rl_tombstones and its fingerprint there. The
 * hash is mixed once more first: below its top bits (the key cache's set)
 * a bit of rl_hash depends only on the key's bits below it, so that 768
 * consecutive IPv4 sources fell into 96 sets. */
static __always_inline struct rl_tomb_set *rl_tomb_of(__u64 h, __u32 *fp)
{
	__u32 tidx;

	h ^= h >> 29;
	h *= 0xbf58476d1ce4e5b9ULL;
	h ^= h >> 32;
	tidx = (__u32)(h >> 32) & rl_tombstone_mask;
	*fp = (__u32)h | 1;
	return bpf_map_lookup_elem(&rl_tombstones, &tidx);
}

_Static_assert(RL_TOMB_WAYS == 4, "rl_tomb_way unrolls four ways");

/* The way of t holding fp, or RL_TOMB_WAYS. */
static __always_inline __u32 rl_tomb_way(const struct rl_tomb_set *t, __u32 fp)
{
	if (t->way[0].fp == fp)
		return 0;
	if (t->way[1].fp == fp)
		return 1;
	if (t->way[2].fp == fp)
		return 2;
	if (t->way[3].fp == fp)
		return 3;
	return RL_TOMB_WAYS;
}

/* The most a bucket can owe, in 2^RL_TOMB_SHIFT ns units, rounded up. */
#define RL_TOMB_MAX_OWED (((RL_MAX_BURST_SECONDS * NSEC_PER_SEC + RL_MAX_HORIZON_NS) >> RL_TOMB_SHIFT) + 2)
_Static_assert(RL_TOMB_MAX_OWED < (1ULL << 30), "a debt fits rl_tomb's half range, with room for stale entries");

/* How long until full_at, in 2^RL_TOMB_SHIFT ns units; 0: it is full, or
 * the entry is stale (older than the wrap, seen as further ahead than any
 * bucket can owe). */
static __always_inline __s32 rl_tomb_owes(__u32 full_at, __u64 now)
{
	__s32 o = (__s32)(full_at - (__u32)(now >> RL_TOMB_SHIFT));

	return o > 0 && o <= (__s32)RL_TOMB_MAX_OWED ? o : 0;
}

/* Notes a keyed bucket's state after its pool moved (a lease, a draw, a
 * reservation): when it will be full again. A bucket notes itself on its
 * first lease (created: a new bucket, the only chance a key evicted after
 * every packet gets), and after that only when it owes at least half its
 * burst: a key within its rate pays nothing for the tombstones (their set
 * is a cache miss in a large table), and one forgotten owing less gains
 * less than half a burst when it returns. An earlier note of a larger debt
 * stands: it says the bucket is full no later than it truly will be. A
 * bucket keeps its way, or takes one that owes nothing. A way that owes is
 * never taken: in a set of more buckets that owe than ways, the ones there
 * stay remembered and the others are forgotten, rather than each
 * forgetting the other in turn. */
static __always_inline void rl_tomb_note(__u64 h, const struct rl_pool *pool, const struct rl_params *p,
					 __u64 now, bool created)
{
	__u64 v = rl_vclock(p, now), owed = READ_ONCE_U64(pool->v_empty) + p->burst;
	__u32 fp, w, full_at;
	struct rl_tomb_set *t;

	if (owed <= v || (!created && owed < v + p->burst / 2))
		return;	/* full, or owes less than half its burst */
	t = rl_tomb_of(h, &fp);
	if (!t)
		return;
	/* Rounded up: a returning key waits at most one unit longer. */
	full_at = (__u32)((now + rl_accrual_ns(p, owed - v) + (1 << RL_TOMB_SHIFT) - 1) >> RL_TOMB_SHIFT);
	w = rl_tomb_way(t, fp);
	if (w >= RL_TOMB_WAYS) {
		for (int i = 0; i < RL_TOMB_WAYS; i++) {
			if (!t->way[i].fp || rl_tomb_owes(t->way[i].full_at, now) <= 0) {
				w = i;
				break;
			}
		}
		if (w >= RL_TOMB_WAYS)
			return;	/* every way owes: forgotten */
		t->way[w & 3].fp = fp;
	}
	t->way[w & 3].full_at = full_at;
}

/* Where a keyed bucket sits in rl_buckets: its set (returned) and its tag
 * there. The hash is mixed once more (as for the tombstones, with another
 * mix, so that a set's keys spread over the tombstones' sets): the set is
 * the low bits of the mix, and the tag its top 48 bits with the limit's id
 * and the low byte of its generation (which tell the claim whose params a
 * way's pool runs on, and whether that generation is gone), and the top
 * bit set, so that no tag is 0. Two keys share a way only if they share
 * the set and 47 bits more of a keyed hash. maps.bucketPlace in Go is the
 * same function. */
static __always_inline __u32 rl_bucket_place(__u64 h, __u32 id, __u32 gen, __u64 *tag)
{
	h ^= h >> 31;
	h *= 0x94d049bb133111ebULL;
	h ^= h >> 29;
	*tag = (h & ~0xffffULL) | (1ULL << 63) | ((__u64)(gen & 0xff) << 8) | (id & 0xff);
	return (__u32)h & rl_bucket_mask;
}

_Static_assert(RL_MAX_LIMITS <= 256, "a limit id fits the tag's low byte");
_Static_assert(RL_BUCKET_WAYS * sizeof(struct rl_bucket_way) == 64, "a set of rl_buckets is one cache line");


/* The pool of set's way tagged tag, or NULL. Branch-free over the ways
 * (a way matches when its tag XOR tag is 0, and x | -x has its top bit set
 * for every other x): one path for the verifier, not one per way. */
static __always_inline struct rl_pool *rl_bucket_find(struct rl_bucket_set *set, __u64 tag)
{
	__u64 found = 0;

#pragma unroll
	for (int i = 0; i < RL_BUCKET_WAYS; i++) {
		__u64 x = READ_ONCE_U64(set->way[i].tag) ^ tag;

		found |= ((((x | -x) >> 63) ^ 1) << i);
	}
	if (!found)
		return NULL;
	return &set->way[rl_ctz64(found) & (RL_BUCKET_WAYS - 1)].pool;
}

/* The pool of the keyed bucket of hash h (limit id, generation gen), if
 * rl_buckets holds it: for the tokens a CPU hands back, and refunds. */
static __always_inline struct rl_pool *rl_bucket_lookup(__u64 h, __u32 id, __u32 gen)
{
	struct rl_bucket_set *set;
	__u64 tag;
	__u32 si = rl_bucket_place(h, id, gen, &tag);

	set = bpf_map_lookup_elem(&rl_buckets, &si);
	return set ? rl_bucket_find(set, tag) : NULL;
}

/* How a claim ranks the bucket of way w (tag t): 0 when its limit or
 * generation is gone (taking it loses nothing), else 1 + how long until it
 * is full, on its limit's clock and params (1: full; an empty way ranks 0).
 * A key with a share of its own (rl_overrides) is judged by its limit's
 * params: the claim's choice is the only thing that depends on it. *now
 * and *pace_now are the two clocks, read when first needed. */
static __always_inline __u64 rl_bucket_owes(const struct rl_bucket_way *w, __u64 t, __u64 *now, __u64 *pace_now)
{
	__u32 id = t & 0xff;
	struct rl_limit *lim = bpf_map_lookup_elem(&rl_limits, &id);
	const struct rl_params *p;
	__u64 at, v, owed;

	if (!lim || lim->key_kind == RL_KEY_NONE || ((t >> 8) & 0xff) != (lim->gen & 0xff))
		return 0;
	if (lim->action == RL_ACTION_PACE) {
		if (!*pace_now)
			*pace_now = rl_pace_clock_read();
		at = *pace_now;
	} else {
		at = rl_now(now);
	}
	p = &lim->params[lim->active & 1];
	v = rl_vclock(p, at);
	owed = READ_ONCE_U64(w->pool.v_empty) + p->burst;
	return 1 + (owed > v ? rl_min(rl_accrual_ns(p, owed - v), ~0ULL - 2) : 0);
}

/* A new keyed bucket a check asked for (rl_bucket_pool) and its decider
 * makes (rl_bucket_claim) before it checks the limit again: the claim's
 * frame would not fit the verifier's 512 bytes of stack under the
 * check's. In the per-CPU scratch of the packet's decision. */
struct rl_claim {
	struct rl_bucket_key k;
	__u64 h;
	__u64 fresh;		/* the new pool's v_empty */
	__u32 state;		/* enum rl_claim_state */
	__u32 returning;	/* a returning key, for the counters */
};

enum rl_claim_state {
	RL_CLAIM_NONE,
	RL_CLAIM_ASKED,		/* k's bucket is to be made */
	RL_CLAIM_MADE,		/* made by this packet: its first lease notes it (rl_tomb_note) */
	RL_CLAIM_FAILED,	/* other CPUs took the ways first: fail open */
	RL_CLAIM_FOUND,		/* another CPU made it meanwhile */
};

/* Gives the claim's key a way of its set in rl_buckets, its pool at
 * fresh: an empty way or one whose limit is gone, else a full bucket's,
 * else the one that will be full soonest. Fails (RL_CLAIM_FAILED) when other
 * CPUs changed the chosen way first, RL_CAS_TRIES times; a key another CPU
 * made meanwhile is found by the check.
 *
 * The way is taken by a compare-and-swap of its tag; its pool is then
 * moved to fresh by another, which fails only if a CPU found the new tag
 * first and leased from the pool the evicted bucket left (off by one
 * lease). Then the key is written for user space, and counted.
 *
 * A global function: the verifier checks it once. */
__noinline int rl_bucket_claim(struct rl_claim *cl)
{
	struct rl_bucket_keyset *keys;
	struct rl_bucket_set *set;
	struct rl_limit_cpu *lc;
	__u64 tag, now = 0, pace_now = 0;
	__u32 si, id;

	if (!cl)
		return 0;
	cl->state = RL_CLAIM_FAILED;
	si = rl_bucket_place(cl->h, cl->k.limit, cl->k.gen, &tag);
	set = bpf_map_lookup_elem(&rl_buckets, &si);
	if (!set)
		return 0;
	for (int try = 0; try < RL_CAS_TRIES; try++) {
		__u64 best_ns = ~0ULL, seen = 0, old;
		int best = -1;

		for (int i = 0; i < RL_BUCKET_WAYS; i++) {
			__u64 t = READ_ONCE_U64(set->way[i].tag), ns;

			if (t == tag) {
				cl->state = RL_CLAIM_FOUND;
				return 0;
			}
			ns = t ? rl_bucket_owes(&set->way[i], t, &now, &pace_now) : 0;
			if (ns < best_ns) {
				best_ns = ns;
				best = i;
				seen = t;
				if (!ns)
					break;
			}
		}
		if (best < 0)
			return 0;
		best &= RL_BUCKET_WAYS - 1;
		if (__sync_val_compare_and_swap(&set->way[best].tag, seen, tag) != seen)
			continue;
		old = READ_ONCE_U64(set->way[best].pool.v_empty);
		__sync_val_compare_and_swap(&set->way[best].pool.v_empty, old, cl->fresh);
		keys = bpf_map_lookup_elem(&rl_bucket_keys, &si);
		if (keys)
			keys->key[best] = cl->k;
		id = cl->k.limit;
		lc = bpf_map_lookup_elem(&rl_percpu, &id);
		if (lc) {
			if (cl->returning)
				lc->stats.returned_keys++;
			else
				lc->stats.new_keys++;
		}
		cl->state = RL_CLAIM_MADE;
		return 0;
	}
	return 0;
}

/* Finds the shared pool of a keyed bucket, or asks for it to be made
 * (NULL, cl->state RL_CLAIM_ASKED: rl_no_pool, rl_check_claiming). A new pool
 * cancels the cache's (c, if any) wait for the old one (retry_ns), which an
 * eviction took away.
 * A new pool for a key this CPU's cache still holds (cached), or whose
 * fingerprint is still in its tombstone set, is a returning key; one its
 * tombstone says is not full yet starts as the evicted bucket would be now
 * (empty until full_at, then full at the limit's rate): v_empty =
 * V(full_at) - burst. Any other starts full: v_empty 0 is far below V.
 * *created says whether this packet made the pool. */
static __always_inline struct rl_pool *rl_bucket_pool(const struct rl_bucket_key *k, __u64 h,
						      struct rl_claim *cl, struct rl_cache *c,
						      bool cached, const struct rl_params *p, __u64 now,
						      bool *created)
{
	struct rl_bucket_set *set;
	struct rl_pool *pool;
	struct rl_tomb_set *t;
	__u64 tag, fresh = 0;
	__u32 fp, si, w = RL_TOMB_WAYS;

	si = rl_bucket_place(h, k->limit, k->gen, &tag);
	set = bpf_map_lookup_elem(&rl_buckets, &si);
	if (!set)
		return NULL;
	pool = rl_bucket_find(set, tag);
	if (pool) {
		if (cl->state == RL_CLAIM_MADE) {
			*created = true;
			if (c)
				c->retry_ns = 0;
		}
		return pool;
	}
	if (cl->state != RL_CLAIM_NONE)
		return NULL;	/* asked for once: fail open (or gone again at once) */

	t = rl_tomb_of(h, &fp);
	if (t) {
		w = rl_tomb_way(t, fp);
		if (w < RL_TOMB_WAYS) {
			__s32 o = rl_tomb_owes(t->way[w & 3].full_at, now);

			if (o > 0) {
				__u64 v = rl_vclock(p, now + ((__u64)o << RL_TOMB_SHIFT));

				fresh = v > p->burst ? v - p->burst : 0;
			}
		}
	}
	cl->k = *k;
	cl->h = h;
	cl->fresh = fresh;
	cl->returning = cached || w < RL_TOMB_WAYS;
	cl->state = RL_CLAIM_ASKED;
	return NULL;
}

/* The override of slot s's key k, or NULL. Looked up only when the
 * limit's override epoch moved since this CPU last looked (s->ov), or the
 * key had one then: a key without one costs a compare. */
static __always_inline struct rl_override *rl_key_override(struct rl_key_slot *s,
							    const struct rl_bucket_key *k,
							    const struct rl_limit *lim)
{
	__u32 epoch = lim->ov_epoch & 0x7fffffff;
	struct rl_override *ov;

	if (s->ov == epoch << 1)
		return NULL;
	ov = bpf_map_lookup_elem(&rl_overrides, k);
	s->ov = epoch << 1 | (ov != NULL);
	return ov;
}

/* Notes that the bucket of slot s turned cost units away at now, the tick
 * being 2^shift ns. The first time in a tick that follows a tick in which
 * it was short too, the key is hot: the tick before is recorded in rl_hot
 * with the units it turned away then (so at most once a tick, and never
 * for a key short in a single tick, as a flood of keys that each send a
 * packet or two is). Writes only this CPU's slot and ring, as the limits'
 * counters on the drop path do: no lookup, no shared line. */
static __always_inline void rl_hot_note(struct rl_key_slot *s, __u64 cost, __u64 now, __u32 shift)
{
	__u32 zero = 0, tick, i;
	struct rl_global_stats *g;
	struct rl_hot_rec *rec;

	if (!shift || shift > 40)
		return;
	tick = (__u32)(now >> shift);
	if (s->hot_tick == tick) {
		s->hot_short += cost;
		return;
	}
	if (s->hot_tick == tick - 1 && s->hot_short) {
		g = bpf_map_lookup_elem(&rl_global, &zero);
		if (g) {
			i = (__u32)g->hot_records & (RL_HOT_RING - 1);
			rec = bpf_map_lookup_elem(&rl_hot, &i);
			if (rec) {
				rec->key = s->key;
				rec->tick = s->hot_tick;
				rec->short_units = s->hot_short;
				g->hot_records++;
			}
		}
	}
	s->hot_tick = tick;
	s->hot_short = cost;
}

#endif /* RL_KEYCACHE_H */
