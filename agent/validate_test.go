package agent

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/maps"
)

// config parses a config file as the agent does; the test fails if it does
// not load.
func config(t *testing.T, yaml string) *v1alpha1.Config {
	t.Helper()
	c, err := v1alpha1.ParseConfig([]byte(yaml))
	if err != nil {
		t.Fatalf("config does not load: %v\n%s", err, yaml)
	}
	return c
}

// limitsYAML is a config whose limits are given one per line, each the
// inside of a flow mapping after the name and rate.
func limitsYAML(limits ...string) string {
	var b strings.Builder
	b.WriteString("interfaces: [lo]\nlimits:\n")
	for i, l := range limits {
		fmt.Fprintf(&b, "- {name: l%d, rate: 1000, %s}\n", i, l)
	}
	return b.String()
}

func repeat(n int, f func(i int) string) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = f(i)
	}
	return out
}

// The agent holds maps.MaxLimits limits: one more is an error naming the
// field and the bound, which v1alpha1.ParseConfig does not report.
func TestValidateConfigTooManyLimits(t *testing.T) {
	for _, n := range []int{int(maps.MaxLimits), int(maps.MaxLimits) + 1} {
		c := config(t, manyLimits(n))
		_, err := ValidateConfig(c)
		want := fmt.Sprintf("limits: %d limits: the data path holds at most %d", n, maps.MaxLimits)
		switch {
		case n <= int(maps.MaxLimits) && err != nil:
			t.Errorf("%d limits: %v, want no error", n, err)
		case n > int(maps.MaxLimits) && (err == nil || err.Error() != want):
			t.Errorf("%d limits: %v, want %q", n, err, want)
		}
	}
}

// Every distinct prefix of a side and family takes one entry of the data
// path's prefix tables (4096 each): more is an error; the same prefix in
// two limits counts once.
func TestValidateConfigPrefixTables(t *testing.T) {
	capacity, err := prefixCapacity()
	if err != nil {
		t.Fatal(err)
	}
	max4 := int(capacity.Src4)
	cidrs := func(n, offset int) string {
		var s []string
		for i := range n {
			s = append(s, fmt.Sprintf("10.%d.%d.0/24", (i+offset)/256, (i+offset)%256))
		}
		return strings.Join(s, ", ")
	}
	// Two limits share half of their prefixes: max4 distinct in all.
	ok := limitsYAML("match: {srcCIDRs: ["+cidrs(max4/2+10, 0)+"]}", "match: {srcCIDRs: ["+cidrs(max4/2-10, max4/2+10)+"], dstCIDRs: ["+cidrs(max4, 0)+"]}")
	if _, err := ValidateConfig(config(t, ok)); err != nil {
		t.Errorf("%d distinct prefixes per side: %v, want no error", max4, err)
	}
	over := limitsYAML("match: {srcCIDRs: ["+cidrs(max4/2+10, 0)+"]}", "match: {srcCIDRs: ["+cidrs(max4/2-9, max4/2+10)+"]}")
	_, err = ValidateConfig(config(t, over))
	var fe *v1alpha1.FieldError
	if !errors.As(err, &fe) || fe.Field != "limits[*].match.srcCIDRs" ||
		!strings.Contains(fe.Detail, fmt.Sprintf("%d distinct IPv4 source prefixes", max4+1)) || !strings.Contains(fe.Detail, fmt.Sprint(max4)) {
		t.Errorf("%d distinct source prefixes: %v, want a srcCIDRs error naming both counts", max4+1, err)
	}
}

// overlap returns ValidateConfig's warnings for limits, which must load.
func overlap(t *testing.T, limits ...string) []string {
	t.Helper()
	w, err := ValidateConfig(config(t, limitsYAML(limits...)))
	if err != nil {
		t.Fatalf("unexpected error: %v", err)
	}
	return w
}

// A config where one packet can match more limits than the data path checks
// on one packet (maps.MaxMatch) is warned about, naming the limits; one
// where no packet can is not. Each case is a config that is near the bound
// one way or the other.
func TestValidateConfigWarnsAboutOverlap(t *testing.T) {
	M := maps.MaxMatch
	names := func(idx ...int) string {
		var s []string
		for _, i := range idx {
			s = append(s, fmt.Sprintf("l%d", i))
		}
		return "the limits: " + strings.Join(s, ", ")
	}
	seq := func(from, to int) []int {
		var s []int
		for i := from; i < to; i++ {
			s = append(s, i)
		}
		return s
	}
	for _, tc := range []struct {
		name   string
		limits []string
		want   []string // substrings of the one warning; nil: no warning
	}{
		{"MaxMatch match-all limits", repeat(M, func(int) string { return "match: {}" }), nil},
		{"MaxMatch+1 match-all limits", repeat(M+1, func(int) string { return "match: {}" }),
			[]string{fmt.Sprintf("ingress: one packet can match up to %d limits, more than the %d", M+1, M), names(seq(0, M+1)...), "dropped (fail closed)"}},
		// A packet has one port, but one whose transport header cannot
		// be found is charged to every limit of every port.
		{"MaxMatch+1 limits on distinct ports", repeat(M+1, func(i int) string { return fmt.Sprintf("match: {protocol: tcp, dstPorts: [\"%d\"]}", 1000+i) }),
			[]string{fmt.Sprintf("up to %d limits", M+1), "(up to 1 with its protocol and ports read"}},
		// Disjoint destinations: no packet is in two of them.
		{"MaxMatch+1 limits on disjoint networks", repeat(M+1, func(i int) string { return fmt.Sprintf("match: {dstCIDRs: [10.0.%d.0/24]}", i) }), nil},
		// Nested prefixes: an address in the longest is in all of them.
		{"MaxMatch+1 nested prefixes", repeat(M+1, func(i int) string { return fmt.Sprintf("match: {srcCIDRs: [10.0.0.0/%d]}", 8+i) }),
			[]string{fmt.Sprintf("up to %d limits", M+1)}},
		// Nested but for one, which is beside the others' longest prefix.
		{"MaxMatch nested prefixes and a sibling", append(repeat(M, func(i int) string { return fmt.Sprintf("match: {srcCIDRs: [10.0.0.0/%d]}", 8+i) }),
			fmt.Sprintf("match: {srcCIDRs: [10.128.0.0/%d]}", 8+M-1)), nil},
		// A family splits them: M match-all, one IPv4-only, one IPv6-only.
		{"MaxMatch match-all and one limit of each family", append(repeat(M, func(int) string { return "match: {}" }),
			"match: {srcCIDRs: [192.0.2.0/24]}", "match: {dstCIDRs: [\"2001:db8::/32\"]}"),
			[]string{fmt.Sprintf("up to %d limits", M+1)}},
		// Protocol classes split known packets but not L4-unknown ones.
		{"MaxMatch/2+1 TCP and MaxMatch/2+1 UDP limits", append(repeat(M/2+1, func(int) string { return "match: {protocol: tcp}" }),
			repeat(M/2+1, func(int) string { return "match: {protocol: udp}" })...),
			[]string{fmt.Sprintf("up to %d limits", 2*(M/2+1)), fmt.Sprintf("(up to %d with its protocol and ports read", M/2+1)}},
		{"MaxMatch+1 shadow limits", repeat(M+1, func(int) string { return "match: {}, action: shadow" }),
			[]string{"passes: all of them are shadow limits"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := overlap(t, tc.limits...)
			if tc.want == nil {
				if len(w) != 0 {
					t.Errorf("warnings %q, want none", w)
				}
				return
			}
			if len(w) != 1 {
				t.Fatalf("warnings %q, want one", w)
			}
			for _, s := range tc.want {
				if !strings.Contains(w[0], s) {
					t.Errorf("warning %q\ndoes not say %q", w[0], s)
				}
			}
		})
	}
}

// largestMatch is checked against every packet of a small universe, on
// random configs: the largest set of limits one packet matches, as a
// reference matcher computes it packet by packet, for packets whose
// protocol and port are read (known) and for packets charged to every limit
// their addresses allow (worst).
func TestLargestMatchAgainstEveryPacket(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	v4 := netip.MustParseAddr("10.0.0.0")
	v6 := netip.MustParseAddr("2001:db8::")
	// Addresses 0..7 of each family, prefixes within them, ports 1..6.
	addr := func(base netip.Addr, i int) netip.Addr {
		b := base.AsSlice()
		b[len(b)-1] = byte(i)
		a, _ := netip.AddrFromSlice(b)
		return a
	}
	randPrefixes := func() []netip.Prefix {
		var out []netip.Prefix
		for range rng.IntN(3) {
			base, bitsLen := v4, 32
			if rng.IntN(2) == 0 {
				base, bitsLen = v6, 128
			}
			p, _ := addr(base, rng.IntN(8)).Prefix(bitsLen - rng.IntN(4))
			out = append(out, p)
		}
		return out
	}
	protos := []v1alpha1.Protocol{v1alpha1.ProtocolAny, v1alpha1.ProtocolTCP, v1alpha1.ProtocolUDP, v1alpha1.ProtocolICMP}
	for round := range 300 {
		n := 1 + rng.IntN(12)
		ms := make([]limitMatch, n)
		for i := range ms {
			spec := v1alpha1.RateLimitSpec{Match: v1alpha1.Match{Protocol: protos[rng.IntN(len(protos))]}}
			if spec.Match.Protocol != v1alpha1.ProtocolICMP && rng.IntN(2) == 0 {
				for range 1 + rng.IntN(2) {
					lo := 1 + rng.IntN(6)
					spec.Match.DstPorts = append(spec.Match.DstPorts, fmt.Sprintf("%d-%d", lo, lo+rng.IntN(3)))
				}
			}
			for _, p := range randPrefixes() {
				spec.Match.SrcCIDRs = append(spec.Match.SrcCIDRs, p.String())
			}
			for _, p := range randPrefixes() {
				spec.Match.DstCIDRs = append(spec.Match.DstCIDRs, p.String())
			}
			ms[i] = newLimitMatch(&spec)
		}
		inDir := newBitset(n)
		for i := range ms {
			inDir.set(i)
		}

		in := func(ps []netip.Prefix, a netip.Addr) bool {
			if len(ps) == 0 {
				return true
			}
			for _, p := range ps {
				if p.Contains(a) {
					return true
				}
			}
			return false
		}
		var wantKnown, wantWorst int
		for _, base := range []netip.Addr{v4, v6} {
			for s := range 9 { // 8: an address no prefix has
				for d := range 9 {
					sa, da := addr(base, s), addr(base, d)
					worst := 0
					for i := range ms {
						if in(ms[i].src, sa) && in(ms[i].dst, da) {
							worst++
						}
					}
					wantWorst = max(wantWorst, worst)
					for c := range numClasses {
						for port := range 10 {
							known := 0
							for i := range ms {
								if in(ms[i].src, sa) && in(ms[i].dst, da) && ms[i].matchesPort(c, uint16(port)) {
									known++
								}
							}
							wantKnown = max(wantKnown, known)
						}
					}
				}
			}
		}
		worst, known := largestMatch(ms, inDir)
		if worst.upper() != wantWorst || known.upper() != wantKnown || worst.exhausted || known.exhausted {
			t.Fatalf("round %d: largestMatch says worst %d, known %d; every packet says %d, %d\n%+v", round, worst.upper(), known.upper(), wantWorst, wantKnown, ms)
		}
		if worst.best.count() != wantWorst {
			t.Fatalf("round %d: the set named has %d limits, want %d", round, worst.best.count(), wantWorst)
		}
	}
}

// The search stays within its budget on a config built to be hard (many
// overlapping prefixes on both sides), and its answer is then still an
// upper bound.
func TestLargestMatchBudget(t *testing.T) {
	var limits []string
	for i := range int(maps.MaxLimits) {
		var src, dst []string
		for j := range 40 {
			src = append(src, fmt.Sprintf("10.%d.%d.0/24", i, j))
			dst = append(dst, fmt.Sprintf("10.%d.%d.0/24", j, i))
		}
		limits = append(limits, fmt.Sprintf("match: {srcCIDRs: [%s], dstCIDRs: [%s, 10.0.0.0/8]}", strings.Join(src, ", "), strings.Join(dst, ", ")))
	}
	c := config(t, limitsYAML(limits...))
	ms := make([]limitMatch, len(c.Limits))
	inDir := newBitset(len(ms))
	for i := range c.Limits {
		ms[i] = newLimitMatch(&c.Limits[i].RateLimitSpec)
		inDir.set(i)
	}
	worst, _ := largestMatch(ms, inDir)
	if worst.steps > 2*searchBudget {
		t.Errorf("%d search steps, budget %d", worst.steps, searchBudget)
	}
	// Each source /24 belongs to one limit: no packet matches two.
	if worst.upper() < 1 || !worst.exhausted && worst.upper() != 1 {
		t.Errorf("worst %d (exhausted %v), want 1", worst.upper(), worst.exhausted)
	}
}

// With a static count, a rate below one unit per second per node is raised
// to 1 by the agent: warned about, since the nodes together then admit
// more than the global rate.
func TestValidateConfigShareBelowOne(t *testing.T) {
	c := config(t, "interfaces: [lo]\ncount: {static: 4}\nlimits:\n- {name: slow, rate: 3, match: {}}\n- {name: fine, rate: 4, match: {}}\n")
	w, err := ValidateConfig(c)
	if err != nil || len(w) != 1 || !strings.Contains(w[0], "limits[0] (slow): rate 3 over count 4 is below 1 unit/s per node") {
		t.Errorf("warnings %q, error %v: want one for limits[0] (slow)", w, err)
	}
}

// TestGSOBurstWarning: a bytes limit at a TC hook whose burst cannot hold
// one GSO packet is warned about; one at the uplink's XDP, or with room, is
// not.
func TestGSOBurstWarning(t *testing.T) {
	for _, tt := range []struct {
		spec string
		warn bool
	}{
		{"{rate: 100000, unit: bytes, match: {direction: egress}}", true},
		{"{rate: 100000, unit: bytes, attach: endpoints, match: {dstCIDRs: [10.0.0.1]}}", true},
		{"{rate: 100000, unit: bytes, burst: 200000, match: {direction: egress}}", false},
		{"{rate: 100000, unit: bytes, match: {}}", false},
		{"{rate: 100000, match: {direction: egress}}", false},
		// Paced: 64 KiB beyond a 10 KB burst at 100 KB/s waits ~560 ms.
		{"{rate: 100000, unit: bytes, action: pace, match: {direction: egress}}", true},
		{"{rate: 100000, unit: bytes, action: pace, horizon: 1s, match: {direction: egress}}", false},
		{"{rate: 1000000, unit: bytes, action: pace, match: {direction: egress}}", false},
	} {
		c, err := v1alpha1.ParseConfig([]byte("interfaces: [eth0]\nlimits:\n- {name: x, " + strings.TrimPrefix(tt.spec, "{") + "\n"))
		if err != nil {
			t.Fatalf("%s: %v", tt.spec, err)
		}
		w, err := ValidateConfig(c)
		if err != nil {
			t.Fatal(err)
		}
		got := slices.ContainsFunc(w, func(s string) bool { return strings.Contains(s, "GSO packet") })
		if got != tt.warn {
			t.Errorf("%s: GSO warning %v, want %v (warnings %q)", tt.spec, got, tt.warn, w)
		}
	}
}

// TestRejectWarning: a limit with action reject that can answer nothing
// (at the endpoints, on ICMP, with a budget of 0) is warned about; one on
// the uplink for TCP or UDP is not.
func TestRejectWarning(t *testing.T) {
	for _, tt := range []struct {
		budget, spec string
		warn         string
	}{
		{"", "{rate: 100, action: reject, match: {protocol: tcp}}", ""},
		{"", "{rate: 100, action: reject, match: {}}", ""},
		{"", "{rate: 100, action: reject, attach: endpoints, match: {dstCIDRs: [10.0.0.1]}}", "drops unanswered"},
		{"", "{rate: 100, action: reject, match: {protocol: icmp}}", "on protocol icmp it drops"},
		{"rejectBudget: {rate: 0}\n", "{rate: 100, action: reject, match: {protocol: udp}}", "rejectBudget.rate 0 answers nothing"},
		{"rejectBudget: {rate: 0}\n", "{rate: 100, match: {protocol: udp}}", ""},
	} {
		c, err := v1alpha1.ParseConfig([]byte("interfaces: [eth0]\n" + tt.budget + "limits:\n- {name: x, " + strings.TrimPrefix(tt.spec, "{") + "\n"))
		if err != nil {
			t.Fatalf("%s: %v", tt.spec, err)
		}
		w, err := ValidateConfig(c)
		if err != nil {
			t.Fatal(err)
		}
		got := slices.ContainsFunc(w, func(s string) bool { return strings.Contains(s, "action reject") })
		if got != (tt.warn != "") || (got && !slices.ContainsFunc(w, func(s string) bool { return strings.Contains(s, tt.warn) })) {
			t.Errorf("%s%s: warnings %q, want one saying %q", tt.budget, tt.spec, w, tt.warn)
		}
	}
}

// TestProtectOffWarnedAtLoad: protect: [] is logged as a warning every
// time the agent loads the file (loadConfig, at the start and at every
// reload); a file without protect (the default rule ssh) is not.
func TestProtectOffWarnedAtLoad(t *testing.T) {
	for _, tc := range []struct {
		yaml string
		warn bool
	}{
		{"interfaces: [lo]\nprotect: []\n", true},
		{"interfaces: [lo]\n", false},
	} {
		path := filepath.Join(t.TempDir(), "rlagent.yaml")
		if err := os.WriteFile(path, []byte(tc.yaml), 0o644); err != nil {
			t.Fatal(err)
		}
		var logs bytes.Buffer
		opts := Options{ConfigPath: path, Log: slog.New(slog.NewTextHandler(&logs, nil))}
		for range 2 { // the start, a reload
			if _, err := loadConfig(opts); err != nil {
				t.Fatal(err)
			}
		}
		if n := strings.Count(logs.String(), "level=WARN msg=\"protect is empty"); n != map[bool]int{true: 2, false: 0}[tc.warn] {
			t.Errorf("%q: %d warnings in two loads, want one each: %t\n%s", tc.yaml, n, tc.warn, logs.String())
		}
	}
}
