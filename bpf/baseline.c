//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * The benchmarks' baseline: parses exactly what xdp_ratelimit parses and
 * passes every packet. Never attached; measured with test_run only.
 */
#include "include/common.h"
#include "include/parse.h"

char __license[] SEC("license") = "Dual BSD/GPL";

/* A port no test uses: the compare keeps the parse from being optimised away. */
volatile const __u16 baseline_drop_port = 0;

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
