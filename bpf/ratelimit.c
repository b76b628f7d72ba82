//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * rlagent's data path: per-key token buckets at the node's share of each
 * global limit.
 *
 * NOTE: semantics.
 * - One decision function (rl_decide) for every program: parse, protect,
 *   classify -> check every matching limit without drawing -> commit all or
 *   none. The fast paths (one limit; several key-less limits holding tokens)
 *   are inline specialisations built from the same helpers.
 * - Programs: xdp_ratelimit (the uplinks' ingress), and one TC program per
 *   hook (enum rl_hook: tc_uplink_in, tc_uplink_out, tc_endpoint_in,
 *   tc_endpoint_out). Each enforces the limits of its hook only: a limit is
 *   enforced at exactly one hook, and all-or-nothing holds among the limits
 *   one program enforces on a packet. A TC program passes with TCX_NEXT
 *   (TC_ACT_UNSPEC under clsact), so that the programs after it still run,
 *   and drops with TC_ACT_SHOT.
 * - At TC a packet may be a GSO (egress) or GRO (ingress) skb of many
 *   segments: a packets limit is charged each segment, a bytes limit what
 *   the segments put on the wire (parse.h, rl_skb_wire), and the per-limit
 *   counters count the same.
 * - A connections limit is charged 1 by a TCP SYN without ACK, RST or FIN;
 *   its other packets are not its at all (neither charged nor counted),
 *   except an L4-unknown packet that could be TCP, which counts as one
 *   connection attempt.
 * - A packet that is not IP passes untouched; so does a packet a protect rule
 *   names (rl_protected), before any limit is looked at. An IP packet whose
 *   transport header cannot be found is L4-unknown (parse.h): it is charged
 *   to every limit whose match could include it. Every fragment is charged
 *   to the limits its datagram matches (frag.h).
 * - A packet matching several limits is admitted only if every matching
 *   limit with action drop admits it. A rejected packet draws tokens from
 *   none of them. A limit with action shadow never rejects: when its bucket
 *   is empty the packet is counted as shadow-dropped and draws nothing.
 *   At most RL_MAX_MATCH limits are checked on one packet; a packet that
 *   matches more is counted in match_overflow and, if one of the limits it
 *   was not checked against has action drop, dropped (fail_closed).
 * - A limit with action pace (TC egress) never uses the per-CPU caches:
 *   each of its packets reserves its cost from the pool (one
 *   compare-and-swap, rl_reserve), which is exact however packets spread
 *   over CPUs. While the pool holds the tokens (the burst) the packet leaves
 *   unstamped; after, it gets skb->tstamp = now + the time until its tokens
 *   accrue (monotonic ns, fq's time base), so that fq releases the limit's
 *   packets at its share. A packet already stamped later keeps the later
 *   time. A packet whose departure would be more than the limit's horizon
 *   ahead is dropped (horizon_drops) and reserves nothing; so is one another
 *   limit rejects: its reservation is given back.
 * - An over-limit packet costs the clock read and, at most once per chunk of
 *   refill per CPU, one look at the shared pool (see bucket.h).
 * - A key seen for the first time gets a full bucket (burst). A key whose
 *   bucket was evicted (its set of rl_buckets full: a new key takes an
 *   empty way, else a full bucket's, else the one full soonest) comes back
 *   where the bucket would be now, if its tombstone set remembers it
 *   (rl_tomb_note), and with a full bucket if not (owing nothing, or
 *   crowded out of a set of indebted keys): it gains at most one burst per
 *   eviction it is forgotten in. new_keys + returned_keys counts every
 *   bucket created, so creations minus live buckets is the number of
 *   evictions (maps.Evictions); returned_keys tells which creations were
 *   returns, as long as the key's cache slot or tombstone survived: exact
 *   under light churn, a lower bound under heavy churn.
 * - If a new key loses the race for its set's ways to other CPUs
 *   RL_CAS_TRIES times, its packet passes and pool_full is counted: the
 *   limiter fails open rather than dropping traffic it cannot account for.
 */
#include "include/common.h"
#include "include/parse.h"
#include "include/maps.h"
#include "include/frag.h"
#include "include/clock.h"
#include "include/bucket.h"
#include "include/reject.h"
#include "include/keycache.h"
#include "include/classify.h"

char __license[] SEC("license") = "Dual BSD/GPL";

/* Forces BTF for the types only user space uses, so bpf2go can export them. */
const enum rl_const *_rl_const __attribute__((unused));
const enum rl_action *_rl_action __attribute__((unused));
const enum rl_unit *_rl_unit __attribute__((unused));
const enum rl_key_kind *_rl_key_kind __attribute__((unused));
const enum rl_proto_class *_rl_proto_class __attribute__((unused));
const enum rl_direction *_rl_direction __attribute__((unused));
const enum rl_attach *_rl_attach __attribute__((unused));
const enum rl_hook *_rl_hook __attribute__((unused));
const enum rl_clock_kind *_rl_clock_kind __attribute__((unused));
const struct rl_global_stats *_rl_global_stats __attribute__((unused));
const enum rl_meta_state *_rl_meta_state __attribute__((unused));
const struct rl_reject_budget *_rl_reject_budget __attribute__((unused));
const enum rl_local_flag *_rl_local_flag __attribute__((unused));
const enum rl_ep_src_check *_rl_ep_src_check __attribute__((unused));

enum {
	MATCH_ADMIT = 0,	/* has the tokens; draws them if the packet passes */
	MATCH_REJECT = 1,	/* empty, action drop: the packet is dropped */
	MATCH_SHADOW = 2,	/* empty, action shadow: counted, draws nothing */
	MATCH_FAIL_OPEN = 3,	/* no room for a bucket: passes, draws nothing */
	MATCH_ADMIT_DRAWN = 4,	/* admitted, cost already drawn from the pool (a way just taken, rl_check_direct, rl_check_pace) */
	MATCH_HORIZON = 5,	/* paced, departure beyond the horizon: the packet is dropped */
	MATCH_REPLY = 6,	/* empty, action reject: the packet is dropped, and answered if it may be */
	MATCH_CLAIM = 7,	/* a new keyed bucket is to be made first (struct rl_claim): check again then */
};

/* Whether a decision drops the packet. */
static __always_inline bool rl_rejects(int state)
{
	return state == MATCH_REJECT || state == MATCH_HORIZON || state == MATCH_REPLY;
}

/* A packet's verdict: what rl_decide returns. */
enum rl_verdict {
	RL_PASS = 0,
	RL_DROP = 1,
	RL_ANSWER = 2,	/* dropped by a limit with action reject: answer it (reject.h) */
};

#define RL_NO_WAY 0xffff

/* One limit's decision for one packet. */
struct match {
	__u32 cost;
	__u16 slot;	/* rl_key_cache set x RL_KEY_CACHE_WAYS + way, or RL_NO_WAY */
	__u8 id;
	__u8 state;
	__u32 wait_ns;	/* paced: how long after pace_now the packet may leave */
	__u32 pad;
};

_Static_assert(RL_MAX_HORIZON_NS <= 0xffffffffU, "struct match holds a wait within the horizon in 32 bits");

_Static_assert(RL_MAX_LIMITS <= 256, "struct match holds a limit id in a byte");
_Static_assert(RL_KEY_CACHE_SETS * RL_KEY_CACHE_WAYS < RL_NO_WAY, "struct match holds a slot in 16 bits");

/* A packet's decisions, checked first and committed together. */
struct rl_decision {
	struct match m[RL_MAX_MATCH];
	__u64 now;	/* the clock, read at most once (rl_now); 0: not yet */
	__u64 pace_now;	/* the paced limits' clock (rl_pace_clock_read), idem */
	__u64 seed[2];	/* rl_config.seed, for the keyed buckets' hash */
	__u32 hot_shift; /* rl_config.hot_shift, for rl_hot_note */
	__u32 pad;
	struct rl_claim claim; /* the check's request for a new keyed bucket */
};

/* 0 -> the decisions of the packet this CPU is deciding. PERCPU scratch
 * space: on the stack, with the frames of rl_decide_all and rl_check, they
 * went past the verifier's 512 bytes. A program runs to its end on its CPU
 * before another packet's starts there (softirq, or bottom halves off on
 * egress), so one entry per CPU is enough. Not pinned: nothing outlives the
 * packet. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rl_decision);
} rl_scratch SEC(".maps");

/* Counters of rl_global_stats, by field. */
enum rl_global_field {
	G_MATCH_OVERFLOW,
	G_LEASE_CONTENDED,
	G_POOL_FULL,
	G_L4_UNKNOWN,
	G_FAIL_CLOSED,
	G_PROTECTED,
	G_FRAG_FIRST,
	G_FRAG_UNSEEN,
	G_CACHE_BYPASS,
	G_REJECT_RST,
	G_REJECT_ICMP,
	G_REJECT_BUDGET,
	G_REJECT_UNANSWERED,
	G_REJECT_DEST_BUDGET,
	G_REJECT_NOT_LOCAL,
	G_ENDPOINT_SRC_MISMATCH,
};

static __always_inline void rl_global_count(enum rl_global_field f)
{
	__u32 zero = 0;
	struct rl_global_stats *g = bpf_map_lookup_elem(&rl_global, &zero);

	if (!g)
		return;
	switch (f) {
	case G_MATCH_OVERFLOW: g->match_overflow++; break;
	case G_LEASE_CONTENDED: g->lease_contended++; break;
	case G_POOL_FULL: g->pool_full++; break;
	case G_L4_UNKNOWN: g->l4_unknown++; break;
	case G_FAIL_CLOSED: g->fail_closed++; break;
	case G_PROTECTED: g->protected_packets++; break;
	case G_FRAG_FIRST: g->frag_first++; break;
	case G_FRAG_UNSEEN: g->frag_unseen++; break;
	case G_CACHE_BYPASS: g->cache_bypass++; break;
	case G_REJECT_RST: g->reject_rst++; break;
	case G_REJECT_ICMP: g->reject_icmp++; break;
	case G_REJECT_BUDGET: g->reject_budget++; break;
	case G_REJECT_UNANSWERED: g->reject_unanswered++; break;
	case G_REJECT_DEST_BUDGET: g->reject_dest_budget++; break;
	case G_REJECT_NOT_LOCAL: g->reject_not_local++; break;
	case G_ENDPOINT_SRC_MISMATCH: g->endpoint_src_mismatch++; break;
	}
}

/* The helpers every path of the decision is built from. */

/* The limit behind a classifier bit, with this CPU's state of it; NULL for
 * a stale bit (a limit deleted since the classifier was read). */
static __always_inline struct rl_limit *rl_limit_of(__u32 id, struct rl_limit_cpu **lc)
{
	struct rl_limit *lim = bpf_map_lookup_elem(&rl_limits, &id);

	*lc = bpf_map_lookup_elem(&rl_percpu, &id);
	if (!lim || !*lc || !lim->gen)
		return NULL;
	return lim;
}

/* A limit's generation and parameter sequence, and those a CPU's cache
 * was filled under, each read as one word: equal if both are. */
_Static_assert(__builtin_offsetof(struct rl_limit, seq) == __builtin_offsetof(struct rl_limit, gen) + 4 &&
		       __builtin_offsetof(struct rl_limit, gen) % 8 == 0, "rl_limit_version reads gen and seq as one word");
_Static_assert(__builtin_offsetof(struct rl_cache, seq) == __builtin_offsetof(struct rl_cache, gen) + 4 &&
		       __builtin_offsetof(struct rl_cache, gen) % 8 == 0, "rl_cache_version reads gen and seq as one word");

static __always_inline __u64 rl_limit_version(const struct rl_limit *lim)
{
	return *(const __u64 *)&lim->gen;
}

static __always_inline __u64 rl_cache_version(const struct rl_cache *c)
{
	return *(const __u64 *)&c->gen;
}

/* What a packet costs a limit, in its units: its wire bytes, its segments,
 * or one connection attempt (only such packets reach a connections limit:
 * rl_classify). */
static __always_inline __u32 rl_cost(const struct rl_limit *lim, const struct pkt *p)
{
	if (lim->unit == RL_UNIT_BYTES)
		return p->len;
	return lim->unit == RL_UNIT_PACKETS ? p->segs : 1;
}

/* What an empty bucket means for the packet. */
static __always_inline int rl_over(const struct rl_limit *lim)
{
	if (lim->action == RL_ACTION_SHADOW)
		return MATCH_SHADOW;
	return lim->action == RL_ACTION_REJECT ? MATCH_REPLY : MATCH_REJECT;
}

/* Counts a packet's segments and wire bytes under its decision. */
static __always_inline void rl_count(struct rl_stats *st, int state, const struct pkt *p)
{
	switch (state) {
	case MATCH_ADMIT:
		st->admitted_packets += p->segs;
		st->admitted_bytes += p->len;
		break;
	case MATCH_REJECT:
	case MATCH_REPLY:
		st->dropped_packets += p->segs;
		st->dropped_bytes += p->len;
		break;
	case MATCH_SHADOW:
		st->shadow_packets += p->segs;
		st->shadow_bytes += p->len;
		break;
	}
}

/* The way a bucket that is not cached takes in set si: the least recently
 * used one, unless an earlier limit of this packet (m[0..i-1]) holds it,
 * whose tokens must stay where its check found them until the commit.
 * RL_KEY_CACHE_WAYS if this packet holds both. */
static __always_inline __u32 rl_key_victim(const struct rl_key_set *set,
					   const struct rl_decision *d, __u32 i, __u32 si)
{
	__u32 lru = (set->mru & 1) ^ 1;
	bool lru_held = false, other_held = false;

	for (int j = 0; j < RL_MAX_MATCH; j++) {
		if (j >= i)
			break;
		if (d->m[j].slot == si * RL_KEY_CACHE_WAYS + lru)
			lru_held = true;
		else if (d->m[j].slot == si * RL_KEY_CACHE_WAYS + (lru ^ 1))
			other_held = true;
	}
	if (!lru_held)
		return lru;
	if (!other_held)
		return lru ^ 1;
	return RL_KEY_CACHE_WAYS;
}

/* What a lease (or a draw) means for the packet: MATCH_ADMIT, or the
 * limit's over-limit state. */
static __always_inline int rl_lease_state(enum rl_lease_result r, const struct rl_limit *lim)
{
	if (r == RL_LEASE_OK)
		return MATCH_ADMIT;
	if (r == RL_LEASE_CONTENDED)
		rl_global_count(G_LEASE_CONTENDED);
	return rl_over(lim);
}

/* What a check that found no keyed bucket returns: MATCH_CLAIM the first
 * time (its decider makes the bucket and checks again), MATCH_FAIL_OPEN
 * (counted in pool_full) when the claim failed. */
static __always_inline int rl_no_pool(const struct rl_claim *cl)
{
	if (cl->state == RL_CLAIM_ASKED)
		return MATCH_CLAIM;
	rl_global_count(G_POOL_FULL);
	return MATCH_FAIL_OPEN;
}

/* A keyed bucket whose set this packet already holds both ways of: its cost
 * is drawn from the pool now, with no cache (rl_draw), and given back if
 * another limit rejects the packet (rl_refund). Costs a pool lookup and a
 * compare-and-swap per packet: only three or more keyed limits whose
 * buckets share a set get here. */
static __always_inline int rl_check_direct(const struct pkt *p, struct rl_decision *d, struct match *m,
					   const struct rl_limit *lim, const struct rl_key_ref *r)
{
	struct rl_pool *pool;
	int state;

	if (d->claim.state == RL_CLAIM_NONE)
		rl_global_count(G_CACHE_BYPASS);	/* once, not again after a claim */
	const struct rl_params *pp = &lim->params[lim->active & 1];
	bool created = false;

	struct rl_override *ov = NULL;

	if (lim->ov_epoch) {
		/* A lookup a packet, on this rare path only. */
		ov = bpf_map_lookup_elem(&rl_overrides, &r->k);
		if (ov)
			pp = &ov->params;
	}

	pool = rl_bucket_pool(&r->k, r->h, &d->claim, NULL, false, pp, rl_now(&d->now), &created);
	if (!pool)
		return rl_no_pool(&d->claim);
	state = rl_lease_state(rl_draw(pool, pp, m->cost, d->now), lim);
	if (state == MATCH_ADMIT) {
		rl_tomb_note(r->h, pool, pp, d->now, created);
		if (ov)
			__sync_fetch_and_add(&ov->leased, m->cost);
		return MATCH_ADMIT_DRAWN;
	}
	return state;
}

/* A paced limit's decision: reserves the packet's cost from the limit's
 * pool, or its key's, at once (rl_reserve; given back if another limit
 * rejects the packet) and notes how long the packet must wait. No per-CPU
 * cache: tokens a CPU held would leave back to back, unstamped. */
static __always_inline int rl_check_pace(const struct pkt *p, struct rl_decision *d, struct match *m,
					 const struct rl_limit *lim, struct rl_limit_cpu *lc)
{
	enum rl_lease_result r;
	struct rl_pool *pool;
	__u32 id = m->id;
	__u64 wait = 0, h = 0;
	bool created = false;

	if (lim->key_kind == RL_KEY_NONE) {
		pool = bpf_map_lookup_elem(&rl_pools, &id);
		if (!pool)
			return MATCH_FAIL_OPEN;
	} else {
		struct rl_bucket_key k = { .limit = id, .gen = lim->gen };

		rl_bucket_key(lim, p, &k);
		h = rl_hash(d->seed, id, lim->gen, k.addr);
		if (!d->pace_now)
			d->pace_now = rl_pace_clock_read();
		pool = rl_bucket_pool(&k, h, &d->claim, NULL, false, &lim->params[lim->active & 1], d->pace_now,
				      &created);
		if (!pool)
			return rl_no_pool(&d->claim);
	}
	if (!d->pace_now)
		d->pace_now = rl_pace_clock_read();
	r = rl_reserve(pool, &lim->params[lim->active & 1], m->cost, d->pace_now, lim->horizon_ns, &wait);
	switch (r) {
	case RL_LEASE_OK:
		if (h)
			rl_tomb_note(h, pool, &lim->params[lim->active & 1], d->pace_now, created);
		m->wait_ns = wait;
		return MATCH_ADMIT_DRAWN;
	case RL_LEASE_SHORT:
		return MATCH_HORIZON;
	default:
		rl_global_count(G_LEASE_CONTENDED);
		return MATCH_REJECT;
	}
}

/* Decides limit m[i] of a packet without drawing from this CPU's cache:
 * makes sure the cache holds the packet's cost, leasing if needed.
 *
 * A global (not static) function: the verifier checks it once, on its own,
 * instead of once per matching limit at every call site, which took the
 * unrolled caller past the 1M-instruction limit. */
__noinline int rl_check(const struct pkt *p, struct rl_decision *d, __u32 i)
{
	struct rl_limit_cpu *lc;
	struct rl_pool *pool = NULL;
	struct rl_key_slot *s = NULL;
	struct rl_override *ov = NULL;
	struct rl_limit *lim;
	struct rl_cache *c;
	struct match *m;
	const struct rl_params *pp;
	__u32 seq;
	__u64 h = 0;	/* a keyed bucket's hash */
	enum rl_lease_result lr;
	bool created = false, cached_way = true;
	__u32 id;

	if (!p || !d || i >= RL_MAX_MATCH)
		return MATCH_FAIL_OPEN;
	m = &d->m[i];
	id = m->id;
	m->slot = RL_NO_WAY;
	m->wait_ns = 0;	/* before any return: the scratch holds the last packet's */
	lim = rl_limit_of(id, &lc);
	if (!lim)
		return MATCH_FAIL_OPEN;	/* stale classifier bit: not a limit */
	m->cost = rl_cost(lim, p);
	if (lim->action == RL_ACTION_PACE)
		return rl_check_pace(p, d, m, lim, lc);
	pp = &lim->params[lim->active & 1];
	seq = lim->seq;

	if (lim->key_kind == RL_KEY_NONE) {
		c = &lc->cache;
	} else {
		struct rl_key_ref r = {};
		bool cached;
		__u32 w;

		if (!rl_key_find(lim, id, p, d->seed, &r))
			return MATCH_FAIL_OPEN;
		w = r.way;
		cached = w < RL_KEY_CACHE_WAYS;
		/* A way taken by the check before a claim is as new. */
		cached_way = cached && d->claim.state == RL_CLAIM_NONE;
		if (!cached) {
			w = rl_key_victim(r.set, d, i, r.si);
			if (w >= RL_KEY_CACHE_WAYS)
				return rl_check_direct(p, d, m, lim, &r);
		}
		w &= RL_KEY_CACHE_WAYS - 1;
		r.set->mru = w;
		s = &r.set->way[w];
		m->slot = r.si * RL_KEY_CACHE_WAYS + w;
		c = &s->cache;
		if (!cached) {
			/* Another bucket's way: hand its tokens back, if it
			 * leased any, and take it. Its hash is its tag. */
			if (((r.set->leased >> w) & 1) && c->tokens && s->key.gen) {
				struct rl_pool *old = rl_bucket_lookup(r.set->tag[w], s->key.limit, s->key.gen);

				if (old)
					rl_give_back(old, c->tokens);
			}
			r.set->tag[w] = r.h;
			r.set->leased &= ~(1U << w);
			s->key = r.k;
			c->tokens = 0;
			c->retry_ns = 0;
			c->gen = lim->gen;
			s->hot_tick = 0;
			s->hot_short = 0;
			s->ov = 0;
		}
		if (c->tokens >= m->cost)
			return MATCH_ADMIT;
		if (cached_way)
			r.set->leased |= 1U << w;	/* it leases below (or fails to) */
		ov = rl_key_override(s, &r.k, lim);
		if (ov) {
			/* A share of its own: its clock, and a seq that no
			 * limit's retry wait was computed under. */
			pp = &ov->params;
			seq = ov->seq | 0x80000000;
		}
		pool = rl_bucket_pool(&r.k, r.h, &d->claim, c, cached, pp, rl_now(&d->now), &created);
		if (!pool)
			return rl_no_pool(&d->claim);
		h = r.h;
	}

	if (c->gen != lim->gen) {
		/* Tokens of a deleted limit that had this id. */
		c->tokens = 0;
		c->retry_ns = 0;
		c->gen = lim->gen;
	}
	if (c->tokens >= m->cost)
		return MATCH_ADMIT;

	if (!pool) {
		pool = bpf_map_lookup_elem(&rl_pools, &id);
		if (!pool)
			return MATCH_FAIL_OPEN;
	}
	if (s && !cached_way) {
		/* A way just taken: the packet's cost straight from the bucket,
		 * and no chunk into the way, so that a key of one packet (a
		 * flood of sources) leaves the way owing its bucket nothing:
		 * the key that takes it next has nothing to give back, and
		 * reads no third line. The key's next packet leases. */
		lr = rl_draw(pool, pp, m->cost, rl_now(&d->now));
		if (ov && lr == RL_LEASE_OK)
			__sync_fetch_and_add(&ov->leased, m->cost);
	} else {
		__u64 held = c->tokens;

		lr = rl_lease(pool, c, pp, seq, m->cost, rl_now(&d->now));
		if (ov && lr == RL_LEASE_OK && c->tokens > held)
			__sync_fetch_and_add(&ov->leased, c->tokens - held);
	}
	if (h && lr == RL_LEASE_OK)
		rl_tomb_note(h, pool, pp, d->now, created);
	if (s && lr != RL_LEASE_OK && lim->hot)
		rl_hot_note(s, m->cost, d->now, d->hot_shift);
	if (s && !cached_way && lr == RL_LEASE_OK)
		return MATCH_ADMIT_DRAWN;
	return rl_lease_state(lr, lim);
}

/* rl_check, and again after making the keyed bucket it asked for
 * (MATCH_CLAIM): the claim runs here, in the decider's frame, not under
 * rl_check's. */
static __always_inline int rl_check_claiming(const struct pkt *p, struct rl_decision *d, __u32 i)
{
	int state;

	d->claim.state = RL_CLAIM_NONE;
	state = rl_check(p, d, i);
	if (state == MATCH_CLAIM) {
		/* Asked once: the second check makes no claim (rl_no_pool). */
		rl_bucket_claim(&d->claim);
		state = rl_check(p, d, i);
	}
	return state;
}

/* Gives a draw made at check time (rl_check_direct, rl_check_pace) back to
 * its pool: the packet was rejected by another limit. Best effort, as
 * rl_give_back. */
__noinline int rl_refund(const struct pkt *p, __u32 id, __u32 cost)
{
	struct rl_bucket_key k = {};
	struct rl_config *cfg;
	struct rl_pool *pool;
	struct rl_limit *lim;
	__u32 zero = 0;

	if (!p)
		return 0;
	lim = bpf_map_lookup_elem(&rl_limits, &id);
	if (!lim)
		return 0;
	if (lim->key_kind == RL_KEY_NONE) {
		pool = bpf_map_lookup_elem(&rl_pools, &id);	/* a paced limit's */
	} else {
		cfg = bpf_map_lookup_elem(&rl_cfg, &zero);
		if (!cfg)
			return 0;
		rl_bucket_key(lim, p, &k);
		pool = rl_bucket_lookup(rl_hash(cfg->seed, id, lim->gen, k.addr), id, lim->gen);
	}
	if (pool)
		rl_give_back(pool, cost);
	return 0;
}

/* Draws the tokens of an admitted packet and counts every decision. */
static __always_inline void rl_commit(const struct pkt *p, const struct match *m, bool pass)
{
	__u32 id = m->id;
	struct rl_limit_cpu *lc = bpf_map_lookup_elem(&rl_percpu, &id);

	if (!lc)
		return;
	switch (m->state) {
	case MATCH_ADMIT_DRAWN:
		if (!pass) {
			/* Dropped by another limit: draws nothing. */
			rl_refund(p, id, m->cost);
			return;
		}
		if (m->wait_ns) {
			struct rl_pace_stats *ps = bpf_map_lookup_elem(&rl_pace, &id);

			if (ps) {
				ps->paced_packets += p->segs;
				ps->paced_delay_ns += (__u64)m->wait_ns * p->segs;
				if (m->wait_ns > ps->paced_delay_max_ns)
					ps->paced_delay_max_ns = m->wait_ns;
			}
		}
		break;
	case MATCH_HORIZON: {
		struct rl_pace_stats *ps = bpf_map_lookup_elem(&rl_pace, &id);

		if (ps)
			ps->horizon_drops += p->segs;
		rl_count(&lc->stats, MATCH_REJECT, p);
		return;
	}
	case MATCH_ADMIT:
		if (!pass)
			return;	/* dropped by another limit: draws nothing */
		if (m->slot == RL_NO_WAY) {
			lc->cache.tokens -= m->cost;
		} else {
			__u32 si = m->slot / RL_KEY_CACHE_WAYS;
			struct rl_key_set *set = bpf_map_lookup_elem(&rl_key_cache, &si);

			if (!set)
				return;
			set->way[m->slot & (RL_KEY_CACHE_WAYS - 1)].cache.tokens -= m->cost;
		}
		break;
	}
	rl_count(&lc->stats, m->state == MATCH_ADMIT_DRAWN ? MATCH_ADMIT : m->state, p);
}

/* The general case: check every candidate without drawing, then commit all
 * or nothing. Returns the verdict (enum rl_verdict; a limit with action
 * reject that rejects makes it RL_ANSWER, whatever else rejects), and sets
 * *depart to the departure its paced limits gave it (0: none).
 *
 * A global function, verified once: inlined at each of its call sites it
 * took the program's verification from 70k to 890k instructions, near the
 * 1M limit. */
__noinline int rl_decide_all(const struct pkt *p, const struct rl_mask *cand, __u64 now, __u64 *depart)
{
	struct rl_decision *d;
	struct rl_walk it;
	struct rl_config *cfg;
	bool pass = true;
	__u32 n = 0, id, zero = 0, wait = 0;

	if (!p || !cand || !depart)
		return RL_PASS;
	cfg = bpf_map_lookup_elem(&rl_cfg, &zero);
	d = bpf_map_lookup_elem(&rl_scratch, &zero);
	if (!cfg || !d)
		return RL_PASS;
	it = rl_walk_start(cand);
	d->now = now;
	d->pace_now = 0;
	d->seed[0] = cfg->seed[0];
	d->seed[1] = cfg->seed[1];
	d->hot_shift = cfg->hot_shift;
	for (int i = 0; i < RL_MAX_MATCH; i++) {
		if (!rl_walk_next(&it, cand, &id))
			break;
		d->m[i].id = id;
		d->m[i].state = rl_check_claiming(p, d, i);
		if (rl_rejects(d->m[i].state))
			pass = false;
		n = i + 1;
	}
	if (n == RL_MAX_MATCH && rl_walk_rest_has(&it, cand, cand)) {
		/* More limits than are checked: a drop limit among the rest
		 * fails closed; shadow limits only miss their counts. */
		rl_global_count(G_MATCH_OVERFLOW);
		if (rl_walk_rest_has(&it, cand, &cfg->drop)) {
			rl_global_count(G_FAIL_CLOSED);
			pass = false;
		}
	}
	for (int i = 0; i < RL_MAX_MATCH; i++) {
		if (i >= n)
			break;
		rl_commit(p, &d->m[i], pass);
		if (d->m[i].wait_ns > wait)
			wait = d->m[i].wait_ns;
	}
	if (pass) {
		if (wait)
			*depart = d->pace_now + wait;
		return RL_PASS;
	}
	/* Whether a limit with action reject rejected it: looked up here,
	 * not carried through the check loop, where one more flag the
	 * verifier must track took 6.1's past its 1M instructions. */
	for (int i = 0; i < RL_MAX_MATCH; i++) {
		if (i >= n)
			break;
		if (d->m[i].state == MATCH_REPLY)
			return RL_ANSWER;
	}
	return RL_DROP;
}

/* The decision for a packet that matches exactly one limit: the common cases
 * inline, built from the same helpers as rl_check and rl_commit (the CPU's
 * cache holds the cost: draw it and admit; a key-less limit's CPU waits for
 * its pool to refill: reject without touching the pool). Everything else
 * (lease, new key, taking a cache way, stale generation) goes through
 * rl_check and rl_commit, as in rl_decide_all, without the walk. A paced
 * limit always goes that way: it never holds cached tokens (its caches'
 * generation is never its own: rl_check_pace does not lease). */
static __always_inline int rl_decide_one(const struct pkt *p, const struct rl_config *cfg,
					 __u32 id, __u64 now, __u64 *depart)
{
	struct rl_limit_cpu *lc;
	struct rl_limit *lim = rl_limit_of(id, &lc);
	struct rl_decision *d;
	struct rl_cache *c;
	__u32 cost, zero = 0;
	int state;

	if (!lim)
		return RL_PASS;	/* stale classifier bit: not a limit */
	cost = rl_cost(lim, p);

	if (lim->key_kind == RL_KEY_NONE) {
		c = &lc->cache;
		if (c->tokens < cost) {
			/* The pool was short: over limit until a chunk has
			 * accrued, if the wait was computed for this limit
			 * (generation) under its parameters (seq): one compare
			 * for the two. */
			if (rl_cache_version(c) != rl_limit_version(lim) || c->retry_ns <= rl_now(&now))
				goto slow;
			/* rl_over and rl_count, with the state known at each
			 * branch: no run-time switch on the drop path. */
			if (lim->action == RL_ACTION_SHADOW) {
				rl_count(&lc->stats, MATCH_SHADOW, p);
				return RL_PASS;
			}
			rl_count(&lc->stats, MATCH_REJECT, p);
			return lim->action == RL_ACTION_REJECT ? RL_ANSWER : RL_DROP;
		}
		if (c->gen != lim->gen)
			goto slow;
	} else {
		struct rl_key_ref r = {};

		if (!rl_key_find(lim, id, p, cfg->seed, &r))
			return RL_PASS;
		/* A keyed limit's over-limit path stays in rl_check: it must see
		 * a pool that was evicted meanwhile. */
		if (r.way >= RL_KEY_CACHE_WAYS)
			goto slow;
		c = &r.set->way[r.way & (RL_KEY_CACHE_WAYS - 1)].cache;
		if (c->gen != lim->gen || c->tokens < cost)
			goto slow;
		if (r.set->mru != r.way)
			r.set->mru = r.way;
	}
	c->tokens -= cost;
	rl_count(&lc->stats, MATCH_ADMIT, p);
	return RL_PASS;

slow:
	/* rl_decide_all with one candidate, without its walk. */
	d = bpf_map_lookup_elem(&rl_scratch, &zero);
	if (!d)
		return RL_PASS;
	d->now = now;
	d->pace_now = 0;
	d->seed[0] = cfg->seed[0];
	d->seed[1] = cfg->seed[1];
	d->hot_shift = cfg->hot_shift;
	d->m[0].id = id;
	state = rl_check_claiming(p, d, 0);
	d->m[0].state = state;
	rl_commit(p, &d->m[0], !rl_rejects(state));
	if (rl_rejects(state))
		return state == MATCH_REPLY ? RL_ANSWER : RL_DROP;
	if (d->m[0].wait_ns)
		*depart = d->pace_now + d->m[0].wait_ns;
	return RL_PASS;
}

/* The common case of several candidates, inline: at most RL_FAST_MATCH of
 * them, every one a key-less limit whose CPU cache holds the packet's cost
 * (never a paced one: see rl_decide_one). Then the packet passes and each
 * draws its cost. One walk: each candidate's state and cost are kept for the
 * draw, so that it is not found again (the id, the lookups and the loads
 * behind them are a chain of dependent loads per limit). Returns false,
 * having drawn nothing, if any candidate needs more (lease, keys, over
 * limit, more candidates): the caller then goes the general way. */
#define RL_FAST_MATCH 4

static __always_inline bool rl_decide_fast(const struct pkt *p, const struct rl_mask *cand)
{
	struct rl_limit_cpu *lcs[RL_FAST_MATCH];
	__u32 costs[RL_FAST_MATCH];
	struct rl_walk it = rl_walk_start(cand);
	__u32 id, n = 0;

	for (int i = 0; i < RL_FAST_MATCH + 1; i++) {
		struct rl_limit_cpu *lc;
		struct rl_limit *lim;

		if (!rl_walk_next(&it, cand, &id))
			break;
		if (i == RL_FAST_MATCH)
			return false;	/* more: decided on the general way */
		lim = rl_limit_of(id, &lc);
		if (!lim || lim->key_kind != RL_KEY_NONE || lc->cache.gen != lim->gen)
			return false;
		costs[i] = rl_cost(lim, p);
		if (lc->cache.tokens < costs[i])
			return false;
		lcs[i] = lc;
		n = i + 1;
	}
	for (int i = 0; i < RL_FAST_MATCH; i++) {
		if (i >= n)
			break;
		lcs[i]->cache.tokens -= costs[i];
		rl_count(&lcs[i]->stats, MATCH_ADMIT, p);
	}
	return true;
}

/* Resolves a fragment (frag.h) and counts it. A global function: its key
 * stays off the stack of the packet's main path, which the decision's
 * frames fill close to the verifier's 512 bytes. */
__noinline int rl_frag(struct pkt *p, __u64 *now)
{
	if (!p || !now)
		return 0;
	switch (rl_frag_resolve(p, now)) {
	case 1:
		rl_global_count(G_FRAG_FIRST);
		break;
	case 2:
		rl_global_count(G_FRAG_UNSEEN);
		break;
	}
	return 0;
}

/* The one decision for a parsed packet, for every program: the limits of
 * hook (enum rl_hook). Returns the verdict (enum rl_verdict); on RL_PASS,
 * *depart is the earliest departure its paced limits gave it, or left
 * alone. */
static __always_inline int rl_decide(struct pkt *p, __u32 hook, __u64 *depart)
{
	struct rl_config *cfg;
	struct rl_mask cand;
	__u64 now = 0;	/* the clock, read at most once, where needed */
	__u32 zero = 0;

	/* One test on the common path for two rare cases. */
	if (__builtin_expect(p->rare != 0, 0)) {
		if (p->frag != RL_FRAG_NONE)
			rl_frag(p, &now);
		if (p->l4_unknown)
			rl_global_count(G_L4_UNKNOWN);
	}

	cfg = bpf_map_lookup_elem(&rl_cfg, &zero);
	if (!cfg)
		return RL_PASS;
	if (__builtin_expect(cfg->protect_rules != 0, 0) && rl_protected(p, cfg, hook)) {
		rl_global_count(G_PROTECTED);
		return RL_PASS;
	}
	if (!rl_classify(p, cfg, hook, &cand))
		return RL_PASS;

	/* Exactly one candidate: the common case. */
	if (cand.w[0] ? !(cand.w[0] & (cand.w[0] - 1)) && !cand.w[1] : !(cand.w[1] & (cand.w[1] - 1)))
		return rl_decide_one(p, cfg, cand.w[0] ? rl_ctz64(cand.w[0]) : 64 + rl_ctz64(cand.w[1]), now,
				     depart);
	if (rl_decide_fast(p, &cand))
		return RL_PASS;
	return rl_decide_all(p, &cand, now, depart);
}

/* Counts a reply sent, of its kind. */
static __always_inline void rl_answered(__u32 kind)
{
	rl_global_count(kind == RL_REPLY_RST ? G_REJECT_RST : G_REJECT_ICMP);
}

/* The first test of a packet that a limit with action reject dropped: may
 * it be answered, by what the parser found, and has the budget a reply
 * left? Cheap, and before any byte is copied, since a flood the budget
 * cannot answer takes this path on every packet. Counts the packet when it
 * returns false. */
static __always_inline bool rl_reply_may(const struct pkt *p)
{
	if (!rl_reply_answerable(p)) {
		rl_global_count(G_REJECT_UNANSWERED);
		return false;
	}
	if (!rl_reject_open()) {
		rl_global_count(G_REJECT_BUDGET);
		return false;
	}
	return true;
}

/* The reply to a packet that a limit with action reject dropped, whose
 * first n bytes are in s->in: built in s->out (reject.h) and paid for from
 * the node's budget. Returns its kind, start in s->out and length, packed
 * (RL_REPLY_*_SHIFT, _MASK); 0 when the packet may not be answered or the
 * budget is spent, each counted. A global function: verified once, for
 * XDP and TC. */
__noinline int rl_reply_build(struct rl_reply_scratch *s, const struct pkt *p, __u32 n, __u32 ifindex)
{
	__u32 start = 0, kind = 0;
	int len;

	if (!s || !p)
		return 0;
	if (n < 14 || n > RL_REPLY_IN || !rl_reply_local(s, p, ifindex)) {
		rl_global_count(G_REJECT_NOT_LOCAL);
		return 0;
	}
	len = rl_reply_fill(s, p, n, &start, &kind);
	if (len <= 0 || len > RL_REPLY_L2MAX + RL_REPLY_L3MAX || start > RL_REPLY_L3) {
		rl_global_count(G_REJECT_UNANSWERED);
		return 0;
	}
	/* The reply's destination's share first: a destination that had
	 * its replies does not spend the node's. */
	if (!rl_reply_dest_spend(p)) {
		rl_global_count(G_REJECT_DEST_BUDGET);
		return 0;
	}
	if (!rl_reject_spend()) {
		rl_global_count(G_REJECT_BUDGET);
		return 0;
	}
	return kind << RL_REPLY_KIND_SHIFT | start << RL_REPLY_START_SHIFT | len;
}

/* Answers a packet that a limit with action reject dropped, at XDP: the
 * frame becomes the reply (reject.h), sent back out of the interface
 * (XDP_TX); or it is dropped, if it may not be answered or the budget is
 * spent. A global function: verified once, off the pass path. */
__noinline int rl_answer_xdp(struct xdp_md *ctx, const struct pkt *p)
{
	struct rl_reply_scratch *s;
	__u32 zero = 0, n, off;
	int r, len, cur, delta;

	if (!ctx || !p || !rl_reply_may(p))
		return XDP_DROP;	/* counted */
	s = bpf_map_lookup_elem(&rl_reply, &zero);
	if (!s)
		return XDP_DROP;
	cur = bpf_xdp_get_buff_len(ctx);
	n = cur < RL_REPLY_IN ? cur : RL_REPLY_IN;
	if (n < 14 || n > RL_REPLY_IN || bpf_xdp_load_bytes(ctx, 0, s->in, n))
		goto unanswered;
	r = rl_reply_build(s, p, n, ctx->ingress_ifindex);
	if (r <= 0)
		return XDP_DROP;	/* counted */
	len = r & RL_REPLY_LEN_MASK;
	off = (r >> RL_REPLY_START_SHIFT) & RL_REPLY_START_MASK;
	if (len < 14)
		goto unanswered;
	delta = len - cur;
	if (delta > 0 && bpf_xdp_adjust_head(ctx, -delta))
		goto unanswered;
	if (delta < 0 && bpf_xdp_adjust_tail(ctx, delta))
		goto unanswered;
	if (bpf_xdp_store_bytes(ctx, 0, s->out + off, len))
		goto unanswered;
	rl_answered(r >> RL_REPLY_KIND_SHIFT);
	return XDP_TX;
unanswered:
	rl_global_count(G_REJECT_UNANSWERED);
	return XDP_DROP;
}

SEC("xdp")
int xdp_ratelimit(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct pkt p = {};
	__u64 depart = 0;	/* no paced limit at XDP (validation) */

	rl_clock_tick();
	if (parse_packet(data, end, &p) < 0)
		return XDP_PASS;
	switch (rl_decide(&p, RL_HOOK_UPLINK_IN, &depart)) {
	case RL_PASS:
		return XDP_PASS;
	case RL_ANSWER:
		return rl_answer_xdp(ctx, &p);
	default:
		return XDP_DROP;
	}
}

#ifndef TCX_NEXT
#define TCX_NEXT -1	/* linux/bpf.h of 6.6+: run the next program */
#endif
_Static_assert(TCX_NEXT == TC_ACT_UNSPEC, "one verdict passes under tcx and under clsact");

/* Sets a paced packet's earliest departure, unless it already has a later
 * one (a TCP socket's own pacing, or another program's): a delivery time on
 * the monotonic clock, which fq releases it at and which survives
 * forwarding and namespace crossings (bpf_skb_set_tstamp, 5.18+). At TC
 * egress a tstamp is 0 or a delivery time: the stack clears receive
 * timestamps when it forwards a packet or moves it to another namespace.
 * (The tstamp_type is not compared: BPF_PROG_TEST_RUN can neither set nor
 * report it, so no test could see that comparison.) */
static __always_inline void rl_stamp(struct __sk_buff *skb, __u64 depart)
{
	if (skb->tstamp >= depart)
		return;
	bpf_skb_set_tstamp(skb, depart, BPF_SKB_TSTAMP_DELIVERY_MONO);
}

/* Answers a packet that a limit with action reject dropped, at TC: only at
 * an uplink's ingress (bpf_redirect back out of the interface, the reply's
 * checksums left for the stack to trust: CHECKSUM_NONE). At an endpoint's
 * interface the packet has been through DNAT: a reply from there would
 * carry the endpoint's address, not the Service's the client knows, so it
 * is dropped, counted unanswered. */
__noinline int rl_answer_tc(struct __sk_buff *skb, const struct pkt *p, __u32 hook)
{
	struct rl_reply_scratch *s;
	__u32 zero = 0, n, cur, off;
	int r, len;

	if (!skb || !p)
		return TC_ACT_SHOT;
	if (hook != RL_HOOK_UPLINK_IN)
		goto unanswered;
	if (!rl_reply_may(p))
		return TC_ACT_SHOT;	/* counted */
	s = bpf_map_lookup_elem(&rl_reply, &zero);
	if (!s)
		return TC_ACT_SHOT;
	cur = skb->len;
	n = cur < RL_REPLY_IN ? cur : RL_REPLY_IN;
	if (n < 14 || n > RL_REPLY_IN || bpf_skb_load_bytes(skb, 0, s->in, n))
		goto unanswered;
	r = rl_reply_build(s, p, n, skb->ifindex);
	if (r <= 0)
		return TC_ACT_SHOT;	/* counted */
	len = r & RL_REPLY_LEN_MASK;
	off = (r >> RL_REPLY_START_SHIFT) & RL_REPLY_START_MASK;
	if (len < 14)
		goto unanswered;
	if (bpf_skb_change_tail(skb, len, 0) || bpf_skb_store_bytes(skb, 0, s->out + off, len, 0))
		goto unanswered;
	bpf_csum_level(skb, BPF_CSUM_LEVEL_RESET);
	rl_answered(r >> RL_REPLY_KIND_SHIFT);
	return bpf_redirect(skb->ifindex, 0);
unanswered:
	rl_global_count(G_REJECT_UNANSWERED);
	return TC_ACT_SHOT;
}

/* Whether an IPv6 source is link-local (fe80::/10) or unspecified (::):
 * what neighbour discovery and duplicate address detection send from, and
 * what the node never forwards. */
static __always_inline bool rl_src6_onlink(const __u32 *a)
{
	if ((a[0] & bpf_htonl(0xffc00000)) == bpf_htonl(0xfe800000))
		return true;
	return (a[0] | a[1] | a[2] | a[3]) == 0;
}

/* At an endpoint's egress (the TC ingress of its host-side interface),
 * the packet's source as the limits see it is the endpoint's own address,
 * whatever the pod wrote: a pod that can write raw packets (CAP_NET_RAW)
 * must neither leave its limits by forging its source nor draw on a
 * neighbour's by forging the neighbour's. A source that is one of the
 * addresses behind this interface (rl_ep_src) stays. Any other is replaced
 * by the interface's lowest address of its family (all zero if it has
 * none), counted (endpoint_src_mismatch), and with ep_src_check drop,
 * dropped. IPv6 link-local and unspecified sources (neighbour discovery;
 * the node never forwards them) are replaced but neither counted nor
 * dropped. An interface the agent wrote nothing for (no entry of family 0)
 * is not checked: the agent writes an endpoint's addresses before it
 * attaches to the endpoint's interface. Returns false to drop the packet. */
static __always_inline bool rl_endpoint_source(const struct __sk_buff *skb, struct pkt *p)
{
	struct rl_ep_key k = { .ifindex = skb->ifindex, .family = p->family };
	struct rl_ep_addr *own;
	struct rl_config *cfg;
	__u32 zero = 0;
	bool onlink;

	if (p->family != 4 && p->family != 6)
		return true;	/* the IP header was not reached: no source to check */
	/* As rl_local_key: IPv4 in a[3] alone (the parser keeps it mapped,
	 * ::ffff:a.b.c.d). An all-zero address is the key of the interface's
	 * entry of the family, never one of its addresses. */
	if (p->family == 4) {
		k.a[3] = p->src[3];
	} else {
		k.a[0] = p->src[0];
		k.a[1] = p->src[1];
		k.a[2] = p->src[2];
		k.a[3] = p->src[3];
	}
	if ((k.a[0] | k.a[1] | k.a[2] | k.a[3]) && bpf_map_lookup_elem(&rl_ep_src, &k))
		return true;
	onlink = p->family == 6 && rl_src6_onlink(p->src);
	__builtin_memset(k.a, 0, sizeof(k.a));
	own = bpf_map_lookup_elem(&rl_ep_src, &k);
	if (own) {
		__builtin_memcpy(k.a, own->a, sizeof(k.a));
	} else {
		k.family = 0;
		if (!bpf_map_lookup_elem(&rl_ep_src, &k))
			return true;	/* not an endpoint's interface the agent knows */
	}
	if (p->family == 4) {
		p->src[3] = k.a[3];
	} else {
		p->src[0] = k.a[0];
		p->src[1] = k.a[1];
		p->src[2] = k.a[2];
		p->src[3] = k.a[3];
	}
	if (onlink)
		return true;
	rl_global_count(G_ENDPOINT_SRC_MISMATCH);
	cfg = bpf_map_lookup_elem(&rl_cfg, &zero);
	return !cfg || cfg->ep_src_check != RL_EP_SRC_DROP;
}

/* The TC programs: one per hook, the hook a constant so that the verifier
 * keeps one hook's path. The same skb program works under tcx and as a
 * clsact direct-action filter. */
static __always_inline int rl_tc(struct __sk_buff *skb, __u32 hook)
{
	struct pkt p = {};
	__u64 depart = 0;

	rl_clock_tick();
	if (rl_parse_skb(skb, &p) < 0)
		return TCX_NEXT;
	rl_skb_wire(skb, &p);
	if (hook == RL_HOOK_UPLINK_OUT)
		p.sk = skb->sk != NULL;
	if (hook == RL_HOOK_ENDPOINT_OUT && !rl_endpoint_source(skb, &p))
		return TC_ACT_SHOT;
	switch (rl_decide(&p, hook, &depart)) {
	case RL_PASS:
		break;
	case RL_ANSWER:
		return rl_answer_tc(skb, &p, hook);
	default:
		return TC_ACT_SHOT;
	}
	if (__builtin_expect(depart != 0, 0))
		rl_stamp(skb, depart);
	return TCX_NEXT;
}

/* An uplink's TC ingress: the uplink's ingress limits where XDP cannot be
 * used. */
SEC("tc")
int tc_uplink_in(struct __sk_buff *skb)
{
	return rl_tc(skb, RL_HOOK_UPLINK_IN);
}

/* An uplink's TC egress. */
SEC("tc")
int tc_uplink_out(struct __sk_buff *skb)
{
	return rl_tc(skb, RL_HOOK_UPLINK_OUT);
}

/* Traffic into a local endpoint: the TC egress of its host-side veth (or
 * the ingress of its own interface, where a CNI redirects past the host
 * side). */
SEC("tc")
int tc_endpoint_in(struct __sk_buff *skb)
{
	return rl_tc(skb, RL_HOOK_ENDPOINT_IN);
}

/* Traffic out of a local endpoint: the TC ingress of its host-side veth. */
SEC("tc")
int tc_endpoint_out(struct __sk_buff *skb)
{
	return rl_tc(skb, RL_HOOK_ENDPOINT_OUT);
}

/* Reads the data path's clock into rl_clock_probe_out, for user space to set
 * a limit's virtual clock base on the same time line. Run with test_run. */
__u64 rl_clock_probe_out;
/* The same for the paced limits' clock (rl_pace_clock_read). */
__u64 rl_pace_probe_out;

SEC("xdp")
int xdp_clock_probe(struct xdp_md *ctx)
{
	rl_clock_probe_out = rl_clock_read();
	rl_pace_probe_out = rl_pace_clock_read();
	return XDP_PASS;
}
