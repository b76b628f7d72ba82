/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Types and constants shared by the BPF programs and by Go (bpf2go -type).
 * Every struct and enum user space reads or writes is defined here, once.
 */
#ifndef RL_COMMON_H
#define RL_COMMON_H

#include <stdbool.h>
#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define NSEC_PER_SEC 1000000000ULL
#define READ_ONCE_U64(x) (*(volatile __u64 *)&(x))

/* Sizes and limits. Go reads these through bpf2go, never retypes them. */
enum rl_const {
	RL_MAX_LIMITS = 128,	/* limit ids are 0..RL_MAX_LIMITS-1 */
	RL_MASK_WORDS = RL_MAX_LIMITS / 64,
	RL_MAX_MATCH = 16,	/* limits enforced on one packet; beyond, a drop limit fails closed */
	RL_PORT_SPACE = 65536,
	RL_KEY_CACHE_SETS = 4096, /* sets of the per-CPU cache of keyed buckets; power of two */
	RL_KEY_CACHE_WAYS = 2,	/* buckets per set */
	RL_HOT_RING = 2048,	/* hot-key records a CPU keeps (rl_hot); power of two */
	RL_MAX_OVERRIDES = 8192, /* keys with a share of their own (rl_overrides), over all limits */
	RL_CAS_TRIES = 4,	/* lease attempts on a contended pool before the packet is rejected */
	RL_STALE_NS = 10000000,	/* a lease older than this hands its remainder back on the next lease */
	RL_MAX_RATE = 4000000000U, /* units/s (32 Gbit/s in bytes); keeps the fixed-point products below 2^64 */
	RL_MAX_BURST_SECONDS = 3600, /* burst / rate; idem */
	RL_MAX_PROTECT = 32,	/* protect rules: one bit each in a __u32 */
	RL_MAX_LOCAL = 16384,	/* rl_local: the node's and its endpoints' addresses */
	RL_MAX_IFACES = 1024,	/* rl_if_mac: interfaces the agent attached to */
	RL_MAX_EP_SRC = 16384,	/* rl_ep_src: the local endpoints' addresses, by interface */
	RL_PROTECT_SIDE = 2 * 65536, /* rl_protect_ports: local ports, then remote ports */
	RL_MAX_HORIZON_NS = 4000000000U, /* a paced limit's horizon: at most 4 s (fits rl_limit.horizon_ns) */
	RL_HEAD4_BITS = 16,	/* the IPv4 prefixes the first stage answers alone: /16 and shorter */
	RL_BUCKET_WAYS = 4,	/* keyed buckets per set of rl_buckets: one cache line */
	RL_TOMB_WAYS = 4,	/* buckets remembered per set of rl_tombstones */
	RL_TOMB_SHIFT = 22,	/* rl_tomb.full_at counts 2^22 ns (~4.2 ms, a jiffy at HZ=250) */
};

/* What happens to a packet that finds its bucket empty. */
enum rl_action : __u8 {
	RL_ACTION_DROP = 0,	/* drop it (XDP_DROP) */
	RL_ACTION_SHADOW = 1,	/* count it as would-drop and pass it; it draws no tokens */
	/* Give it an earliest departure time (skb->tstamp) at which its tokens
	 * will have accrued, for fq to hold it until then; drop it if that is
	 * more than the limit's horizon ahead. TC egress only. */
	RL_ACTION_PACE = 2,
	/* Drop it and answer it, if it may be answered and the node's reply
	 * budget allows (reject.h): a TCP SYN with a RST, a UDP datagram with
	 * an ICMP port unreachable. Ingress only. */
	RL_ACTION_REJECT = 3,
};

/* What one token is worth. */
enum rl_unit : __u8 {
	/* A packet; at TC, each segment of a GSO or GRO packet (gso_segs). */
	RL_UNIT_PACKETS = 0,
	/* What goes on the wire, L2 header included: the frame length at XDP;
	 * at TC, skb->len plus the headers each further segment of a GSO or GRO
	 * packet repeats (struct pkt, len). */
	RL_UNIT_BYTES = 1,
	/* A connection attempt: a TCP SYN without ACK, RST or FIN (or an
	 * L4-unknown packet that could be one). The limit's other packets are
	 * not its: rl_config.conn. */
	RL_UNIT_CONNECTIONS = 2,
};

/* How a limit splits its traffic into buckets. */
enum rl_key_kind : __u8 {
	RL_KEY_NONE = 0,	/* one bucket for the limit */
	RL_KEY_SRC_IP = 1,
	RL_KEY_DST_IP = 2,
	RL_KEY_SRC_PREFIX = 3,	/* source address masked to prefix4 / prefix6 */
	RL_KEY_DST_PORT = 4,	/* protocol class and destination port */
	RL_KEY_DST_PREFIX = 5,	/* destination address masked to prefix4 / prefix6 */
};

/* Protocol classes of the classifier. */
enum rl_proto_class {
	RL_PROTO_TCP = 0,
	RL_PROTO_UDP = 1,
	RL_PROTO_ICMP = 2,	/* ICMP and ICMPv6 */
	RL_PROTO_OTHER = 3,	/* any other protocol */
	RL_PROTO_UNKNOWN = 4,	/* the protocol could not be found (see parse.h) */
	RL_PROTO_CLASSES = 5,
	/* rl_proto_any is indexed by class, for the class's limits that restrict
	 * no port, and by RL_PROTO_CLASSES + class, for every limit of the class
	 * whatever its ports: the limits an L4-unknown packet of that class
	 * could match. Both entries of RL_PROTO_UNKNOWN hold every limit. */
	RL_PROTO_ANY_ENTRIES = 2 * RL_PROTO_CLASSES,
};

/* The direction of the traffic a limit is about, seen from the host or
 * from the endpoint it protects: ingress is traffic coming in, egress
 * traffic going out. */
enum rl_direction {
	RL_DIR_INGRESS = 0,
	RL_DIR_EGRESS = 1,
	RL_DIRECTIONS = 2,
};

/* Where a limit is enforced. */
enum rl_attach {
	RL_ATTACH_UPLINK = 0,	/* the host's uplink interfaces */
	RL_ATTACH_ENDPOINTS = 1, /* the interfaces of the local endpoints (pods) */
	RL_ATTACHES = 2,
};

/* The hooks: one attach point and one direction each, attach x 2 +
 * direction. A limit is enforced at exactly one hook (rl_config.hook), so no
 * packet is charged twice for one limit. The direction is the traffic's, not
 * the kernel hook's: RL_HOOK_ENDPOINT_IN is traffic INTO a local endpoint,
 * which the host sees leaving through the host side of the endpoint's veth
 * (its TC egress); RL_HOOK_ENDPOINT_OUT is traffic out of the endpoint (TC
 * ingress of the host side). */
enum rl_hook {
	RL_HOOK_UPLINK_IN = 0,		/* XDP, or TC ingress, of an uplink */
	RL_HOOK_UPLINK_OUT = 1,		/* TC egress of an uplink */
	RL_HOOK_ENDPOINT_IN = 2,	/* TC egress of an endpoint's host-side veth */
	RL_HOOK_ENDPOINT_OUT = 3,	/* TC ingress of an endpoint's host-side veth */
	RL_HOOKS = 4,
};

_Static_assert(RL_HOOK_UPLINK_IN == RL_ATTACH_UPLINK * RL_DIRECTIONS + RL_DIR_INGRESS &&
	       RL_HOOK_UPLINK_OUT == RL_ATTACH_UPLINK * RL_DIRECTIONS + RL_DIR_EGRESS &&
	       RL_HOOK_ENDPOINT_IN == RL_ATTACH_ENDPOINTS * RL_DIRECTIONS + RL_DIR_INGRESS &&
	       RL_HOOK_ENDPOINT_OUT == RL_ATTACH_ENDPOINTS * RL_DIRECTIONS + RL_DIR_EGRESS &&
	       RL_HOOKS == RL_ATTACHES * RL_DIRECTIONS,
	       "a hook is attach x 2 + direction");

/* Where the data path reads the time. Chosen by user space at load time. */
enum rl_clock_kind {
	RL_CLOCK_KTIME = 0,	/* bpf_ktime_get_ns */
	RL_CLOCK_COARSE = 1,	/* bpf_ktime_get_coarse_ns (5.11+) */
	RL_CLOCK_JIFFIES = 2,	/* bpf_jiffies64 x ns_per_jiffy: inlined, tick resolution */
	RL_CLOCK_TEST = 3,	/* rl_test_clock, advanced by step on every packet: tests only */
};

/* A set of limit ids. */
struct rl_mask {
	__u64 w[RL_MASK_WORDS];
};

/* Parameters of a limit's bucket at this node. Read only on the lease path.
 *
 * Tokens are counted on a virtual clock V(t) that runs at the node share:
 *   V(t) = base_v + (t - base_ns) x rate / 1e9
 * and a bucket stores only the point v_empty at which it would be empty; it
 * holds min(burst, V(now) - v_empty) tokens. A rate change rewrites base_v and
 * base_ns so that V is continuous and changes slope at that moment: no bucket
 * is touched, every bucket keeps its tokens, and the burst clamp applies at
 * the next lease.
 */
struct rl_params {
	__u64 rate;	/* node share, units per second (0: admit nothing) */
	__u64 burst;	/* node share of the burst, units, >= 1 */
	__u64 chunk;	/* tokens one CPU leases at a time */
	__u64 base_ns;	/* clock reading at which V(t) == base_v */
	__u64 base_v;
};

/* A configured limit, ARRAY-indexed by limit id. */
struct rl_limit {
	__u32 gen;	/* identity of the limit that owns this id; 0 = free */
	__u32 seq;	/* bumped on every parameter change */
	/* Enums of one byte: bpftool map dump prints their names. */
	enum rl_unit unit;
	enum rl_key_kind key_kind;
	enum rl_action action;
	/* 1: record this keyed limit's hot keys (rl_hot): a keyed limit with
	 * share demand, whose keys' shares follow their demand. */
	__u8 hot;
	/* RL_ACTION_PACE: a packet that would leave later than this many ns
	 * from now is dropped (<= RL_MAX_HORIZON_NS). */
	__u32 horizon_ns;
	__u32 prefix4;	/* RL_KEY_SRC_PREFIX, RL_KEY_DST_PREFIX: IPv4 netmask, network byte order */
	__u32 prefix6[4]; /* RL_KEY_SRC_PREFIX, RL_KEY_DST_PREFIX: IPv6 netmask, network byte order */
	struct rl_params params[2];
	/* Index of the live params. User space writes the other slot and this
	 * byte in one map update; active is last in the struct so that a reader
	 * that sees the new index also sees the new params (stores are ordered
	 * on x86 and the copy runs forward). */
	__u32 active;
	/* Bumped by user space (mod 2^31) whenever this limit's key overrides
	 * change (rl_overrides): a CPU looks a key's override up again when
	 * the epoch it saw is not this one. 0: the limit has never had one. */
	__u32 ov_epoch;
};

/* Classifier state that is not per-port or per-prefix. One entry. */
struct rl_config {
	/* The limits enforced at each hook (enum rl_hook). A limit's bit is
	 * set in one of them: no packet is charged twice for one limit. */
	struct rl_mask hook[RL_HOOKS];
	struct rl_mask src_cidr;	/* limits restricted to source CIDRs */
	struct rl_mask dst_cidr;	/* limits restricted to destination CIDRs */
	__u32 last_gen;		/* user space: the last limit generation handed out */
	/* A hot-key tick is 2^hot_shift ns of the limits' clock (rl_hot_note);
	 * 0: no key is recorded. */
	__u32 hot_shift;
	/* Limits with action drop: a packet matching more limits than
	 * RL_MAX_MATCH is dropped if one it was not checked against is one. */
	struct rl_mask drop;
	/* Limits with unit connections: a packet that is not a connection
	 * attempt (struct pkt, syn) is none of theirs. */
	struct rl_mask conn;
	/* Protect rules (bit i: rule i); see rl_protected. */
	__u32 protect_rules;	/* rules in use; 0: nothing is protected */
	__u32 protect_portless;	/* rules that name no port */
	__u32 protect_peers;	/* rules restricted to peer prefixes */
	/* At an endpoint's egress, a packet from an address that is not the
	 * endpoint's (enum rl_ep_src_check; rl_endpoint_source). */
	__u32 ep_src_check;
	/* Key of the keyed buckets' hash: random, kept with the pins so that a
	 * restarted agent's program finds the same cache sets and tombstones. */
	__u64 seed[2];
};

/* A datagram whose first fragment was seen. */
/* What an address of rl_local is to this node (flags). */
enum rl_local_flag {
	RL_LOCAL_NODE = 1,	/* one of the node's own addresses (an interface's of its namespace) */
	RL_LOCAL_ENDPOINT = 2,	/* a local endpoint's (a pod on this node), which the node delivers */
};

/* An address of rl_local: IPv4 in a[3] (as the parser keeps it), the rest
 * zero. */
struct rl_local_key {
	__u32 family;		/* 4 or 6 */
	__u32 a[4];
};

/* What an endpoint's egress does with a packet whose source is not one of
 * the endpoint's addresses (rl_config.ep_src_check). Either way it is
 * counted, and charged as the endpoint's. */
enum rl_ep_src_check {
	RL_EP_SRC_COUNT = 0,
	RL_EP_SRC_DROP = 1,
};

/* A key of rl_ep_src: an address of the endpoint behind interface ifindex
 * (IPv4 in a[3], as the parser keeps it); with a all zero, the entry that
 * names the address of the family its other packets are charged as; with
 * family 0 too, the entry that says the interface is an endpoint's. */
struct rl_ep_key {
	__u32 ifindex;
	__u32 family;		/* 4 or 6; 0: the interface's entry */
	__u32 a[4];
};

/* A value of rl_ep_src: an address of the endpoint's, as rl_ep_key holds
 * one. */
struct rl_ep_addr {
	__u32 a[4];
};

/* An interface's MAC address, in rl_if_mac. */
struct rl_mac {
	__u8 addr[6];
	__u8 pad[2];
};

struct rl_frag_key {
	__u32 src[4];
	__u32 dst[4];
	__u32 id;		/* IPv4 identification, or the IPv6 fragment header's */
	__u8 proto;		/* IPv4 protocol; 0 for IPv6 (not part of its identity) */
	__u8 family;
	__u16 pad;
};

/* The transport fields of the datagram's first fragment. */
struct rl_frag_info {
	__u64 seen_ns;		/* when the first fragment came (the data path's clock) */
	__u16 sport;
	__u16 dport;
	__u8 pclass;
	__u8 has_ports;
	__u8 l4_unknown;	/* unknown, or no longer trusted (see rl_frag_resolve) */
	__u8 pad;
	__u16 next;		/* offset the next fragment in order starts at, 8-byte units */
	__u16 pad2[3];
};

struct rl_lpm4 {
	__u32 prefixlen;
	__u32 addr;		/* network byte order */
};

/* The first stage of the IPv4 prefix match (rl_src4_head, rl_dst4_head):
 * one entry per /16, indexed by an address's first 16 bits. m is what the
 * trie would answer for every address of the /16 (the limits of the longest
 * prefix of /16 or shorter that covers it); deep says that a longer prefix
 * lies inside the /16, so that the trie must be asked. */
struct rl_head4 {
	struct rl_mask m;
	__u32 deep;
	__u32 pad;
};

struct rl_lpm6 {
	__u32 prefixlen;
	__u32 addr[4];		/* network byte order */
};

/* Tokens one CPU has leased from a bucket's pool. */
struct rl_cache {
	__u64 tokens;
	__u64 lease_ns;	/* when the last lease was taken */
	__u64 retry_ns;	/* the pool was short: do not ask it again before this */
	__u32 gen;	/* limit generation these tokens belong to */
	__u32 seq;	/* params seq retry_ns was computed under */
};

/* Per-limit counters, per CPU. */
struct rl_stats {
	__u64 admitted_packets;
	__u64 admitted_bytes;
	__u64 dropped_packets;
	__u64 dropped_bytes;
	__u64 shadow_packets;	/* would have been dropped (action shadow), passed */
	__u64 shadow_bytes;
	__u64 new_keys;		/* keys that got a bucket for the first time */
	__u64 returned_keys;	/* keys that came back after their bucket was evicted */
};

/* Per-limit counters of a paced limit (RL_ACTION_PACE), per CPU: admitted
 * packets given a later departure, the delay they got in all (ns, per
 * segment) and at most (user space takes the largest of the CPUs' maxima),
 * and packets dropped because their departure was beyond the horizon (also
 * in rl_stats.dropped_packets). Apart from rl_stats so that the layout of
 * rl_percpu, which every limit touches, stays as it was. */
struct rl_pace_stats {
	__u64 paced_packets;
	__u64 paced_delay_ns;
	__u64 paced_delay_max_ns;
	__u64 horizon_drops;
};

/* Per-limit, per-CPU state: counters, and the token cache of a key-less limit. */
struct rl_limit_cpu {
	struct rl_stats stats;
	struct rl_cache cache;
};

/* A bucket of a keyed limit. */
struct rl_bucket_key {
	__u32 limit;
	__u32 gen;
	__u32 addr[4];		/* address (IPv4 as ::ffff:a.b.c.d) or {class, port} */
};

/* A bucket's shared pool: see struct rl_params. Updated with compare-and-swap. */
struct rl_pool {
	__u64 v_empty;
};

/* One way of rl_buckets: a keyed bucket's pool and its tag (rl_bucket_tag:
 * bits of the key's hash, the limit's id and the low byte of its
 * generation; never 0). Tag 0: the way is empty. */
struct rl_bucket_way {
	struct rl_pool pool;
	__u64 tag;
};

/* One set of rl_buckets: the keyed buckets whose hash selects it. 64
 * bytes, page-aligned in the map: a lookup reads one cache line. */
struct rl_bucket_set {
	struct rl_bucket_way way[RL_BUCKET_WAYS];
};

/* The keys of one set of rl_buckets, way by way: written when a key takes
 * a way, read only by user space (status, metrics, the agent's writes),
 * which checks each against its way's tag. */
struct rl_bucket_keyset {
	struct rl_bucket_key key[RL_BUCKET_WAYS];
};

/* What the data path remembers of a keyed bucket after rl_buckets may have
 * evicted it (rl_tombstones): its fingerprint (bits of its hash, never 0)
 * and when it will be full again, in units of 2^RL_TOMB_SHIFT ns of its
 * limit's clock, rounded up, modulo 2^32 (208 days). A bucket that is full
 * by then owes nothing: forgetting it costs nothing. No bucket owes more
 * than its burst's worth of time (RL_MAX_BURST_SECONDS) and a paced
 * limit's horizon: a full_at further ahead is a stale entry seen through
 * the wrap, and owes nothing. */
struct rl_tomb {
	__u32 fp;
	__u32 full_at;
};

/* One set of rl_tombstones: the buckets whose hash selects it. */
struct rl_tomb_set {
	struct rl_tomb way[RL_TOMB_WAYS];
};

/* One slot of the per-CPU keyed-bucket cache. */
struct rl_key_slot {
	struct rl_bucket_key key;
	struct rl_cache cache;
	/* Of a limit that records hot keys (rl_limit.hot): the last tick in
	 * which this bucket was short on this CPU, and the units it turned
	 * away in that tick (rl_hot_note). */
	__u32 hot_tick;
	/* The limit's ov_epoch when this CPU last looked the key's override
	 * up, shifted left by one, | 1 if it found one (rl_key_override). */
	__u32 ov;
	__u64 hot_short;
};

/* A key's own node share (rl_overrides): its rate, burst and virtual
 * clock, in place of the limit's params, with a seq of its own. */
struct rl_override {
	struct rl_params params;
	__u32 seq;
	__u32 pad;
	/* Units the key's bucket handed out (leases, draws) under this
	 * override, for user space to measure the key's use of its share
	 * (once a lease, not a packet). A write of the override starts it
	 * at 0. */
	__u64 leased;
};

/* A hot key: a keyed bucket that was short on this CPU in two consecutive
 * ticks, recorded once a tick (rl_hot): its key, the first of the two
 * ticks, and the units it turned away in that tick. What it admitted is its
 * share (it was short). */
struct rl_hot_rec {
	struct rl_bucket_key key;
	__u32 tick;
	__u32 pad;
	__u64 short_units;
};

/* One set of the per-CPU keyed-bucket cache: the buckets whose hash selects
 * it, least recently used replaced first. What a packet of a key the set
 * does not hold reads is its first line: the ways' hashes, which way was
 * used last and which ways may hold tokens (rl_key_find, and the way it
 * takes then, rl_check); the ways themselves it only writes. A flood of
 * new sources then costs one line of this cache a packet, not three. */
struct rl_key_set {
	__u64 tag[RL_KEY_CACHE_WAYS];	/* rl_hash of each way's key; 0: never taken */
	__u32 mru;	/* the way used last */
	/* Bit w: way w leased tokens since its key took it (it may hold
	 * some, to give back when another key takes the way). */
	__u32 leased;
	struct rl_key_slot way[RL_KEY_CACHE_WAYS];
};

/* Counters that belong to no limit, per CPU. */
struct rl_global_stats {
	__u64 match_overflow;	/* packets that matched more than RL_MAX_MATCH limits */
	__u64 lease_contended;	/* leases that gave up after RL_CAS_TRIES */
	__u64 pool_full;	/* new keys that lost the race for their set's ways to other CPUs (rl_bucket_claim) */
	__u64 l4_unknown;	/* IP packets whose transport header could not be found */
	__u64 fail_closed;	/* dropped: matched a drop limit beyond RL_MAX_MATCH */
	__u64 protected_packets; /* passed by a protect rule before classification */
	__u64 frag_first;	/* first fragments recorded for their later fragments */
	__u64 frag_unseen;	/* later fragments whose first fragment was not seen */
	__u64 cache_bypass;	/* keyed checks that found both ways of their set taken by the same packet */
	__u64 reject_rst;	/* action reject: TCP RST/ACKs sent */
	__u64 reject_icmp;	/* action reject: ICMP and ICMPv6 port unreachables sent */
	__u64 reject_budget;	/* action reject: dropped unanswered, the reply budget spent */
	__u64 reject_unanswered; /* action reject: dropped unanswered, the packet may not be answered there */
	__u64 reject_dest_budget; /* action reject: dropped unanswered, the reply's destination had its replies */
	__u64 reject_not_local;	/* action reject: dropped unanswered, not to this interface's MAC or not to an address of the node's */
	__u64 endpoint_src_mismatch; /* endpoint egress: from an address that is not the endpoint's (rl_endpoint_source) */
	__u64 hot_records;	/* hot keys recorded (rl_hot): the next one goes to hot_records % RL_HOT_RING */
};

/* The node's budget of replies to rejected packets (reject.h). Written by
 * user space, interval and tolerance; tat by the data path. */
struct rl_reject_budget {
	__u64 tat;		/* the theoretical arrival time of the next reply, ns */
	__u64 interval_ns;	/* 1e9 / the replies per second; 0: no replies */
	__u64 tolerance_ns;	/* burst x interval, at least a tick: how far tat may run ahead */
	__u64 dest_interval_ns;	/* per destination (rl_reply_dest): 1e9 / its replies per second; 0: no replies */
	__u64 dest_tolerance_ns; /* per destination: its burst x its interval, at least a tick */
};

/* What the agent knows of a limit, for `rlagent status` to read from the
 * pins while the agent is down. Written by user space only. */
struct rl_limit_meta {
	char name[64];
	__u64 global_rate;	/* units/s over all replicas */
	__u64 global_burst;
	__u32 replicas;		/* observed count the share was divided by */
	__u32 local;		/* service scope: replicas on this node */
	__s64 observed_unix_ns;	/* when the count was last confirmed; 0: never */
	__u8 scope;		/* 0 static, 1 file, 2 nodes, 3 service */
	__u8 stale;		/* the count source failed on its last read */
	__u8 state;		/* enum rl_meta_state */
	__u8 pad[5];
	/* Counters at the agent's last snapshot, for per-second rates. */
	__s64 snap_unix_ns;
	__u64 snap_admitted;
	__u64 snap_dropped;
	__u64 snap_shadow;
	/* Why the limit is clamped or not applied (enum rl_meta_state); empty
	 * when it is applied as configured. NUL-terminated. */
	char note[128];
};

/* What became of a limit the agent was asked to enforce. */
enum rl_meta_state {
	RL_META_APPLIED = 0,	/* enforced at its share */
	RL_META_CLAMPED = 1,	/* enforced, its share clamped to the data path's range */
	RL_META_REJECTED = 2,	/* not enforced: it does not fit (note says why) */
};

struct rl_test_clock {
	__u64 now;
	__u64 step;		/* added to now before each packet */
};

#endif /* RL_COMMON_H */
