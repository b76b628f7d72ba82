package bpf_test

import (
	"testing"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/maps"
)

// verifierBudget is the most instructions the verifier may walk for one of
// the data path's programs. The kernel refuses a program at 1,000,000
// (BPF_COMPLEXITY_LIMIT_INSNS); the budget keeps a margin below it, so that
// a change that brings a program near the limit on one kernel fails here
// (and in make vmtest, on 6.1) rather than on a node. 6.1's verifier once
// went past 1M on rl_decide_all where 6.18 needed far less: the count
// depends on the kernel, which is why this test runs on each.
const verifierBudget = 850_000

// TestVerifierBudget loads the production data path (the jiffies clock: the
// test clock's branch is pruned as in production) and reads how many
// instructions the verifier processed for each program.
func TestVerifierBudget(t *testing.T) {
	d := newDatapath(t, maps.Options{})
	progs := []struct {
		name string
		prog *ebpf.Program
	}{
		{"xdp_ratelimit", d.Program()},
		{"tc_uplink_in", d.TCProgram(maps.UplinkIn)},
		{"tc_uplink_out", d.TCProgram(maps.UplinkOut)},
		{"tc_endpoint_in", d.TCProgram(maps.EndpointIn)},
		{"tc_endpoint_out", d.TCProgram(maps.EndpointOut)},
	}
	for _, p := range progs {
		if p.prog == nil {
			t.Errorf("%s: not loaded", p.name)
			continue
		}
		info, err := p.prog.Info()
		if err != nil {
			t.Fatalf("%s: program info: %v", p.name, err)
		}
		n, ok := info.VerifiedInstructions()
		if !ok {
			t.Fatalf("%s: the kernel does not report verified instructions (bpf_prog_info.verified_insns, Linux 5.16)", p.name)
		}
		t.Logf("%s: %d instructions verified (budget %d)", p.name, n, verifierBudget)
		if n > verifierBudget {
			t.Errorf("%s: the verifier processed %d instructions, over the budget of %d (the kernel's limit is 1,000,000)", p.name, n, verifierBudget)
		}
	}
}
