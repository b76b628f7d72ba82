/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Fragments. Only the first fragment of a datagram carries its transport
 * header; later ones would match no port-restricted limit and walk around
 * it (a byte limit on a UDP port saw one fragment in ~44 of a large
 * datagram). So the first fragment leaves its transport fields in rl_frags,
 * keyed by the datagram's identity (RFC 791 / RFC 8200), and later fragments
 * take them from there: every fragment is charged to the limits its datagram
 * matches. A later fragment whose first was not seen (reordered, evicted,
 * or never sent) is L4-unknown.
 */
#ifndef RL_FRAG_H
#define RL_FRAG_H

#include "common.h"
#include "parse.h"
#include "maps.h"
#include "clock.h"

/* How long a record stands for its datagram: as long as the kernel keeps
 * an incomplete datagram (net.ipv4.ipfrag_time, 30 s by default; IPv6's is
 * 60 s). An older record is treated as absent: its later fragments are
 * L4-unknown, so a reused identification can only be charged to more
 * limits, never to the wrong ones. */
#define RL_FRAG_TTL_NS (30 * NSEC_PER_SEC)

/* rl_frag_info.next after the last fragment: no offset (13 bits) is it. */
#define RL_FRAG_DONE 0xffff

static __always_inline void rl_frag_key_of(const struct pkt *p, struct rl_frag_key *k)
{
	__builtin_memcpy(k->src, p->src, sizeof(k->src));
	__builtin_memcpy(k->dst, p->dst, sizeof(k->dst));
	k->id = p->frag_id;
	k->family = p->family;
	k->proto = p->family == 4 ? p->proto : 0;
}

/* Records a first fragment, or completes a later one. Returns 1 for a first
 * fragment recorded, 2 for a later fragment whose first was not seen, 0
 * otherwise (for the counters).
 *
 * A record is only trusted for the datagram it was made for, and only
 * while that datagram's fragments come in order:
 * - a fragment that does not start where the one before it ended (reordered,
 *   a gap, or overlapping, which makes the kernel drop the datagram: a
 *   later datagram reusing the identification would otherwise inherit the
 *   record) is L4-unknown, and so are the datagram's fragments after it;
 * - after the last fragment (offset > 0, no more to come) no later fragment
 *   is in order: a later datagram that reuses the identification (IPv4 has
 *   16 bits of it) does not inherit the record, and its first fragment
 *   replaces it (or, if it names other ports, leaves it unknown, below);
 * - it expires with the kernel's reassembly (RL_FRAG_TTL_NS);
 * - two first fragments of one datagram that disagree (a sender racing the
 *   kernel's reassembly with a second offset-0 fragment to another port:
 *   the kernel keeps the first as a duplicate, or drops the datagram as an
 *   overlap) leave it L4-unknown: neither is trusted.
 * The clock is read here, on fragments only, and kept for the decision. */
static __always_inline int rl_frag_resolve(struct pkt *p, __u64 *clock)
{
	struct rl_frag_key k = {};
	struct rl_frag_info *fi;
	__u64 now;

	if (p->frag == RL_FRAG_NONE)
		return 0;
	now = rl_now(clock);
	rl_frag_key_of(p, &k);
	fi = bpf_map_lookup_elem(&rl_frags, &k);
	if (fi && now - fi->seen_ns > RL_FRAG_TTL_NS)
		fi = NULL;
	if (p->frag == RL_FRAG_FIRST) {
		struct rl_frag_info v = {
			.seen_ns = now,
			.sport = p->sport,
			.dport = p->dport,
			.pclass = p->pclass,
			.has_ports = p->has_ports,
			.l4_unknown = p->l4_unknown,
			.next = p->frag_len >> 3,
		};

		if (fi && (fi->sport != v.sport || fi->dport != v.dport || fi->pclass != v.pclass ||
			   fi->has_ports != v.has_ports || fi->l4_unknown != v.l4_unknown)) {
			v.has_ports = 0;
			v.l4_unknown = 1;
			if (fi->pclass != v.pclass)
				v.pclass = RL_PROTO_UNKNOWN;
		}
		bpf_map_update_elem(&rl_frags, &k, &v, BPF_ANY);
		return 1;
	}
	if (fi) {
		if (p->frag_start != fi->next) {
			/* Out of order: this fragment and the rest are unknown. */
			fi->has_ports = 0;
			fi->l4_unknown = 1;
			if (p->family == 6)
				fi->pclass = RL_PROTO_UNKNOWN;
		}
		fi->next = p->frag == RL_FRAG_LAST ? RL_FRAG_DONE : p->frag_start + (p->frag_len >> 3);
		p->sport = fi->sport;
		p->dport = fi->dport;
		p->pclass = fi->pclass;
		p->has_ports = fi->has_ports;
		p->l4_unknown |= fi->l4_unknown; /* an IPv4 TCP offset 1 stays unknown */
		return 0;
	}
	p->l4_unknown = 1;
	/* An IPv6 datagram's protocol is the one its first fragment names
	 * (RFC 8200, 4.5): a later fragment's next header is the sender's word
	 * only. IPv4 fragments carry the protocol in their IP header, and the
	 * kernel reassembles only fragments that agree on it. */
	if (p->family == 6)
		p->pclass = RL_PROTO_UNKNOWN;
	return 2;
}

#endif /* RL_FRAG_H */
