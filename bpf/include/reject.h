/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Visible rejects (action reject): the reply to an over-limit connection
 * attempt or datagram, built in place of the packet and sent back out of the
 * interface it came in on.
 *
 * NOTE: what is answered, and how.
 * - A TCP SYN without ACK, RST or FIN and without payload gets a RST/ACK:
 *   seq 0, ack the SYN's seq + 1 (RFC 793 / 9293, 3.10.7.1: the segment had
 *   no ACK); only if its TCP checksum (over the header with its options) is
 *   valid, or holds the pseudo-header's sum (CHECKSUM_PARTIAL from a local
 *   veth peer). An IPv4 packet is answered only if its header checksum is
 *   valid. A UDP payload is not verified: a forger computes checksums, and
 *   the budgets bound what a forged packet buys. Every other TCP packet is dropped, never reset: a connection
 *   that runs over its limit for a moment loses packets, not its life.
 * - A UDP datagram gets an ICMP port unreachable (type 3 code 3), an IPv6
 *   one an ICMPv6 port unreachable (type 1 code 4), quoting the datagram's
 *   IP header and the 8 bytes of its UDP header (RFC 792, RFC 4443 2.4:
 *   "as much of invoking packet as possible" is allowed, this is the least
 *   that identifies the socket).
 * - Nothing else is answered: not ICMP (an error is never answered, an echo
 *   is not a connection), not a fragment (a later one has no ports, and a
 *   first one is not a whole datagram), not a packet with IPv4 options or
 *   with IPv6 extension headers before TCP or UDP, not a frame sent to a
 *   broadcast or multicast address (MAC or IP), not a packet whose source
 *   is not a unicast address (unspecified, loopback, multicast, the IPv4
 *   class E and limited broadcast, IPv4-mapped IPv6). Those are dropped.
 * - The reply swaps the MAC addresses and keeps the inline VLAN tags, so
 *   it goes back to the VLAN it came from; a fresh IP header (TTL/hop
 *   limit 64, no options) with the addresses swapped; checksums computed
 *   from scratch (IPv4 header; TCP and ICMPv6 over their pseudo-headers;
 *   ICMPv4 over its message).
 * - Replies are limited per destination (the packet's source address, an
 *   IPv6 /64: rl_reply_dest), and node-wide by one budget (rl_reject, a GCRA over a
 *   compare-and-swap: any CPU may spend it); beyond it a reject is a drop,
 *   counted, so that the node can never be made a reflector. A packet that
 *   may not be answered does not spend the budget.
 */
#ifndef RL_REJECT_H
#define RL_REJECT_H

#include "common.h"
#include "parse.h"
#include "clock.h"
#include "maps.h"

#define RL_REPLY_IN 136		/* bytes of the packet read: L2 (up to 30) + IPv6 + TCP with options */
#define RL_REPLY_L2MAX (14 + 4 * RL_MAX_VLAN)
#define RL_REPLY_L3 32		/* the reply's IP header starts here in out[] */
#define RL_REPLY_L3MAX 96	/* IPv6 + ICMPv6 + the quoted IPv6 and UDP headers */
#define RL_REPLY_OUT (RL_REPLY_L3 + RL_REPLY_L3MAX + 32)
#define RL_REPLY_TTL 64

/* ICMP types and codes (linux/icmp.h and linux/icmpv6.h, which pull in
 * libc headers a BPF build cannot have). */
#define RL_ICMP_DEST_UNREACH 3
#define RL_ICMP_PORT_UNREACH 3
#define RL_ICMPV6_DEST_UNREACH 1
#define RL_ICMPV6_PORT_UNREACH 4

/* An ICMP or ICMPv6 error's header: the same 8 bytes in both. */
struct rl_icmp_err {
	__u8 type;
	__u8 code;
	__u16 check;
	__u32 unused;
};

_Static_assert(RL_REPLY_L2MAX <= RL_REPLY_L3, "the L2 header fits before the reply's IP header");
_Static_assert(RL_REPLY_L2MAX + 40 + 60 <= RL_REPLY_IN, "the L2 header, IPv6 and TCP with options fit in in[]");

/* A reply starts at RL_REPLY_L3 - its L2 length (14 at least) in out[] and
 * is less than 128 bytes long: rl_reply_build packs the two with its kind
 * into its return value, which the callers unpack with these masks (the
 * verifier keeps no bounds across a global function). */
#define RL_REPLY_START_MASK 31
#define RL_REPLY_LEN_MASK 127
#define RL_REPLY_START_SHIFT 7
#define RL_REPLY_KIND_SHIFT 12
_Static_assert(RL_REPLY_L3 - 14 <= RL_REPLY_START_MASK, "the mask keeps every start");
_Static_assert(RL_REPLY_L2MAX + RL_REPLY_L3MAX < 128, "a reply is less than 128 bytes");
_Static_assert(RL_REPLY_START_MASK + RL_REPLY_LEN_MASK <= RL_REPLY_OUT, "a masked start and length stay in out[]");
_Static_assert(RL_REPLY_LEN_MASK < 1 << RL_REPLY_START_SHIFT, "the packed length and start do not overlap");
_Static_assert(RL_REPLY_START_MASK < 1 << (RL_REPLY_KIND_SHIFT - RL_REPLY_START_SHIFT), "the packed start and kind do not overlap");

/* What a reject did. */
enum rl_reply_kind {
	RL_REPLY_NONE = 0,	/* the packet may not be answered: dropped */
	RL_REPLY_RST = 1,	/* a TCP RST/ACK */
	RL_REPLY_ICMP = 2,	/* an ICMP or ICMPv6 port unreachable */
};

/* The per-CPU space a reply is built in: the start of the packet, its IP
 * and transport headers copied to a fixed place, and the reply. */
struct rl_reply_scratch {
	__u8 in[RL_REPLY_IN];
	__u8 l3[64];		/* the packet's IP header on: IPv6 (40) + TCP (20) at most */
	__u8 out[RL_REPLY_OUT];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rl_reply_scratch);
} rl_reply SEC(".maps");

/* The node's reply budget, spent by every CPU: a GCRA. tat is the
 * theoretical arrival time of the next reply, on rl_clock_read's time line
 * (jiffies in production); a reply is allowed when tat, moved on by one
 * interval, is at most tolerance ahead of now. User space writes interval
 * and tolerance (rl_reject_budget), the tolerance at least one tick, so that
 * a clock that moves a tick at a time still allows the whole rate; interval
 * 0: no replies.
 *
 * Not bpf_ktime_get_ns: a flood that the budget cannot answer reads the
 * clock on every packet, and the precise clock costs 4-5 times a drop there
 * (docs/benchmarks.md, reject-overload=1), where jiffies cost about one. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rl_reject_budget);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rl_reject SEC(".maps");

/* Whether the budget holds a reply at now: tat, moved on by one interval,
 * at most tolerance ahead. */
static __always_inline bool rl_reject_fits(const struct rl_reject_budget *b, __u64 tat, __u64 now)
{
	return (tat > now ? tat : now) + b->interval_ns - now <= b->tolerance_ns;
}

/* Whether the budget has a reply left, spending none: read only, so that a
 * flood the budget cannot answer never writes the line every CPU reads. */
static __always_inline bool rl_reject_open(void)
{
	struct rl_reject_budget *b;
	__u32 zero = 0;

	b = bpf_map_lookup_elem(&rl_reject, &zero);
	return b && b->interval_ns && rl_reject_fits(b, READ_ONCE_U64(b->tat), rl_clock_read());
}

/* Spends one reply of the budget; false when it is spent. */
static __always_inline bool rl_reject_spend(void)
{
	struct rl_reject_budget *b;
	__u32 zero = 0;
	__u64 now;

	b = bpf_map_lookup_elem(&rl_reject, &zero);
	if (!b || !b->interval_ns)
		return false;
	now = rl_clock_read();
	for (int i = 0; i < 4; i++) {
		__u64 tat = READ_ONCE_U64(b->tat);

		if (!rl_reject_fits(b, tat, now))
			return false;
		if (__sync_val_compare_and_swap(&b->tat, tat, (tat > now ? tat : now) + b->interval_ns) == tat)
			return true;
	}
	return false;	/* contended: as spent */
}

/* The key of a reply's destination in rl_reply_dest: the packet's source,
 * an IPv4 address or an IPv6 /64 (one host's addresses, as one sender may
 * take any address of its /64). */
struct rl_reply_dest_key {
	__u32 family;
	__u32 a[2];
};

/* Replies per destination: key rl_reply_dest_key, value the destination's
 * GCRA tat (ns, rl_clock_read's time line). An LRU hash: a flood of spoofed
 * sources evicts the least recently answered, and an evicted destination
 * comes back with one reply's worth only (rl_reply_dest_spend), so that
 * evicting a victim's entry buys it nothing. An entry is made only for a
 * packet the node's budget had room for, so the flood that evicts one costs
 * the node's budget this table's size in replies. Not pinned: a restart
 * starts every destination at one reply. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct rl_reply_dest_key);
	__type(value, __u64);
} rl_reply_dest SEC(".maps");

/* Spends one reply of the packet's source's share (the reply's
 * destination); false when it is spent. A dest_interval_ns of 0 is no
 * share per destination (user space's PerDestination rate 0; the config
 * has none). A destination not in the table gets one reply: its tat
 * starts one tolerance ahead, where a GCRA has no reply left. */
static __always_inline bool rl_reply_dest_spend(const struct pkt *p)
{
	struct rl_reply_dest_key k = {};
	struct rl_reject_budget *b;
	__u32 zero = 0;
	__u64 now, *tat;

	b = bpf_map_lookup_elem(&rl_reject, &zero);
	if (!b)
		return false;
	if (!b->dest_interval_ns)
		return true;	/* no share per destination: the node's budget alone */
	k.family = p->family;
	if (p->family == 4) {
		k.a[0] = p->src[3];
	} else {
		k.a[0] = p->src[0];
		k.a[1] = p->src[1];
	}
	now = rl_clock_read();
	tat = bpf_map_lookup_elem(&rl_reply_dest, &k);
	if (!tat) {
		__u64 start = now + b->dest_tolerance_ns;

		/* Another CPU's entry, made meanwhile, wins: no reply. */
		return bpf_map_update_elem(&rl_reply_dest, &k, &start, BPF_NOEXIST) == 0;
	}
	for (int i = 0; i < 4; i++) {
		__u64 t = READ_ONCE_U64(*tat);
		__u64 from = t > now ? t : now;

		if (from + b->dest_interval_ns - now > b->dest_tolerance_ns)
			return false;
		if (__sync_val_compare_and_swap(tat, t, from + b->dest_interval_ns) == t)
			return true;
	}
	return false;	/* contended: as spent */
}

/* Whether the packet is the node's to answer: a frame to the receiving
 * interface's own MAC (rl_if_mac: XDP has no pkt_type; so that a reply
 * never takes another host's MAC as its source on a veth or a promiscuous
 * uplink), to an address the node owns or delivers (rl_local: so that a
 * reply never comes from an address that is not the node's, and a subnet
 * broadcast, which is no one's address, is never answered). */
static __always_inline bool rl_reply_local(const struct rl_reply_scratch *s, const struct pkt *p, __u32 ifindex)
{
	const struct rl_mac *mac;

	mac = bpf_map_lookup_elem(&rl_if_mac, &ifindex);
	if (!mac)
		return false;
	for (int i = 0; i < 6; i++)
		if (s->in[i] != mac->addr[i])
			return false;
	return rl_local_flags(p->family, p->dst) != 0;
}

/* One's-complement addition of a 32-bit word: the carry goes around. */
static __always_inline __u32 rl_csum_add(__u32 sum, __u32 v)
{
	sum += v;
	return sum + (sum < v);
}

static __always_inline __u16 rl_csum_fold(__u32 sum)
{
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)~sum;
}

/* Whether a source address may be answered: unicast, not loopback, not
 * unspecified. a is the IPv4 address in network byte order. */
static __always_inline bool rl_unicast4(__u32 a)
{
	__u8 first = a & 0xff;

	return first != 0 && first != 127 && first < 224;
}

static __always_inline bool rl_unicast6(const __u8 *a)
{
	__u32 w0, w1, w2, w3;

	__builtin_memcpy(&w0, a, 4);
	__builtin_memcpy(&w1, a + 4, 4);
	__builtin_memcpy(&w2, a + 8, 4);
	__builtin_memcpy(&w3, a + 12, 4);
	if (a[0] == 0xff)
		return false;	/* multicast */
	if (!w0 && !w1 && !w2 && (!w3 || w3 == bpf_htonl(1)))
		return false;	/* unspecified, loopback */
	if (!w0 && !w1 && w2 == bpf_htonl(0xffff))
		return false;	/* IPv4-mapped: not on the wire */
	return true;
}

/* Whether the parser's view of a packet lets it be answered: a TCP SYN (no
 * ACK, RST or FIN) or a UDP datagram, whole (no fragment, one segment),
 * between unicast addresses. rl_reply_fill checks the frame's own bytes
 * again, and what only they hold (MAC addresses, IPv4 options). */
static __always_inline bool rl_reply_answerable(const struct pkt *p)
{
	if (p->rare || p->segs != 1)
		return false;
	if (p->proto == IPPROTO_TCP ? !p->syn : p->proto != IPPROTO_UDP || !p->has_ports)
		return false;
	if (p->family == 4)
		return rl_unicast4(p->src[3]) && rl_unicast4(p->dst[3]);
	return p->family == 6 && rl_unicast6((const __u8 *)p->src) && ((const __u8 *)p->dst)[0] != 0xff;
}

/* Whether the TCP header at off in s->in (hlen bytes, the whole segment: a
 * SYN without payload) has a valid checksum, pseudo being the sum of its
 * pseudo-header. A checksum field that holds the pseudo-header's sum is
 * valid too: a local veth peer leaves the rest to an offload
 * (CHECKSUM_PARTIAL) that never came. */
static __always_inline bool rl_tcp_csum_ok(const struct rl_reply_scratch *s, __u32 off, __u32 hlen, __u32 n,
					   __u32 pseudo)
{
	__u16 field;
	__s64 sum;

	if (hlen < 20 || hlen > 60 || off > RL_REPLY_L2MAX + 40 || off + hlen > n)
		return false;
	sum = bpf_csum_diff(0, 0, (__be32 *)(s->in + off), hlen, pseudo);
	if (sum < 0)
		return false;
	if (!rl_csum_fold((__u32)sum))
		return true;
	__builtin_memcpy(&field, s->in + off + 16, 2);
	return field == (__u16)~rl_csum_fold(pseudo);
}

/* Writes at out the RST/ACK that answers the SYN in, which carries seg
 * bytes of payload. */
static __always_inline void rl_rst(struct tcphdr *out, const struct tcphdr *in, __u32 seg)
{
	__builtin_memset(out, 0, 20);
	out->source = in->dest;
	out->dest = in->source;
	out->ack_seq = bpf_htonl(bpf_ntohl(in->seq) + 1 + seg);
	out->doff = 5;
	out->rst = 1;
	out->ack = 1;
}

/* Builds the reply to the packet whose first n bytes are in s->in (p, its
 * parse) in s->out, from *start, and returns its length; 0 if the packet
 * may not be answered. */
static __always_inline int rl_reply_fill(struct rl_reply_scratch *s, const struct pkt *p, __u32 n, __u32 *start,
					 __u32 *kind)
{
	__u32 l2 = 14, l3len, sum, hlen, plen;
	__u16 proto;
	__u8 *o, *ip;

	*kind = RL_REPLY_NONE;
	if (!rl_reply_answerable(p) || n < 14 || n > RL_REPLY_IN)
		return 0;
	/* Broadcast or multicast frame, or a multicast source MAC. */
	if ((s->in[0] & 1) || (s->in[6] & 1))
		return 0;
	__builtin_memcpy(&proto, s->in + 12, 2);
#pragma unroll
	for (int i = 0; i < RL_MAX_VLAN; i++) {
		if (!parse_is_vlan(proto))
			break;
		__builtin_memcpy(&proto, s->in + 16 + 4 * i, 2);
		l2 += 4;
	}
	if (l2 > RL_REPLY_L2MAX)
		return 0;
	/* The IP header on, to a fixed place. */
	for (int k = 0; k < (int)sizeof(s->l3); k++) {
		__u32 at = l2 + k;

		if (at >= n || at >= RL_REPLY_IN)
			break;
		s->l3[k] = s->in[at];
	}
	ip = s->l3;
	o = s->out + RL_REPLY_L3;

	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *in4 = (struct iphdr *)ip;
		struct iphdr *out4 = (struct iphdr *)o;
		__u32 saddr, daddr;

		if (p->family != 4 || in4->ihl != 5)
			return 0;	/* options: dropped */
		if (l2 + 20 + (p->proto == IPPROTO_TCP ? 20 : 8) > n)
			return 0;
		if (rl_csum_fold(bpf_csum_diff(0, 0, (__be32 *)ip, 20, 0)))
			return 0;	/* a bad header checksum */
		saddr = in4->saddr;
		daddr = in4->daddr;
		if (!rl_unicast4(saddr) || !rl_unicast4(daddr))
			return 0;
		__builtin_memset(o, 0, 20);
		out4->version = 4;
		out4->ihl = 5;
		out4->ttl = RL_REPLY_TTL;
		out4->saddr = daddr;
		out4->daddr = saddr;
		if (p->proto == IPPROTO_TCP) {
			struct tcphdr *in = (struct tcphdr *)(ip + 20);
			struct tcphdr *out = (struct tcphdr *)(o + 20);
			__u32 seg;

			hlen = in->doff * 4;
			plen = bpf_ntohs(in4->tot_len);
			if (hlen < 20 || plen != 20 + hlen)
				return 0;	/* a SYN with payload is not answered */
			sum = bpf_csum_diff(0, 0, (__be32 *)(ip + 12), 8, 0);
			sum = rl_csum_add(sum, bpf_htons(IPPROTO_TCP) + bpf_htons(hlen));
			if (!rl_tcp_csum_ok(s, l2 + 20, hlen, n, sum))
				return 0;
			seg = plen - 20 - hlen;	/* the SYN's payload */
			l3len = 40;
			out4->tot_len = bpf_htons(40);
			out4->frag_off = bpf_htons(0x4000);	/* DF, as the kernel's resets */
			out4->protocol = IPPROTO_TCP;
			rl_rst(out, in, seg);
			/* The pseudo-header, then the segment. */
			sum = bpf_csum_diff(0, 0, (__be32 *)(o + 12), 8, 0);
			sum = rl_csum_add(sum, bpf_htons(IPPROTO_TCP) + bpf_htons(20));
			sum = bpf_csum_diff(0, 0, (__be32 *)(o + 20), 20, sum);
			out->check = rl_csum_fold(sum);
			*kind = RL_REPLY_RST;
		} else {
			struct rl_icmp_err *icmp = (struct rl_icmp_err *)(o + 20);

			l3len = 20 + 8 + 28;
			out4->tos = 0xc0;	/* internetwork control, as the kernel's ICMP errors */
			out4->tot_len = bpf_htons(l3len);
			out4->protocol = IPPROTO_ICMP;
			__builtin_memset(icmp, 0, 8);
			icmp->type = RL_ICMP_DEST_UNREACH;
			icmp->code = RL_ICMP_PORT_UNREACH;
			__builtin_memcpy(o + 28, ip, 28);	/* the datagram's IP and UDP headers */
			icmp->check = rl_csum_fold(bpf_csum_diff(0, 0, (__be32 *)(o + 20), 36, 0));
			*kind = RL_REPLY_ICMP;
		}
		out4->check = rl_csum_fold(bpf_csum_diff(0, 0, (__be32 *)o, 20, 0));
	} else if (proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *in6 = (struct ipv6hdr *)ip;
		struct ipv6hdr *out6 = (struct ipv6hdr *)o;
		__u32 nh;

		if (p->family != 6 || in6->nexthdr != p->proto)
			return 0;	/* extension headers: dropped */
		if (l2 + 40 + (p->proto == IPPROTO_TCP ? 20 : 8) > n)
			return 0;
		if (!rl_unicast6(ip + 8) || ip[24] == 0xff)
			return 0;	/* the source, and a multicast destination */
		__builtin_memset(o, 0, 8);
		o[0] = 0x60;
		out6->hop_limit = RL_REPLY_TTL;
		__builtin_memcpy(o + 8, ip + 24, 16);
		__builtin_memcpy(o + 24, ip + 8, 16);
		if (p->proto == IPPROTO_TCP) {
			struct tcphdr *in = (struct tcphdr *)(ip + 40);
			struct tcphdr *out = (struct tcphdr *)(o + 40);
			__u32 seg;

			hlen = in->doff * 4;
			plen = bpf_ntohs(in6->payload_len);
			if (hlen < 20 || plen != hlen)
				return 0;	/* a SYN with payload is not answered */
			sum = bpf_csum_diff(0, 0, (__be32 *)(ip + 8), 32, 0);
			sum = rl_csum_add(sum, bpf_htonl(hlen));
			sum = rl_csum_add(sum, bpf_htonl(IPPROTO_TCP));
			if (!rl_tcp_csum_ok(s, l2 + 40, hlen, n, sum))
				return 0;
			seg = plen - hlen;
			l3len = 60;
			nh = IPPROTO_TCP;
			out6->payload_len = bpf_htons(20);
			out6->nexthdr = IPPROTO_TCP;
			rl_rst(out, in, seg);
			*kind = RL_REPLY_RST;
		} else {
			struct rl_icmp_err *icmp = (struct rl_icmp_err *)(o + 40);

			l3len = 40 + 8 + 48;
			nh = IPPROTO_ICMPV6;
			out6->payload_len = bpf_htons(8 + 48);
			out6->nexthdr = IPPROTO_ICMPV6;
			__builtin_memset(icmp, 0, 8);
			icmp->type = RL_ICMPV6_DEST_UNREACH;
			icmp->code = RL_ICMPV6_PORT_UNREACH;
			__builtin_memcpy(o + 48, ip, 48);	/* the datagram's IPv6 and UDP headers */
			*kind = RL_REPLY_ICMP;
		}
		/* The pseudo-header (addresses, upper-layer length, next
		 * header), then the upper-layer packet. */
		sum = bpf_csum_diff(0, 0, (__be32 *)(o + 8), 32, 0);
		sum = rl_csum_add(sum, bpf_htonl(l3len - 40));
		sum = rl_csum_add(sum, bpf_htonl(nh));
		if (nh == IPPROTO_TCP)
			sum = bpf_csum_diff(0, 0, (__be32 *)(o + 40), 20, sum);
		else
			sum = bpf_csum_diff(0, 0, (__be32 *)(o + 40), 56, sum);
		if (nh == IPPROTO_TCP)
			((struct tcphdr *)(o + 40))->check = rl_csum_fold(sum);
		else
			((struct rl_icmp_err *)(o + 40))->check = rl_csum_fold(sum);
	} else {
		return 0;
	}

	/* The L2 header, just before: the MAC addresses swapped, the tags
	 * and the ethertype as they came. */
	*start = RL_REPLY_L3 - l2;
	for (int k = 0; k < RL_REPLY_L2MAX; k++) {
		if (k >= (int)l2)
			break;
		s->out[RL_REPLY_L3 - l2 + k] = s->in[k];
	}
	for (int k = 0; k < 6; k++) {
		s->out[RL_REPLY_L3 - l2 + k] = s->in[6 + k];
		s->out[RL_REPLY_L3 - l2 + 6 + k] = s->in[k];
	}
	return l2 + l3len;
}

#endif /* RL_REJECT_H */
