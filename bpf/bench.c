//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * The benchmarks' references (issue 12): what rlagent's per-packet cost is
 * divided by besides the parse-only baseline. Never attached to a device;
 * measured with test_run only (bpf/bench_test.go).
 *
 * - xdp_floor: the least any per-CPU limiter does per packet. Parse, one
 *   per-CPU array lookup of one fixed bucket, compare, decrement, one
 *   counter; the clock is read only when the bucket is empty.
 * - xdp_floor_dram: parse plus one random read per packet from an array
 *   far larger than any cache (bench_dram, sized by user space, >= 256 MiB),
 *   its index a multiplicative hash of a per-CPU counter: one cache and TLB
 *   miss, the cost of a keyed table too large for the caches.
 * - The peers, written from their published designs, all on rlagent's clock
 *   (jiffies x bench_ns_per_jiffy) so that the algorithms are compared and
 *   not the clocks:
 *   - xdp_peer_gcra: a GCRA bucket ("theoretical arrival time") shared by
 *     every CPU, one compare-and-swap per packet: the best shared-state
 *     design.
 *   - xdp_peer_lock: a token bucket in a hash map, refilled on every packet
 *     under bpf_spin_lock (the shape of Cilium's bpf/lib/ratelimit.h and
 *     tb.h, made safe on many CPUs by the lock).
 *   - xdp_peer_naive: a token bucket per CPU, each refilled at rate / CPUs
 *     on every packet: inaccurate whenever traffic is not spread evenly over
 *     the CPUs, a speed reference only.
 *
 * Every program parses what xdp_ratelimit parses (parse_packet) and charges
 * one packet of the one limit configured in bench_limit.
 */
#include "include/common.h"
#include "include/parse.h"
#include "include/bench_gcra.h"

char __license[] SEC("license") = "Dual BSD/GPL";

/* Length of a jiffy in ns; set by user space (CLOCK_MONOTONIC_COARSE's
 * resolution), as rl_ns_per_jiffy is. */
volatile const __u64 bench_ns_per_jiffy = 4000000;

/* The one limit, set by user space before a run. */
struct bench_conf {
	__u64 rate;		/* packets per second, for the whole node */
	__u64 burst;		/* packets */
	__u64 interval_ns;	/* GCRA: ns per packet, NSEC_PER_SEC / rate (at least 1) */
	__u64 tolerance_ns;	/* GCRA: how far the arrival time may run ahead, burst x interval */
	__u64 cpus;		/* naive: CPUs the rate is split over */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct bench_conf);
} bench_limit SEC(".maps");

/* Each program's own entry in bench_percpu and bench_stats: no program's
 * state is another's. */
enum bench_slot {
	BENCH_FLOOR = 0,
	BENCH_NAIVE = 1,
	BENCH_DRAM = 2,
	BENCH_GCRA = 0,
	BENCH_LOCK = 1,
	BENCH_SLOTS = 3,
};

const enum bench_slot *_bench_slot __attribute__((unused));

/* A per-CPU bucket with its counters, in one cache line: the floor's and the
 * naive peer's (the DRAM floor counts its packets in passed). */
struct bench_bucket {
	__u64 tokens;
	__u64 last_ns;		/* when tokens were last refilled */
	__u64 passed;
	__u64 dropped;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, BENCH_SLOTS);
	__type(key, __u32);
	__type(value, struct bench_bucket);
} bench_percpu SEC(".maps");

/* The peers' shared state and their per-CPU counters. */
struct bench_gcra {
	__u64 tat;		/* theoretical arrival time of the next packet, ns */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct bench_gcra);
} bench_tat SEC(".maps");

struct bench_locked {
	struct bpf_spin_lock lock;
	__u32 pad;
	__u64 tokens;
	__u64 last_ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 64);
	__type(key, __u32);
	__type(value, struct bench_locked);
} bench_shared SEC(".maps");

struct bench_counters {
	__u64 passed;
	__u64 dropped;
	__u64 cas_lost;		/* GCRA: compare-and-swaps lost to another CPU */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, BENCH_SLOTS);
	__type(key, __u32);
	__type(value, struct bench_counters);
} bench_stats SEC(".maps");

/* The DRAM floor's table: one 64-byte line per entry. user space sets
 * max_entries (a power of two) and bench_dram_shift = 64 - log2 of it. */
struct bench_line {
	__u64 word[8];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct bench_line);
} bench_dram SEC(".maps");

volatile const __u32 bench_dram_shift = 63;

static __always_inline __u64 bench_min(__u64 a, __u64 b) { return a < b ? a : b; }

static __always_inline __u64 bench_now(void)
{
	return bpf_jiffies64() * bench_ns_per_jiffy;
}

/* Tokens that accrue at rate over dt ns, dt split so that dt x rate cannot
 * overflow (rate < 2^32). */
static __always_inline __u64 bench_accrued(__u64 dt, __u64 rate)
{
	return (dt / NSEC_PER_SEC) * rate + ((dt % NSEC_PER_SEC) * rate) / NSEC_PER_SEC;
}

/* A port no packet uses: the compare keeps the parse from being optimised
 * away, as in baseline.c. */
volatile const __u16 bench_drop_port = 0;

/* The parse every program starts with, exactly the baseline's (xdp_baseline
 * in baseline.c), so that the baseline's time is the parse of each: returns
 * false for a packet that is not IP (it passes untouched, as in
 * xdp_ratelimit) and drops what the baseline would drop (nothing the
 * benchmarks send). Without the compare the compiler would drop the parse
 * of every field the program does not read, and a reference would measure
 * less than the baseline. */
static __always_inline int bench_parse(struct xdp_md *ctx, struct pkt *p)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;

	if (parse_packet(data, end, p) < 0)
		return XDP_PASS;
	if (p->has_ports && p->dport == bench_drop_port && p->src[3] == p->dst[3])
		return XDP_DROP;
	return -1;
}

SEC("xdp")
int xdp_floor(struct xdp_md *ctx)
{
	struct pkt p = {};
	__u32 zero = 0, slot = BENCH_FLOOR;
	struct bench_bucket *b;

	int v = bench_parse(ctx, &p);

	if (v >= 0)
		return v;
	b = bpf_map_lookup_elem(&bench_percpu, &slot);
	if (!b)
		return XDP_PASS;
	if (b->tokens) {
		b->tokens--;
		b->passed++;
		return XDP_PASS;
	}
	/* Empty: refill from the clock, at the node's whole rate (one CPU). */
	struct bench_conf *c = bpf_map_lookup_elem(&bench_limit, &zero);
	__u64 now = bench_now();

	if (c && now > b->last_ns) {
		b->tokens = bench_min(c->burst, bench_accrued(now - b->last_ns, c->rate));
		b->last_ns = now;
	}
	if (b->tokens) {
		b->tokens--;
		b->passed++;
		return XDP_PASS;
	}
	b->dropped++;
	return XDP_DROP;
}

SEC("xdp")
int xdp_floor_dram(struct xdp_md *ctx)
{
	struct pkt p = {};
	__u32 slot = BENCH_DRAM, idx;
	struct bench_bucket *b;
	struct bench_line *l;

	int v = bench_parse(ctx, &p);

	if (v >= 0)
		return v;
	b = bpf_map_lookup_elem(&bench_percpu, &slot);
	if (!b)
		return XDP_PASS;
	/* Fibonacci hashing of the counter: consecutive packets land far
	 * apart, and nothing predicts the next line. */
	idx = (__u32)((++b->passed * 0x9e3779b97f4a7c15ULL) >> bench_dram_shift);
	l = bpf_map_lookup_elem(&bench_dram, &idx);
	if (!l)
		return XDP_ABORTED;
	/* The read must happen: its value decides the verdict (the table is
	 * zeroes, so every packet passes). */
	if (l->word[0] == p.len)
		return XDP_DROP;
	return XDP_PASS;
}

SEC("xdp")
int xdp_peer_gcra(struct xdp_md *ctx)
{
	struct pkt p = {};
	__u32 zero = 0, slot = BENCH_GCRA;
	struct bench_conf *c;
	struct bench_gcra *g;
	struct bench_counters *n;

	int v = bench_parse(ctx, &p);

	if (v >= 0)
		return v;
	c = bpf_map_lookup_elem(&bench_limit, &zero);
	g = bpf_map_lookup_elem(&bench_tat, &zero);
	n = bpf_map_lookup_elem(&bench_stats, &slot);
	if (!c || !g || !n)
		return XDP_PASS;

	if (bench_gcra_take(&g->tat, c->interval_ns, c->tolerance_ns, bench_now(), &n->cas_lost)) {
		n->passed++;
		return XDP_PASS;
	}
	n->dropped++;
	return XDP_DROP;
}

SEC("xdp")
int xdp_peer_lock(struct xdp_md *ctx)
{
	struct pkt p = {};
	__u32 zero = 0, slot = BENCH_LOCK;
	struct bench_conf *c;
	struct bench_locked *b;
	struct bench_counters *n;
	bool pass = false;

	int v = bench_parse(ctx, &p);

	if (v >= 0)
		return v;
	c = bpf_map_lookup_elem(&bench_limit, &zero);
	b = bpf_map_lookup_elem(&bench_shared, &zero);
	n = bpf_map_lookup_elem(&bench_stats, &slot);
	if (!c || !b || !n)
		return XDP_PASS;

	/* No helper may be called under the lock: the clock first. */
	__u64 now = bench_now();
	__u64 rate = c->rate, burst = c->burst;

	bpf_spin_lock(&b->lock);
	if (now > b->last_ns) {
		b->tokens = bench_min(burst, b->tokens + bench_accrued(now - b->last_ns, rate));
		b->last_ns = now;
	}
	if (b->tokens) {
		b->tokens--;
		pass = true;
	}
	bpf_spin_unlock(&b->lock);
	if (pass) {
		n->passed++;
		return XDP_PASS;
	}
	n->dropped++;
	return XDP_DROP;
}

SEC("xdp")
int xdp_peer_naive(struct xdp_md *ctx)
{
	struct pkt p = {};
	__u32 zero = 0, slot = BENCH_NAIVE;
	struct bench_conf *c;
	struct bench_bucket *b;

	int v = bench_parse(ctx, &p);

	if (v >= 0)
		return v;
	c = bpf_map_lookup_elem(&bench_limit, &zero);
	b = bpf_map_lookup_elem(&bench_percpu, &slot);
	if (!c || !b || !c->cpus)
		return XDP_PASS;

	__u64 now = bench_now();

	if (now > b->last_ns) {
		b->tokens = bench_min(c->burst / c->cpus,
				       b->tokens + bench_accrued(now - b->last_ns, c->rate / c->cpus));
		b->last_ns = now;
	}
	if (b->tokens) {
		b->tokens--;
		b->passed++;
		return XDP_PASS;
	}
	b->dropped++;
	return XDP_DROP;
}

/*
 * The live-frame path (BenchmarkLive, TestLiveGenerator): frames sent
 * through a real driver, veth's, instead of test_run's loop alone.
 *
 * - xdp_live_gen is the generator: run by BPF_PROG_TEST_RUN with
 *   BPF_F_TEST_XDP_LIVE_FRAMES on one veth end, it counts the frame and
 *   transmits it (XDP_TX: out of that end, into its peer's ring, where the
 *   program under test runs natively in the peer's NAPI poll). With
 *   bench_live_conf.keys set it first rewrites the IPv4 source from a
 *   counter, 10.0.0.0 + i for i in [0, keys), as the test_run cycler does.
 * - xdp_live_pass and xdp_live_drop are the bare receivers the cases are
 *   compared with: each counts the frames that carry the marker and
 *   passes or drops them. A frame without the marker (the peer's stack
 *   sends some: neighbour and router solicitations) passes uncounted.
 *
 * The marker is BENCH_LIVE_MAGIC in the 8 bytes after the UDP header of an
 * untagged IPv4 frame (offset 42).
 */
#define BENCH_LIVE_MAGIC 0x31746e6567616c72ULL	/* "rlagent1", little-endian */
#define BENCH_LIVE_MARK 42

enum bench_live_slot {
	BENCH_LIVE_SENT = 0,	/* frames the generator transmitted */
	BENCH_LIVE_PASSED = 1,	/* marked frames xdp_live_pass counted */
	BENCH_LIVE_DROPPED = 2,	/* marked frames xdp_live_drop counted */
	BENCH_LIVE_CYCLE = 3,	/* the generator's source counter */
	BENCH_LIVE_SLOTS = 4,
};

const enum bench_live_slot *_bench_live_slot __attribute__((unused));

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, BENCH_LIVE_SLOTS);
	__type(key, __u32);
	__type(value, __u64);
} bench_live SEC(".maps");

struct bench_live_conf {
	__u32 keys;		/* > 0: sources to cycle over */
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct bench_live_conf);
} bench_live_cfg SEC(".maps");

static __always_inline void bench_live_inc(__u32 slot)
{
	__u64 *n = bpf_map_lookup_elem(&bench_live, &slot);

	if (n)
		(*n)++;
}

SEC("xdp")
int xdp_live_gen(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	__u32 zero = 0, slot = BENCH_LIVE_CYCLE;
	struct bench_live_conf *c = bpf_map_lookup_elem(&bench_live_cfg, &zero);

	if (!c)
		return XDP_ABORTED;
	if (c->keys) {
		__u64 *i = bpf_map_lookup_elem(&bench_live, &slot);
		__u32 *src = data + 14 + 12;

		if (!i || (void *)(src + 1) > end)
			return XDP_ABORTED;
		*src = bpf_htonl(0x0a000000 | (__u32)*i);
		if (++*i >= c->keys)
			*i = 0;
	}
	bench_live_inc(BENCH_LIVE_SENT);
	return XDP_TX;
}

static __always_inline int bench_live_count(struct xdp_md *ctx, __u32 slot, int verdict)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	__u64 *mark = data + BENCH_LIVE_MARK;

	if ((void *)(mark + 1) > end || *mark != BENCH_LIVE_MAGIC)
		return XDP_PASS;
	bench_live_inc(slot);
	return verdict;
}

SEC("xdp")
int xdp_live_pass(struct xdp_md *ctx)
{
	return bench_live_count(ctx, BENCH_LIVE_PASSED, XDP_PASS);
}

SEC("xdp")
int xdp_live_drop(struct xdp_md *ctx)
{
	return bench_live_count(ctx, BENCH_LIVE_DROPPED, XDP_DROP);
}
