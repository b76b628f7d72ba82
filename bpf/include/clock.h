/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The clock, read in one place. rl_clock_kind is a load-time constant: the
 * verifier sees its value and removes the branches not taken, so the test
 * clock costs nothing in production.
 *
 * Measured on a 2-vCPU machine of the kind CI runs on (see docs/benchmarks.md):
 * bpf_ktime_get_ns ~46-54 ns, bpf_ktime_get_coarse_ns ~30 ns, bpf_jiffies64
 * ~8 ns (inlined by the JIT). Only the lease and over-limit paths read it.
 */
#ifndef RL_CLOCK_H
#define RL_CLOCK_H

#include "common.h"

volatile const __u32 rl_clock_src = RL_CLOCK_JIFFIES;
/* Length of a jiffy in ns: the resolution of CLOCK_MONOTONIC_COARSE. */
volatile const __u64 rl_ns_per_jiffy = 4000000;

struct rl_test_clock rl_test_now;

/* Called once at the top of every packet: in test mode, time moves by step
 * per packet, so a run with Repeat=N simulates N packets over N x step ns. */
static __always_inline void rl_clock_tick(void)
{
	if (rl_clock_src == RL_CLOCK_TEST)
		rl_test_now.now += rl_test_now.step;
}

static __always_inline __u64 rl_clock_read(void)
{
	switch (rl_clock_src) {
	case RL_CLOCK_TEST:
		return rl_test_now.now;
	case RL_CLOCK_JIFFIES:
		return bpf_jiffies64() * rl_ns_per_jiffy;
	case RL_CLOCK_COARSE:
		return bpf_ktime_get_coarse_ns();
	default:
		return bpf_ktime_get_ns();
	}
}

/* The clock of paced limits: departure times are on fq's time base,
 * CLOCK_MONOTONIC in ns, which jiffies are not (another epoch). Read only on
 * the paced path. Paced limits keep their virtual clock on this time line
 * (rl_params.base_ns), the others on rl_clock_read's. */
static __always_inline __u64 rl_pace_clock_read(void)
{
	if (rl_clock_src == RL_CLOCK_TEST)
		return rl_test_now.now;
	return bpf_ktime_get_ns();
}

/* The clock read lazily: at most once per packet, and only by a path that
 * needs it. *now == 0 means not read yet. */
static __always_inline __u64 rl_now(__u64 *now)
{
	if (!*now)
		*now = rl_clock_read();
	return *now;
}

#endif /* RL_CLOCK_H */
