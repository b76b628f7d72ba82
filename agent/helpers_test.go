package agent

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

func limitsName(n int) string { return fmt.Sprintf("limits=%d", n) }

// manyLimits is a config of n limits on distinct ports.
func manyLimits(n int) string {
	var b strings.Builder
	b.WriteString("interfaces: [lo]\nlimits:\n")
	for i := range n {
		fmt.Fprintf(&b, "- name: l%d\n  rate: %d\n  match: {protocol: udp, dstPorts: [\"%d\"]}\n", i, 10000+i, 1000+i)
	}
	return b.String()
}

func percentile(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, int(p*float64(len(s))))]
}
