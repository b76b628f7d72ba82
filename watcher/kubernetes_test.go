package watcher

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/client/clientset/versioned"
	"github.com/rlagent/rlagent/internal/k8stest"
)

// The Kubernetes source against a real kube-apiserver and etcd
// (internal/k8stest): what it watches, what it counts, and that it asks
// nothing beyond its watches. RateLimits are cluster-scoped: each test
// names its own and deletes them when it ends.

func TestMain(m *testing.M) { os.Exit(k8stest.RunShared(m)) }

// source is one agent's Kubernetes source on env, with its own clients,
// whose requests it counts.
type source struct {
	k        *Kubernetes
	requests atomic.Int64 // every HTTP request its clients made
	probes   atomic.Int64
	notes    atomic.Int64
	cancel   context.CancelFunc
	done     chan struct{}
}

func startSource(t *testing.T, env *k8stest.Env, ns, node string) *source {
	t.Helper()
	s := &source{done: make(chan struct{})}
	cfg := rest.CopyConfig(env.Config)
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(r *http.Request) (*http.Response, error) {
			s.requests.Add(1)
			return rt.RoundTrip(r)
		})
	})
	cs := kubernetes.NewForConfigOrDie(cfg)
	rls := versioned.NewForConfigOrDie(cfg)
	probe := func(ctx context.Context) error {
		s.probes.Add(1)
		return cs.Discovery().RESTClient().Get().AbsPath("/readyz").Do(ctx).Error()
	}
	s.k = NewKubernetes(KubernetesConfig{
		Client: cs, RateLimits: rls, NodeName: node, AgentNamespace: ns,
		ProbeInterval: 200 * time.Millisecond, Probe: probe, Log: quietLog(),
	})
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	go func() { s.k.Run(ctx, func() { s.notes.Add(1) }); close(s.done) }()
	t.Cleanup(s.stop)
	k8stest.WaitUntil(t, node+"'s caches to sync", s.k.Synced)
	return s
}

func (s *source) stop() {
	s.cancel()
	<-s.done
}

func sharedEnv(t *testing.T) *k8stest.Env {
	t.Helper()
	env := k8stest.Shared(t)
	env.InstallCRD(t, "../deploy/crd.yaml")
	return env
}

func ep(addr, node string, ready bool) discoveryv1.Endpoint {
	return discoveryv1.Endpoint{Addresses: []string{addr}, NodeName: ptr.To(node), Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(ready)}}
}

// putSlice creates or replaces an EndpointSlice of Service svc, as the
// EndpointSlice controller would (its managed-by label).
func putSlice(t *testing.T, env *k8stest.Env, ns, svc, name string, port int32, eps ...discoveryv1.Endpoint) {
	t.Helper()
	putSliceBy(t, env, ns, svc, name, "endpointslice-controller.k8s.io", port, eps...)
}

// putSliceBy is putSlice with the label endpointslice.kubernetes.io/managed-by
// set to managedBy ("": no label, a slice written by hand).
func putSliceBy(t *testing.T, env *k8stest.Env, ns, svc, name, managedBy string, port int32, eps ...discoveryv1.Endpoint) {
	t.Helper()
	labels := map[string]string{discoveryv1.LabelServiceName: svc}
	if managedBy != "" {
		labels[discoveryv1.LabelManagedBy] = managedBy
	}
	s := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: name, Labels: labels},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Port: ptr.To(port), Protocol: ptr.To(corev1.ProtocolUDP)}},
		Endpoints:   eps,
	}
	slices := env.Clientset().DiscoveryV1().EndpointSlices(ns)
	cur, err := slices.Get(context.Background(), name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		_, err = slices.Create(context.Background(), s, metav1.CreateOptions{})
	case err == nil:
		s.ResourceVersion = cur.ResourceVersion
		_, err = slices.Update(context.Background(), s, metav1.UpdateOptions{})
	}
	if err != nil {
		t.Fatalf("EndpointSlice %s/%s: %v", ns, name, err)
	}
}

// setDaemonSet writes a DaemonSet's status as its controller would.
func setDaemonSet(t *testing.T, env *k8stest.Env, ns, name string, ready, desired int32) {
	t.Helper()
	env.SetDaemonSetStatus(t, ns, name, int(ready), int(desired))
}

// TestKubernetesServiceScope: a service-scoped limit counts its Service's
// ready endpoints (once each, across slices) and this node's, from the
// slices of that Service only: of 40 other Services' slices in the
// cluster, the agent lists and receives none, before or after they change.
func TestKubernetesServiceScope(t *testing.T) {
	env := sharedEnv(t)
	ns := env.Namespace(t)
	for i := range 40 {
		putSlice(t, env, ns, fmt.Sprintf("noise-%d", i), fmt.Sprintf("noise-%d", i), 53, ep(fmt.Sprintf("10.9.%d.1", i), "node-a", true))
	}
	putSlice(t, env, ns, "web", "web-1", 8080, ep("10.0.0.1", "node-a", true), ep("10.0.0.2", "node-b", true), ep("10.0.0.3", "node-a", false))
	putSlice(t, env, ns, "web", "web-2", 8080, ep("10.0.0.2", "node-b", true), ep("10.0.0.4", "node-a", true))
	env.CreateRateLimit(t, k8stest.RateLimit("svc-scope", map[string]any{
		"rate": int64(90), "scope": "service", "match": map[string]any{"service": ns + "/web"},
	}))
	s := startSource(t, env, ns, "node-a")
	k8stest.WaitUntil(t, "3 ready endpoints, 2 on node-a", func() bool {
		o := s.k.Observe("svc-scope")
		return o.Replicas == 3 && o.Local == 2
	})
	local, ports := s.k.LocalEndpoints("svc-scope")
	want := []Endpoint{{netip.MustParseAddr("10.0.0.1")}, {netip.MustParseAddr("10.0.0.4")}}
	if fmt.Sprint(local) != fmt.Sprint(want) || fmt.Sprint(ports) != fmt.Sprint([]EndpointPort{{corev1.ProtocolUDP, 8080}}) {
		t.Errorf("local endpoints %v, ports %v; want %v, [UDP 8080]", local, ports, want)
	}
	st := s.k.WatchStats()["endpointslices"]
	t.Logf("endpointslices: %+v", st)
	if st.Listed != 2 {
		t.Errorf("the agent listed %d EndpointSlices, want the 2 of the Service its limit references (of 42)", st.Listed)
	}

	// Other Services' slices change: nothing reaches the agent. Then its
	// Service's: one event.
	for i := range 40 {
		putSlice(t, env, ns, fmt.Sprintf("noise-%d", i), fmt.Sprintf("noise-%d", i), 53, ep(fmt.Sprintf("10.9.%d.2", i), "node-a", true))
	}
	events := st.Events
	putSlice(t, env, ns, "web", "web-2", 8080, ep("10.0.0.2", "node-b", true))
	k8stest.WaitUntil(t, "2 ready endpoints, 1 on node-a", func() bool {
		o := s.k.Observe("svc-scope")
		return o.Replicas == 2 && o.Local == 1
	})
	if got := s.k.WatchStats()["endpointslices"].Events - events; got != 1 {
		t.Errorf("the agent received %d EndpointSlice events for 40 changes of other Services and 1 of its own, want 1", got)
	}
}

// TestKubernetesServiceScopeControllerSlicesOnly: a Service's count and its
// nodes' weights come from the EndpointSlice controller's slices only. A
// slice written by hand (no managed-by label), one mirrored from
// hand-written Endpoints and one another tool manages, all with the
// Service's label and endpoints on this node, count for nothing, before or
// after they change; the agent does not even receive them. An endpoint
// with several addresses weighs one on its node.
func TestKubernetesServiceScopeControllerSlicesOnly(t *testing.T) {
	env := sharedEnv(t)
	ns := env.Namespace(t)
	// The controller's slice, one endpoint of which lists three addresses:
	// it weighs one on its node. (A Service name no other test uses: the
	// watch selects by name in every namespace.)
	multi := ep("10.0.0.1", "node-a", true)
	multi.Addresses = append(multi.Addresses, "10.0.0.5", "10.0.0.6")
	putSlice(t, env, ns, "shop", "shop-1", 8080, multi, ep("10.0.0.2", "node-b", true))
	putSliceBy(t, env, ns, "shop", "shop-by-hand", "", 8080, ep("10.0.9.1", "node-a", true), ep("10.0.9.2", "node-a", true), ep("10.0.9.3", "node-a", true))
	putSliceBy(t, env, ns, "shop", "shop-mirrored", "endpointslicemirroring-controller.k8s.io", 8080, ep("10.0.8.1", "node-a", true), ep("10.0.8.2", "node-a", true))
	putSliceBy(t, env, ns, "shop", "shop-tool", "some-tool.example.com", 9090, ep("10.0.7.1", "node-a", true))
	env.CreateRateLimit(t, k8stest.RateLimit("controller-only", map[string]any{
		"rate": int64(90), "scope": "service", "match": map[string]any{"service": ns + "/shop"},
	}))
	s := startSource(t, env, ns, "node-a")
	k8stest.WaitUntil(t, "shop's slices", func() bool { return s.k.Observe("controller-only").Replicas > 0 })
	check := func(when string) {
		t.Helper()
		o := s.k.Observe("controller-only")
		local, ports := s.k.LocalEndpoints("controller-only")
		want := []Endpoint{{netip.MustParseAddr("10.0.0.1")}}
		if o.Replicas != 2 || o.Local != 1 || fmt.Sprint(local) != fmt.Sprint(want) || fmt.Sprint(ports) != fmt.Sprint([]EndpointPort{{corev1.ProtocolUDP, 8080}}) {
			t.Errorf("%s: count %d, %d on node-a, local endpoints %v, ports %v; want the controller's slice only: 2, 1, %v, [UDP 8080]",
				when, o.Replicas, o.Local, local, ports, want)
		}
	}
	check("at start")
	if st := s.k.WatchStats()["endpointslices"]; st.Listed != 1 {
		t.Errorf("the agent listed %d EndpointSlices, want the controller's 1 of shop's 4", st.Listed)
	}

	// The others change, and one more comes by hand: nothing reaches the
	// agent, the count stands. Then the controller's slice changes: seen.
	events := s.k.WatchStats()["endpointslices"].Events
	putSliceBy(t, env, ns, "shop", "shop-by-hand", "", 8080, ep("10.0.9.1", "node-a", true), ep("10.0.9.4", "node-a", true))
	putSliceBy(t, env, ns, "shop", "shop-by-hand-2", "", 8080, ep("10.0.6.1", "node-a", true))
	putSliceBy(t, env, ns, "shop", "shop-mirrored", "endpointslicemirroring-controller.k8s.io", 8080, ep("10.0.8.3", "node-a", true))
	putSlice(t, env, ns, "shop", "shop-1", 8080, ep("10.0.0.1", "node-a", true), ep("10.0.0.2", "node-b", true), ep("10.0.0.3", "node-b", true))
	k8stest.WaitUntil(t, "the controller's third endpoint", func() bool { return s.k.Observe("controller-only").Replicas == 3 })
	if got := s.k.WatchStats()["endpointslices"].Events - events; got != 1 {
		t.Errorf("the agent received %d EndpointSlice events for 3 writes of others' slices and 1 of the controller's, want 1", got)
	}
	putSlice(t, env, ns, "shop", "shop-1", 8080, ep("10.0.0.1", "node-a", true), ep("10.0.0.2", "node-b", true))
	k8stest.WaitUntil(t, "the controller's 2 endpoints again", func() bool { return s.k.Observe("controller-only").Replicas == 2 })
	check("after the changes")
}

// TestKubernetesSlicesFollowReferences: when a RateLimit referencing
// another Service appears, the agent watches that Service's slices too, and
// the first limit's count never falls to "none seen" while it switches;
// with no service-scoped limit left it watches no slices at all.
func TestKubernetesSlicesFollowReferences(t *testing.T) {
	env := sharedEnv(t)
	ns := env.Namespace(t)
	putSlice(t, env, ns, "web", "web-1", 8080, ep("10.0.0.1", "node-a", true), ep("10.0.0.2", "node-b", true))
	putSlice(t, env, ns, "api", "api-1", 443, ep("10.0.1.1", "node-b", true), ep("10.0.1.2", "node-b", true), ep("10.0.1.3", "node-a", true))
	env.CreateRateLimit(t, k8stest.RateLimit("follow-web", map[string]any{"rate": int64(90), "scope": "service", "match": map[string]any{"service": ns + "/web"}}))
	s := startSource(t, env, ns, "node-a")
	k8stest.WaitUntil(t, "web's 2 endpoints", func() bool { return s.k.Observe("follow-web").Replicas == 2 })

	var low atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			if n := s.k.Observe("follow-web").Replicas; n != 2 {
				low.Add(1)
			}
			time.Sleep(time.Millisecond)
		}
	})
	api := env.CreateRateLimit(t, k8stest.RateLimit("follow-api", map[string]any{"rate": int64(90), "scope": "service", "match": map[string]any{"service": ns + "/api"}}))
	k8stest.WaitUntil(t, "api's 3 endpoints", func() bool { return s.k.Observe("follow-api").Replicas == 3 })
	close(stop)
	wg.Wait()
	if low.Load() > 0 {
		t.Errorf("web's count was not 2 in %d reads while the agent started watching api's slices", low.Load())
	}
	if names := s.k.slices.names; fmt.Sprint(names) != "[api web]" {
		t.Errorf("watched Services %v, want [api web]", names)
	}

	rl := dynamic.NewForConfigOrDie(env.Config).Resource(RateLimitResource)
	for _, name := range []string{"follow-web", api.GetName()} {
		if err := rl.Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	k8stest.WaitUntil(t, "no slice informer", func() bool {
		s.k.slices.mu.Lock()
		defer s.k.slices.mu.Unlock()
		return s.k.slices.cur == nil && s.k.slices.pending == nil
	})
}

// TestKubernetesNodesScope: the nodes scope divides by the agents'
// DaemonSet's status.numberReady, and the agent receives the events of
// that one object only.
func TestKubernetesNodesScope(t *testing.T) {
	env := sharedEnv(t)
	ns := env.Namespace(t)
	env.CreateRateLimit(t, k8stest.RateLimit("nodes-scope", map[string]any{"rate": int64(90), "scope": "nodes", "match": map[string]any{}}))
	env.SetDaemonSetStatus(t, ns, "rlagent", 3, 3)
	s := startSource(t, env, ns, "node-a")
	k8stest.WaitUntil(t, "3 ready agents", func() bool { return s.k.Observe("nodes-scope").Replicas == 3 })
	if o := s.k.Observe("nodes-scope"); o.Local != 1 {
		t.Errorf("local %d, want 1", o.Local)
	}
	events := s.k.WatchStats()["daemonset"].Events
	for i := range 5 {
		setDaemonSet(t, env, ns, "other", int32(i), 9)
	}
	env.SetDaemonSetStatus(t, ns, "rlagent", 2, 3)
	k8stest.WaitUntil(t, "2 ready agents", func() bool { return s.k.Observe("nodes-scope").Replicas == 2 })
	if got := s.k.WatchStats()["daemonset"].Events - events; got != 1 {
		t.Errorf("the agent received %d DaemonSet events for 5 changes of another DaemonSet and 1 of its own, want 1", got)
	}
	if ready, desired := s.k.Agents(); ready != 2 || desired != 3 {
		t.Errorf("Agents() = %d, %d; want 2, 3", ready, desired)
	}
}

// TestKubernetesAsksNothingWhileWatching: once its informers have listed
// and watch, an agent sends the API server no request at all while nothing
// changes (the API server's reachability comes from the watches, not from
// polling), and its observations are fresh.
func TestKubernetesAsksNothingWhileWatching(t *testing.T) {
	env := sharedEnv(t)
	ns := env.Namespace(t)
	env.CreateRateLimit(t, k8stest.RateLimit("quiet", map[string]any{"rate": int64(90), "scope": "service", "match": map[string]any{"service": ns + "/web"}}))
	putSlice(t, env, ns, "web", "web-1", 8080, ep("10.0.0.1", "node-a", true))
	env.SetDaemonSetStatus(t, ns, "rlagent", 1, 1)
	s := startSource(t, env, ns, "node-a")
	k8stest.WaitUntil(t, "web's endpoint", func() bool { return s.k.Observe("quiet").Replicas == 1 })
	before := s.requests.Load()
	const quiet = 5 * time.Second
	time.Sleep(quiet)
	if n := s.requests.Load() - before; n != 0 {
		t.Errorf("the agent sent %d requests in %v of quiet, want 0", n, quiet)
	}
	if s.probes.Load() != 0 {
		t.Errorf("the agent probed the API server %d times while its watches worked", s.probes.Load())
	}
	if o := s.k.Observe("quiet"); o.Err != nil || o.Age(time.Now()) > time.Second {
		t.Errorf("observation %+v (age %v), want fresh and without error", o, o.Age(time.Now()))
	}
}

// TestKubernetesKeepsCountsWhenUnreachable: with the API server stopped the
// last counts stand, the observation carries the error and ages from the
// moment the watches failed; the agent probes only then, and once the API
// server is back the informers resume within seconds and follow changes.
func TestKubernetesKeepsCountsWhenUnreachable(t *testing.T) {
	env := k8stest.Start(t) // stopped below: not the shared one
	env.InstallCRD(t, "../deploy/crd.yaml")
	ns := env.Namespace(t)
	env.CreateRateLimit(t, k8stest.RateLimit("outage", map[string]any{"rate": int64(90), "scope": "nodes", "match": map[string]any{}}))
	env.SetDaemonSetStatus(t, ns, "rlagent", 4, 4)
	s := startSource(t, env, ns, "node-a")
	k8stest.WaitUntil(t, "4 ready agents", func() bool { return s.k.Observe("outage").Replicas == 4 })

	stopped := time.Now()
	if err := env.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	k8stest.WaitUntil(t, "the observation to carry an error", func() bool { return s.k.Observe("outage").Err != nil })
	time.Sleep(2 * time.Second)
	o := s.k.Observe("outage")
	t.Logf("2 s into the outage: %+v, age %v", o, o.Age(time.Now()).Round(time.Millisecond))
	if o.Replicas != 4 {
		t.Errorf("count %d during the outage, want the last one, 4", o.Replicas)
	}
	if o.At.Before(stopped) || o.Age(time.Now()) < 2*time.Second {
		t.Errorf("observation dated %v (age %v), want the moment the watches failed, after %v", o.At, o.Age(time.Now()), stopped)
	}
	if s.probes.Load() == 0 {
		t.Errorf("the agent did not probe the API server during the outage")
	}

	if err := env.StartAPIServer(); err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	k8stest.WaitUntil(t, "a fresh observation", func() bool {
		o := s.k.Observe("outage")
		return o.Err == nil && o.Age(time.Now()) < 100*time.Millisecond
	})
	t.Logf("fresh again %v after the API server's start", time.Since(back).Round(time.Millisecond))
	env.SetDaemonSetStatus(t, ns, "rlagent", 5, 5)
	k8stest.WaitUntil(t, "5 ready agents after the outage", func() bool { return s.k.Observe("outage").Replicas == 5 })
	t.Logf("a count change seen %v after the API server's start", time.Since(back).Round(time.Millisecond))
	probes := s.probes.Load()
	time.Sleep(time.Second)
	if s.probes.Load() != probes {
		t.Errorf("the agent still probes after the outage")
	}
}

// TestKubernetesInvalidSpecReported: a RateLimit the schema admits but the
// agent rejects is reported as invalid; the others are not.
func TestKubernetesInvalidSpecReported(t *testing.T) {
	env := sharedEnv(t)
	ns := env.Namespace(t)
	env.CreateRateLimit(t, k8stest.RateLimit("bad-horizon", map[string]any{
		"rate": int64(90), "scope": "nodes", "action": "pace", "attach": "uplink", "horizon": "10s",
		"match": map[string]any{"direction": "egress"},
	}))
	env.CreateRateLimit(t, k8stest.RateLimit("good", map[string]any{"rate": int64(5), "scope": "nodes", "match": map[string]any{}}))
	s := startSource(t, env, ns, "node-a")
	k8stest.WaitUntil(t, "both limits", func() bool { ls, _ := s.k.Limits(); return len(ls) >= 2 })
	_, invalid := s.k.Limits()
	if invalid["bad-horizon"] == nil || !strings.Contains(invalid["bad-horizon"].Error(), "horizon") || invalid["good"] != nil {
		t.Fatalf("invalid = %v, want only bad-horizon, for its horizon", invalid)
	}
}

func TestNotAnswering(t *testing.T) {
	gr := schema.GroupResource{}
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{nil, false},
		{errors.New("dial tcp 127.0.0.1:6443: connect: connection refused"), true},
		{apierrors.NewInternalError(errors.New("readyz check failed")), true},
		{apierrors.NewServiceUnavailable("starting"), true},
		{apierrors.NewForbidden(gr, "", errors.New("no")), false},
		{apierrors.NewUnauthorized("no"), false},
	} {
		if got := notAnswering(tc.err); got != tc.want {
			t.Errorf("notAnswering(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}

// TestKubernetesPerObject: each RateLimit is synced by its own key. A
// limit's change or deletion changes that limit alone (a scope that
// becomes static drops its count, which the agent then takes from its own
// source), and the objects the lister holds are never modified: defaulting
// works on a copy (a shared pointer, prefixLength, would carry the default
// into the cache and from there into the status writer's updates).
func TestKubernetesPerObject(t *testing.T) {
	env := sharedEnv(t)
	ns := env.Namespace(t)
	env.SetDaemonSetStatus(t, ns, "rlagent", 3, 3)
	env.CreateRateLimit(t, k8stest.RateLimit("per-object-a", map[string]any{
		"rate": int64(90), "scope": "nodes", "match": map[string]any{},
		"key": "src-prefix", "prefixLength": map[string]any{"ipv6": int64(48)},
	}))
	env.CreateRateLimit(t, k8stest.RateLimit("per-object-b", map[string]any{"rate": int64(90), "scope": "nodes", "match": map[string]any{}}))
	s := startSource(t, env, ns, "node-a")
	k8stest.WaitUntil(t, "both limits counted", func() bool {
		return s.k.Observe("per-object-a").Replicas == 3 && s.k.Observe("per-object-b").Replicas == 3
	})

	limits, _ := s.k.Limits()
	if len(limits) < 2 || limits[0].Name != "per-object-a" || limits[0].PrefixLength == nil || limits[0].PrefixLength.IPv4 != v1alpha1.DefaultPrefixLengthIPv4 {
		t.Fatalf("limits %+v: want per-object-a defaulted (prefixLength.ipv4 %d)", limits, v1alpha1.DefaultPrefixLengthIPv4)
	}
	cached, err := s.k.RateLimits().Get("per-object-a")
	if err != nil {
		t.Fatal(err)
	}
	if pl := cached.Spec.PrefixLength; pl == nil || pl.IPv4 != 0 || cached.Spec.Attach != "" {
		t.Errorf("the lister's object was modified: spec %+v, prefixLength %+v", cached.Spec, pl)
	}

	rls := dynamic.NewForConfigOrDie(env.Config).Resource(v1alpha1.RateLimitResource)
	patch := []byte(`{"spec":{"scope":"static"}}`)
	if _, err := rls.Patch(context.Background(), "per-object-a", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	k8stest.WaitUntil(t, "per-object-a static", func() bool {
		l, _ := s.k.Limits()
		return len(l) > 0 && l[0].Name == "per-object-a" && l[0].Scope == v1alpha1.ScopeStatic
	})
	if o := s.k.Observe("per-object-a"); o.Replicas != 0 {
		t.Errorf("a static limit's count from the cluster: %d, want none (0)", o.Replicas)
	}
	if o := s.k.Observe("per-object-b"); o.Replicas != 3 {
		t.Errorf("per-object-b: count %d after another limit changed, want 3", o.Replicas)
	}

	if err := rls.Delete(context.Background(), "per-object-a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	k8stest.WaitUntil(t, "per-object-a gone", func() bool {
		l, _ := s.k.Limits()
		return len(l) > 0 && l[0].Name != "per-object-a"
	})
	if l, _ := s.k.Limits(); l[0].Name != "per-object-b" || s.k.Observe("per-object-b").Replicas != 3 {
		t.Errorf("after deleting per-object-a: limits %+v, per-object-b's count %d", l, s.k.Observe("per-object-b").Replicas)
	}
}
