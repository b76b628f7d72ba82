package bpf_test

import (
	"testing"

	"github.com/rlagent/rlagent/maps"
)

// The reference object (1acc742, for x-ref and the bypass subtests) reads
// the limits as its own layout has them: rl_config grew a mask per hook in
// issue 9, so its classifier config is copied member by member (its
// per-direction masks are the uplink's hooks), not as a byte prefix (which
// put hook[2] where it reads src_cidr: a limit restricted to source CIDRs
// was charged by every source).
func TestReferenceSeesLimits(t *testing.T) {
	egress := empty(maps.Match{})
	egress.Match.Direction = maps.Egress
	ref := reference(t,
		empty(maps.Match{Protocol: maps.UDP, SrcCIDRs: prefixes("10.1.0.0/16")}),
		egress,
		empty(maps.Match{Attach: maps.Endpoints}), // at endpoint-in: not the reference's
	)
	for _, c := range []struct {
		src  string
		want uint32
	}{{"10.1.0.1", xdpDrop}, {"10.2.0.1", xdpPass}} {
		if got := mustRun(t, ref, udp4(c.src, "10.0.0.2", 53)); got != c.want {
			t.Errorf("from %s: the reference's verdict %d, want %d", c.src, got, c.want)
		}
	}
}
