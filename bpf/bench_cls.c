//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * The classified peers (issue 28): the bucket design alone, measured against
 * rlagent's. Each does rlagent's own work up to the buckets, with its code
 * (parse.h, classify.h) on a Datapath's own maps (loaded over them as the
 * reference object is, maps.Datapath.LoadReference): the parse, the rl_cfg
 * entry, the protect test, the protocol and port lookup and the hook and
 * prefix masks, the walk over the candidates, and rlagent's per-CPU
 * counters of each limit (rl_percpu). Then each candidate is charged the
 * way the fixed-bucket GCRA peer of bench.c charges its one bucket: a
 * theoretical arrival time shared by the CPUs, advanced with one
 * compare-and-swap per admitted packet, on rlagent's clock (clock.h).
 *
 * - xdp_peer_cls: one arrival time per limit id, in a line of its own
 *   (bench_cls_tat, which also holds the limit's GCRA interval and
 *   tolerance, set by user space).
 * - xdp_peer_keyed: one arrival time per key, in a preallocated hash keyed
 *   by rlagent's 24-byte bucket key (the limit's id and the packet's source
 *   address, as rlagent's src-ip keys are), 1,024 entries; a key's first
 *   packet inserts it. The limit's interval and tolerance are those of
 *   bench_cls_tat.
 *
 * The bucket is bench_gcra.h's, as the fixed-bucket peer's; at most
 * RL_MAX_MATCH candidates are charged, as rlagent checks at most that many.
 * A candidate whose arrival time is too far ahead drops the packet (counted
 * as dropped; the candidates before it keep their charge, as a simple
 * limiter of one bucket per limit would).
 */
#include "include/common.h"
#include "include/parse.h"
#include "include/maps.h"
#include "include/clock.h"
#include "include/classify.h"
#include "include/bench_gcra.h"

char __license[] SEC("license") = "Dual BSD/GPL";

/* One limit's GCRA bucket, in a cache line of its own. */
struct bench_cls_line {
	__u64 tat;		/* theoretical arrival time of the next packet, ns */
	__u64 interval_ns;	/* ns per packet: NSEC_PER_SEC / rate, at least 1 */
	__u64 tolerance_ns;	/* how far tat may run ahead: burst x interval */
	__u64 pad[5];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, RL_MAX_LIMITS);
	__type(key, __u32);
	__type(value, struct bench_cls_line);
} bench_cls_tat SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct rl_bucket_key);
	__type(value, __u64);
} bench_keyed_tat SEC(".maps");

/* rlagent's counters of a limit, as rl_count keeps them. */
static __always_inline void bench_cls_count(struct rl_limit_cpu *lc, const struct pkt *p, bool pass)
{
	if (pass) {
		lc->stats.admitted_packets += p->segs;
		lc->stats.admitted_bytes += p->len;
	} else {
		lc->stats.dropped_packets += p->segs;
		lc->stats.dropped_bytes += p->len;
	}
}

static __always_inline int bench_cls(struct xdp_md *ctx, bool keyed)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct pkt p = {};
	struct rl_config *cfg;
	struct rl_mask cand;
	struct rl_walk it;
	__u32 zero = 0, id;
	__u64 now, lost = 0;	/* swaps lost to other CPUs: not counted here */

	if (parse_packet(data, end, &p) < 0)
		return XDP_PASS;
	cfg = bpf_map_lookup_elem(&rl_cfg, &zero);
	if (!cfg)
		return XDP_PASS;
	if (__builtin_expect(cfg->protect_rules != 0, 0) && rl_protected(&p, cfg, RL_HOOK_UPLINK_IN))
		return XDP_PASS;
	if (!rl_classify(&p, cfg, RL_HOOK_UPLINK_IN, &cand))
		return XDP_PASS;
	now = rl_clock_read();
	it = rl_walk_start(&cand);
	for (int i = 0; i < RL_MAX_MATCH; i++) {
		struct bench_cls_line *l;
		struct rl_limit_cpu *lc;
		__u64 *tat;
		bool pass;

		if (!rl_walk_next(&it, &cand, &id))
			break;
		l = bpf_map_lookup_elem(&bench_cls_tat, &id);
		lc = bpf_map_lookup_elem(&rl_percpu, &id);
		if (!l || !lc)
			return XDP_PASS;
		tat = &l->tat;
		if (keyed) {
			struct rl_bucket_key k = { .limit = id };

			__builtin_memcpy(k.addr, p.src, sizeof(k.addr));
			tat = bpf_map_lookup_elem(&bench_keyed_tat, &k);
			if (!tat) {
				__u64 first = 0;

				bpf_map_update_elem(&bench_keyed_tat, &k, &first, BPF_NOEXIST);
				tat = bpf_map_lookup_elem(&bench_keyed_tat, &k);
				if (!tat)
					return XDP_PASS;
			}
		}
		pass = bench_gcra_take(tat, l->interval_ns, l->tolerance_ns, now, &lost);
		bench_cls_count(lc, &p, pass);
		if (!pass)
			return XDP_DROP;
	}
	return XDP_PASS;
}

SEC("xdp")
int xdp_peer_cls(struct xdp_md *ctx)
{
	return bench_cls(ctx, false);
}

SEC("xdp")
int xdp_peer_keyed(struct xdp_md *ctx)
{
	return bench_cls(ctx, true);
}
