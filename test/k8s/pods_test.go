package k8s

import (
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// podsRate is the pods-scoped limit's global rate: every count below
// divides it exactly (1..6 pods).
const podsRate = 6000

// TestPodSelector: a limit of scope pods, chosen by podSelector and
// namespaceSelector, on three agents against the real API server. There is
// no kubelet: the test writes each pod's status as one would (Ready, the
// pod's addresses, which are on its node's B side). It checks, after each
// change, every node's share (rate x matching ready pods here / all of
// them), the count in status.replicas (the elected agent's), and that
// every node's maps were rewritten within a second of the change:
//
//   - the first pods, 2:1:0 over the nodes, and pods that must not count
//     (another app, hostNetwork, not ready, a namespace the selector does
//     not choose); the hostNetwork one named in the Accepted condition;
//   - a pod turning ready, and not ready again;
//   - a pod relabelled out of the selection, and back;
//   - a pod moved to another node (deleted, and created there);
//   - a namespace relabelled out of the selection, and back;
//   - a new namespace coming with a pod, and going (deleted; its pod is
//     left, as without the namespace controller, and must not count).
func TestPodSelector(t *testing.T) {
	testenv.RequireRoot(t)
	env := k8stest.Shared(t)
	installCRD(t, env)
	c := startCluster(t, env, env.Namespace(t), 3)
	p := &podWorld{t: t, c: env.Clientset(), suffix: strings.TrimPrefix(c.ns, "test-")}
	shop := p.namespace("shop", map[string]string{"team": "shop"})
	ops := p.namespace("ops", map[string]string{"team": "ops"})

	web := map[string]string{"app": "web"}
	p.create(newPod(shop, "web-1", 1, 1, web, true))
	p.create(newPod(shop, "web-2", 1, 2, web, true))
	p.create(newPod(shop, "web-3", 2, 1, web, true))
	p.create(newPod(shop, "db-1", 3, 1, map[string]string{"app": "db"}, true)) // another app
	p.create(newPod(shop, "web-4", 3, 2, web, false))                          // not ready
	p.create(newPod(ops, "web-5", 3, 3, web, true))                            // a namespace not chosen
	host := newPod(shop, "web-host", 3, 4, web, true)                          // hostNetwork: never
	host.Spec.HostNetwork = true
	p.create(host)

	const name = "pods-web"
	spec := map[string]any{
		"rate": int64(podsRate), "scope": "pods",
		"match": map[string]any{
			"protocol":          "udp",
			"podSelector":       map[string]any{"matchLabels": map[string]any{"app": "web"}},
			"namespaceSelector": map[string]any{"matchExpressions": []any{map[string]any{"key": "team", "operator": "In", "values": []any{"shop"}}}},
		},
	}
	created := time.Now()
	createRateLimit(t, env, rateLimit(name, spec))
	rl := dynamicClient(t, env).Resource(v1alpha1.RateLimitResource)
	check := func(what string, since time.Time, local ...int) {
		t.Helper()
		total := 0
		for _, n := range local {
			total += n
		}
		wants := make([]want, len(c.nodes))
		for i := range wants {
			wants[i] = want{absent: true}
			if local[i] > 0 {
				wants[i] = want{share: uint64(podsRate * local[i] / total), replicas: uint32(total), local: uint32(local[i])}
			}
		}
		a, err := c.waitShares(name, wants, since, 5*time.Second)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		t.Logf("%s (%v pods): %v", what, local, a)
		if w, _ := a.slowest(); w > shareTimeout && what != "the new RateLimit" {
			t.Errorf("%s: the maps were rewritten %v after the change, want <= %v", what, w, shareTimeout)
		}
		obj, err := rl.Get(t.Context(), name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if got, _, _ := unstructured.NestedInt64(obj.Object, "status", "replicas"); got != int64(total) {
			t.Errorf("%s: status.replicas %d, want %d", what, got, total)
		}
		if total > 0 {
			c.checkSum(what, name, podsRate)
		}
	}
	check("the new RateLimit", created, 2, 1, 0)
	// The pod with hostNetwork is named, not counted. (The test's pods'
	// addresses are on their nodes' B sides, with no interface of their
	// own: the limit runs at the uplinks, and the condition says that too.)
	waitAccepted(t, rl, 10*time.Second, name, "True", v1alpha1.ReasonEnforcedAtUplink,
		"hostNetwork pods the selectors choose never match and are not counted (no interface of their own): 1 ("+shop+"/web-host)")
	// What `rlagent status` shows.
	if s, ok := c.nodes[0].statusCLI(t, name); !ok || s.Scope != "pods" || s.Local != 2 || s.Replicas != 3 {
		t.Errorf("rlagent status on node-1: %s, scope %q; want scope pods, local 2 of 3", describe(s, ok), s.Scope)
	}

	at := time.Now()
	p.setReady(shop, "web-4", true)
	check("web-4 ready", at, 2, 1, 1)
	at = time.Now()
	p.setReady(shop, "web-4", false)
	check("web-4 not ready", at, 2, 1, 0)

	at = time.Now()
	p.relabel(shop, "web-2", map[string]string{"app": "web-canary"})
	check("web-2 relabelled out", at, 1, 1, 0)
	at = time.Now()
	p.relabel(shop, "web-2", web)
	check("web-2 relabelled back", at, 2, 1, 0)

	at = time.Now()
	p.delete(shop, "web-1")
	p.create(newPod(shop, "web-1", 3, 1, web, true))
	check("web-1 moved to node-3", at, 1, 1, 1)

	at = time.Now()
	p.relabelNamespace(shop, map[string]string{"team": "shop-old"})
	check("namespace shop relabelled out", at, 0, 0, 0)
	at = time.Now()
	p.relabelNamespace(shop, map[string]string{"team": "shop"})
	check("namespace shop relabelled back", at, 1, 1, 1)

	at = time.Now()
	extra := p.namespace("extra", map[string]string{"team": "shop"})
	p.create(newPod(extra, "web-6", 2, 2, web, true))
	check("namespace extra comes with a pod", at, 1, 2, 1)
	at = time.Now()
	p.deleteNamespace(extra)
	check("namespace extra goes", at, 1, 1, 1)
}

// podWorld creates the test's namespaces and pods, and deletes them in
// Cleanup (the namespaces are finalized as the namespace controller would:
// the test's API server runs none).
type podWorld struct {
	t      *testing.T
	c      kubernetes.Interface
	suffix string
}

func (p *podWorld) namespace(name string, labels map[string]string) string {
	p.t.Helper()
	name = name + "-" + p.suffix
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
	if _, err := p.c.CoreV1().Namespaces().Create(p.t.Context(), ns, metav1.CreateOptions{}); err != nil {
		p.t.Fatalf("create namespace %s: %v", name, err)
	}
	p.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		pods, err := p.c.CoreV1().Pods(name).List(ctx, metav1.ListOptions{})
		if err == nil {
			for _, pod := range pods.Items {
				p.deletePod(ctx, name, pod.Name)
			}
		}
		if err := p.c.CoreV1().Namespaces().Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			p.t.Errorf("delete namespace %s: %v", name, err)
		}
		finalizeNamespace(ctx, p.t, p.c, name)
	})
	return name
}

// newPod is pod name of namespace ns on node-<node>, ready or not, its
// address endpoint j of that node.
func newPod(ns, name string, node, j int, labels map[string]string, ready bool) *corev1.Pod {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: labels},
		Spec: corev1.PodSpec{
			NodeName:   fmt.Sprintf("node-%d", node),
			Containers: []corev1.Container{{Name: "app", Image: "registry.invalid/app:1"}},
		},
	}
	setPodStatus(pod, endpointAddr(node, j), ready)
	return pod
}

// setPodStatus writes the status a kubelet would: running, the address,
// and Ready.
func setPodStatus(pod *corev1.Pod, addr netip.Addr, ready bool) {
	st := corev1.ConditionFalse
	if ready {
		st = corev1.ConditionTrue
	}
	pod.Status = corev1.PodStatus{
		Phase: corev1.PodRunning, PodIP: addr.String(), PodIPs: []corev1.PodIP{{IP: addr.String()}},
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: st, LastTransitionTime: metav1.Now()}},
	}
}

// create creates pod and writes its status (a kubelet's part).
func (p *podWorld) create(pod *corev1.Pod) {
	p.t.Helper()
	status := pod.Status
	created, err := p.c.CoreV1().Pods(pod.Namespace).Create(p.t.Context(), pod, metav1.CreateOptions{})
	if err != nil {
		p.t.Fatalf("create pod %s/%s: %v", pod.Namespace, pod.Name, err)
	}
	created.Status = status
	if _, err := p.c.CoreV1().Pods(pod.Namespace).UpdateStatus(p.t.Context(), created, metav1.UpdateOptions{}); err != nil {
		p.t.Fatalf("pod %s/%s status: %v", pod.Namespace, pod.Name, err)
	}
}

func (p *podWorld) update(ns, name string, f func(*corev1.Pod), status bool) {
	p.t.Helper()
	pods := p.c.CoreV1().Pods(ns)
	pod, err := pods.Get(p.t.Context(), name, metav1.GetOptions{})
	if err != nil {
		p.t.Fatal(err)
	}
	f(pod)
	if status {
		_, err = pods.UpdateStatus(p.t.Context(), pod, metav1.UpdateOptions{})
	} else {
		_, err = pods.Update(p.t.Context(), pod, metav1.UpdateOptions{})
	}
	if err != nil {
		p.t.Fatalf("update pod %s/%s: %v", ns, name, err)
	}
}

func (p *podWorld) setReady(ns, name string, ready bool) {
	p.t.Helper()
	p.update(ns, name, func(pod *corev1.Pod) {
		addr := netip.MustParseAddr(pod.Status.PodIP)
		setPodStatus(pod, addr, ready)
	}, true)
}

func (p *podWorld) relabel(ns, name string, labels map[string]string) {
	p.t.Helper()
	p.update(ns, name, func(pod *corev1.Pod) { pod.Labels = labels }, false)
}

func (p *podWorld) relabelNamespace(name string, labels map[string]string) {
	p.t.Helper()
	nss := p.c.CoreV1().Namespaces()
	ns, err := nss.Get(p.t.Context(), name, metav1.GetOptions{})
	if err != nil {
		p.t.Fatal(err)
	}
	ns.Labels = labels
	if _, err := nss.Update(p.t.Context(), ns, metav1.UpdateOptions{}); err != nil {
		p.t.Fatalf("relabel namespace %s: %v", name, err)
	}
}

// delete deletes a pod at once (grace period 0: no kubelet confirms).
func (p *podWorld) delete(ns, name string) {
	p.t.Helper()
	p.deletePod(p.t.Context(), ns, name)
}

func (p *podWorld) deletePod(ctx context.Context, ns, name string) {
	err := p.c.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
	if err != nil && !apierrors.IsNotFound(err) {
		p.t.Errorf("delete pod %s/%s: %v", ns, name, err)
	}
}

// deleteNamespace deletes a namespace and finalizes it, its pods left in
// place: with no namespace controller, they outlive it, and a pod of a
// namespace that is gone must not match a namespaceSelector.
func (p *podWorld) deleteNamespace(name string) {
	p.t.Helper()
	if err := p.c.CoreV1().Namespaces().Delete(p.t.Context(), name, metav1.DeleteOptions{}); err != nil {
		p.t.Fatalf("delete namespace %s: %v", name, err)
	}
	finalizeNamespace(p.t.Context(), p.t, p.c, name)
}

// TestLimitsSetPodSelectors: `rlagent limits set --scope pods` with
// --pod-selector and --namespace-selector in kubectl's syntax stores, on
// the real API server, the LabelSelectors they mean (an empty one is {},
// every pod, not absent) and warns that hostNetwork pods never match; the
// API server's own rules refuse scope pods without a selector and a
// selector without scope pods, naming the field; without --scope nothing
// is sent.
func TestLimitsSetPodSelectors(t *testing.T) {
	env := k8stest.Shared(t)
	installCRD(t, env)
	rl := dynamicClient(t, env).Resource(v1alpha1.RateLimitResource)
	run := func(args ...string) (string, error) {
		t.Helper()
		cmd := exec.Command(rlagentBin, append(args, "--kubeconfig", env.Kubeconfig)...)
		var e bytes.Buffer
		cmd.Stderr = &e
		err := cmd.Run()
		return e.String(), err
	}
	for _, tc := range []struct {
		name             string
		args             []string
		wantPods, wantNS *metav1.LabelSelector
	}{
		{"both", []string{"--pod-selector", "app=web,tier in (b,a),!canary", "--namespace-selector", "env notin (dev)"},
			&metav1.LabelSelector{
				MatchLabels: map[string]string{"app": "web"},
				MatchExpressions: []metav1.LabelSelectorRequirement{
					{Key: "canary", Operator: metav1.LabelSelectorOpDoesNotExist},
					{Key: "tier", Operator: metav1.LabelSelectorOpIn, Values: []string{"a", "b"}},
				},
			},
			&metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
				{Key: "env", Operator: metav1.LabelSelectorOpNotIn, Values: []string{"dev"}},
			}}},
		{"every pod", []string{"--pod-selector", ""}, &metav1.LabelSelector{}, nil},
		{"namespaces only", []string{"--namespace-selector", "team"},
			nil, &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
				{Key: "team", Operator: metav1.LabelSelectorOpExists},
			}}},
	} {
		name := "sel-" + strings.ReplaceAll(tc.name, " ", "-")
		deleteInCleanup(t, env, name)
		stderr, err := run(append([]string{"limits", "set", name, "--rate", "100", "--scope", "pods"}, tc.args...)...)
		if err != nil {
			t.Errorf("%s: %v\n%s", tc.name, err, stderr)
			continue
		}
		if !strings.Contains(stderr, "warning: scope pods: pods with hostNetwork never match") {
			t.Errorf("%s: no warning about hostNetwork pods: %q", tc.name, stderr)
		}
		obj, err := rl.Get(t.Context(), name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var stored v1alpha1.RateLimit
		if err := runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(obj.Object, &stored, true); err != nil {
			t.Fatalf("%s: the stored RateLimit does not decode strictly: %v", tc.name, err)
		}
		m := stored.Spec.Match
		if stored.Spec.Scope != v1alpha1.ScopePods {
			t.Errorf("%s: scope %q, want pods", tc.name, stored.Spec.Scope)
		}
		if !apiequality.Semantic.DeepEqual(m.PodSelector, tc.wantPods) || !apiequality.Semantic.DeepEqual(m.NamespaceSelector, tc.wantNS) {
			t.Errorf("%s: stored podSelector %+v, namespaceSelector %+v; want %+v, %+v", tc.name, m.PodSelector, m.NamespaceSelector, tc.wantPods, tc.wantNS)
		}
	}

	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"scope pods without a selector", []string{"--scope", "pods"}, "spec.match.podSelector: Required value: scope pods requires match.podSelector or match.namespaceSelector"},
		{"a selector without scope pods", []string{"--scope", "nodes", "--pod-selector", "app=web"}, "spec.match.podSelector: Invalid value"},
		{"no scope", []string{"--pod-selector", "app=web"}, "--scope: required in a cluster: one of static, nodes, service, pods"},
	} {
		stderr, err := run(append([]string{"limits", "set", "sel-bad", "--rate", "100"}, tc.args...)...)
		if err == nil || !strings.Contains(stderr, tc.want) {
			t.Errorf("%s: %v, stderr %q; want a failure saying %q", tc.name, err, stderr, tc.want)
		}
		if _, err := rl.Get(t.Context(), "sel-bad", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			t.Errorf("%s: the RateLimit was stored (%v)", tc.name, err)
			rl.Delete(t.Context(), "sel-bad", metav1.DeleteOptions{})
		}
	}
}
