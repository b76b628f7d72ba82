/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The GCRA bucket of the benchmarks' peers (bench.c's xdp_peer_gcra and
 * bench_cls.c's classified peers), one definition so that every peer
 * charges its bucket the same way. Never part of the data path.
 *
 * A bucket is a theoretical arrival time (tat, ns) shared by the CPUs: a
 * packet is admitted if tat runs no more than tolerance ahead of now, and
 * then advances it by interval with one compare-and-swap. A lost swap
 * means another CPU admitted a packet: try again with its arrival time.
 * The bound on tries is the verifier's; two CPUs on one key lose 4 in a
 * row now and then, BENCH_CAS_TRIES never.
 */
#ifndef RL_BENCH_GCRA_H
#define RL_BENCH_GCRA_H

#include "common.h"

#define BENCH_CAS_TRIES 64

/* Charges one packet to the bucket at *tat_p: true if admitted. *lost
 * counts the swaps lost to other CPUs. */
static __always_inline bool bench_gcra_take(__u64 *tat_p, __u64 interval, __u64 tolerance, __u64 now,
					    __u64 *lost)
{
	__u64 tat = READ_ONCE_U64(*tat_p);

	for (int i = 0; i < BENCH_CAS_TRIES; i++) {
		__u64 t = tat > now ? tat : now;

		if (t - now > tolerance)
			return false;
		__u64 seen = __sync_val_compare_and_swap(tat_p, tat, t + interval);

		if (seen == tat)
			return true;
		(*lost)++;
		tat = seen;
	}
	return false;
}

#endif /* RL_BENCH_GCRA_H */
