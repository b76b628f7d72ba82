/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The maps of the data path. User space (package maps) pins them by name and
 * is the only writer of the classifier and limit maps; the data path writes
 * pools, caches, tombstones and counters.
 */
#ifndef RL_MAPS_H
#define RL_MAPS_H

#include "common.h"

/* struct rl_local_key -> enum rl_local_flag bits: the addresses this node
 * owns or delivers (its own, its local endpoints'), written by the agent
 * from netlink and its endpoints. HASH: exact /32 and /128 addresses, few
 * and sparse. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, RL_MAX_LOCAL);
	__type(key, struct rl_local_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_local SEC(".maps");

/* What the address a (IPv4 in a[3]) of family is to this node: enum
 * rl_local_flag bits, 0 when it is not the node's. */
static __always_inline __u32 rl_local_flags(__u8 family, const __u32 *a)
{
	struct rl_local_key k = {};
	__u32 *v;

	k.family = family;
	if (family == 4) {
		k.a[3] = a[3];
	} else {
		k.a[0] = a[0];
		k.a[1] = a[1];
		k.a[2] = a[2];
		k.a[3] = a[3];
	}
	v = bpf_map_lookup_elem(&rl_local, &k);
	return v ? *v : 0;
}

/* ifindex -> struct rl_mac: the MAC address of each interface the
 * agent attached to, which XDP cannot read from its context. HASH:
 * ifindexes are sparse. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, RL_MAX_IFACES);
	__type(key, __u32);
	__type(value, struct rl_mac);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_if_mac SEC(".maps");

/* struct rl_ep_key -> struct rl_ep_addr: the addresses of the local
 * endpoint behind each interface that tc_endpoint_out runs on, and per
 * interface and family the one its packets from other addresses are
 * charged as (rl_endpoint_source). Written by the agent from the same
 * routes and neighbour entries that place the endpoints' limits. HASH: a
 * few entries per endpoint. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, RL_MAX_EP_SRC);
	__type(key, struct rl_ep_key);
	__type(value, struct rl_ep_addr);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_ep_src SEC(".maps");

/* limit id -> struct rl_limit. ARRAY: inlined lookup, ids are dense. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, RL_MAX_LIMITS);
	__type(key, __u32);
	__type(value, struct rl_limit);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_limits SEC(".maps");

/* 0 -> struct rl_config. ARRAY of one: inlined lookup. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rl_config);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_cfg SEC(".maps");

/* enum rl_proto_class -> limits matching every packet of that class (no port
 * restriction); RL_PROTO_CLASSES + class -> every limit of the class, for
 * packets whose ports are unknown (see RL_PROTO_ANY_ENTRIES). ARRAY: inlined
 * lookup. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, RL_PROTO_ANY_ENTRIES);
	__type(key, __u32);
	__type(value, struct rl_mask);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_proto_any SEC(".maps");

/* class x 65536 + dport -> limits restricted to that port (TCP and UDP only).
 * ARRAY rather than a hash: a port range is expanded into its ports once, and
 * the per-packet lookup is an inlined index, whatever the number of limits. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2 * RL_PORT_SPACE);
	__type(key, __u32);
	__type(value, struct rl_mask);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_ports SEC(".maps");

/* Source / destination prefix -> limits whose CIDR list covers it. LPM_TRIE:
 * longest match; user space ORs the masks of covering prefixes into each
 * entry. Consulted only when a candidate limit restricts that side. */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 4096);
	__type(key, struct rl_lpm4);
	__type(value, struct rl_mask);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_src4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 4096);
	__type(key, struct rl_lpm4);
	__type(value, struct rl_mask);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_dst4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 4096);
	__type(key, struct rl_lpm6);
	__type(value, struct rl_mask);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_src6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 4096);
	__type(key, struct rl_lpm6);
	__type(value, struct rl_mask);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_dst6 SEC(".maps");

/* The first stage of rl_src4 / rl_dst4: an address's first RL_HEAD4_BITS
 * bits -> the answer of the trie for the whole /16, unless a longer prefix
 * lies in it (struct rl_head4). ARRAY: an inlined index where a trie lookup
 * is a helper call walking up to 32 nodes (~20 ns). User space writes it
 * from the same prefixes as the tries. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1 << RL_HEAD4_BITS);
	__type(key, __u32);
	__type(value, struct rl_head4);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_src4_head SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1 << RL_HEAD4_BITS);
	__type(key, __u32);
	__type(value, struct rl_head4);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_dst4_head SEC(".maps");

/* limit id -> counters and the token cache of a key-less limit.
 * PERCPU: written from softirq on one CPU, no atomics needed. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, RL_MAX_LIMITS);
	__type(key, __u32);
	__type(value, struct rl_limit_cpu);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_percpu SEC(".maps");

/* limit id -> struct rl_pace_stats. PERCPU: updated on the paced path
 * only, on the CPU that decided the packet. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, RL_MAX_LIMITS);
	__type(key, __u32);
	__type(value, struct rl_pace_stats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_pace SEC(".maps");

/* limit id -> shared pool of a key-less limit. ARRAY: inlined lookup; the
 * value is changed only by compare-and-swap on the lease path. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, RL_MAX_LIMITS);
	__type(key, __u32);
	__type(value, struct rl_pool);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_pools SEC(".maps");

/* hash(limit, gen, key) -> a set of RL_BUCKET_WAYS keyed buckets' shared
 * pools (rl_bucket_pool). ARRAY: a fixed-size table whose set is an inlined
 * index and whose ways are found by tag, with no element to allocate and no
 * list to keep; a new key takes an empty way, else one whose bucket is
 * full, else the one full soonest (its tombstone remembers it: see
 * rl_tombstones). BPF_F_MMAPABLE: the sets are page-aligned, each on a
 * cache line of its own, and the agent changes a way with the same
 * compare-and-swap as the data path. The number of sets is set by user
 * space at load time (a power of two, rl_bucket_mask). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 8192);
	__type(key, __u32);
	__type(value, struct rl_bucket_set);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_buckets SEC(".maps");

/* The same set -> the keys of its ways, for user space: written when a key
 * takes a way, never read by the data path. ARRAY of rl_buckets' size. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 8192);
	__type(key, __u32);
	__type(value, struct rl_bucket_keyset);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_bucket_keys SEC(".maps");

/* hash(bucket) & mask -> a set of RL_KEY_CACHE_WAYS buckets' tokens leased
 * by this CPU. PERCPU set-associative cache: the fast path of a keyed limit
 * is an inlined index and a tag compare per way, no hash map walk and no
 * atomic. Two ways keep two keys that hash alike from taking the slot from
 * each other on every packet (with one way, 11% of 1,000 keys did). A key
 * that finds its set full takes the least recently used way and hands that
 * bucket's tokens back, if the way leased any (struct rl_key_set). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, RL_KEY_CACHE_SETS);
	__type(key, __u32);
	__type(value, struct rl_key_set);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_key_cache SEC(".maps");

/* hash(bucket) -> up to RL_TOMB_WAYS keyed buckets that owe tokens (struct
 * rl_tomb): a bucket created for a key whose fingerprint is in its set had
 * a bucket before, evicted since. It counts as returned_keys and starts
 * where the evicted one would be now: empty until the time it noted, full
 * then, not with a fresh burst. A bucket notes itself at each lease; it
 * takes a way that owes nothing, never one that owes. ARRAY sized by user space (a power of two, rl_tombstone_mask): a
 * key the sets cannot hold is forgotten, and then counts as new and starts
 * full. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct rl_tomb_set);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_tombstones SEC(".maps");

/* (limit, gen, key) -> the key's own node share, for the keys of a limit
 * with share demand that the allocation gives more or less than the
 * limit's equal share. HASH: user space writes it (and bumps the limit's
 * ov_epoch); a CPU looks a key up when it takes the key's cache way and
 * when the epoch moved, and on each lease only for the keys that have one:
 * the others cost no lookup. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, RL_MAX_OVERRIDES);
	__type(key, struct rl_bucket_key);
	__type(value, struct rl_override);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_overrides SEC(".maps");

/* The hot keys this CPU recorded, a ring of RL_HOT_RING (the next record
 * goes to rl_global_stats.hot_records % RL_HOT_RING): a key is recorded at
 * most once a tick on a CPU, and only when its bucket was short in two
 * consecutive ticks, so that a flood of keys that each send a packet or two
 * records nothing, and the ring's size bounds what a flood of hot ones
 * writes. User space reads the records of the ticks since its last read. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, RL_HOT_RING);
	__type(key, __u32);
	__type(value, struct rl_hot_rec);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_hot SEC(".maps");

/* 0 -> counters that belong to no limit. PERCPU: no atomics. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rl_global_stats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_global SEC(".maps");

/* limit id -> struct rl_limit_meta. Never read by the data path: it is
 * pinned with the other maps so that status works while the agent is down. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, RL_MAX_LIMITS);
	__type(key, __u32);
	__type(value, struct rl_limit_meta);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_meta SEC(".maps");

/* Datagram (src, dst, id, protocol) -> transport fields of its first
 * fragment, for its later fragments, which carry none. LRU_HASH: written only
 * by first fragments, bounded; an entry evicted before its later fragments
 * arrive makes them L4-unknown (charged to more limits, never to fewer).
 * Shared by all CPUs: fragments of one datagram may arrive on different ones. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct rl_frag_key);
	__type(value, struct rl_frag_info);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_frags SEC(".maps");

/* Protect rules by port: side x RL_PROTECT_SIDE + class x 65536 + port ->
 * the rules (bit i: rule i) naming that local (side 0) or remote (side 1)
 * TCP or UDP port. ARRAY: two inlined lookups per packet, and only while a
 * rule is in use (rl_config.protect_rules). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2 * RL_PROTECT_SIDE);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_protect_ports SEC(".maps");

/* Peer prefix -> the protect rules whose peer list covers it (user space ORs
 * covering prefixes in, as for rl_src4). LPM_TRIE; consulted only when a
 * candidate rule is restricted to peers. */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 1024);
	__type(key, struct rl_lpm4);
	__type(value, __u32);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_protect4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 1024);
	__type(key, struct rl_lpm6);
	__type(value, __u32);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_protect6 SEC(".maps");

#endif /* RL_MAPS_H */
