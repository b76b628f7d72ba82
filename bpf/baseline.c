//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * The benchmarks' baselines: parse exactly what the data path's programs
 * parse and pass every packet. Never attached; measured with test_run only.
 */
#include "include/common.h"
#include "include/parse.h"

char __license[] SEC("license") = "Dual BSD/GPL";

#ifndef TCX_NEXT
#define TCX_NEXT -1
#endif

/* A port no test uses: the compare keeps the parse from being optimised away. */
volatile const __u16 baseline_drop_port = 0;

/* What xdp_ratelimit parses. */
SEC("xdp")
int xdp_baseline(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct pkt p = {};

	if (parse_packet(data, end, &p) < 0)
		return XDP_PASS;
	if (p.has_ports && p.dport == baseline_drop_port && p.src[3] == p.dst[3])
		return XDP_DROP;
	return XDP_PASS;
}

/* What the TC programs parse: the skb parse (with its pull when the
 * headers are not linear) and the segments and wire bytes. */
SEC("tc")
int tc_baseline(struct __sk_buff *skb)
{
	struct pkt p = {};

	if (rl_parse_skb(skb, &p) < 0)
		return TCX_NEXT;
	rl_skb_wire(skb, &p);
	if (p.has_ports && p.dport == baseline_drop_port && p.len == p.segs)
		return TC_ACT_SHOT;
	return TCX_NEXT;
}
