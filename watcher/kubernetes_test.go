package watcher

import (
	"context"
	"errors"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/utils/ptr"
)

// Unit tests with fake clientsets: event handling and count math. The real
// API server is exercised in test/k8s.

func rateLimit(name string, spec map[string]any) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "rlagent.io/v1alpha1", "kind": "RateLimit",
		"metadata": map[string]any{"name": name}, "spec": spec,
	}}
}

func slice(ns, svc, name string, eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	return &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Port: ptr.To[int32](8080), Protocol: ptr.To(corev1.ProtocolTCP)}},
		Endpoints:   eps,
	}
}

func ep(addr, node string, ready bool) discoveryv1.Endpoint {
	return discoveryv1.Endpoint{Addresses: []string{addr}, NodeName: ptr.To(node), Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(ready)}}
}

func agentPod(name string, ready bool) *corev1.Pod {
	st := corev1.ConditionFalse
	if ready {
		st = corev1.ConditionTrue
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "rlagent-system", Name: name, Labels: map[string]string{"app": "rlagent"}},
		Status:     corev1.PodStatus{Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: st}}},
	}
}

type harness struct {
	k       *Kubernetes
	cs      *fake.Clientset
	dyn     *dynamicfake.FakeDynamicClient
	notes   atomic.Int32
	probeOK atomic.Bool
}

func newHarness(t *testing.T, objs ...runtime.Object) *harness {
	t.Helper()
	h := &harness{cs: fake.NewClientset(objs...)}
	h.dyn = dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{RateLimitResource: "RateLimitList"})
	h.probeOK.Store(true)
	h.k = NewKubernetes(KubernetesConfig{
		Client: h.cs, Dynamic: h.dyn, NodeName: "node-a",
		AgentNamespace: "rlagent-system", AgentSelector: labels.SelectorFromSet(labels.Set{"app": "rlagent"}),
		ProbeInterval: 10 * time.Millisecond, Log: quietLog(),
		Probe: func(context.Context) error {
			if h.probeOK.Load() {
				return nil
			}
			return errors.New("connection refused")
		},
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { h.k.Run(ctx, func() { h.notes.Add(1) }); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	waitFor(t, h.k.Synced)
	return h
}

func (h *harness) createRL(t *testing.T, u *unstructured.Unstructured) {
	t.Helper()
	if _, err := h.dyn.Resource(RateLimitResource).Create(context.Background(), u, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func TestKubernetesServiceScope(t *testing.T) {
	h := newHarness(t)
	h.createRL(t, rateLimit("api", map[string]any{
		"rate": int64(90000), "scope": "service",
		"match": map[string]any{"service": "shop/api"},
	}))
	waitFor(t, func() bool { ls, _ := h.k.Limits(); return len(ls) == 1 })

	ctx := context.Background()
	s := slice("shop", "api", "api-1", ep("10.0.0.1", "node-a", true), ep("10.0.0.2", "node-b", true), ep("10.0.0.3", "node-c", true))
	if _, err := h.cs.DiscoveryV1().EndpointSlices("shop").Create(ctx, s, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { o := h.k.Observe("api"); return o.Replicas == 3 && o.Local == 1 })

	// Scale 3 -> 6 with a second slice, one endpoint not ready.
	s2 := slice("shop", "api", "api-2", ep("10.0.0.4", "node-a", true), ep("10.0.0.5", "node-b", true),
		ep("10.0.0.6", "node-a", true), ep("10.0.0.7", "node-a", false))
	if _, err := h.cs.DiscoveryV1().EndpointSlices("shop").Create(ctx, s2, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { o := h.k.Observe("api"); return o.Replicas == 6 && o.Local == 3 })
	local, ports := h.k.LocalEndpoints("api")
	want := []netip.Addr{netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.4"), netip.MustParseAddr("10.0.0.6")}
	if len(local) != len(want) {
		t.Fatalf("local endpoints %v, want %v", local, want)
	}
	for i := range want {
		if local[i].Addr != want[i] {
			t.Fatalf("local endpoints %v, want %v", local, want)
		}
	}
	if len(ports) != 1 || ports[0].Port != 8080 || ports[0].Protocol != corev1.ProtocolTCP {
		t.Fatalf("ports %v", ports)
	}

	// Scale to 2: delete the first slice, leaving 3 ready in the second... then 2.
	if err := h.cs.DiscoveryV1().EndpointSlices("shop").Delete(ctx, "api-1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	s2.Endpoints = s2.Endpoints[:2]
	if _, err := h.cs.DiscoveryV1().EndpointSlices("shop").Update(ctx, s2, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { o := h.k.Observe("api"); return o.Replicas == 2 && o.Local == 1 })
}

func TestKubernetesNodesScope(t *testing.T) {
	h := newHarness(t, agentPod("a", true), agentPod("b", true), agentPod("c", false))
	h.createRL(t, rateLimit("all", map[string]any{"rate": int64(1000), "scope": "nodes", "match": map[string]any{}}))
	waitFor(t, func() bool { return h.k.Observe("all").Replicas == 2 })
	if _, err := h.cs.CoreV1().Pods("rlagent-system").Create(context.Background(), agentPod("d", true), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return h.k.Observe("all").Replicas == 3 })
}

// An unreachable API server keeps the counts; only the age grows.
func TestKubernetesKeepsCountsWhenUnreachable(t *testing.T) {
	h := newHarness(t, agentPod("a", true), agentPod("b", true))
	h.createRL(t, rateLimit("all", map[string]any{"rate": int64(1000), "scope": "nodes", "match": map[string]any{}}))
	waitFor(t, func() bool { return h.k.Observe("all").Replicas == 2 })

	h.probeOK.Store(false)
	waitFor(t, func() bool { return h.k.Observe("all").Err != nil })
	o := h.k.Observe("all")
	at := o.At
	time.Sleep(50 * time.Millisecond)
	o = h.k.Observe("all")
	if o.Replicas != 2 || o.At != at || o.Age(time.Now()) < 50*time.Millisecond {
		t.Fatalf("while unreachable: %+v (at %v), want replicas 2 and a growing age", o, at)
	}
	h.probeOK.Store(true)
	waitFor(t, func() bool { o := h.k.Observe("all"); return o.Err == nil && o.At.After(at) })
}

// While the probe finds the API server unreachable, the informers' list and
// watch calls wait for it instead of failing into client-go's growing
// backoff; they go ahead once a probe gets through. (test/k8s measures what
// this does to the resumption after a real outage.)
func TestKubernetesListWatchWaitsForAPIServer(t *testing.T) {
	h := newHarness(t)
	if err := h.k.waitReachable(context.Background()); err != nil {
		t.Fatalf("reachable: waitReachable: %v", err)
	}
	h.probeOK.Store(false)
	waitFor(t, func() bool { return h.k.Observe("any").Err != nil })
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := h.k.waitReachable(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("unreachable: waitReachable returned %v, want it to wait until the context ends", err)
	}
	done := make(chan error, 1)
	go func() { done <- h.k.waitReachable(context.Background()) }()
	h.probeOK.Store(true)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("reachable again: waitReachable: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("waitReachable still waits 5 s after the probe got through")
	}
}

// Only a probe that gets no answer, or a 5xx, holds the informers: an API
// server that answers 401 or 403 to /readyz is there.
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

func TestKubernetesInvalidSpecReported(t *testing.T) {
	h := newHarness(t)
	h.createRL(t, rateLimit("bad", map[string]any{"rate": int64(0), "scope": "nodes", "match": map[string]any{}}))
	h.createRL(t, rateLimit("good", map[string]any{"rate": int64(5), "scope": "nodes", "match": map[string]any{}}))
	waitFor(t, func() bool { ls, _ := h.k.Limits(); return len(ls) == 2 })
	_, invalid := h.k.Limits()
	if invalid["bad"] == nil || invalid["good"] != nil {
		t.Fatalf("invalid = %v, want only bad", invalid)
	}
}
