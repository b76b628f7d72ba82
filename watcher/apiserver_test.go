package watcher

import (
	"context"
	"errors"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/rlagent/rlagent/internal/k8stest"
)

func addrPorts(s ...string) []netip.AddrPort {
	out := make([]netip.AddrPort, len(s))
	for i, a := range s {
		out[i] = netip.MustParseAddrPort(a)
	}
	return out
}

// notified counts notify calls and lets a test wait for the next one.
type notified struct {
	n  atomic.Int32
	ch chan struct{}
}

func newNotified() *notified { return &notified{ch: make(chan struct{}, 100)} }

func (n *notified) notify() { n.n.Add(1); n.ch <- struct{}{} }

// waitEndpoints waits until s's endpoints are want, for up to 20 s.
func waitEndpoints(t *testing.T, s *APIServer, n *notified, want []netip.AddrPort) {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		got, known := s.Endpoints()
		if known && slices.Equal(got, want) {
			return
		}
		select {
		case <-n.ch:
		case <-deadline:
			t.Fatalf("API server endpoints %v (known %v), want %v", got, known, want)
		}
	}
}

// requestLog records the paths and queries a client asks for.
type requestLog struct {
	mu   sync.Mutex
	reqs []string
}

func (l *requestLog) wrap(rt http.RoundTripper) http.RoundTripper {
	return roundTripFunc(func(r *http.Request) (*http.Response, error) {
		l.mu.Lock()
		l.reqs = append(l.reqs, r.Method+" "+r.URL.Path+"?"+r.URL.RawQuery)
		l.mu.Unlock()
		return rt.RoundTrip(r)
	})
}

func (l *requestLog) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.reqs)
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func apiSlice(ns, name, service string, typ discoveryv1.AddressType, port int32, addrs ...string) *discoveryv1.EndpointSlice {
	tcp := corev1.ProtocolTCP
	https := "https"
	s := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: service}},
		AddressType: typ,
		Ports:       []discoveryv1.EndpointPort{{Name: &https, Port: &port, Protocol: &tcp}},
	}
	for _, a := range addrs {
		s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{Addresses: []string{a}})
	}
	return s
}

// TestAPIServerEndpointsFromSlices follows the endpoints of the Service
// default/kubernetes on a real API server, from the one EndpointSlice the
// API servers write, default/kubernetes: the addresses and ports the
// packets carry, not the ClusterIP. Other Services' slices, a "kubernetes"
// slice in another namespace and, above all, other slices in default
// labelled as the Service's (anyone who may write EndpointSlices in default
// can make one) are ignored: they never widen the protect list. A change of
// the named slice is seen and notified; and the watcher reads nothing but
// that object.
func TestAPIServerEndpointsFromSlices(t *testing.T) {
	env := k8stest.Start(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	admin := env.Clientset()
	ns := env.Namespace(t)
	create := func(s *discoveryv1.EndpointSlice) {
		t.Helper()
		if _, err := admin.DiscoveryV1().EndpointSlices(s.Namespace).Create(ctx, s, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// The bare API server runs with --endpoint-reconciler-type=none: no
	// slice default/kubernetes yet. That is known, with no endpoints (the
	// agent warns that the connection is not protected), and a slice that
	// only carries the Service's label changes nothing.
	create(apiSlice("default", "kubernetes-extra", "kubernetes", discoveryv1.AddressTypeIPv4, 6443, "198.51.100.7"))
	empty, err := NewAPIServer(APIServerConfig{Host: "https://10.96.0.1:443", Client: admin})
	if err != nil {
		t.Fatal(err)
	}
	en := newNotified()
	ectx, ecancel := context.WithCancel(ctx)
	go empty.Run(ectx, en.notify)
	waitEndpoints(t, empty, en, nil)
	ecancel()

	// The test writes the slice the API servers would.
	create(apiSlice("default", "kubernetes", "kubernetes", discoveryv1.AddressTypeIPv4, 6443, "192.0.2.10"))
	create(apiSlice("default", "other", "other", discoveryv1.AddressTypeIPv4, 443, "203.0.113.1"))
	create(apiSlice(ns, "kubernetes", "kubernetes", discoveryv1.AddressTypeIPv4, 443, "203.0.113.2"))

	var log requestLog
	cfg := rest.CopyConfig(env.Config)
	cfg.WrapTransport = log.wrap
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	s, err := NewAPIServer(APIServerConfig{Host: "https://10.96.0.1:443", Client: cs})
	if err != nil {
		t.Fatal(err)
	}
	n := newNotified()
	go s.Run(ctx, n.notify)
	waitEndpoints(t, s, n, addrPorts("192.0.2.10:6443"))

	// Another slice with the Service's label and other addresses, IPv4
	// and IPv6, does not widen the list: no notification, the same
	// endpoints.
	before := n.n.Load()
	create(apiSlice("default", "kubernetes-v6", "kubernetes", discoveryv1.AddressTypeIPv6, 6443, "2001:db8::66"))
	create(apiSlice("default", "kubernetes-wide", "kubernetes", discoveryv1.AddressTypeIPv4, 22, "192.0.2.66"))
	time.Sleep(time.Second)
	if got, _ := s.Endpoints(); n.n.Load() != before || !slices.Equal(got, addrPorts("192.0.2.10:6443")) {
		t.Errorf("slices labelled kubernetes.io/service-name=kubernetes but not named kubernetes: endpoints %v after %d notifications, want 192.0.2.10:6443 and none",
			got, n.n.Load()-before)
	}

	// A second API server in the named slice: followed.
	sl, err := admin.DiscoveryV1().EndpointSlices("default").Get(ctx, "kubernetes", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	sl.Endpoints = append(sl.Endpoints, discoveryv1.Endpoint{Addresses: []string{"192.0.2.11"}})
	if _, err := admin.DiscoveryV1().EndpointSlices("default").Update(ctx, sl, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitEndpoints(t, s, n, addrPorts("192.0.2.10:6443", "192.0.2.11:6443"))

	// The named slice goes: nothing is left, the other labelled slices
	// notwithstanding.
	if err := admin.DiscoveryV1().EndpointSlices("default").Delete(ctx, "kubernetes", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitEndpoints(t, s, n, nil)

	// A change elsewhere is not a change: no notification.
	before = n.n.Load()
	create(apiSlice("default", "other-2", "other", discoveryv1.AddressTypeIPv4, 443, "203.0.113.3"))
	time.Sleep(time.Second)
	if got := n.n.Load(); got != before {
		t.Errorf("another Service's slice notified %d times", got-before)
	}

	// Tiny API load: one list and watches, of the one object
	// default/kubernetes.
	reqs := log.all()
	if len(reqs) == 0 {
		t.Fatal("no request recorded")
	}
	for _, r := range reqs {
		if !strings.HasPrefix(r, "GET /apis/discovery.k8s.io/v1/namespaces/default/endpointslices?") ||
			!strings.Contains(r, "fieldSelector=metadata.name%3Dkubernetes") {
			t.Errorf("request beyond the slice default/kubernetes: %s", r)
		}
	}
	t.Logf("%d requests: %v", len(reqs), reqs)
}

func TestAPIServerHost(t *testing.T) {
	for _, tc := range []struct {
		host string
		want []netip.AddrPort // nil: a name to resolve
		err  string
	}{
		{"https://192.0.2.1:6443", addrPorts("192.0.2.1:6443"), ""},
		{"https://192.0.2.1", addrPorts("192.0.2.1:443"), ""},
		{"http://192.0.2.1", addrPorts("192.0.2.1:80"), ""},
		{"192.0.2.1:8443", addrPorts("192.0.2.1:8443"), ""},
		{"https://[2001:db8::1]:6443", addrPorts("[2001:db8::1]:6443"), ""},
		{"https://[::ffff:192.0.2.1]:6443", addrPorts("192.0.2.1:6443"), ""},
		{"https://api.example.com:6443", nil, ""},
		{"https://192.0.2.1:0", nil, `port "0" is not in 1..65535`},
		{"https://192.0.2.1:99999", nil, `port "99999" is not in 1..65535`},
		{"", nil, "is not a URL or host:port"},
	} {
		s, err := NewAPIServer(APIServerConfig{Host: tc.host})
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: error %v, want %q", tc.host, err, tc.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%q: %v", tc.host, err)
			continue
		}
		eps, known := s.Endpoints()
		if known != (tc.want != nil) || !slices.Equal(eps, tc.want) {
			t.Errorf("%q: endpoints %v known %v, want %v", tc.host, eps, known, tc.want)
		}
	}
}

// A host name: resolved at start (after failures, retried), again every
// ResolveEvery; a failure keeps the last addresses.
func TestAPIServerResolves(t *testing.T) {
	var mu sync.Mutex
	answers := []struct {
		addrs []string
		err   error
	}{
		{nil, errors.New("no such host")},
		{nil, errors.New("no such host")},
		{[]string{"192.0.2.2", "192.0.2.1"}, nil},
		{nil, errors.New("timeout")},
		{[]string{"192.0.2.3"}, nil},
	}
	calls := 0
	resolve := func(_ context.Context, host string) ([]netip.Addr, error) {
		mu.Lock()
		defer mu.Unlock()
		if host != "api.example.com" {
			t.Errorf("resolved %q", host)
		}
		a := answers[min(calls, len(answers)-1)]
		calls++
		var out []netip.Addr
		for _, s := range a.addrs {
			out = append(out, netip.MustParseAddr(s))
		}
		return out, a.err
	}
	s, err := NewAPIServer(APIServerConfig{Host: "https://api.example.com:6443", Resolve: resolve, ResolveEvery: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, known := s.Endpoints(); known {
		t.Fatal("known before the first lookup")
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	n := newNotified()
	go s.Run(ctx, n.notify)
	waitEndpoints(t, s, n, addrPorts("192.0.2.1:6443", "192.0.2.2:6443"))
	waitEndpoints(t, s, n, addrPorts("192.0.2.3:6443"))
	// Two changes, two notifications: the failed lookup in between kept
	// the addresses and notified nothing.
	time.Sleep(100 * time.Millisecond)
	if got := n.n.Load(); got != 2 {
		t.Errorf("%d notifications, want 2", got)
	}
	if err := s.Err(); err != nil {
		t.Errorf("Err after a good lookup: %v", err)
	}
}
