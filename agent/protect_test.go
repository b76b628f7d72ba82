package agent

import (
	"context"
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/maps"
	"github.com/rlagent/rlagent/watcher"
)

func protectPrefixes(s ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(s))
	for i, p := range s {
		out[i] = netip.MustParsePrefix(p)
	}
	return out
}

func endpoints(s ...string) []netip.AddrPort {
	out := make([]netip.AddrPort, len(s))
	for i, a := range s {
		out[i] = netip.MustParseAddrPort(a)
	}
	return out
}

// The config's protect list and the API server's endpoints become data path
// rules: the file's in order, then one for the API server.
func TestProtectRulesConversion(t *testing.T) {
	c, err := v1alpha1.ParseConfig([]byte(`
interfaces: [eth0]
protect:
- name: ssh
  protocol: tcp
  localPorts: [22]
- name: monitoring
  peers: [192.0.2.10, "2001:db8:7::1/64", 10.1.2.3/8]
- name: ntp
  protocol: udp
  peers: [198.51.100.0/24]
  remotePorts: [123]
  localPorts: [123, 40000-40100]
- name: both
  localPorts: [8080]
`))
	if err != nil {
		t.Fatal(err)
	}
	file := []maps.ProtectRule{
		{Protocol: maps.TCP, LocalPorts: []maps.PortRange{{First: 22, Last: 22}}},
		{Protocol: maps.AnyProtocol, Peers: protectPrefixes("192.0.2.10/32", "2001:db8:7::/64", "10.0.0.0/8")},
		{Protocol: maps.UDP, Peers: protectPrefixes("198.51.100.0/24"),
			LocalPorts: []maps.PortRange{{First: 123, Last: 123}, {First: 40000, Last: 40100}}, RemotePorts: []maps.PortRange{{First: 123, Last: 123}}},
		{Protocol: maps.AnyProtocol, LocalPorts: []maps.PortRange{{First: 8080, Last: 8080}}},
	}
	for _, tc := range []struct {
		name string
		api  []netip.AddrPort
		want []maps.ProtectRule
	}{
		{"no API server", nil, file},
		{"one endpoint", endpoints("192.0.2.1:6443"), append(slices.Clone(file),
			maps.ProtectRule{Protocol: maps.TCP, Peers: protectPrefixes("192.0.2.1/32"), RemotePorts: []maps.PortRange{{First: 6443, Last: 6443}}})},
		{"three endpoints, two families, an IPv4-mapped address", endpoints("192.0.2.1:6443", "[::ffff:192.0.2.2]:6443", "[2001:db8::1]:6443"),
			append(slices.Clone(file), maps.ProtectRule{Protocol: maps.TCP, Peers: protectPrefixes("192.0.2.1/32", "192.0.2.2/32", "2001:db8::1/128"),
				RemotePorts: []maps.PortRange{{First: 6443, Last: 6443}}})},
		{"endpoints on two ports: one rule", endpoints("192.0.2.1:6443", "192.0.2.2:443", "192.0.2.1:443"),
			append(slices.Clone(file), maps.ProtectRule{Protocol: maps.TCP, Peers: protectPrefixes("192.0.2.1/32", "192.0.2.2/32"),
				RemotePorts: []maps.PortRange{{First: 443, Last: 443}, {First: 6443, Last: 6443}}})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := protectRules(c.Protect, tc.api)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("rules\n got %+v\nwant %+v", got, tc.want)
			}
		})
	}

	// A full file (31 rules) and the API server fill the data path exactly;
	// one more rule does not fit.
	many := func(n int) []v1alpha1.Protect {
		var out []v1alpha1.Protect
		for i := range n {
			out = append(out, v1alpha1.Protect{Name: fmt.Sprintf("r%d", i), LocalPorts: []string{fmt.Sprint(1000 + i)}})
		}
		return out
	}
	api := endpoints("192.0.2.1:6443")
	if rules, err := protectRules(many(v1alpha1.MaxProtect), api); err != nil || len(rules) != maps.MaxProtectRules {
		t.Errorf("31 rules and the API server: %d rules, %v", len(rules), err)
	}
	if _, err := protectRules(many(v1alpha1.MaxProtect+1), api); err == nil || !strings.Contains(err.Error(), "33 protect rules is more than the data path's 32") {
		t.Errorf("32 rules and the API server: %v", err)
	}
	// An unvalidated protocol is an error, not "any".
	if _, err := protectRules([]v1alpha1.Protect{{Name: "x", Protocol: v1alpha1.ProtocolICMP, Peers: []string{"10.0.0.1"}}}, nil); err == nil {
		t.Error("protocol icmp converted")
	}
}

// fixedAPIServer is an APIServer for host, not run: an address is known
// from the start, a name never.
func fixedAPIServer(t *testing.T, host string) *watcher.APIServer {
	t.Helper()
	s, err := watcher.NewAPIServer(watcher.APIServerConfig{Host: host, Log: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

const protectTwo = `
interfaces: [lo]
protect:
- name: ssh
  protocol: tcp
  localPorts: [22]
- name: kubelet
  protocol: tcp
  localPorts: [10250]
`

func TestApplyProtect(t *testing.T) {
	t.Run("outside a cluster: the file's rules", func(t *testing.T) {
		a := newTestAgent(t, protectTwo, &fakeSource{})
		a.applyProtect("start")
		st := a.Protection()
		if st.Err != nil || st.Rules != 2 || len(st.APIServer) != 0 || st.Waiting || st.APIServerOff || st.At.IsZero() {
			t.Errorf("state %+v", st)
		}
	})
	t.Run("in a cluster: and the API server", func(t *testing.T) {
		a := newTestAgent(t, protectTwo, &fakeSource{})
		a.opts.APIServer = fixedAPIServer(t, "https://192.0.2.1:6443")
		a.applyProtect("start")
		st := a.Protection()
		if st.Err != nil || st.Rules != 3 || !slices.Equal(st.APIServer, endpoints("192.0.2.1:6443")) {
			t.Errorf("state %+v", st)
		}
	})
	t.Run("protectAPIServer false", func(t *testing.T) {
		a := newTestAgent(t, protectTwo+"protectAPIServer: false\n", &fakeSource{})
		a.opts.APIServer = fixedAPIServer(t, "https://192.0.2.1:6443")
		a.applyProtect("start")
		st := a.Protection()
		if st.Err != nil || st.Rules != 2 || len(st.APIServer) != 0 || !st.APIServerOff {
			t.Errorf("state %+v", st)
		}
	})
	t.Run("endpoints unknown without limits", func(t *testing.T) {
		a := newTestAgent(t, protectTwo, &fakeSource{})
		a.opts.APIServer = fixedAPIServer(t, "https://api.invalid:6443") // never run: never known
		a.applyProtect("start")
		st := a.Protection()
		if st.Err != nil || st.Rules != 2 || st.Waiting {
			t.Errorf("state %+v", st)
		}
	})
	t.Run("endpoints unknown with limits in force", func(t *testing.T) {
		a := newTestAgent(t, protectTwo, &fakeSource{})
		a.opts.APIServer = fixedAPIServer(t, "https://api.invalid:6443")
		if err := a.dp.SetLimit(0, maps.Limit{Rate: 1, Burst: 1}); err != nil { // as adopted from the pins
			t.Fatal(err)
		}
		a.applyProtect("start")
		st := a.Protection()
		if !st.Waiting || !st.At.IsZero() || st.Rules != 0 {
			t.Errorf("state %+v: want waiting, nothing written", st)
		}
		if got := protectMetric(t, &a.protect, "rlagent_protect_waiting"); got != 1 {
			t.Errorf("rlagent_protect_waiting %v, want 1", got)
		}
	})
}

// A rule set that cannot be written does not stop the limits: the failure
// is recorded, counted and exported, the limits are applied, and the next
// write succeeds once the cause is gone.
func TestProtectFailureDoesNotStopLimits(t *testing.T) {
	src := &fakeSource{}
	src.set(1)
	a := newTestAgent(t, twoLimits, src)
	// 32 rules from the file (validation would reject it) and the API
	// server: 33 do not fit the data path. (The file's default rule ssh
	// is dropped first, so that the 32 are these.)
	a.cfg.Protect = nil
	for i := range v1alpha1.MaxProtect + 1 {
		a.cfg.Protect = append(a.cfg.Protect, v1alpha1.Protect{Name: fmt.Sprintf("r%d", i), LocalPorts: []string{fmt.Sprint(1000 + i)}})
	}
	a.opts.APIServer = fixedAPIServer(t, "https://192.0.2.1:6443")
	a.applyProtect("start")
	mustReconcile(t, a)
	st := a.Protection()
	if st.Err == nil || !strings.Contains(st.Err.Error(), "33 protect rules is more than the data path's 32") || st.Errors != 1 {
		t.Fatalf("state %+v: want the error recorded", st)
	}
	if l := shareOf(t, a, "dns"); l.Rate != 100000 {
		t.Errorf("dns share %d: the limits were not applied", l.Rate)
	}
	for name, want := range map[string]float64{"rlagent_protect_errors_total": 1, "rlagent_protect_failing": 1, "rlagent_protect_rules": 0} {
		if got := protectMetric(t, &a.protect, name); got != want {
			t.Errorf("%s %v, want %v", name, got, want)
		}
	}

	// The cause goes (a reload with a valid list): the write succeeds.
	a.cfg.Protect = a.cfg.Protect[:2]
	a.applyProtect("reload")
	if st := a.Protection(); st.Err != nil || st.Rules != 3 || st.Errors != 1 {
		t.Errorf("after the fix: %+v", st)
	}
	if got := protectMetric(t, &a.protect, "rlagent_protect_failing"); got != 0 {
		t.Errorf("rlagent_protect_failing %v after the fix, want 0", got)
	}
}

// protectMetric gathers the protect metrics (through a pedantic registry,
// which also checks Describe against Collect) and returns the named one.
func protectMetric(t *testing.T, p *protectState, name string) float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(p)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		m := mf.GetMetric()[0]
		if g := m.GetGauge(); g != nil {
			return g.GetValue()
		}
		return m.GetCounter().GetValue()
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// The agent follows the API server's endpoints on a real API server: the
// rule is there when startProtect returns (before the first attach), and it
// follows a change of the Service's EndpointSlices.
func TestProtectFollowsAPIServer(t *testing.T) {
	a := newTestAgent(t, protectTwo, &fakeSource{})
	env := k8stest.Start(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cs := env.Clientset()
	tcp, port := corev1.ProtocolTCP, int32(6443)
	sl := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "default", Name: "kubernetes", Labels: map[string]string{discoveryv1.LabelServiceName: "kubernetes"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Port: &port, Protocol: &tcp}},
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{"192.0.2.10"}}},
	}
	sl, err := cs.DiscoveryV1().EndpointSlices("default").Create(ctx, sl, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	api, err := watcher.NewAPIServer(watcher.APIServerConfig{Host: "https://10.96.0.1:443", Client: cs, Log: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	a.opts.APIServer = api
	began := time.Now()
	a.startProtect(ctx)
	st := a.Protection()
	t.Logf("startProtect returned after %s", time.Since(began).Round(time.Millisecond))
	if st.Err != nil || st.Rules != 3 || !slices.Equal(st.APIServer, endpoints("192.0.2.10:6443")) {
		t.Fatalf("after start: %+v", st)
	}

	sl.Endpoints = []discoveryv1.Endpoint{{Addresses: []string{"192.0.2.11"}}, {Addresses: []string{"192.0.2.12"}}}
	if _, err := cs.DiscoveryV1().EndpointSlices("default").Update(ctx, sl, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	changed := time.Now()
	want := endpoints("192.0.2.11:6443", "192.0.2.12:6443")
	for !slices.Equal(a.Protection().APIServer, want) {
		if ctx.Err() != nil {
			t.Fatalf("protected %v, want %v", a.Protection().APIServer, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("endpoint change protected after %s", time.Since(changed).Round(time.Microsecond))
}
