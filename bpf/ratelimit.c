//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * rlagent's data path: per-key token buckets at the node's share of each
 * global limit.
 *
 * NOTE: semantics.
 * - A packet that does not parse, or matches no limit, passes untouched.
 * - A packet matching several limits (at most RL_MAX_MATCH are enforced; more
 *   are counted in match_overflow) is admitted only if every matching limit
 *   with action drop admits it. A rejected packet draws tokens from none of
 *   them. A limit with action shadow never rejects: when its bucket is empty
 *   the packet is counted as shadow-dropped and draws nothing from it.
 * - An over-limit packet costs the clock read and, at most once per chunk of
 *   refill per CPU, one look at the shared pool (see bucket.h).
 * - A key seen for the first time gets a full bucket (burst). A key whose
 *   bucket was evicted (rl_buckets full) comes back with a full bucket too:
 *   it gains at most one burst per eviction. new_keys + returned_keys counts
 *   every bucket created, so creations minus live buckets is the exact
 *   number of evictions (maps.Evictions); returned_keys tells which
 *   creations were returns, as long as the key's cache slot or tombstone
 *   survived: exact under light churn, a lower bound under heavy churn.
 * - If rl_buckets cannot take a new key at all, the packet passes and
 *   pool_full is counted: the limiter fails open rather than dropping
 *   traffic it cannot account for.
 */
#include "include/common.h"
#include "include/parse.h"
#include "include/maps.h"
#include "include/clock.h"
#include "include/bucket.h"

char __license[] SEC("license") = "Dual BSD/GPL";

/* Size of rl_tombstones minus one; set by user space with the map's size. */
volatile const __u32 rl_tombstone_mask = 262143;

/* Forces BTF for the types only user space uses, so bpf2go can export them. */
const enum rl_const *_rl_const __attribute__((unused));
const enum rl_action *_rl_action __attribute__((unused));
const enum rl_unit *_rl_unit __attribute__((unused));
const enum rl_key_kind *_rl_key_kind __attribute__((unused));
const enum rl_proto_class *_rl_proto_class __attribute__((unused));
const enum rl_direction *_rl_direction __attribute__((unused));
const enum rl_clock_kind *_rl_clock_kind __attribute__((unused));
const struct rl_global_stats *_rl_global_stats __attribute__((unused));

enum {
	MATCH_ADMIT = 0,	/* has the tokens; draws them if the packet passes */
	MATCH_REJECT = 1,	/* empty, action drop: the packet is dropped */
	MATCH_SHADOW = 2,	/* empty, action shadow: counted, draws nothing */
	MATCH_FAIL_OPEN = 3,	/* no room for a bucket: passes, draws nothing */
};

struct match {
	__u32 id;
	__u32 slot;		/* rl_key_cache set x RL_KEY_CACHE_WAYS + way, or RL_NO_SLOT */
	__u32 cost;
	__u32 state;
};

/* The hash of a keyed bucket: picks its cache set, its tombstone and the
 * tombstone's fingerprint. One multiply on the packet's path: the address
 * words are folded into 64 bits and multiplied by an odd constant, whose
 * high bits depend on every bit of the product, then folded down; the limit
 * and generation, mixed in first, put the same address's buckets of
 * different limits in different sets. Not keyed: a sender who picks
 * addresses that share a set makes them take each other's ways (each taker
 * pays a pool lookup), which costs time, not accuracy. */
static __always_inline __u64 rl_hash(__u32 id, __u32 gen, const __u32 a[4])
{
	__u64 x = (((__u64)(a[0] ^ a[2]) << 32) | (a[1] ^ a[3])) ^
		  ((((__u64)id << 32) | gen) * 0x9E3779B97F4A7C15ULL);
	__u64 h = x * 0xFF51AFD7ED558CCDULL;

	return h ^ (h >> 32);
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
		if (p->family == 4) {
			k->addr[2] = p->src[2];
			k->addr[3] = p->src[3] & lim->prefix4;
		} else {
			k->addr[0] = p->src[0] & lim->prefix6[0];
			k->addr[1] = p->src[1] & lim->prefix6[1];
			k->addr[2] = p->src[2] & lim->prefix6[2];
			k->addr[3] = p->src[3] & lim->prefix6[3];
		}
		break;
	case RL_KEY_DST_PORT:
		k->addr[0] = p->pclass;
		k->addr[1] = p->has_ports ? p->dport : 0x10000;
		break;
	}
}

static __always_inline bool rl_key_equal(const struct rl_bucket_key *a,
					 const struct rl_bucket_key *b)
{
	return !((a->limit ^ b->limit) | (a->gen ^ b->gen) |
		 (a->addr[0] ^ b->addr[0]) | (a->addr[1] ^ b->addr[1]) |
		 (a->addr[2] ^ b->addr[2]) | (a->addr[3] ^ b->addr[3]));
}

/* Finds or creates the shared pool of a keyed bucket. A new pool cancels
 * the cache's wait for the old one (retry_ns), which an eviction took away.
 * A new pool for a key this CPU's cache still holds (cached), or whose
 * fingerprint is still in its tombstone slot, is a returning key. */
static __always_inline struct rl_pool *rl_bucket_pool(const struct rl_bucket_key *k, __u64 h,
						      struct rl_stats *st, struct rl_cache *c,
						      bool cached)
{
	struct rl_pool *pool = bpf_map_lookup_elem(&rl_buckets, k);
	struct rl_pool fresh = {};
	__u32 tidx, fp;
	__u32 *tomb;

	if (pool)
		return pool;

	/* v_empty 0 is far below V: the new bucket starts full. */
	if (bpf_map_update_elem(&rl_buckets, k, &fresh, BPF_NOEXIST) == 0) {
		c->retry_ns = 0;
		tidx = (h >> 40) & rl_tombstone_mask;
		fp = (__u32)h | 1;
		tomb = bpf_map_lookup_elem(&rl_tombstones, &tidx);
		if (cached || (tomb && *tomb == fp)) {
			st->returned_keys++;
		} else {
			st->new_keys++;
		}
		if (tomb)
			*tomb = fp;
	}
	return bpf_map_lookup_elem(&rl_buckets, k);
}

static __always_inline void rl_global_count(int field)
{
	__u32 zero = 0;
	struct rl_global_stats *g = bpf_map_lookup_elem(&rl_global, &zero);

	if (!g)
		return;
	if (field == 0)
		g->match_overflow++;
	else if (field == 1)
		g->lease_contended++;
	else
		g->pool_full++;
}

/* Finds a keyed bucket's way in this CPU's cache set. Returns the way
 * holding key k, or RL_KEY_CACHE_WAYS if none does. */
static __always_inline __u32 rl_key_way(const struct rl_key_set *set, const struct rl_bucket_key *k)
{
	if (rl_key_equal(&set->way[0].key, k))
		return 0;
	if (rl_key_equal(&set->way[1].key, k))
		return 1;
	return RL_KEY_CACHE_WAYS;
}

_Static_assert(RL_KEY_CACHE_WAYS == 2, "rl_key_way compares two ways");

/* Decides one limit for one packet without drawing: makes sure this CPU's
 * cache holds the packet's cost, leasing if needed.
 *
 * A global (not static) function: the verifier checks it once, on its own,
 * instead of once per matching limit at every call site, which took the
 * unrolled caller past the 1M-instruction limit. */
__noinline int rl_check(const struct pkt *p, struct match *m, __u64 *now)
{
	const struct rl_params *params;
	struct rl_limit_cpu *lc;
	struct rl_pool *pool = NULL;
	struct rl_limit *lim;
	struct rl_cache *c;
	__u64 h = 0;
	__u32 id;

	if (!p || !m || !now)
		return MATCH_FAIL_OPEN;
	id = m->id;
	lim = bpf_map_lookup_elem(&rl_limits, &id);
	lc = bpf_map_lookup_elem(&rl_percpu, &id);
	if (!lim || !lc || !lim->gen)
		return MATCH_FAIL_OPEN;	/* stale classifier bit: not a limit */
	m->cost = lim->unit == RL_UNIT_BYTES ? p->len : 1;
	m->slot = RL_NO_SLOT;

	if (lim->key_kind == RL_KEY_NONE) {
		c = &lc->cache;
	} else {
		struct rl_bucket_key k = { .limit = id, .gen = lim->gen };
		struct rl_key_set *set;
		struct rl_key_slot *s;
		__u32 si, w;
		bool cached;

		rl_bucket_key(lim, p, &k);
		h = rl_hash(id, lim->gen, k.addr);
		si = h & (RL_KEY_CACHE_SETS - 1);
		set = bpf_map_lookup_elem(&rl_key_cache, &si);
		if (!set)
			return MATCH_FAIL_OPEN;
		w = rl_key_way(set, &k);
		cached = w < RL_KEY_CACHE_WAYS;
		if (!cached)
			w = !set->mru;	/* the least recently used way */
		w &= RL_KEY_CACHE_WAYS - 1;
		set->mru = w;
		s = &set->way[w];
		m->slot = si * RL_KEY_CACHE_WAYS + w;
		c = &s->cache;
		if (!cached) {
			/* Another bucket's way: hand its tokens back and take it. */
			if (c->tokens && s->key.gen) {
				struct rl_pool *old = bpf_map_lookup_elem(&rl_buckets, &s->key);

				if (old)
					rl_give_back(old, c->tokens);
			}
			s->key = k;
			c->tokens = 0;
			c->retry_ns = 0;
			c->gen = lim->gen;
		}
		if (c->tokens >= m->cost)
			return MATCH_ADMIT;
		pool = rl_bucket_pool(&k, h, &lc->stats, c, cached);
		if (!pool) {
			rl_global_count(2);
			return MATCH_FAIL_OPEN;
		}
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
	params = &lim->params[lim->active & 1];
	switch (rl_lease(pool, c, params, lim->seq, m->cost, rl_now(now))) {
	case RL_LEASE_OK:
		return MATCH_ADMIT;
	case RL_LEASE_CONTENDED:
		rl_global_count(1);
		break;
	default:
		break;
	}
	return lim->action == RL_ACTION_SHADOW ? MATCH_SHADOW : MATCH_REJECT;
}

/* Draws the tokens of an admitted packet and counts it. */
static __always_inline void rl_commit(const struct match *m, __u32 len, bool pass)
{
	__u32 id = m->id;
	struct rl_limit_cpu *lc = bpf_map_lookup_elem(&rl_percpu, &id);

	if (!lc)
		return;
	switch (m->state) {
	case MATCH_ADMIT:
		if (!pass)
			return;	/* dropped by another limit: draws nothing */
		if (m->slot == RL_NO_SLOT) {
			lc->cache.tokens -= m->cost;
		} else {
			__u32 si = m->slot / RL_KEY_CACHE_WAYS;
			struct rl_key_set *set = bpf_map_lookup_elem(&rl_key_cache, &si);

			if (!set)
				return;
			set->way[m->slot & (RL_KEY_CACHE_WAYS - 1)].cache.tokens -= m->cost;
		}
		lc->stats.admitted_packets++;
		lc->stats.admitted_bytes += len;
		break;
	case MATCH_REJECT:
		lc->stats.dropped_packets++;
		lc->stats.dropped_bytes += len;
		break;
	case MATCH_SHADOW:
		lc->stats.shadow_packets++;
		lc->stats.shadow_bytes += len;
		break;
	}
}

/* Narrows the candidates to the limits whose source (destination) CIDRs
 * contain the packet's address, for the candidates restricted by them. A
 * missing prefix leaves src/dst zero: the restricted limits drop out. */
/* The LPM entry of addr in the IPv4 or the IPv6 trie of one side, or an
 * empty set. */
static __always_inline struct rl_mask rl_prefix_limits(void *trie4, void *trie6, __u8 family,
						       const __u32 addr[4])
{
	struct rl_mask none = {}, *m;

	if (family == 4) {
		struct rl_lpm4 k = { .prefixlen = 32, .addr = addr[3] };
		m = bpf_map_lookup_elem(trie4, &k);
	} else {
		struct rl_lpm6 k = { .prefixlen = 128 };
		__builtin_memcpy(k.addr, addr, sizeof(k.addr));
		m = bpf_map_lookup_elem(trie6, &k);
	}
	return m ? *m : none;
}

static __always_inline void rl_classify_cidr(const struct pkt *p, const struct rl_config *cfg,
					     bool need_src, bool need_dst, struct rl_mask *out)
{
	struct rl_mask src = {}, dst = {};

	if (need_src)
		src = rl_prefix_limits(&rl_src4, &rl_src6, p->family, p->src);
	if (need_dst)
		dst = rl_prefix_limits(&rl_dst4, &rl_dst6, p->family, p->dst);

#pragma unroll
	for (int w = 0; w < RL_MASK_WORDS; w++) {
		if (need_src)
			out->w[w] &= src.w[w] | ~cfg->src_cidr.w[w];
		if (need_dst)
			out->w[w] &= dst.w[w] | ~cfg->dst_cidr.w[w];
	}
}

/* The packet's candidate limits: one array entry by protocol and port (user
 * space ORs the class's port-less limits into every port entry, so that a
 * packet with ports needs no rl_proto_any lookup), ANDed with the
 * direction's limits; then source and destination prefixes, only if a
 * candidate is restricted by them. */
static __always_inline bool rl_classify(const struct pkt *p, __u32 dir, struct rl_mask *out)
{
	__u32 zero = 0, idx;
	struct rl_config *cfg = bpf_map_lookup_elem(&rl_cfg, &zero);
	__u64 need_src = 0, need_dst = 0;
	struct rl_mask *m;

	if (!cfg || dir >= RL_DIRECTIONS)
		return false;
	/* Two call sites, kept apart (barrier_var): merged into one call with
	 * either map, the verifier could no longer inline the array lookup. */
	if (p->has_ports) {	/* TCP or UDP */
		idx = p->pclass * RL_PORT_SPACE + p->dport;
		m = bpf_map_lookup_elem(&rl_ports, &idx);
		barrier_var(m);
	} else {
		idx = p->pclass;
		m = bpf_map_lookup_elem(&rl_proto_any, &idx);
		barrier_var(m);
	}
	if (!m)
		return false;

#pragma unroll
	for (int w = 0; w < RL_MASK_WORDS; w++) {
		__u64 c = m->w[w] & cfg->dir[dir].w[w];

		out->w[w] = c;
		need_src |= c & cfg->src_cidr.w[w];
		need_dst |= c & cfg->dst_cidr.w[w];
	}
	if (need_src | need_dst)
		rl_classify_cidr(p, cfg, need_src, need_dst, out);
	return (out->w[0] | out->w[1]) != 0;
}

/* Index of the lowest set bit of x (x != 0): de Bruijn multiply and a table
 * in .rodata (one load), rather than six compare-and-branch steps. */
static const __u8 rl_debruijn[64] = {
	0, 1, 56, 2, 57, 49, 28, 3, 61, 58, 42, 50, 38, 29, 17, 4,
	62, 47, 59, 36, 45, 43, 51, 22, 53, 39, 33, 30, 24, 18, 12, 5,
	63, 55, 48, 27, 60, 41, 37, 16, 46, 35, 44, 21, 52, 32, 23, 11,
	54, 26, 40, 15, 34, 20, 31, 10, 25, 14, 19, 9, 13, 8, 7, 6,
};

_Static_assert(RL_MASK_WORDS == 2, "rl_classify and rl_enforce read two mask words");

static __always_inline __u32 rl_ctz64(__u64 x)
{
	return rl_debruijn[((x & -x) * 0x03F79D71B4CA8B09ULL) >> 58];
}

/* The whole decision for a packet that matches exactly one limit, with the
 * common cases inlined: the CPU's cache holds the cost (draw it and admit),
 * or a key-less limit's CPU waits for its pool to refill (reject without
 * touching the pool). Everything else (lease, new key, taking a cache way, stale
 * generation) goes through rl_check and rl_commit, as in the general case. */
static __always_inline bool rl_enforce_one(const struct pkt *p, __u32 id, __u64 *now)
{
	struct rl_limit_cpu *lc = bpf_map_lookup_elem(&rl_percpu, &id);
	struct rl_limit *lim = bpf_map_lookup_elem(&rl_limits, &id);
	struct match m = { .id = id };
	struct rl_cache *c;
	__u32 cost;

	if (!lim || !lc || !lim->gen)
		return true;	/* stale classifier bit: not a limit */
	cost = lim->unit == RL_UNIT_BYTES ? p->len : 1;

	if (lim->key_kind == RL_KEY_NONE) {
		c = &lc->cache;
		if (c->gen != lim->gen)
			goto slow;
		if (c->tokens < cost) {
			/* The pool was short: drop until a chunk has accrued. */
			if (c->seq != lim->seq || c->retry_ns <= rl_now(now))
				goto slow;
			if (lim->action == RL_ACTION_SHADOW) {
				lc->stats.shadow_packets++;
				lc->stats.shadow_bytes += p->len;
				return true;
			}
			lc->stats.dropped_packets++;
			lc->stats.dropped_bytes += p->len;
			return false;
		}
	} else {
		struct rl_bucket_key k = { .limit = id, .gen = lim->gen };
		struct rl_key_set *set;
		__u32 si, w;

		rl_bucket_key(lim, p, &k);
		si = rl_hash(id, lim->gen, k.addr) & (RL_KEY_CACHE_SETS - 1);
		set = bpf_map_lookup_elem(&rl_key_cache, &si);
		if (!set)
			return true;
		w = rl_key_way(set, &k);
		/* A keyed limit's over-limit path stays in rl_check: it must see
		 * a pool that was evicted meanwhile. */
		if (w >= RL_KEY_CACHE_WAYS)
			goto slow;
		c = &set->way[w].cache;
		if (c->gen != lim->gen || c->tokens < cost)
			goto slow;
		if (set->mru != w)
			set->mru = w;
	}
	c->tokens -= cost;
	lc->stats.admitted_packets++;
	lc->stats.admitted_bytes += p->len;
	return true;

slow:
	m.state = rl_check(p, &m, now);
	rl_commit(&m, p->len, m.state != MATCH_REJECT);
	return m.state != MATCH_REJECT;
}

/* Walks a candidate set, lowest id first. RL_MASK_WORDS is 2: the walk
 * moves to the second word once, when the first is spent. */
struct rl_walk {
	__u64 bits;
	__u32 w;
};

static __always_inline struct rl_walk rl_walk_start(const struct rl_mask *cand)
{
	struct rl_walk it = { .bits = cand->w[0] };

	return it;
}

static __always_inline bool rl_walk_next(struct rl_walk *it, const struct rl_mask *cand, __u32 *id)
{
	if (!it->bits) {
		if (it->w || !cand->w[1])
			return false;
		it->w = 1;
		it->bits = cand->w[1];
	}
	*id = it->w * 64 + rl_ctz64(it->bits);
	it->bits &= it->bits - 1;
	return true;
}

/* The common case of several candidates, inlined: every one is a key-less
 * limit whose CPU cache holds the packet's cost. Then the packet passes and
 * each draws its cost. Returns false, having drawn nothing, if any candidate
 * needs more (lease, keys, over limit, more than RL_MAX_MATCH candidates):
 * rl_enforce then goes the general way. */
static __always_inline bool rl_enforce_fast(const struct pkt *p, const struct rl_mask *cand)
{
	struct rl_walk it = rl_walk_start(cand);
	__u32 id;

	for (int i = 0; i < RL_MAX_MATCH + 1; i++) {
		struct rl_limit_cpu *lc;
		struct rl_limit *lim;

		if (!rl_walk_next(&it, cand, &id))
			break;
		if (i == RL_MAX_MATCH)
			return false;	/* overflow: counted on the general way */
		lc = bpf_map_lookup_elem(&rl_percpu, &id);
		lim = bpf_map_lookup_elem(&rl_limits, &id);
		if (!lim || !lc || !lim->gen || lim->key_kind != RL_KEY_NONE ||
		    lc->cache.gen != lim->gen ||
		    lc->cache.tokens < (lim->unit == RL_UNIT_BYTES ? p->len : 1))
			return false;
	}

	it = rl_walk_start(cand);
	for (int i = 0; i < RL_MAX_MATCH; i++) {
		struct rl_limit_cpu *lc;
		struct rl_limit *lim;

		if (!rl_walk_next(&it, cand, &id))
			break;
		lc = bpf_map_lookup_elem(&rl_percpu, &id);
		lim = bpf_map_lookup_elem(&rl_limits, &id);
		if (!lim || !lc)
			continue;	/* cannot happen: checked above */
		lc->cache.tokens -= lim->unit == RL_UNIT_BYTES ? p->len : 1;
		lc->stats.admitted_packets++;
		lc->stats.admitted_bytes += p->len;
	}
	return true;
}

/* Returns true if the packet may pass. */
static __always_inline bool rl_enforce(const struct pkt *p, __u32 dir)
{
	struct match ms[RL_MAX_MATCH];
	struct rl_mask cand;
	struct rl_walk it;
	__u32 n = 0, extra;
	__u64 now = 0;
	bool pass = true;

	if (!rl_classify(p, dir, &cand))
		return true;

	/* Exactly one candidate: the common case, decided inline. */
	if (!(cand.w[0] & (cand.w[0] - 1)) && !cand.w[1])
		return rl_enforce_one(p, rl_ctz64(cand.w[0]), &now);
	if (!cand.w[0] && !(cand.w[1] & (cand.w[1] - 1)))
		return rl_enforce_one(p, 64 + rl_ctz64(cand.w[1]), &now);
	if (rl_enforce_fast(p, &cand))
		return true;

	/* Check every candidate without drawing, then commit: all or nothing. */
	it = rl_walk_start(&cand);
	for (int i = 0; i < RL_MAX_MATCH; i++) {
		if (!rl_walk_next(&it, &cand, &ms[i].id))
			break;
		ms[i].state = rl_check(p, &ms[i], &now);
		if (ms[i].state == MATCH_REJECT)
			pass = false;
		n = i + 1;
	}
	if (n == RL_MAX_MATCH && rl_walk_next(&it, &cand, &extra))
		rl_global_count(0);

	for (int i = 0; i < RL_MAX_MATCH; i++) {
		if (i >= n)
			break;
		rl_commit(&ms[i], p->len, pass);
	}
	return pass;
}

SEC("xdp")
int xdp_ratelimit(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct pkt p = {};

	rl_clock_tick();
	if (parse_packet(data, end, &p) < 0)
		return XDP_PASS;
	return rl_enforce(&p, RL_DIR_INGRESS) ? XDP_PASS : XDP_DROP;
}

/* Reads the data path's clock into rl_clock_probe_out, for user space to set
 * a limit's virtual clock base on the same time line. Run with test_run. */
__u64 rl_clock_probe_out;

SEC("xdp")
int xdp_clock_probe(struct xdp_md *ctx)
{
	rl_clock_probe_out = rl_clock_read();
	return XDP_PASS;
}
