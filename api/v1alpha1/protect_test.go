package v1alpha1_test

import (
	"errors"
	"fmt"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/maps"
)

// protectConfig is a valid config with the protect rules given as YAML.
func protectConfig(rules string) string {
	return "interfaces: [eth0]\nprotect:\n" + rules
}

// problems returns the *FieldErrors of a joined validation error.
func problems(t *testing.T, err error) []*v1alpha1.FieldError {
	t.Helper()
	var out []*v1alpha1.FieldError
	var walk func(error)
	walk = func(err error) {
		if j, ok := err.(interface{ Unwrap() []error }); ok {
			for _, e := range j.Unwrap() {
				walk(e)
			}
			return
		}
		var fe *v1alpha1.FieldError
		if !errors.As(err, &fe) {
			t.Fatalf("error %q is not a *FieldError", err)
		}
		out = append(out, fe)
	}
	if err != nil {
		walk(err)
	}
	return out
}

func TestProtectAccepts(t *testing.T) {
	c, err := v1alpha1.ParseConfig([]byte(protectConfig(`
- name: ssh
  protocol: tcp
  localPorts: [22]
- name: kubelet
  protocol: tcp
  localPorts: ["10250"]
- name: monitoring
  peers: [192.0.2.10, "2001:db8::/64"]
- name: api-lb
  protocol: tcp
  peers: [198.51.100.7]
  remotePorts: [6443]
- name: dns-anywhere
  peers: [0.0.0.0/0, "::/0"]
  protocol: udp
  remotePorts: [53]
- name: high
  localPorts: [0-65535]
  peers: [10.0.0.0/8]
`)))
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Protect) != 6 {
		t.Fatalf("protect: %+v", c.Protect)
	}
	want := v1alpha1.Protect{Name: "monitoring", Protocol: v1alpha1.ProtocolAny, Peers: []string{"192.0.2.10", "2001:db8::/64"}}
	if !reflect.DeepEqual(c.Protect[2], want) {
		t.Errorf("protect[2] = %+v, want %+v (protocol defaults to any)", c.Protect[2], want)
	}
	if !slices.Equal(c.Protect[0].LocalPorts, []string{"22"}) {
		t.Errorf("a bare port number is read as its text: %q", c.Protect[0].LocalPorts)
	}
}

func TestProtectAPIServerDefault(t *testing.T) {
	for _, tc := range []struct {
		yaml string
		want bool
	}{
		{"interfaces: [eth0]\n", true},
		{"interfaces: [eth0]\nprotectAPIServer: true\n", true},
		{"interfaces: [eth0]\nprotectAPIServer: false\n", false},
	} {
		c, err := v1alpha1.ParseConfig([]byte(tc.yaml))
		if err != nil {
			t.Fatalf("%q: %v", tc.yaml, err)
		}
		if c.ProtectAPIServer == nil || *c.ProtectAPIServer != tc.want || c.ProtectsAPIServer() != tc.want {
			t.Errorf("%q: protectAPIServer %v, ProtectsAPIServer %v; want %v", tc.yaml, c.ProtectAPIServer, c.ProtectsAPIServer(), tc.want)
		}
		// Defaults are idempotent, and an explicit false is kept.
		c.Default()
		if c.ProtectsAPIServer() != tc.want {
			t.Errorf("%q: a second Default changed protectAPIServer", tc.yaml)
		}
	}
	// Not a boolean.
	_, err := v1alpha1.ParseConfig([]byte("interfaces: [eth0]\nprotectAPIServer: \"no\"\n"))
	if err == nil || !strings.Contains(err.Error(), `protectAPIServer: expected true or false, got the string "no"`) {
		t.Errorf("a string for protectAPIServer: %v", err)
	}
	// Decoded without defaults (what `rlagent limits set` rewrites), the
	// field stays out of the file.
	raw, err := v1alpha1.DecodeConfig([]byte("interfaces: [eth0]\nprotect:\n- name: ssh\n  localPorts: [22]\n"))
	if err != nil {
		t.Fatal(err)
	}
	out, err := raw.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if want := "interfaces:\n- eth0\nprotect:\n- name: ssh\n  localPorts:\n  - \"22\"\n"; string(out) != want {
		t.Errorf("raw config marshals as\n%s\nwant\n%s", out, want)
	}
}

func TestProtectRules(t *testing.T) {
	tests := []struct {
		name  string
		rules string
		field string   // the path the error must name
		want  []string // substrings of its detail
	}{
		{"name missing", "- localPorts: [22]\n",
			"protect[0].name", []string{"required"}},
		{"name not a label", "- name: SSH\n  localPorts: [22]\n",
			"protect[0].name", []string{`"SSH" is not a name`, "lowercase letters, digits and '-'"}},
		{"name twice", "- name: ssh\n  localPorts: [22]\n- name: ssh\n  localPorts: [2222]\n",
			"protect[1].name", []string{`"ssh" is already the name of protect[0]`}},
		{"protocol icmp", "- name: x\n  protocol: icmp\n  peers: [10.0.0.1]\n",
			"protect[0].protocol", []string{`"icmp" is not one of any, tcp, udp`}},
		{"protocol unknown", "- name: x\n  protocol: sctp\n  localPorts: [22]\n",
			"protect[0].protocol", []string{`"sctp" is not one of any, tcp, udp`}},
		{"protocol without ports", "- name: x\n  protocol: tcp\n  peers: [10.0.0.1]\n",
			"protect[0].protocol", []string{`"tcp" needs localPorts or remotePorts`, "protects every packet of its peers, whatever the protocol"}},
		{"bad peer", "- name: x\n  peers: [10.0.0.0/33]\n",
			"protect[0].peers[0]", []string{`"10.0.0.0/33" is not an IPv4 or IPv6 CIDR or address`}},
		{"mapped peer", "- name: x\n  peers: [\"::ffff:10.0.0.1\"]\n",
			"protect[0].peers[0]", []string{"IPv4-mapped", "write it as IPv4"}},
		{"every IPv4 peer without ports", "- name: x\n  peers: [0.0.0.0/0]\n",
			"protect[0].peers[0]", []string{`"0.0.0.0/0" without localPorts or remotePorts would protect every IPv4 packet`, "disable every limit"}},
		{"every IPv6 peer without ports", "- name: x\n  peers: [10.0.0.1, \"::/0\"]\n",
			"protect[0].peers[1]", []string{`"::/0" without localPorts or remotePorts would protect every IPv6 packet`, "disable every limit"}},
		{"every peer written with host bits", "- name: x\n  peers: [10.1.2.3/0]\n",
			"protect[0].peers[0]", []string{"would protect every IPv4 packet"}},
		{"too many peers", fmt.Sprintf("- name: x\n  peers: [%s]\n", strings.Repeat("10.0.0.1, ", 256)+"10.0.0.2"),
			"protect[0].peers", []string{"257 networks is more than 256"}},
		{"bad local port", "- name: x\n  localPorts: [\"22\", \"70000\"]\n",
			"protect[0].localPorts[1]", []string{`"70000" is not a port in 0..65535`}},
		{"reversed remote range", "- name: x\n  remotePorts: [\"9000-8000\"]\n",
			"protect[0].remotePorts[0]", []string{"first port 9000 is above last 8000"}},
		{"too many ports", fmt.Sprintf("- name: x\n  localPorts: [%s]\n", strings.Repeat("1, ", 64)+"2"),
			"protect[0].localPorts", []string{"65 entries is more than 64"}},
		{"every local port of every peer", "- name: x\n  localPorts: [0-1023, 1024-65535]\n",
			"protect[0].localPorts", []string{"covers every port 0..65535 for every peer", "every TCP and UDP packet", "disable every limit"}},
		{"every remote port of every IPv6 peer", "- name: x\n  protocol: udp\n  peers: [\"::/0\"]\n  remotePorts: [0-65535]\n",
			"protect[0].remotePorts", []string{"covers every port 0..65535", "every UDP packet"}},
		{"nothing", "- name: x\n",
			"protect[0]", []string{"protects nothing in particular: set peers, localPorts or remotePorts"}},
		{"nothing with protocol any", "- name: x\n  protocol: any\n",
			"protect[0]", []string{"protects nothing in particular"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := v1alpha1.ParseConfig([]byte(protectConfig(tt.rules)))
			if err == nil {
				t.Fatal("valid; want an error")
			}
			var found bool
			for _, fe := range problems(t, err) {
				if fe.Field != tt.field {
					continue
				}
				found = true
				for _, w := range tt.want {
					if !strings.Contains(fe.Detail, w) {
						t.Errorf("%s: %q does not say %q", fe.Field, fe.Detail, w)
					}
				}
			}
			if !found {
				t.Errorf("no error names %s; got:\n%v", tt.field, err)
			}
		})
	}
}

// One rule is kept for the API server: 31 file rules fit, 32 do not.
func TestProtectCount(t *testing.T) {
	rules := func(n int) string {
		var b strings.Builder
		for i := range n {
			fmt.Fprintf(&b, "- name: r%d\n  protocol: tcp\n  localPorts: [%d]\n", i, 1000+i)
		}
		return b.String()
	}
	if _, err := v1alpha1.ParseConfig([]byte(protectConfig(rules(v1alpha1.MaxProtect)))); err != nil {
		t.Errorf("%d rules: %v", v1alpha1.MaxProtect, err)
	}
	_, err := v1alpha1.ParseConfig([]byte(protectConfig(rules(v1alpha1.MaxProtect + 1))))
	if err == nil || !strings.Contains(err.Error(), "protect: 32 rules is more than 31: the data path holds 32 and keeps one for the agent's API server connection") {
		t.Errorf("%d rules: %v", v1alpha1.MaxProtect+1, err)
	}
}

// The api package types the data path's rule count a second time (it
// cannot import maps).
func TestProtectDataPathAgrees(t *testing.T) {
	if v1alpha1.MaxProtectRules != maps.MaxProtectRules {
		t.Errorf("MaxProtectRules %d, data path %d", v1alpha1.MaxProtectRules, maps.MaxProtectRules)
	}
}

// docs/config.md documents every field of a protect rule, and its protect
// example parses.
func TestProtectDocs(t *testing.T) {
	data, err := os.ReadFile("../../docs/config.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(data)
	for _, n := range []string{"protect", "protectAPIServer", "name", "protocol", "peers", "localPorts", "remotePorts"} {
		if !strings.Contains(doc, "\n| `"+n+"` |") {
			t.Errorf("docs/config.md has no row for %s", n)
		}
	}
	_, after, ok := strings.Cut(doc, "<!-- protect example -->")
	if !ok {
		t.Fatal("docs/config.md has no protect example")
	}
	_, after, _ = strings.Cut(after, "```")
	_, after, _ = strings.Cut(after, "\n")
	body, _, _ := strings.Cut(after, "```")
	c, err := v1alpha1.ParseConfig([]byte(body))
	if err != nil {
		t.Fatalf("the protect example: %v", err)
	}
	if len(c.Protect) < 2 {
		t.Errorf("the protect example has %d rules", len(c.Protect))
	}
}

// The DaemonSet's ConfigMap protects SSH and the kubelet, and the API
// server connection (by default).
func TestProtectConfigMap(t *testing.T) {
	data, err := os.ReadFile("../../deploy/configmap.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var cm corev1.ConfigMap
	if err := yaml.Unmarshal(data, &cm); err != nil {
		t.Fatal(err)
	}
	c, err := v1alpha1.ParseConfig([]byte(cm.Data["rlagent.yaml"]))
	if err != nil {
		t.Fatal(err)
	}
	local := map[string]bool{}
	for _, p := range c.Protect {
		if p.Protocol == v1alpha1.ProtocolTCP && len(p.Peers) == 0 && len(p.RemotePorts) == 0 {
			for _, port := range p.LocalPorts {
				local[port] = true
			}
		}
	}
	if !local["22"] || !local["10250"] {
		t.Errorf("the ConfigMap protects tcp local ports %v; want 22 (SSH) and 10250 (the kubelet)", local)
	}
	if !c.ProtectsAPIServer() {
		t.Errorf("the ConfigMap turns the API server's protection off")
	}
}

// TestProtectDefault: a file without protect (or with protect: null) gets
// the rule ssh, tcp local port 22 from every peer; protect: [] turns
// protection off and stays [] when the file is written back (limits set);
// a list left out stays left out.
func TestProtectDefault(t *testing.T) {
	const head = "interfaces: [eth0]\n"
	ssh := []v1alpha1.Protect{{Name: "ssh", Protocol: v1alpha1.ProtocolTCP, LocalPorts: []string{"22"}}}
	for _, tc := range []struct {
		yaml string
		want []v1alpha1.Protect
		off  bool
	}{
		{head, ssh, false},
		{head + "protect:\n", ssh, false},
		{head + "protect: []\n", []v1alpha1.Protect{}, true},
		{head + "protect: [{name: web, protocol: tcp, localPorts: [443]}]\n", []v1alpha1.Protect{{Name: "web", Protocol: v1alpha1.ProtocolTCP, LocalPorts: []string{"443"}}}, false},
	} {
		c, err := v1alpha1.ParseConfig([]byte(tc.yaml))
		if err != nil {
			t.Fatalf("%q: %v", tc.yaml, err)
		}
		if !reflect.DeepEqual(c.Protect, tc.want) || c.ProtectOff() != tc.off {
			t.Errorf("%q: protect %+v, off %v; want %+v, off %v", tc.yaml, c.Protect, c.ProtectOff(), tc.want, tc.off)
		}
		wantSSH := len(tc.want) > 0 && tc.want[0].Name == "ssh"
		if name, ok := c.ProtectsLocalTCP(22); ok != wantSSH || wantSSH && name != "ssh" {
			t.Errorf("%q: ProtectsLocalTCP(22) = %q, %v", tc.yaml, name, ok)
		}
	}

	// Written back as it was decoded: [] kept, left out kept out.
	for _, tc := range []struct{ in, want string }{
		{head + "protect: []\n", "protect: []\n"},
		{head, ""},
	} {
		raw, err := v1alpha1.DecodeConfig([]byte(tc.in))
		if err != nil {
			t.Fatal(err)
		}
		out, err := raw.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.Contains(string(out), "protect"); got != (tc.want != "") || !strings.Contains(string(out), tc.want) {
			t.Errorf("%q marshals as\n%s\nwant %q", tc.in, out, tc.want)
		}
		c, err := v1alpha1.ParseConfig(out)
		if err != nil {
			t.Fatal(err)
		}
		if c.ProtectOff() != (tc.want != "") {
			t.Errorf("%q after a round trip: protection off %v", tc.in, c.ProtectOff())
		}
	}
}
