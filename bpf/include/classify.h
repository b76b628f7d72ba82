/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The classifier: which limits a packet may be charged to, before any
 * bucket is looked at.
 *
 * User space (maps/classifier.go) compiles the limits into bitmasks of
 * limit ids: one per protocol class and destination port (rl_config and
 * rl_ports), one per hook, and one per source and destination prefix in the
 * prefix tables (rl_src4/6, rl_dst4/6, with the IPv4 heads). A packet's
 * candidates are the AND of its protocol and port's mask with its hook's,
 * narrowed by the prefix tables only for the limits that name prefixes
 * (rl_classify). Protect rules (rl_protected) are looked at first: a packet
 * they name is no limit's.
 *
 * Owns: rl_protected, rl_prefix_limits, rl_classify_cidr, rl_classify, and
 * the walk over its candidates (rl_walk_start, rl_walk_next). Relies
 * on maps.h (the tables) and the packet of parse.h; reads only.
 */
#ifndef RL_CLASSIFY_H
#define RL_CLASSIFY_H

#include "common.h"
#include "parse.h"
#include "maps.h"

/* Protect rules: does one name this packet? Its peer is the source on
 * ingress and the destination on egress; its local port the destination
 * port on ingress, the source port on egress. A rule names no port
 * (protect_portless: any packet of its peers) or local or remote TCP/UDP
 * ports (rl_protect_ports), and may be restricted to peer prefixes
 * (protect_peers, rl_protect4/6). A rule exempts only the node's own
 * traffic (docs/datapath.md, Protect rules): at the uplinks' ingress (XDP
 * and TC) a packet to one of the node's addresses (rl_local, flag node);
 * at an uplink's TC egress one from a node address with a local socket;
 * at the endpoints' hooks nothing. */
static __always_inline bool rl_protected(const struct pkt *p, const struct rl_config *cfg, __u32 hook)
{
	__u32 dir = hook & 1;
	__u32 rules = cfg->protect_portless;
	const __u32 *peer = dir == RL_DIR_INGRESS ? p->src : p->dst;

	/* The node's own control traffic only: never at an endpoint's
	 * interface (a pod's ports are not the node's). */
	if (hook >> 1 != RL_ATTACH_UPLINK)
		return false;

	if (p->has_ports) {
		__u32 local = dir == RL_DIR_INGRESS ? p->dport : p->sport;
		__u32 remote = dir == RL_DIR_INGRESS ? p->sport : p->dport;
		__u32 idx, *m;

		idx = p->pclass * RL_PORT_SPACE + local;
		m = bpf_map_lookup_elem(&rl_protect_ports, &idx);
		if (m)
			rules |= *m;
		idx = RL_PROTECT_SIDE + p->pclass * RL_PORT_SPACE + remote;
		m = bpf_map_lookup_elem(&rl_protect_ports, &idx);
		if (m)
			rules |= *m;
	}
	if (rules & cfg->protect_peers) {
		__u32 *m = NULL;

		if (p->family == 4) {
			struct rl_lpm4 k = { .prefixlen = 32, .addr = peer[3] };
			m = bpf_map_lookup_elem(&rl_protect4, &k);
		} else if (p->family == 6) {
			struct rl_lpm6 k = { .prefixlen = 128 };
			__builtin_memcpy(k.addr, peer, sizeof(k.addr));
			m = bpf_map_lookup_elem(&rl_protect6, &k);
		}
		rules &= ~cfg->protect_peers | (m ? *m : 0);
	}
	if (!rules)
		return false;
	/* Arriving: to one of the node's own addresses (not an endpoint's).
	 * Leaving: from one, and sent by a socket of this host; a forwarded
	 * packet has none, also after SNAT gave it the node's address. */
	if (dir == RL_DIR_INGRESS)
		return rl_local_flags(p->family, p->dst) & RL_LOCAL_NODE;
	return p->sk && (rl_local_flags(p->family, p->src) & RL_LOCAL_NODE);
}

/* The limits whose prefixes of one side cover addr: for IPv4 the first
 * stage's entry of its /16 (rl_head4) when no longer prefix lies in that
 * /16, else the longest-prefix match of the trie (IPv4 or IPv6); an empty
 * set when no prefix covers it. */
static __always_inline struct rl_mask rl_prefix_limits(void *head4, void *trie4, void *trie6, __u8 family,
						       const __u32 addr[4])
{
	struct rl_mask none = {}, *m;

	if (family == 4) {
		__u32 idx = bpf_ntohl(addr[3]) >> (32 - RL_HEAD4_BITS);
		struct rl_head4 *h = bpf_map_lookup_elem(head4, &idx);

		if (h && !h->deep)
			return h->m;
		struct rl_lpm4 k = { .prefixlen = 32, .addr = addr[3] };
		m = bpf_map_lookup_elem(trie4, &k);
	} else {
		struct rl_lpm6 k = { .prefixlen = 128 };
		__builtin_memcpy(k.addr, addr, sizeof(k.addr));
		m = bpf_map_lookup_elem(trie6, &k);
	}
	return m ? *m : none;
}

/* Narrows the candidates to the limits whose source (destination) CIDRs
 * contain the packet's address, for the candidates restricted by them. A
 * missing prefix leaves src/dst zero: the restricted limits drop out, and so
 * do they for a frame whose addresses were not reached (family 0). */
static __always_inline void rl_classify_cidr(const struct pkt *p, const struct rl_config *cfg,
					     bool need_src, bool need_dst, struct rl_mask *out)
{
	struct rl_mask src = {}, dst = {};

	if (p->family) {
		if (need_src)
			src = rl_prefix_limits(&rl_src4_head, &rl_src4, &rl_src6, p->family, p->src);
		if (need_dst)
			dst = rl_prefix_limits(&rl_dst4_head, &rl_dst4, &rl_dst6, p->family, p->dst);
	}

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
 * packet with ports needs no rl_proto_any lookup; a packet without ports
 * reads its class's entry of rl_proto_any, the "any port" entry if its
 * ports are unknown), ANDed with the hook's limits, less the connections
 * limits unless the packet is a connection attempt; then source and
 * destination prefixes, only if a candidate is restricted by them.
 *
 * Connection attempts: a TCP SYN without ACK, RST or FIN, or an L4-unknown
 * packet (it could be one). User space puts a connections limit in the TCP
 * entries only (and in the L4-unknown entries of TCP and of an unknown
 * protocol), so only a TCP packet can find one among its candidates that
 * is not its: the others skip the mask. */
static __always_inline bool rl_classify(const struct pkt *p, const struct rl_config *cfg,
					__u32 hook, struct rl_mask *out)
{
	__u64 need_src = 0, need_dst = 0;
	bool keep_conn = p->pclass != RL_PROTO_TCP || (p->syn | p->l4_unknown);
	struct rl_mask *m;
	__u32 idx;

	if (hook >= RL_HOOKS)
		return false;
	/* Two call sites, kept apart (barrier_var): merged into one call with
	 * either map, the verifier could no longer inline the array lookup. */
	if (p->has_ports) {	/* TCP or UDP */
		idx = p->pclass * RL_PORT_SPACE + p->dport;
		m = bpf_map_lookup_elem(&rl_ports, &idx);
		barrier_var(m);
	} else {
		idx = p->pclass + (p->l4_unknown ? RL_PROTO_CLASSES : 0);
		m = bpf_map_lookup_elem(&rl_proto_any, &idx);
		barrier_var(m);
	}
	if (!m)
		return false;

#pragma unroll
	for (int w = 0; w < RL_MASK_WORDS; w++) {
		__u64 c = m->w[w] & cfg->hook[hook].w[w];

		if (!keep_conn)
			c &= ~cfg->conn.w[w];
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

_Static_assert(RL_MASK_WORDS == 2, "rl_classify and the walk read two mask words");

static __always_inline __u32 rl_ctz64(__u64 x)
{
	return rl_debruijn[((x & -x) * 0x03F79D71B4CA8B09ULL) >> 58];
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

/* The candidates the walk has not reached. */
static __always_inline bool rl_walk_rest_has(const struct rl_walk *it, const struct rl_mask *cand,
					     const struct rl_mask *of)
{
	if (it->w)
		return (it->bits & of->w[1]) != 0;
	return ((it->bits & of->w[0]) | (cand->w[1] & of->w[1])) != 0;
}

#endif /* RL_CLASSIFY_H */
