package watcher

import (
	"net/netip"
	"slices"
	"sync"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/tools/cache"

	"github.com/rlagent/rlagent/api/v1alpha1"
)

// Workloads chosen by labels (scope pods): the matching pods' placement is
// each agent's, from the pods of its own node (field selector spec.nodeName)
// and the namespaces' labels; the count of all matching ready pods is the
// elected agent's, from one watch of the cluster's pods (cluster.PodCounter),
// written to each limit's status.replicas, which every agent already
// watches. No agent but that one receives the pods of other nodes.

// PodSelection is a limit's podSelector and namespaceSelector, compiled.
type PodSelection struct {
	pods       labels.Selector // nil: every pod
	namespaces labels.Selector // nil: every namespace
}

// SelectionOf compiles m's selectors; ok is false when m selects no pods
// (neither selector set) or a selector does not compile (validation rejects
// its limit).
func SelectionOf(m *v1alpha1.Match) (_ PodSelection, ok bool) {
	if !m.SelectsPods() {
		return PodSelection{}, false
	}
	var s PodSelection
	var err error
	if m.PodSelector != nil {
		if s.pods, err = metav1.LabelSelectorAsSelector(m.PodSelector); err != nil {
			return PodSelection{}, false
		}
	}
	if m.NamespaceSelector != nil {
		if s.namespaces, err = metav1.LabelSelectorAsSelector(m.NamespaceSelector); err != nil {
			return PodSelection{}, false
		}
	}
	return s, true
}

// NeedsNamespaces reports whether the selection reads namespaces' labels.
func (s PodSelection) NeedsNamespaces() bool { return s.namespaces != nil }

// Matches reports whether a pod with podLabels, in a namespace with
// nsLabels (known: whether the namespace is known at all), is chosen.
func (s PodSelection) Matches(podLabels map[string]string, nsLabels map[string]string, known bool) bool {
	if s.namespaces != nil && (!known || !s.namespaces.Matches(labels.Set(nsLabels))) {
		return false
	}
	return s.pods == nil || s.pods.Matches(labels.Set(podLabels))
}

// CountsPod reports whether a pod counts, as an endpoint and in the count:
// ready (condition Ready True), not terminating, with an address, and with
// an interface of its own (not hostNetwork). The EndpointSlice controller
// takes a terminating pod out of the ready endpoints the same way.
func CountsPod(p *corev1.Pod) bool {
	if p.Spec.HostNetwork || p.DeletionTimestamp != nil || len(p.Status.PodIPs) == 0 && p.Status.PodIP == "" {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// PodAddrs are a pod's addresses (status.podIPs; status.podIP without
// them), those that parse as addresses without a zone, each once (an
// IPv4-mapped address as IPv4).
func PodAddrs(p *corev1.Pod) []netip.Addr {
	var out []netip.Addr
	ips := p.Status.PodIPs
	if len(ips) == 0 && p.Status.PodIP != "" {
		ips = []corev1.PodIP{{IP: p.Status.PodIP}}
	}
	for _, ip := range ips {
		if a, err := netip.ParseAddr(ip.IP); err == nil && a.Zone() == "" && !slices.Contains(out, a.Unmap()) {
			out = append(out, a.Unmap())
		}
	}
	return out
}

// SlimPod is an informer's transform that keeps of a pod only what
// selecting and counting it reads (name, namespace, labels, deletion,
// node, hostNetwork, the Ready condition, addresses): the cluster-wide
// watch of the elected agent holds every pod, and a whole pod is kilobytes.
func SlimPod(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	s := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: p.Name, Namespace: p.Namespace, UID: p.UID, ResourceVersion: p.ResourceVersion,
			Labels: p.Labels, DeletionTimestamp: p.DeletionTimestamp,
		},
		Spec:   corev1.PodSpec{NodeName: p.Spec.NodeName, HostNetwork: p.Spec.HostNetwork},
		Status: corev1.PodStatus{PodIP: p.Status.PodIP, PodIPs: p.Status.PodIPs},
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			s.Status.Conditions = []corev1.PodCondition{{Type: c.Type, Status: c.Status}}
		}
	}
	return s, nil
}

// SlimNamespace is the transform of a namespace informer: its name and
// labels.
func SlimNamespace(obj any) (any, error) {
	n, ok := obj.(*corev1.Namespace)
	if !ok {
		return obj, nil
	}
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
		Name: n.Name, UID: n.UID, ResourceVersion: n.ResourceVersion, Labels: n.Labels,
	}}, nil
}

// MatchesIn reports whether a pod with podLabels in namespace is chosen,
// the namespace's labels read (when the selection needs them) from nss, a
// namespace informer's store: the one rule of the agents' placement and
// the elected agent's count.
func (s PodSelection) MatchesIn(podLabels map[string]string, namespace string, nss cache.Store) bool {
	var nsLabels map[string]string
	known := true
	if s.NeedsNamespaces() {
		nsLabels, known = NamespaceLabels(nss, namespace)
	}
	return s.Matches(podLabels, nsLabels, known)
}

// NamespaceLabels reads a namespace's labels from a namespace informer's
// store; known is false when the store has no such namespace.
func NamespaceLabels(store cache.Store, name string) (_ map[string]string, known bool) {
	obj, ok, err := store.GetByKey(name)
	if err != nil || !ok {
		return nil, false
	}
	n, ok := obj.(*corev1.Namespace)
	if !ok {
		return nil, false
	}
	return n.Labels, true
}

// NotHostNetwork is the field selector of the pods that can match: a
// hostNetwork pod has no interface of its own, and never does.
const NotHostNetwork = "spec.hostNetwork=false"

// podWatch is an agent's watch of its own node's pods and of the
// namespaces, started with the first limit of scope pods (watchPods) and
// kept until the agent stops.
type podWatch struct {
	mu         sync.Mutex
	pods       cache.SharedIndexInformer
	namespaces cache.SharedIndexInformer
}

// synced reports whether the watch is synced, or not started (nothing to
// wait for).
func (w *podWatch) synced() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.pods == nil || w.pods.HasSynced() && w.namespaces.HasSynced()
}

// watchPods starts the watch of this node's pods and of the namespaces if
// a limit has scope pods and they are not watched yet. Callers hold k.mu.
func (k *Kubernetes) watchPods() error {
	if k.ctx == nil || k.cfg.NodeName == "" || !k.anyPodsScope() {
		return nil
	}
	k.pods.mu.Lock()
	defer k.pods.mu.Unlock()
	if k.pods.pods != nil {
		return nil
	}
	pods := k.cfg.Client.CoreV1().Pods(metav1.NamespaceAll)
	onNode := fields.AndSelectors(fields.OneTermEqualSelector("spec.nodeName", k.cfg.NodeName),
		fields.ParseSelectorOrDie(NotHostNetwork)).String()
	k.pods.pods = k.informer("pods", &corev1.Pod{}, listOf(pods.List), pods.Watch,
		func(o *metav1.ListOptions) { o.FieldSelector = onNode }, nil)
	nss := k.cfg.Client.CoreV1().Namespaces()
	k.pods.namespaces = k.informer("namespaces", &corev1.Namespace{}, listOf(nss.List), nss.Watch, nil, nil)
	if err := k.pods.pods.SetTransform(SlimPod); err != nil {
		return err
	}
	if err := k.pods.namespaces.SetTransform(SlimNamespace); err != nil {
		return err
	}
	enqueue := handler(func(any) { k.queue.Add(keyPods) })
	for _, inf := range []cache.SharedIndexInformer{k.pods.pods, k.pods.namespaces} {
		if _, err := inf.AddEventHandler(enqueue); err != nil {
			return err
		}
		go inf.RunWithContext(k.ctx)
	}
	ctx := k.ctx
	go func() {
		if cache.WaitForCacheSync(ctx.Done(), k.pods.pods.HasSynced, k.pods.namespaces.HasSynced) {
			k.queue.Add(keyPods)
		}
	}()
	return nil
}

// anyPodsScope reports whether a limit has scope pods. Callers hold k.mu.
func (k *Kubernetes) anyPodsScope() bool {
	for _, l := range k.limits {
		if l.Scope == v1alpha1.ScopePods {
			return true
		}
	}
	return false
}

// localPods are the ready pods on this node that l selects, as endpoints
// (every address of each), and how many pods they are. Callers hold k.mu.
func (k *Kubernetes) localPods(l *v1alpha1.Limit) (n int, local []Endpoint) {
	sel, ok := SelectionOf(&l.Match)
	k.pods.mu.Lock()
	pods, nss := k.pods.pods, k.pods.namespaces
	k.pods.mu.Unlock()
	if !ok || pods == nil {
		return 0, nil
	}
	for _, obj := range pods.GetStore().List() {
		p, ok := obj.(*corev1.Pod)
		if !ok || p.Spec.NodeName != k.cfg.NodeName || !CountsPod(p) {
			continue
		}
		if !sel.MatchesIn(p.Labels, p.Namespace, nss.GetStore()) {
			continue
		}
		n++
		for _, a := range PodAddrs(p) {
			local = append(local, Endpoint{Addr: a})
		}
	}
	slices.SortFunc(local, func(a, b Endpoint) int { return a.Addr.Compare(b.Addr) })
	return n, slices.Compact(local)
}
