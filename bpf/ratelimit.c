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
	__u32 slot;		/* rl_key_cache index, or RL_NO_SLOT */
	__u32 cost;
	__u32 state;
};

static __always_inline __u64 rl_hash(__u32 id, __u32 gen, const __u32 a[4])
{
	__u64 h = (((__u64)id << 32) | gen) * 0x9E3779B97F4A7C15ULL;

	h ^= ((((__u64)a[0] << 32) | a[1]) * 0xC2B2AE3D27D4EB4FULL);
	h = (h << 31) | (h >> 33);
	h ^= ((((__u64)a[2] << 32) | a[3]) * 0x165667B19E3779F9ULL);
	h ^= h >> 29;
	h *= 0xFF51AFD7ED558CCDULL;
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
		struct rl_key_slot *s;
		bool cached;
		__u32 slot;

		rl_bucket_key(lim, p, &k);
		h = rl_hash(id, lim->gen, k.addr);
		slot = h & (RL_KEY_CACHE_SLOTS - 1);
		s = bpf_map_lookup_elem(&rl_key_cache, &slot);
		if (!s)
			return MATCH_FAIL_OPEN;
		m->slot = slot;
		c = &s->cache;
		cached = rl_key_equal(&s->key, &k);
		if (!cached) {
			/* Another bucket's slot: hand its tokens back and take it. */
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
	if (rl_lease(pool, c, params, lim->seq, m->cost, rl_now(now)))
		return MATCH_ADMIT;
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
			__u32 slot = m->slot;
			struct rl_key_slot *s = bpf_map_lookup_elem(&rl_key_cache, &slot);

			if (!s)
				return;
			s->cache.tokens -= m->cost;
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

/* The packet's candidate limits: direction, protocol and port, then source
 * and destination prefixes only if a candidate is restricted by them. */
static __always_inline bool rl_classify(const struct pkt *p, __u32 dir, struct rl_mask *out)
{
	__u32 zero = 0, cls = p->pclass, port_idx;
	struct rl_config *cfg = bpf_map_lookup_elem(&rl_cfg, &zero);
	struct rl_mask *any, *m, ports = {}, src = {}, dst = {};
	__u64 need_src = 0, need_dst = 0, all = 0;

	if (!cfg || dir >= RL_DIRECTIONS)
		return false;
	any = bpf_map_lookup_elem(&rl_proto_any, &cls);
	if (!any)
		return false;
	if (p->has_ports && cls <= RL_PROTO_UDP) {
		port_idx = cls * RL_PORT_SPACE + p->dport;
		m = bpf_map_lookup_elem(&rl_ports, &port_idx);
		if (m)
			ports = *m;
	}

#pragma unroll
	for (int w = 0; w < RL_MASK_WORDS; w++) {
		__u64 c = (any->w[w] | ports.w[w]) & cfg->dir[dir].w[w];

		out->w[w] = c;
		need_src |= c & cfg->src_cidr.w[w];
		need_dst |= c & cfg->dst_cidr.w[w];
	}

	/* A missing prefix leaves src/dst zero: the restricted limits drop out. */
	if (need_src) {
		if (p->family == 4) {
			struct rl_lpm4 k = { .prefixlen = 32, .addr = p->src[3] };
			m = bpf_map_lookup_elem(&rl_src4, &k);
		} else {
			struct rl_lpm6 k = { .prefixlen = 128 };
			__builtin_memcpy(k.addr, p->src, sizeof(k.addr));
			m = bpf_map_lookup_elem(&rl_src6, &k);
		}
		if (m)
			src = *m;
	}
	if (need_dst) {
		if (p->family == 4) {
			struct rl_lpm4 k = { .prefixlen = 32, .addr = p->dst[3] };
			m = bpf_map_lookup_elem(&rl_dst4, &k);
		} else {
			struct rl_lpm6 k = { .prefixlen = 128 };
			__builtin_memcpy(k.addr, p->dst, sizeof(k.addr));
			m = bpf_map_lookup_elem(&rl_dst6, &k);
		}
		if (m)
			dst = *m;
	}

#pragma unroll
	for (int w = 0; w < RL_MASK_WORDS; w++) {
		if (need_src)
			out->w[w] &= src.w[w] | ~cfg->src_cidr.w[w];
		if (need_dst)
			out->w[w] &= dst.w[w] | ~cfg->dst_cidr.w[w];
		all |= out->w[w];
	}
	return all != 0;
}

static __always_inline __u32 rl_ctz64(__u64 x)
{
	__u32 n = 0;

	if (!(x & 0xffffffffULL)) { n += 32; x >>= 32; }
	if (!(x & 0xffffULL)) { n += 16; x >>= 16; }
	if (!(x & 0xffULL)) { n += 8; x >>= 8; }
	if (!(x & 0xfULL)) { n += 4; x >>= 4; }
	if (!(x & 0x3ULL)) { n += 2; x >>= 2; }
	if (!(x & 0x1ULL)) { n += 1; }
	return n;
}

/* Returns true if the packet may pass. */
static __always_inline bool rl_enforce(const struct pkt *p, __u32 dir)
{
	struct match ms[RL_MAX_MATCH];
	struct rl_mask cand;
	__u32 n = 0, w = 0;
	__u64 now = 0, bits;
	bool pass = true;

	if (!rl_classify(p, dir, &cand))
		return true;

	bits = cand.w[0];
	for (int i = 0; i < RL_MAX_MATCH; i++) {
		while (!bits && w < RL_MASK_WORDS - 1) {
			w++;
			bits = cand.w[w & (RL_MASK_WORDS - 1)];
		}
		if (!bits)
			break;
		ms[i].id = w * 64 + rl_ctz64(bits);
		bits &= bits - 1;
		ms[i].state = rl_check(p, &ms[i], &now);
		if (ms[i].state == MATCH_REJECT)
			pass = false;
		n = i + 1;
	}
	if (bits || (w < RL_MASK_WORDS - 1 && cand.w[(RL_MASK_WORDS - 1) & (w + 1)]))
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
