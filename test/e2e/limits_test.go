package e2e

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/rlagent/rlagent/api/v1alpha1"
)

// TestLimitsCommands edits a config file with `rlagent limits set|get|list|
// delete`. It needs no root: nothing is loaded.
func TestLimitsCommands(t *testing.T) {
	dir := t.TempDir()
	config := filepath.Join(dir, "rlagent.yaml")
	const initial = `interfaces: [eth0]
metricsAddress: "off"
count:
  static: 3
limits:
  - name: dns
    rate: 20000
    match:
      protocol: udp
      dstPorts: ["53"]
`
	if err := os.WriteFile(config, []byte(initial), 0o640); err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) (stdout, stderr string, err error) {
		t.Helper()
		cmd := exec.Command(rlagentBin, append(args, "--config", config)...)
		var o, e bytes.Buffer
		cmd.Stdout, cmd.Stderr = &o, &e
		err = cmd.Run()
		return o.String(), e.String(), err
	}
	mustRun := func(args ...string) string {
		t.Helper()
		out, stderr, err := run(args...)
		if err != nil {
			t.Fatalf("rlagent %s: %v\n%s", strings.Join(args, " "), err, stderr)
		}
		return out
	}
	load := func() *v1alpha1.Config {
		t.Helper()
		c, err := v1alpha1.LoadConfig(config)
		if err != nil {
			t.Fatalf("the edited file does not load: %v", err)
		}
		return c
	}
	names := func(c *v1alpha1.Config) []string {
		var n []string
		for _, l := range c.Limits {
			n = append(n, l.Name)
		}
		return n
	}

	// set adds a limit; get prints it as YAML; list shows both.
	mustRun("limits", "set", "web", "--rate", "100", "--burst", "500", "--protocol", "tcp", "--dst-ports", "80,443,8000-8080",
		"--key", "src-prefix", "--prefix-v4", "16", "--src-cidrs", "10.0.0.0/8,2001:db8::/32")
	if got := names(load()); !slices.Equal(got, []string{"dns", "web"}) {
		t.Fatalf("limits after set: %v, want [dns web]", got)
	}
	if fi, err := os.Stat(config); err != nil || fi.Mode().Perm() != 0o640 {
		t.Errorf("the rewritten file: %v, mode %v; want its mode 0640 kept", err, fi.Mode())
	}
	var web v1alpha1.Limit
	out := mustRun("limits", "get", "web")
	if err := yaml.UnmarshalStrict([]byte(out), &web); err != nil {
		t.Fatalf("limits get web printed no limit: %v\n%s", err, out)
	}
	if web.Name != "web" || web.Rate != 100 || web.EffectiveBurst() != 500 || web.Match.Protocol != v1alpha1.ProtocolTCP ||
		!slices.Equal(web.Match.DstPorts, []string{"80", "443", "8000-8080"}) || web.Key != v1alpha1.KeySrcPrefix ||
		web.PrefixLength == nil || web.PrefixLength.IPv4 != 16 || len(web.Match.SrcCIDRs) != 2 {
		t.Errorf("limits get web:\n%s", out)
	}
	out = mustRun("limits", "list")
	for _, want := range []string{"dns", "20000", "web", "100", "500", "src-prefix", "port 80,443,8000-8080"} {
		if !strings.Contains(out, want) {
			t.Errorf("limits list does not show %q:\n%s", want, out)
		}
	}

	// set replaces a limit whole.
	mustRun("limits", "set", "dns", "--rate", "30000", "--protocol", "udp", "--dst-ports", "53", "--action", "shadow")
	c := load()
	if l := c.Limits[0]; l.Name != "dns" || l.Rate != 30000 || l.Action != v1alpha1.ActionShadow || len(c.Limits) != 2 {
		t.Errorf("after set dns: %+v", c.Limits)
	}

	// Invalid values are rejected, naming the field, and leave the file as
	// it was.
	before, err := os.ReadFile(config)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args  []string
		field string
	}{
		{[]string{"x", "--rate", "5", "--unit", "pkts"}, `limits[2].unit: "pkts" is not one of packets, bytes`},
		{[]string{"x", "--rate", "5", "--action", "block"}, `limits[2].action: "block" is not one of drop, shadow, pace, reject`},
		{[]string{"x", "--rate", "5", "--action", "pace"}, "limits[2].action: pace needs match.direction egress"},
		{[]string{"x", "--rate", "5", "--protocol", "sctp"}, `limits[2].match.protocol: "sctp" is not one of any, tcp, udp, icmp`},
		{[]string{"x", "--rate", "5", "--key", "src-port"}, `limits[2].key: "src-port" is not one of`},
		{[]string{"x", "--rate", "5", "--dst-ports", "70000"}, "limits[2].match.dstPorts[0]"},
		{[]string{"x", "--rate", "5", "--src-cidrs", "10.0.0.0/33"}, "limits[2].match.srcCIDRs[0]"},
		{[]string{"x", "--rate", "5", "--key", "src-prefix", "--prefix-v4", "40"}, "limits[2].prefixLength.ipv4"},
		{[]string{"x", "--rate", "5", "--burst", "0"}, "limits[2].burst"},
		{[]string{"x", "--rate", "0"}, "limits[2].rate"},
		{[]string{"x"}, `"rate" not set`},
		{[]string{"x", "--rate", "5", "--scope", "nodes"}, "limits[2].scope"},
		{[]string{"Bad_Name", "--rate", "5"}, "limits[2].name"},
		{[]string{"dns", "--rate", "5", "--dst-ports", "53", "--protocol", "icmp"}, "limits[0].match.dstPorts"},
	} {
		_, stderr, err := run(append([]string{"limits", "set"}, tc.args...)...)
		if err == nil {
			t.Errorf("limits set %s: accepted", strings.Join(tc.args, " "))
			continue
		}
		if !strings.Contains(stderr, tc.field) {
			t.Errorf("limits set %s: the error does not say %q:\n%s", strings.Join(tc.args, " "), tc.field, stderr)
		}
		if after, _ := os.ReadFile(config); !bytes.Equal(after, before) {
			t.Fatalf("limits set %s changed the file:\n%s", strings.Join(tc.args, " "), after)
		}
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("files left next to the config: %v", ents)
	}

	// delete removes; a missing limit is an error that lists the limits.
	mustRun("limits", "delete", "web")
	if got := names(load()); !slices.Equal(got, []string{"dns"}) {
		t.Errorf("limits after delete web: %v, want [dns]", got)
	}
	for _, args := range [][]string{{"get", "web"}, {"delete", "web"}} {
		_, stderr, err := run(append([]string{"limits"}, args...)...)
		if err == nil || !strings.Contains(stderr, `limit "web": not in`) || !strings.Contains(stderr, "dns") {
			t.Errorf("limits %s of a deleted limit: %v\n%s", strings.Join(args, " "), err, stderr)
		}
	}
	if out := mustRun("limits", "list"); strings.Contains(out, "web") {
		t.Errorf("limits list still shows web:\n%s", out)
	}
}
