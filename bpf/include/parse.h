/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Packet parsing with cursor helpers. Each helper checks its own bounds and
 * returns the next protocol, or -1 when the packet is too short or not one we
 * read. A packet that does not parse is never limited: it passes untouched.
 */
#ifndef RL_PARSE_H
#define RL_PARSE_H

#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/in.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include "common.h"

#define RL_MAX_VLAN 2		/* 802.1ad outer + 802.1Q inner */
#define RL_MAX_EXTHDRS 6	/* IPv6 extension headers followed before giving up */

#ifndef ETH_P_8021AD
#define ETH_P_8021AD 0x88A8
#endif

struct cursor {
	void *pos;
};

struct vlan_hdr {
	__be16 tci;
	__be16 encap_proto;
};

/* What the classifier needs of a packet. Addresses are 128-bit, IPv4 mapped
 * as ::ffff:a.b.c.d, in network byte order. */
struct pkt {
	__u32 src[4];
	__u32 dst[4];
	__u32 len;		/* frame length */
	__u16 dport;		/* host byte order; valid when has_ports */
	__u8 pclass;		/* enum rl_proto_class */
	__u8 family;		/* 4 or 6 */
	__u8 has_ports;
};

static __always_inline int parse_eth(struct cursor *c, void *end)
{
	struct ethhdr *eth = c->pos;
	__u16 proto;

	if ((void *)(eth + 1) > end)
		return -1;
	c->pos = eth + 1;
	proto = eth->h_proto;

#pragma unroll
	for (int i = 0; i < RL_MAX_VLAN; i++) {
		struct vlan_hdr *vh = c->pos;

		if (proto != bpf_htons(ETH_P_8021Q) && proto != bpf_htons(ETH_P_8021AD))
			break;
		if ((void *)(vh + 1) > end)
			return -1;
		c->pos = vh + 1;
		proto = vh->encap_proto;
	}
	return bpf_ntohs(proto);
}

/* Returns the L4 protocol. *l4 is false for a non-first fragment, which has no
 * L4 header. */
static __always_inline int parse_ipv4(struct cursor *c, void *end, struct pkt *p, bool *l4)
{
	struct iphdr *ip = c->pos;
	__u32 hlen;

	if ((void *)(ip + 1) > end)
		return -1;
	hlen = ip->ihl * 4;
	if (ip->version != 4 || hlen < sizeof(*ip))
		return -1;
	if (c->pos + hlen > end)
		return -1;
	c->pos += hlen;

	p->family = 4;
	p->src[2] = bpf_htonl(0xffff);
	p->src[3] = ip->saddr;
	p->dst[2] = bpf_htonl(0xffff);
	p->dst[3] = ip->daddr;
	*l4 = !(ip->frag_off & bpf_htons(0x1fff));
	return ip->protocol;
}

struct ipv6_exthdr {
	__u8 nexthdr;
	__u8 hdrlen;
	__be16 frag_off;	/* fragment header only */
};

static __always_inline int parse_ipv6(struct cursor *c, void *end, struct pkt *p, bool *l4)
{
	struct ipv6hdr *ip6 = c->pos;
	int nexthdr;

	if ((void *)(ip6 + 1) > end)
		return -1;
	if (ip6->version != 6)
		return -1;
	c->pos = ip6 + 1;

	p->family = 6;
	__builtin_memcpy(p->src, &ip6->saddr, sizeof(p->src));
	__builtin_memcpy(p->dst, &ip6->daddr, sizeof(p->dst));
	*l4 = true;
	nexthdr = ip6->nexthdr;

#pragma unroll
	for (int i = 0; i < RL_MAX_EXTHDRS; i++) {
		struct ipv6_exthdr *h = c->pos;

		switch (nexthdr) {
		case IPPROTO_HOPOPTS:
		case IPPROTO_ROUTING:
		case IPPROTO_DSTOPTS:
			if ((void *)(h + 1) > end)
				return -1;
			nexthdr = h->nexthdr;
			c->pos += (h->hdrlen + 1) * 8;
			break;
		case IPPROTO_AH:
			if ((void *)(h + 1) > end)
				return -1;
			nexthdr = h->nexthdr;
			c->pos += (h->hdrlen + 2) * 4;
			break;
		case IPPROTO_FRAGMENT:
			/* 8 bytes: nexthdr, reserved, offset|flags, identification */
			if (c->pos + 8 > end)
				return -1;
			nexthdr = h->nexthdr;
			if (h->frag_off & bpf_htons(0xfff8))
				*l4 = false;
			c->pos += 8;
			break;
		default:
			return nexthdr;
		}
	}
	/* The last header followed may be followed by a seventh: not parsed. */
	switch (nexthdr) {
	case IPPROTO_HOPOPTS:
	case IPPROTO_ROUTING:
	case IPPROTO_DSTOPTS:
	case IPPROTO_AH:
	case IPPROTO_FRAGMENT:
		return -1;
	}
	return nexthdr;
}

/* Fills p from the packet. Returns 0, or -1 when the packet is not parsed
 * (too short at some header, not IP, or unreadable), in which case it must be
 * passed untouched. */
static __always_inline int parse_packet(void *data, void *end, struct pkt *p)
{
	struct cursor c = { .pos = data };
	bool l4 = false;
	int proto;

	p->len = end - data;
	proto = parse_eth(&c, end);
	if (proto == ETH_P_IP)
		proto = parse_ipv4(&c, end, p, &l4);
	else if (proto == ETH_P_IPV6)
		proto = parse_ipv6(&c, end, p, &l4);
	else
		return -1;
	if (proto < 0)
		return -1;

	/* A non-first fragment keeps its protocol class but has no ports: limits
	 * on ports do not match it, limits on the protocol alone do. */
	switch (proto) {
	case IPPROTO_TCP: {
		struct tcphdr *th = c.pos;

		p->pclass = RL_PROTO_TCP;
		if (!l4)
			break;
		if ((void *)(th + 1) > end)
			return -1;
		p->dport = bpf_ntohs(th->dest);
		p->has_ports = 1;
		break;
	}
	case IPPROTO_UDP: {
		struct udphdr *uh = c.pos;

		p->pclass = RL_PROTO_UDP;
		if (!l4)
			break;
		if ((void *)(uh + 1) > end)
			return -1;
		p->dport = bpf_ntohs(uh->dest);
		p->has_ports = 1;
		break;
	}
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		p->pclass = RL_PROTO_ICMP;
		/* type, code, checksum and 4 bytes of rest-of-header */
		if (l4 && c.pos + 8 > end)
			return -1;
		break;
	default:
		p->pclass = RL_PROTO_OTHER;
	}
	return 0;
}

#endif /* RL_PARSE_H */
