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
 * otherwise (for the counters). */
static __always_inline int rl_frag_resolve(struct pkt *p)
{
	struct rl_frag_key k = {};
	struct rl_frag_info *fi;

	if (p->frag == RL_FRAG_NONE)
		return 0;
	rl_frag_key_of(p, &k);
	if (p->frag == RL_FRAG_FIRST) {
		struct rl_frag_info v = {
			.sport = p->sport,
			.dport = p->dport,
			.pclass = p->pclass,
			.has_ports = p->has_ports,
			.l4_unknown = p->l4_unknown,
		};

		bpf_map_update_elem(&rl_frags, &k, &v, BPF_ANY);
		return 1;
	}
	fi = bpf_map_lookup_elem(&rl_frags, &k);
	if (fi) {
		p->sport = fi->sport;
		p->dport = fi->dport;
		p->pclass = fi->pclass;
		p->has_ports = fi->has_ports;
		p->l4_unknown |= fi->l4_unknown; /* an IPv4 TCP offset 1 stays unknown */
		return 0;
	}
	p->l4_unknown = 1;
	/* After an IPv6 fragment header, "other" may be an extension header
	 * that hides the transport protocol. */
	if (p->family == 6 && p->pclass == RL_PROTO_OTHER)
		p->pclass = RL_PROTO_UNKNOWN;
	return 2;
}

#endif /* RL_FRAG_H */
