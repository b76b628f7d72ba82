package watcher

import (
	"net/netip"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rlagent/rlagent/api/v1alpha1"
)

// TestPodSelection: the selectors as NetworkPolicy's peers read them, for a
// cluster-scoped object: podSelector alone chooses in every namespace,
// namespaceSelector alone every pod of the namespaces it chooses, both
// together the pods of the one in the namespaces of the other; {} chooses
// all, and a namespace not known cannot match a namespaceSelector.
func TestPodSelection(t *testing.T) {
	web := map[string]string{"app": "web"}
	shop := map[string]string{"team": "shop"}
	sel := func(m map[string]string) *metav1.LabelSelector { return &metav1.LabelSelector{MatchLabels: m} }
	tests := []struct {
		name           string
		match          v1alpha1.Match
		pod, ns        map[string]string
		nsKnown        bool
		want, compiles bool
	}{
		{"no selector", v1alpha1.Match{}, web, shop, true, false, false},
		{"pod selector, any namespace", v1alpha1.Match{PodSelector: sel(web)}, web, nil, true, true, true},
		{"pod selector, namespace unknown", v1alpha1.Match{PodSelector: sel(web)}, web, nil, false, true, true},
		{"pod selector, other labels", v1alpha1.Match{PodSelector: sel(web)}, map[string]string{"app": "db"}, shop, true, false, true},
		{"pod selector, no labels", v1alpha1.Match{PodSelector: sel(web)}, nil, shop, true, false, true},
		{"empty pod selector", v1alpha1.Match{PodSelector: &metav1.LabelSelector{}}, nil, nil, true, true, true},
		{"namespace selector", v1alpha1.Match{NamespaceSelector: sel(shop)}, nil, shop, true, true, true},
		{"namespace selector, other namespace", v1alpha1.Match{NamespaceSelector: sel(shop)}, web, map[string]string{"team": "ops"}, true, false, true},
		{"namespace selector, namespace unknown", v1alpha1.Match{NamespaceSelector: &metav1.LabelSelector{}}, web, nil, false, false, true},
		{"both", v1alpha1.Match{PodSelector: sel(web), NamespaceSelector: sel(shop)}, web, shop, true, true, true},
		{"both, pod does not match", v1alpha1.Match{PodSelector: sel(web), NamespaceSelector: sel(shop)}, nil, shop, true, false, true},
		{"expressions", v1alpha1.Match{PodSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
			{Key: "app", Operator: metav1.LabelSelectorOpIn, Values: []string{"web", "api"}},
			{Key: "canary", Operator: metav1.LabelSelectorOpDoesNotExist},
		}}}, web, nil, true, true, true},
		{"expressions, excluded", v1alpha1.Match{PodSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
			{Key: "canary", Operator: metav1.LabelSelectorOpDoesNotExist},
		}}}, map[string]string{"app": "web", "canary": "1"}, nil, true, false, true},
		{"bad operator", v1alpha1.Match{PodSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
			{Key: "app", Operator: "Like"},
		}}}, web, nil, true, false, false},
	}
	for _, tt := range tests {
		s, ok := SelectionOf(&tt.match)
		if ok != tt.compiles {
			t.Errorf("%s: compiles %v, want %v", tt.name, ok, tt.compiles)
			continue
		}
		if !ok {
			continue
		}
		if got := s.Matches(tt.pod, tt.ns, tt.nsKnown); got != tt.want {
			t.Errorf("%s: matches %v, want %v", tt.name, got, tt.want)
		}
	}
}

// TestCountsPod: only a ready pod with an address and an interface of its
// own counts; the Ready condition decides, not the phase; a hostile or
// broken status (addresses that do not parse, a mapped address, one listed
// twice) yields only the addresses that parse, each once.
func TestCountsPod(t *testing.T) {
	ready := func(s corev1.ConditionStatus) []corev1.PodCondition {
		return []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionTrue}, {Type: corev1.PodReady, Status: s}}
	}
	pod := func(mod func(p *corev1.Pod)) *corev1.Pod {
		p := &corev1.Pod{Status: corev1.PodStatus{PodIP: "10.0.0.1", PodIPs: []corev1.PodIP{{IP: "10.0.0.1"}, {IP: "fd00::1"}},
			Conditions: ready(corev1.ConditionTrue)}}
		if mod != nil {
			mod(p)
		}
		return p
	}
	now := metav1.Now()
	tests := []struct {
		name string
		pod  *corev1.Pod
		want bool
	}{
		{"ready", pod(nil), true},
		{"not ready", pod(func(p *corev1.Pod) { p.Status.Conditions = ready(corev1.ConditionFalse) }), false},
		{"ready unknown", pod(func(p *corev1.Pod) { p.Status.Conditions = ready(corev1.ConditionUnknown) }), false},
		{"no Ready condition", pod(func(p *corev1.Pod) { p.Status.Conditions = p.Status.Conditions[:1] }), false},
		{"hostNetwork", pod(func(p *corev1.Pod) { p.Spec.HostNetwork = true }), false},
		{"terminating", pod(func(p *corev1.Pod) { p.DeletionTimestamp = &now }), false},
		{"no address", pod(func(p *corev1.Pod) { p.Status.PodIP, p.Status.PodIPs = "", nil }), false},
		{"podIP only", pod(func(p *corev1.Pod) { p.Status.PodIPs = nil }), true},
	}
	for _, tt := range tests {
		if got := CountsPod(tt.pod); got != tt.want {
			t.Errorf("%s: counts %v, want %v", tt.name, got, tt.want)
		}
	}

	p := pod(func(p *corev1.Pod) {
		p.Status.PodIPs = []corev1.PodIP{{IP: "10.0.0.1"}, {IP: "not-an-ip"}, {IP: "::ffff:10.0.0.1"}, {IP: "fd00::1"}, {IP: "fe80::1%eth0"}, {IP: ""}}
	})
	want := []netip.Addr{netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("fd00::1")}
	if got := PodAddrs(p); !slices.Equal(got, want) {
		t.Errorf("PodAddrs %v, want %v", got, want)
	}
	if got := PodAddrs(pod(func(p *corev1.Pod) { p.Status.PodIPs = nil })); !slices.Equal(got, want[:1]) {
		t.Errorf("PodAddrs of podIP alone %v, want %v", got, want[:1])
	}
}

// TestSlimPod: the transform keeps what selecting and counting read, and
// drops the rest (a pod's spec and most of its status are kilobytes).
func TestSlimPod(t *testing.T) {
	now := metav1.Now()
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "web-1", Namespace: "shop", UID: "u1", ResourceVersion: "7",
			Labels: map[string]string{"app": "web"}, Annotations: map[string]string{"big": "x"}, DeletionTimestamp: &now,
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubelet"}}},
		Spec: corev1.PodSpec{NodeName: "node-1", HostNetwork: true, Containers: []corev1.Container{{Name: "web", Image: "web:1",
			Env: []corev1.EnvVar{{Name: "TOKEN", Value: "secret"}}}}},
		Status: corev1.PodStatus{PodIP: "10.0.0.1", PodIPs: []corev1.PodIP{{IP: "10.0.0.1"}}, Phase: corev1.PodRunning,
			Conditions: []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionTrue},
				{Type: corev1.PodReady, Status: corev1.ConditionTrue, Message: "ok"}}},
	}
	obj, err := SlimPod(p)
	if err != nil {
		t.Fatal(err)
	}
	s := obj.(*corev1.Pod)
	if s.Name != p.Name || s.Namespace != p.Namespace || s.UID != p.UID || s.ResourceVersion != p.ResourceVersion ||
		s.Labels["app"] != "web" || s.DeletionTimestamp == nil || s.Spec.NodeName != "node-1" || !s.Spec.HostNetwork ||
		s.Status.PodIP != "10.0.0.1" || len(s.Status.PodIPs) != 1 ||
		len(s.Status.Conditions) != 1 || s.Status.Conditions[0].Type != corev1.PodReady || s.Status.Conditions[0].Status != corev1.ConditionTrue {
		t.Errorf("slim pod lost what counting reads: %+v", s)
	}
	if s.Annotations != nil || s.ManagedFields != nil || s.Spec.Containers != nil || s.Status.Phase != "" || s.Status.Conditions[0].Message != "" {
		t.Errorf("slim pod kept what nothing reads: %+v", s)
	}
	if CountsPod(s) != CountsPod(p) {
		t.Errorf("CountsPod differs on the slim pod")
	}
	ns, _ := SlimNamespace(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{"team": "shop"},
		Annotations: map[string]string{"a": "b"}}, Spec: corev1.NamespaceSpec{Finalizers: []corev1.FinalizerName{"kubernetes"}}})
	if n := ns.(*corev1.Namespace); n.Name != "shop" || n.Labels["team"] != "shop" || n.Annotations != nil || n.Spec.Finalizers != nil {
		t.Errorf("slim namespace: %+v", n)
	}
}
