package bpf

//go:generate go tool bpf2go -tags linux -cc clang -target bpfel -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I/usr/include/x86_64-linux-gnu" -type rl_const -type rl_action -type rl_unit -type rl_key_kind -type rl_proto_class -type rl_direction -type rl_attach -type rl_hook -type rl_clock_kind -type rl_mask -type rl_params -type rl_limit -type rl_config -type rl_lpm4 -type rl_lpm6 -type rl_cache -type rl_stats -type rl_limit_cpu -type rl_bucket_key -type rl_pool -type rl_key_slot -type rl_global_stats -type rl_meta_state -type rl_frag_key -type rl_frag_info Ratelimit ratelimit.c -- -I./include
//go:generate go tool bpf2go -tags linux -cc clang -target bpfel -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I/usr/include/x86_64-linux-gnu" Baseline baseline.c -- -I./include
