/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Packet parsing with cursor helpers. Each helper checks its own bounds and
 * returns the next protocol, or -1 when the packet is too short or not one we
 * read.
 *
 * NOTE: what a packet is to the classifier.
 * - Not IP (another ethertype), or an IP header the kernel would drop (cut
 *   short, a bad version or header length): parse_packet returns -1 and the
 *   packet passes untouched. The kernel delivers none of these to a socket.
 * - IP whose transport header cannot be found: "L4-unknown" (l4_unknown = 1).
 *   That is an IPv6 extension-header chain longer than RL_MAX_EXTHDRS or with
 *   a header this parser does not walk (RFC 7045 says such headers may be
 *   followed by TCP or UDP), a TCP or UDP header cut short by the frame or by
 *   the IP length (a tiny first fragment, RFC 1858 / 3128 / 7112), an IPv4
 *   TCP fragment at offset 1 (it can rewrite the TCP header, RFC 1858), a
 *   later fragment whose first fragment was not seen (see frag.h), and a frame
 *   with more VLAN tags than RL_MAX_VLAN (then even the addresses are unknown:
 *   family 0). The classifier charges an L4-unknown packet to every limit
 *   whose match could include it, never to none.
 * - A later fragment whose first fragment was seen takes that fragment's
 *   transport fields (frag.h): every fragment of a datagram is charged to the
 *   limits the datagram matches.
 * - At TC (rl_parse_skb) the headers may sit outside the skb's linear part:
 *   a parse that runs off its end is done again once after making up to
 *   RL_PULL_LEN bytes linear. Headers that still run past the linear part
 *   make the packet L4-unknown, as a frame cut short does at XDP; a packet is
 *   never passed unclassified because its headers were not linear.
 */
#ifndef RL_PARSE_H
#define RL_PARSE_H

#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/in.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <linux/pkt_cls.h>
#include "common.h"

#define RL_MAX_VLAN 4		/* tags walked; more make the frame L4-unknown, family 0 */
#define RL_MAX_EXTHDRS 8	/* IPv6 extension headers walked; more make the packet L4-unknown */

#ifndef ETH_P_8021AD
#define ETH_P_8021AD 0x88A8
#endif

#define RL_IP_MF 0x2000		/* IPv4 more fragments */
#define RL_IP_OFFSET 0x1fff	/* IPv4 fragment offset, 8-byte units */

/* TCP flags, in byte 13 of the header. */
#define RL_TCP_FIN 0x01
#define RL_TCP_SYN 0x02
#define RL_TCP_RST 0x04
#define RL_TCP_ACK 0x10

/* parse_packet's "the packet ended before its IP header did": at XDP the
 * frame is whole and the packet passes as any other the kernel drops; at TC
 * the rest may be outside the linear part (rl_parse_skb). */
#define RL_PARSE_SHORT -2

struct cursor {
	void *pos;
};

struct vlan_hdr {
	__be16 tci;
	__be16 encap_proto;
};

enum rl_frag {
	RL_FRAG_NONE = 0,	/* a whole datagram */
	RL_FRAG_FIRST = 1,	/* offset 0, more to come: carries the transport header */
	RL_FRAG_LATER = 2,	/* offset > 0, more to come: no transport header */
	RL_FRAG_LAST = 3,	/* offset > 0, the last: no transport header */
};

/* What the classifier needs of a packet. Addresses are 128-bit, IPv4 mapped
 * as ::ffff:a.b.c.d, in network byte order. Kept small: it sits on the
 * stack of every program, next to the decision's frames. */
struct pkt {
	__u32 src[4];
	__u32 dst[4];
	__u32 len;		/* bytes on the wire: the frame; at TC, see rl_skb_wire */
	__u32 frag_id;		/* fragments: the IP identification */
	__u16 sport;		/* host byte order; valid when has_ports */
	__u16 dport;
	__u8 pclass;		/* enum rl_proto_class */
	__u8 family;		/* 4 or 6; 0 when the IP header was not reached */
	union {
		struct {
			__u8 frag;		/* enum rl_frag */
			__u8 l4_unknown;	/* the transport header could not be found */
		};
		__u16 rare;	/* either of them: one test on the common path */
	};
	__u8 has_ports;
	__u8 proto;		/* IP protocol number (of the transport header) */
	__u16 frag_start;	/* fragments: offset, 8-byte units */
	__u16 frag_len;		/* fragments: bytes of the datagram this one carries */
	__u16 segs;		/* segments: 1, or at TC a GSO/GRO packet's (rl_skb_wire) */
	/* Bytes from the start of the frame to the end of the transport header
	 * (to its start when there is none or it was not read): what each
	 * segment of a GSO/GRO packet repeats. */
	__u16 hdr_len;
	/* A TCP SYN without ACK, RST or FIN, its whole header read: a
	 * connection attempt (RL_UNIT_CONNECTIONS). */
	__u8 syn;
	/* At an uplink's TC egress: the skb has a socket of this host (the
	 * node sends it; a forwarded packet has none). 0 elsewhere. */
	__u8 sk;
};

static __always_inline bool parse_is_vlan(__u16 proto)
{
	return proto == bpf_htons(ETH_P_8021Q) || proto == bpf_htons(ETH_P_8021AD);
}

/* More VLAN tags than RL_MAX_VLAN: not an ethertype (those are 16 bits). */
#define RL_ETH_TOO_MANY_TAGS 0x10000

/* Returns the ethertype after the VLAN tags, RL_PARSE_SHORT if the frame
 * ends first, or RL_ETH_TOO_MANY_TAGS. */
static __always_inline int parse_eth(struct cursor *c, void *end)
{
	struct ethhdr *eth = c->pos;
	__u16 proto;

	if ((void *)(eth + 1) > end)
		return RL_PARSE_SHORT;
	c->pos = eth + 1;
	proto = eth->h_proto;

#pragma unroll
	for (int i = 0; i < RL_MAX_VLAN; i++) {
		struct vlan_hdr *vh = c->pos;

		if (!parse_is_vlan(proto))
			break;
		if ((void *)(vh + 1) > end)
			return RL_PARSE_SHORT;
		c->pos = vh + 1;
		proto = vh->encap_proto;
	}
	if (parse_is_vlan(proto))
		return RL_ETH_TOO_MANY_TAGS;
	return bpf_ntohs(proto);
}

/* Returns the L4 protocol, RL_PARSE_SHORT if the frame ends inside the
 * header, or -1 for a header the kernel drops. *l3_end is where the IP
 * datagram ends (its total length), as an offset from data. */
static __always_inline int parse_ipv4(struct cursor *c, void *data, void *end, struct pkt *p,
				      __u32 *l3_end)
{
	struct iphdr *ip = c->pos;
	__u32 hlen, tot;
	__u16 frag;

	if ((void *)(ip + 1) > end)
		return RL_PARSE_SHORT;
	hlen = ip->ihl * 4;
	tot = bpf_ntohs(ip->tot_len);
	if (ip->version != 4 || hlen < sizeof(*ip) || tot < hlen)
		return -1;
	if (c->pos + hlen > end)
		return RL_PARSE_SHORT;
	*l3_end = (c->pos - data) + tot;
	c->pos += hlen;

	p->family = 4;
	p->src[2] = bpf_htonl(0xffff);
	p->src[3] = ip->saddr;
	p->dst[2] = bpf_htonl(0xffff);
	p->dst[3] = ip->daddr;
	frag = bpf_ntohs(ip->frag_off);
	if (!(frag & (RL_IP_OFFSET | RL_IP_MF)))
		return ip->protocol;	/* a whole datagram: the common case */
	p->frag_id = ip->id;
	p->frag_start = frag & RL_IP_OFFSET;
	p->frag_len = tot - hlen;
	if (frag & RL_IP_OFFSET) {
		p->frag = frag & RL_IP_MF ? RL_FRAG_LATER : RL_FRAG_LAST;
		/* Offset 1 overlaps bytes 8-15 of a TCP header (the flags). */
		if ((frag & RL_IP_OFFSET) == 1 && ip->protocol == IPPROTO_TCP)
			p->l4_unknown = 1;
	} else {
		p->frag = RL_FRAG_FIRST;
	}
	return ip->protocol;
}

struct ipv6_exthdr {
	__u8 nexthdr;
	__u8 hdrlen;
	__be16 frag_off;	/* fragment header only */
	__be32 id;		/* fragment header only */
};

/* Returns the L4 protocol, or 0 (with l4_unknown set) when the chain is too
 * long, cut short, or holds a header that is not walked; RL_PARSE_SHORT if
 * the frame ends inside the fixed header, -1 for a version the kernel drops. */
static __always_inline int parse_ipv6(struct cursor *c, void *data, void *end, struct pkt *p,
				      __u32 *l3_end)
{
	struct ipv6hdr *ip6 = c->pos;
	__u32 plen;
	int nexthdr;

	if ((void *)(ip6 + 1) > end)
		return RL_PARSE_SHORT;
	if (ip6->version != 6)
		return -1;
	c->pos = ip6 + 1;
	plen = bpf_ntohs(ip6->payload_len);
	/* 0 is a jumbogram (RFC 2675) when a hop-by-hop header follows:
	 * bounded by the frame only. Otherwise the kernel trims the packet to
	 * its fixed header (ipv6_rcv), and so does the parser. */
	if (plen)
		*l3_end = (c->pos - data) + plen;
	else
		*l3_end = ip6->nexthdr == IPPROTO_HOPOPTS ? ~0U : c->pos - data;

	p->family = 6;
	__builtin_memcpy(p->src, &ip6->saddr, sizeof(p->src));
	__builtin_memcpy(p->dst, &ip6->daddr, sizeof(p->dst));
	nexthdr = ip6->nexthdr;

#pragma unroll
	for (int i = 0; i < RL_MAX_EXTHDRS; i++) {
		struct ipv6_exthdr *h = c->pos;

		switch (nexthdr) {
		case IPPROTO_HOPOPTS:
		case IPPROTO_ROUTING:
		case IPPROTO_DSTOPTS:
			if (c->pos + 2 > end)
				goto unknown;
			nexthdr = h->nexthdr;
			c->pos += (h->hdrlen + 1) * 8;
			break;
		case IPPROTO_AH:
			if (c->pos + 2 > end)
				goto unknown;
			nexthdr = h->nexthdr;
			c->pos += (h->hdrlen + 2) * 4;
			break;
		case IPPROTO_FRAGMENT: {
			__u16 off;

			/* 8 bytes: nexthdr, reserved, offset|flags, identification */
			if ((void *)(h + 1) > end)
				goto unknown;
			nexthdr = h->nexthdr;
			off = bpf_ntohs(h->frag_off);
			if (off & 0xfff8)
				p->frag = off & 1 ? RL_FRAG_LATER : RL_FRAG_LAST;
			else if (off & 1)
				p->frag = RL_FRAG_FIRST;
			/* else an atomic fragment (RFC 6946): a whole datagram */
			p->frag_id = h->id;
			c->pos += 8;
			p->frag_start = off >> 3;
			p->frag_len = *l3_end > c->pos - data ? *l3_end - (c->pos - data) : 0;
			break;
		}
		case 135:	/* mobility */
		case 139:	/* HIP */
		case 140:	/* shim6 */
		case 253:	/* experiments (RFC 3692) */
		case 254:
			/* Extension headers this parser does not walk. */
			goto unknown;
		default:
			return nexthdr;
		}
		if (p->frag >= RL_FRAG_LATER)
			return nexthdr;	/* what follows is payload, not a header */
	}
	/* The chain goes on past RL_MAX_EXTHDRS headers. */
	switch (nexthdr) {
	case IPPROTO_HOPOPTS:
	case IPPROTO_ROUTING:
	case IPPROTO_DSTOPTS:
	case IPPROTO_AH:
	case IPPROTO_FRAGMENT:
	case 135:
	case 139:
	case 140:
	case 253:
	case 254:
		goto unknown;
	}
	return nexthdr;
unknown:
	p->l4_unknown = 1;
	return 0;
}

/* The transport header's fields, for a packet that carries one. Sets
 * l4_unknown if the header is cut short by the frame or by the IP length. */
static __always_inline void parse_l4(struct cursor *c, void *data, void *end, struct pkt *p,
				     __u32 l3_end)
{
	__u32 off = c->pos - data;
	struct udphdr *uh = c->pos;	/* TCP ports sit where UDP's do */
	__u32 need;

	p->hdr_len = off;
	switch (p->proto) {
	case IPPROTO_TCP:
		p->pclass = RL_PROTO_TCP;
		need = sizeof(struct tcphdr);
		break;
	case IPPROTO_UDP:
		p->pclass = RL_PROTO_UDP;
		need = sizeof(struct udphdr);
		break;
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		p->pclass = RL_PROTO_ICMP;
		return;
	default:
		p->pclass = RL_PROTO_OTHER;
		return;
	}
	if (p->frag >= RL_FRAG_LATER)
		return;	/* no header here: frag.h finds the datagram's */
	if (c->pos + need > end || off + need > l3_end) {
		p->l4_unknown = 1;
		return;
	}
	p->sport = bpf_ntohs(uh->source);
	p->dport = bpf_ntohs(uh->dest);
	p->has_ports = 1;
	if (p->pclass == RL_PROTO_TCP) {
		struct tcphdr *th = c->pos;
		__u8 flags = ((__u8 *)th)[13];
		__u32 doff = th->doff * 4;

		p->syn = (flags & (RL_TCP_SYN | RL_TCP_ACK | RL_TCP_RST | RL_TCP_FIN)) == RL_TCP_SYN;
		/* The options are repeated in every segment; a data offset
		 * below the fixed header is one the kernel drops. */
		need = doff > need ? doff : need;
	}
	p->hdr_len = off + need;
}

/* Fills p from the packet. Returns 0; -1 when the packet is not IP or its
 * IP header is one the kernel drops, in which case it passes untouched; or
 * RL_PARSE_SHORT when it ends before its IP header does. */
static __always_inline int parse_packet(void *data, void *end, struct pkt *p)
{
	struct cursor c = { .pos = data };
	__u32 l3_end = 0;
	int proto;

	p->len = end - data;
	p->segs = 1;
	proto = parse_eth(&c, end);
	if (proto == RL_ETH_TOO_MANY_TAGS) {
		/* More VLAN tags than walked: neither addresses nor ports. */
		p->pclass = RL_PROTO_UNKNOWN;
		p->l4_unknown = 1;
		return 0;
	}
	if (proto == ETH_P_IP)
		proto = parse_ipv4(&c, data, end, p, &l3_end);
	else if (proto == ETH_P_IPV6)
		proto = parse_ipv6(&c, data, end, p, &l3_end);
	else if (proto != RL_PARSE_SHORT)
		return -1;
	if (proto < 0)
		return proto;
	if (p->l4_unknown && proto == 0) {
		/* The IPv6 chain hid the protocol. */
		p->pclass = RL_PROTO_UNKNOWN;
		p->hdr_len = c.pos - data;
		return 0;
	}
	p->proto = proto;
	parse_l4(&c, data, end, p, l3_end);
	return 0;
}

/* How much of an skb rl_linearize makes linear when its headers are not:
 * every IPv4 header stack the parser reads (Ethernet, four VLAN tags, a
 * 60-byte IPv4 header and a 60-byte TCP header: 150 bytes) and IPv6 chains
 * of up to ~900 bytes of extension headers, while the copy stays under a
 * kilobyte. Longer chains are dropped by most networks (RFC 9098) and are
 * L4-unknown here: charged to more limits, never to fewer. */
#define RL_PULL_LEN 1024

/* Makes the headers of a packet whose bytes are not all linear (skb->len
 * above data_end - data) readable: parses the linear part and, if that ran
 * off its end (RL_PARSE_SHORT, or L4-unknown), makes up to RL_PULL_LEN
 * bytes linear with bpf_skb_pull_data. Returns RL_PARSE_SHORT if the pull
 * failed (no memory) for a packet whose IP header was not reached, else 0.
 *
 * Drivers that leave headers in page fragments and packet sockets (a
 * PACKET_VNET_HDR sender's skb is linear for its Ethernet header only) make
 * such skbs. Most non-linear skbs (GSO on egress, GRO on ingress) have
 * their headers linear: they pay this parse and no pull.
 *
 * A global function, called before the program's own parse, with nothing
 * but the skb: verified once on its own. A second parse written after the
 * first (or a loop around one) had the verifier walk the decision again
 * for the paths of the first, past its 1M-instruction limit; a global
 * function given the caller's struct pkt counts as a read of the whole
 * struct and stops the pruning of the parse's paths. */
__noinline int rl_linearize(struct __sk_buff *skb)
{
	struct pkt p = {};
	__u32 len;
	int ret;

	if (!skb)
		return 0;
	len = skb->len;
	ret = parse_packet((void *)(long)skb->data, (void *)(long)skb->data_end, &p);
	if (ret != RL_PARSE_SHORT && !(ret == 0 && p.l4_unknown))
		return 0;	/* the headers are linear */
	if (bpf_skb_pull_data(skb, len < RL_PULL_LEN ? len : RL_PULL_LEN) == 0)
		return 0;
	return ret == RL_PARSE_SHORT ? RL_PARSE_SHORT : 0;
}

/* Fills p from an skb (TC): rl_linearize first if some of the packet is
 * outside the linear part, then the parse. A packet whose headers still
 * run past the linear part is L4-unknown (parse.h NOTE), and one whose
 * headers could not be made linear at all is L4-unknown without addresses:
 * never passed unclassified. Returns what parse_packet returns. */
static __always_inline int rl_parse_skb(struct __sk_buff *skb, struct pkt *p)
{
	if (__builtin_expect(skb->len > skb->data_end - skb->data, 0) &&
	    rl_linearize(skb) == RL_PARSE_SHORT) {
		p->segs = 1;
		p->pclass = RL_PROTO_UNKNOWN;
		p->l4_unknown = 1;
		return 0;
	}
	/* Read after rl_linearize: a pull moves the packet. */
	return parse_packet((void *)(long)skb->data, (void *)(long)skb->data_end, p);
}

/* Segments and wire bytes of an skb whose headers p describes. A GSO
 * packet (egress) or a GRO one (ingress) is one skb for gso_segs segments,
 * each of which repeats the headers up to the end of the transport header
 * (hdr_len) on the wire. A GSO packet whose sender did not count its
 * segments (gso_segs 0, gso_size set: SKB_GSO_DODGY, from a VM or a packet
 * socket) gets them from its payload, as the kernel's qdisc_pkt_len_init
 * does. */
static __always_inline void rl_skb_wire(const struct __sk_buff *skb, struct pkt *p)
{
	__u32 len = skb->len;
	__u32 segs = skb->gso_segs;
	__u32 size = skb->gso_size;
	__u64 wire;

	if (!segs && size && len > p->hdr_len)
		segs = (len - p->hdr_len + size - 1) / size;
	if (segs < 1)
		segs = 1;
	if (segs > 0xffff)
		segs = 0xffff;
	wire = len + (__u64)(segs - 1) * p->hdr_len;
	p->segs = segs;
	p->len = wire < 0xffffffffULL ? wire : 0xffffffffU;
}

#endif /* RL_PARSE_H */
