package v1alpha1

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// fullConfig sets every field of the file to a value other than its default.
const fullConfig = `
interfaces: [eth0, "ens5"]
pinDir: /sys/fs/bpf/rl-test
metricsAddress: "[::1]:9999"
secureMetrics:
  address: ":9479"
  certDir: /etc/rlagent/tls
maxBuckets: 131072
count:
  file: /run/rlagent/replicas
limits:
- name: dns
  rate: 20000
  match:
    protocol: udp
    dstPorts: [53]
- name: per-source
  rate: 1000
  unit: bytes
  burst: 5000
  match:
    direction: ingress
    protocol: tcp
    dstPorts: ["80", 8000-8080]
    srcCIDRs: [10.0.0.0/8, "2001:db8::/32"]
    dstCIDRs: [192.0.2.1]
  key: src-prefix
  prefixLength:
    ipv4: 16
  scope: static
  action: shadow
- name: egress-paced
  rate: 5000
  match:
    direction: egress
  action: pace
  horizon: 250ms
manageQdisc: true
`

func TestParseConfig(t *testing.T) {
	c, err := ParseConfig([]byte(fullConfig))
	if err != nil {
		t.Fatal(err)
	}
	want := &Config{
		Interfaces:          []string{"eth0", "ens5"},
		PinDir:              "/sys/fs/bpf/rl-test",
		MetricsAddress:      "[::1]:9999",
		SecureMetrics:       SecureMetrics{Address: ":9479", CertDir: "/etc/rlagent/tls"},
		MaxBuckets:          131072,
		Count:               CountSource{File: "/run/rlagent/replicas"},
		Protect:             DefaultProtect(),
		ProtectAPIServer:    ptr(true),
		XDPFallback:         XDPFallbackNone,
		EndpointHook:        EndpointHookHost,
		EndpointSourceCheck: SourceCheckCount,
		DemandShares:        DemandShares{Interval: &metav1.Duration{Duration: 15 * time.Second}, StaleAfter: &metav1.Duration{Duration: time.Minute}, FloorPerMille: ptr(uint32(10))},
		RejectBudget:        RejectBudget{Rate: ptr(uint32(1000)), Burst: ptr(uint32(50)), PerDestination: ReplyRate{Rate: ptr(uint32(100)), Burst: ptr(uint32(10))}},
		Limits: []Limit{
			{Name: "dns", RateLimitSpec: RateLimitSpec{
				Rate: 20000, Unit: UnitPackets,
				Match: Match{Direction: DirectionIngress, Protocol: ProtocolUDP, DstPorts: []string{"53"}},
				Key:   KeyNone, Scope: ScopeStatic, Action: ActionDrop, Share: ShareEqual, Attach: AttachUplink,
			}},
			{Name: "per-source", RateLimitSpec: RateLimitSpec{
				Rate: 1000, Unit: UnitBytes, Burst: ptr(uint64(5000)),
				Match: Match{
					Direction: DirectionIngress, Protocol: ProtocolTCP,
					DstPorts: []string{"80", "8000-8080"},
					SrcCIDRs: []string{"10.0.0.0/8", "2001:db8::/32"},
					DstCIDRs: []string{"192.0.2.1"},
				},
				Key:          KeySrcPrefix,
				PrefixLength: &PrefixLength{IPv4: 16, IPv6: DefaultPrefixLengthIPv6},
				Scope:        ScopeStatic, Action: ActionShadow, Share: ShareEqual, Attach: AttachUplink,
			}},
			{Name: "egress-paced", RateLimitSpec: RateLimitSpec{
				Rate: 5000, Unit: UnitPackets,
				Match: Match{Direction: DirectionEgress, Protocol: ProtocolAny},
				Key:   KeyNone, Scope: ScopeStatic, Action: ActionPace, Share: ShareEqual, Attach: AttachUplink,
				Horizon: &metav1.Duration{Duration: 250 * time.Millisecond},
			}},
		},
		ManageQdisc: true,
	}
	if !reflect.DeepEqual(c, want) {
		t.Errorf("got\n%+v\nwant\n%+v", c, want)
	}
}

func TestRoundTrip(t *testing.T) {
	c, err := ParseConfig([]byte(fullConfig))
	if err != nil {
		t.Fatal(err)
	}
	out, err := c.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	c2, err := ParseConfig(out)
	if err != nil {
		t.Fatalf("parse marshaled config: %v\n%s", err, out)
	}
	if !reflect.DeepEqual(c, c2) {
		t.Errorf("round trip changed the config:\n%+v\n%+v\n%s", c, c2, out)
	}
	// The fields come in the order of the types, so a limit starts with
	// its name.
	if !strings.HasPrefix(string(out), "interfaces:") || !strings.Contains(string(out), "limits:\n- name: dns\n  rate: 20000\n") {
		t.Errorf("marshaled fields out of order:\n%s", out)
	}

	// Decoded without defaults, the config marshals without them.
	raw, err := DecodeConfig([]byte("interfaces: [eth0]\nlimits:\n- name: a\n  rate: 100\n  match: {}\n"))
	if err != nil {
		t.Fatal(err)
	}
	out, err = raw.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if want := "interfaces:\n- eth0\nlimits:\n- name: a\n  rate: 100\n  match: {}\n"; string(out) != want {
		t.Errorf("raw config marshals as\n%s\nwant\n%s", out, want)
	}
	raw2, err := DecodeConfig(out)
	if err != nil || !reflect.DeepEqual(raw, raw2) {
		t.Errorf("raw round trip: %v\n%+v\n%+v", err, raw, raw2)
	}
}

func TestDecodeErrors(t *testing.T) {
	tests := []struct {
		name string
		yaml string
		want []string // each must appear in the error
	}{
		{"unknown top-level field", "interfaces: [eth0]\ninterface: eth1\n",
			[]string{"interface: unknown field; valid fields: interfaces, pinDir, metricsAddress, secureMetrics, maxBuckets, count, limits"}},
		{"unknown nested field", "interfaces: [eth0]\nlimits:\n- name: a\n  rate: 1\n  match: {dstPort: 53}\n",
			[]string{"limits[0].match.dstPort: unknown field; valid fields: direction, protocol, dstPorts, srcCIDRs, dstCIDRs, service, podSelector, namespaceSelector"}},
		{"unknown field in a limit lists the inline fields", "limits:\n- name: a\n  rate: 1\n  match: {}\n  burts: 3\n",
			[]string{"limits[0].burts: unknown field; valid fields: name, rate, unit, burst, match, key, prefixLength, scope, action"}},
		{"field names are case-sensitive", "interfaces: [eth0]\nPinDir: /x\n",
			[]string{"PinDir: unknown field: field names are case-sensitive, did you mean pinDir?"}},
		{"duplicate key", "interfaces: [eth0]\ninterfaces: [eth1]\n",
			[]string{`line 2: key "interfaces" already set`}},
		{"syntax", "interfaces: [eth0\n", []string{"yaml: line 1: did not find expected ',' or ']'"}},
		{"not a mapping", "- eth0\n", []string{"config: expected a mapping of fields"}},
		{"bare off", "interfaces: [eth0]\nmetricsAddress: off\n",
			[]string{"metricsAddress: YAML reads this unquoted value as a boolean", "quote it"}},
		{"list expected", "interfaces: eth0\n", []string{`interfaces: expected auto or a list of interface names, got the string "eth0"`}},
		{"auto or a list", "interfaces: {auto: true}\n", []string{`interfaces: expected auto or a list of interface names, got a mapping`}},
		{"auto stands alone", "interfaces: [eth0, auto]\n",
			[]string{`interfaces[1]: "auto" stands alone (interfaces: auto finds the uplinks); an interface named auto cannot be listed`}},
		{"mapping expected", "interfaces: [eth0]\ncount: 3\n", []string{"count: expected a mapping, got 3"}},
		{"unknown secure metrics field", "interfaces: [eth0]\nsecureMetrics: {address: \":9479\", certFile: /x}\n",
			[]string{"secureMetrics.certFile: unknown field; valid fields: address, certDir"}},
		{"quoted number", "limits:\n- name: a\n  rate: \"100\"\n  match: {}\n",
			[]string{`limits[0].rate: expected a whole number, got the string "100"`}},
		{"fraction", "limits:\n- name: a\n  rate: 1.5\n  match: {}\n", []string{"limits[0].rate: 1.5 is not a whole number"}},
		{"negative unsigned", "maxBuckets: -1\n", []string{"maxBuckets: -1 is out of range 0..4294967295"}},
		{"too large for the type", "limits:\n- name: a\n  rate: 1\n  match: {}\n  key: src-prefix\n  prefixLength: {ipv4: 300}\n",
			[]string{"limits[0].prefixLength.ipv4: 300 is out of range 0..255"}},
		{"count too large for int32", "count: {static: 3000000000}\n",
			[]string{"count.static: 3000000000 is out of range -2147483648..2147483647"}},
		{"horizon a number", "limits:\n- name: a\n  rate: 1\n  match: {direction: egress}\n  action: pace\n  horizon: 100\n",
			[]string{`limits[0].horizon: expected a duration such as "100ms", got 100`}},
		{"horizon not a duration", "limits:\n- name: a\n  rate: 1\n  match: {direction: egress}\n  action: pace\n  horizon: 100 ms\n",
			[]string{`limits[0].horizon: "100 ms" is not a duration: a number and a unit, such as 100ms or 1.5s`}},
		{"horizon a mapping", "limits:\n- name: a\n  rate: 1\n  match: {}\n  horizon: {ms: 100}\n",
			[]string{`limits[0].horizon: expected a duration such as "100ms"`}},
		{"label key not a string", "limits:\n- name: a\n  rate: 1\n  scope: pods\n  match: {podSelector: {matchLabels: {yes: web}}}\n",
			[]string{"limits[0].match.podSelector.matchLabels: key true is not a string: quote it"}},
		{"label value a list", "limits:\n- name: a\n  rate: 1\n  scope: pods\n  match: {podSelector: {matchLabels: {app: [web]}}}\n",
			[]string{"limits[0].match.podSelector.matchLabels.app: expected a string, got a list"}},
		{"label selector unknown field", "limits:\n- name: a\n  rate: 1\n  scope: pods\n  match: {namespaceSelector: {matchLabel: {team: a}}}\n",
			[]string{"limits[0].match.namespaceSelector.matchLabel: unknown field; valid fields: matchLabels, matchExpressions"}},
		{"every problem at once", "interfaces: eth0\nfoo: 1\nlimits:\n- name: a\n  rate: x\n",
			[]string{"interfaces: expected auto or a list", "\nfoo: unknown field", "\nlimits[0].rate: expected a whole number"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseConfig([]byte(tt.yaml))
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error\n%v\ndoes not contain\n%s", err, w)
				}
			}
		})
	}
}

// interfaces: auto decodes, validates, and is written back as auto, and
// only the single word auto means it.
func TestInterfacesAuto(t *testing.T) {
	for _, in := range []string{"interfaces: auto\n", "interfaces: [auto]\n"} {
		c, err := ParseConfig([]byte(in))
		if err != nil {
			t.Fatalf("%q: %v", in, err)
		}
		if !c.Interfaces.Auto() {
			t.Errorf("%q: %v is not auto", in, c.Interfaces)
		}
		raw, err := DecodeConfig([]byte(in))
		if err != nil {
			t.Fatal(err)
		}
		out, err := raw.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		if string(out) != "interfaces: auto\n" {
			t.Errorf("%q written back as %q, want interfaces: auto", in, out)
		}
	}
	for _, l := range []InterfaceList{nil, {}, {"eth0"}, {"auto", "eth0"}, {"Auto"}} {
		if l.Auto() {
			t.Errorf("%q is auto", l)
		}
	}
	c, err := ParseConfig([]byte("interfaces: [eth0, bond0]\n"))
	if err != nil || c.Interfaces.Auto() || !reflect.DeepEqual(c.Interfaces, InterfaceList{"eth0", "bond0"}) {
		t.Errorf("a list: %v %v", c, err)
	}
	if _, err := ParseConfig([]byte("interfaces: Auto\n")); err == nil || !strings.Contains(err.Error(), `got the string "Auto"`) {
		t.Errorf("Auto: %v, want an error naming the word", err)
	}
}

// TestDecodeLenient covers what YAML writers do that the decoder accepts.
func TestDecodeLenient(t *testing.T) {
	c, err := ParseConfig([]byte(`
interfaces: [eth0]
metricsAddress: "off"
count: {static: 0}
limits:
- name: a
  rate: 2e4        # a whole float
  burst: null      # null leaves the default
  match: {dstPorts: [53, 8000-8080], srcCIDRs: [10.0.0.1]}
`))
	if err != nil {
		t.Fatal(err)
	}
	l := c.Limits[0]
	if c.MetricsAddress != "off" || *c.Count.Static != 0 || l.Rate != 20000 || l.Burst != nil ||
		!reflect.DeepEqual(l.Match.DstPorts, []string{"53", "8000-8080"}) {
		t.Errorf("got %+v", c)
	}
	// An empty file decodes; it is invalid for want of interfaces.
	if _, err := ParseConfig(nil); err == nil || err.Error() != "interfaces: required: auto, or at least one network interface" {
		t.Errorf("empty file: %v", err)
	}
}

func TestDefault(t *testing.T) {
	c := &Config{Interfaces: []string{"eth0"}, Limits: []Limit{
		{Name: "a", RateLimitSpec: RateLimitSpec{Rate: 5}},
		{Name: "b", RateLimitSpec: RateLimitSpec{Rate: 1000, Key: KeySrcPrefix, PrefixLength: &PrefixLength{IPv6: 48}}},
		{Name: "c", RateLimitSpec: RateLimitSpec{Rate: 1000, Unit: UnitBytes, Burst: ptr(uint64(7)), Key: KeySrcIP,
			Scope: ScopeNodes, Action: ActionShadow, Match: Match{Direction: DirectionEgress, Protocol: ProtocolTCP}}},
		{Name: "d", RateLimitSpec: RateLimitSpec{Rate: 10, Action: ActionPace, Match: Match{Direction: DirectionEgress}}},
	}}
	c.Default()
	want := &Config{
		Interfaces:          []string{"eth0"},
		PinDir:              "/sys/fs/bpf/rlagent",
		MetricsAddress:      "127.0.0.1:9478",
		MaxBuckets:          65536,
		Count:               CountSource{Static: ptr(int32(1))},
		Protect:             DefaultProtect(),
		ProtectAPIServer:    ptr(true),
		XDPFallback:         XDPFallbackNone,
		EndpointHook:        EndpointHookHost,
		EndpointSourceCheck: SourceCheckCount,
		DemandShares:        DemandShares{Interval: &metav1.Duration{Duration: 15 * time.Second}, StaleAfter: &metav1.Duration{Duration: time.Minute}, FloorPerMille: ptr(uint32(10))},
		RejectBudget:        RejectBudget{Rate: ptr(uint32(1000)), Burst: ptr(uint32(50)), PerDestination: ReplyRate{Rate: ptr(uint32(100)), Burst: ptr(uint32(10))}},
		Limits: []Limit{
			{Name: "a", RateLimitSpec: RateLimitSpec{Rate: 5, Unit: UnitPackets, Key: KeyNone, Scope: ScopeStatic, Action: ActionDrop, Share: ShareEqual, Attach: AttachUplink,
				Match: Match{Direction: DirectionIngress, Protocol: ProtocolAny}}},
			{Name: "b", RateLimitSpec: RateLimitSpec{Rate: 1000, Unit: UnitPackets, Key: KeySrcPrefix, Scope: ScopeStatic, Action: ActionDrop, Share: ShareEqual, Attach: AttachUplink,
				PrefixLength: &PrefixLength{IPv4: 24, IPv6: 48},
				Match:        Match{Direction: DirectionIngress, Protocol: ProtocolAny}}},
			// Every field set: nothing changes.
			{Name: "c", RateLimitSpec: RateLimitSpec{Rate: 1000, Unit: UnitBytes, Burst: ptr(uint64(7)), Key: KeySrcIP,
				Scope: ScopeNodes, Action: ActionShadow, Share: ShareEqual, Attach: AttachUplink, Match: Match{Direction: DirectionEgress, Protocol: ProtocolTCP}}},
			// Pace: the horizon's default.
			{Name: "d", RateLimitSpec: RateLimitSpec{Rate: 10, Unit: UnitPackets, Key: KeyNone, Scope: ScopeStatic, Action: ActionPace, Share: ShareEqual,
				Horizon: &metav1.Duration{Duration: 100 * time.Millisecond}, Attach: AttachUplink,
				Match: Match{Direction: DirectionEgress, Protocol: ProtocolAny}}},
		},
	}
	if !reflect.DeepEqual(c, want) {
		t.Fatalf("Default:\n got %+v\nwant %+v", c, want)
	}

	// Idempotent: a second Default changes nothing.
	c.Default()
	if !reflect.DeepEqual(c, want) {
		t.Errorf("second Default changed the config:\n%+v", c)
	}
	// A count file is not overridden by the static default.
	f := &Config{Count: CountSource{File: "/run/n"}}
	f.Default()
	if f.Count.Static != nil {
		t.Errorf("Default set static next to file")
	}
	// ParseConfig defaults exactly once: defaulting its result again is a
	// no-op.
	p, err := ParseConfig([]byte(fullConfig))
	if err != nil {
		t.Fatal(err)
	}
	q, _ := ParseConfig([]byte(fullConfig))
	q.Default()
	if !reflect.DeepEqual(p, q) {
		t.Errorf("Default on a parsed config changed it")
	}
}

func TestEffectiveBurst(t *testing.T) {
	tests := []struct {
		rate  uint64
		burst *uint64
		want  uint64
	}{
		{20000, nil, 2000},
		{25, nil, 2},
		{9, nil, 1},
		{1, nil, 1},
		{1000, ptr(uint64(5)), 5},
	}
	for _, tt := range tests {
		s := RateLimitSpec{Rate: tt.rate, Burst: tt.burst}
		s.Default()
		if s.Burst != tt.burst {
			t.Errorf("Default changed burst")
		}
		if got := s.EffectiveBurst(); got != tt.want {
			t.Errorf("rate %d burst %v: EffectiveBurst = %d, want %d", tt.rate, tt.burst, got, tt.want)
		}
	}
}

func TestLoadConfig(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "rlagent.yaml")
	if _, err := LoadConfig(path); err == nil || !strings.Contains(err.Error(), path) {
		t.Errorf("missing file: %v", err)
	}
	os.WriteFile(path, []byte("interfaces: [eth0]\nlimits:\n- name: a\n  rate: 0\n  unit: pkts\n  match: {}\n"), 0o644)
	_, err := LoadConfig(path)
	want := "load config " + path + ": 2 errors:\n" +
		"limits[0].rate: required: 1..4000000000 units per second over all replicas\n" +
		`limits[0].unit: "pkts" is not one of packets, bytes, connections, requests`
	if err == nil || err.Error() != want {
		t.Errorf("got\n%v\nwant\n%s", err, want)
	}
	os.WriteFile(path, []byte("interfaces: [eth0]\nlimits:\n- name: a\n  rate: 10\n  unit: pkts\n  match: {}\n"), 0o644)
	_, err = LoadConfig(path)
	want = "load config " + path + `: limits[0].unit: "pkts" is not one of packets, bytes, connections, requests`
	if err == nil || err.Error() != want {
		t.Errorf("got\n%v\nwant\n%s", err, want)
	}
	os.WriteFile(path, []byte(fullConfig), 0o644)
	if _, err := LoadConfig(path); err != nil {
		t.Error(err)
	}
}

func TestWriteConfigAtomic(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "rlagent.yaml")
	old := []byte("# hand-written\ninterfaces: [eth0]\n")
	if err := os.WriteFile(path, old, 0o600); err != nil {
		t.Fatal(err)
	}
	onlyFile := func(t *testing.T, dir, name string) {
		t.Helper()
		ents, _ := os.ReadDir(dir)
		if len(ents) != 1 || ents[0].Name() != name {
			var names []string
			for _, e := range ents {
				names = append(names, e.Name())
			}
			t.Errorf("directory holds %v, want only %s", names, name)
		}
	}

	// An invalid config leaves the file alone.
	bad, _ := DecodeConfig([]byte(fullConfig))
	bad.Limits[1].Name = "dns"
	err := WriteConfigAtomic(path, bad)
	if err == nil || !strings.Contains(err.Error(), "write config "+path+": ") ||
		!strings.Contains(err.Error(), `limits[1].name: "dns" is already the name of limits[0]`) {
		t.Errorf("invalid config: %v", err)
	}
	if got, _ := os.ReadFile(path); string(got) != string(old) {
		t.Errorf("file changed to\n%s", got)
	}
	onlyFile(t, dir, "rlagent.yaml")

	// A valid one replaces it, keeps the mode, and loads as written.
	good, _ := DecodeConfig([]byte(fullConfig))
	if err := WriteConfigAtomic(path, good); err != nil {
		t.Fatal(err)
	}
	onlyFile(t, dir, "rlagent.yaml")
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o600 {
		t.Errorf("mode %v, want 0600", fi.Mode().Perm())
	}
	loaded, err := LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := ParseConfig([]byte(fullConfig))
	if !reflect.DeepEqual(loaded, want) {
		t.Errorf("loaded %+v, want %+v", loaded, want)
	}

	// A new file is created 0644.
	fresh := filepath.Join(t.TempDir(), "new.yaml")
	if err := WriteConfigAtomic(fresh, good); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(fresh); fi.Mode().Perm() != 0o644 {
		t.Errorf("new file mode %v, want 0644", fi.Mode().Perm())
	}

	// Through a symbolic link the target is replaced and the link stays.
	link := filepath.Join(t.TempDir(), "link.yaml")
	if err := os.Symlink(path, link); err != nil {
		t.Fatal(err)
	}
	good.MaxBuckets = 4096
	if err := WriteConfigAtomic(link, good); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Lstat(link); fi.Mode()&os.ModeSymlink == 0 {
		t.Errorf("link replaced by a file")
	}
	if c, err := LoadConfig(path); err != nil || c.MaxBuckets != 4096 {
		t.Errorf("target not written: %v %+v", err, c)
	}

	// A failure after the temporary file exists (the rename onto a
	// directory) removes it.
	dir2 := t.TempDir()
	target := filepath.Join(dir2, "rlagent.yaml")
	os.Mkdir(target, 0o755)
	os.WriteFile(filepath.Join(target, "keep"), nil, 0o644)
	if err := WriteConfigAtomic(target, good); err == nil {
		t.Errorf("rename onto a directory succeeded")
	}
	onlyFile(t, dir2, "rlagent.yaml")
}

// TestDefaultAttach checks that a scope service limit is enforced at the
// endpoints by default and every other one at the uplink, and that an
// explicit attach is kept.
func TestDefaultAttach(t *testing.T) {
	for _, tt := range []struct {
		spec RateLimitSpec
		want Attach
	}{
		{RateLimitSpec{Rate: 1, Scope: ScopeService, Match: Match{Service: "default/web"}}, AttachEndpoints},
		{RateLimitSpec{Rate: 1, Scope: ScopeNodes}, AttachUplink},
		{RateLimitSpec{Rate: 1}, AttachUplink},
		{RateLimitSpec{Rate: 1, Scope: ScopeService, Attach: AttachUplink, Match: Match{Service: "default/web"}}, AttachUplink},
		{RateLimitSpec{Rate: 1, Attach: AttachEndpoints, Match: Match{DstCIDRs: []string{"10.0.0.1"}}}, AttachEndpoints},
	} {
		s := tt.spec
		s.Default()
		if s.Attach != tt.want {
			t.Errorf("scope %q attach %q: defaulted to %q, want %q", tt.spec.Scope, tt.spec.Attach, s.Attach, tt.want)
		}
		if err := s.Validate("spec"); err != nil {
			t.Errorf("scope %q attach %q: %v", tt.spec.Scope, tt.spec.Attach, err)
		}
	}
}

// TestMatchRequired: a limit without match (left out, or null) is an error
// naming the field, as the docs say Required; match: {} is the explicit way
// to match every ingress packet.
func TestMatchRequired(t *testing.T) {
	for _, tt := range []struct{ name, limit string }{
		{"left out", "- name: a\n  rate: 10\n"},
		{"null", "- name: a\n  rate: 10\n  match:\n"},
		{"flow, left out", "- {name: a, rate: 10}\n"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseConfig([]byte("interfaces: [eth0]\nlimits:\n- name: ok\n  rate: 1\n  match: {}\n" + tt.limit))
			if err == nil || !strings.Contains(err.Error(), "limits[1].match: required") || !strings.Contains(err.Error(), "match: {}") {
				t.Errorf("error %v: want limits[1].match: required, naming match: {}", err)
			}
		})
	}
	c, err := ParseConfig([]byte("interfaces: [eth0]\nlimits:\n- name: all\n  rate: 10\n  match: {}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if m := c.Limits[0].Match; m.Direction != DirectionIngress || m.Protocol != ProtocolAny || m.DstPorts != nil || m.SrcCIDRs != nil || m.DstCIDRs != nil {
		t.Errorf("match: {} defaulted to %+v, want every ingress packet", m)
	}
}

// TestLoadConfigNotRegular: the loader (rlagent validate, the agent's start
// and reload) refuses a FIFO without a writer and /dev/zero at once, and a
// regular file over MaxConfigBytes without reading it all; each case runs
// under a deadline, since before it a FIFO blocked the read forever and
// /dev/zero never ended.
func TestLoadConfigNotRegular(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo.yaml")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	big := filepath.Join(dir, "big.yaml")
	if err := os.WriteFile(big, []byte("interfaces: [eth0]\n"+strings.Repeat("#", MaxConfigBytes)), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, path, want string }{
		{"fifo", fifo, "not a regular file (a FIFO)"},
		{"dev-zero", "/dev/zero", "not a regular file (a device)"},
		{"too large", big, "more than 16777216 bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			done := make(chan error, 1)
			go func() {
				_, err := LoadConfig(tc.path)
				done <- err
			}()
			select {
			case err := <-done:
				if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), tc.path) {
					t.Errorf("LoadConfig(%s): %v; want an error naming the path and %q", tc.path, err, tc.want)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("LoadConfig(%s) has not returned after 10s", tc.path)
			}
		})
	}
}
