package cluster

import (
	"context"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/watcher"
)

// podCounter counts, for the limits of scope pods, the ready pods their
// selectors choose in the whole cluster. Only the elected status writer
// runs one (started with the first such limit while it leads, stopped when
// it stops leading): one watch of the cluster's pods that can match
// (spec.hostNetwork=false), kept as a few words each (podStore, which
// counts as the pods change), and one of the namespaces. Every other agent
// reads the count from the status it writes.
type podCounter struct {
	pods       *podStore
	namespaces cache.SharedIndexInformer
}

// startPodCounter starts the counter's watches until ctx ends; changed is
// called with every pod and namespace event (the limits to count again).
func startPodCounter(ctx context.Context, client kubernetes.Interface, changed func()) (*podCounter, error) {
	lw := func(resource string, tweak func(*metav1.ListOptions)) *cache.ListWatch {
		return cache.NewFilteredListWatchFromClient(client.CoreV1().RESTClient(), resource, metav1.NamespaceAll, tweak)
	}
	c := &podCounter{
		namespaces: cache.NewSharedIndexInformer(lw("namespaces", func(*metav1.ListOptions) {}), &corev1.Namespace{}, 0, cache.Indexers{}),
	}
	c.pods = newPodStore(c.namespaces.GetStore(), changed)
	if err := c.namespaces.SetTransform(watcher.SlimNamespace); err != nil {
		return nil, err
	}
	h := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { c.pods.namespacesChanged() },
		UpdateFunc: func(_, _ any) { c.pods.namespacesChanged() },
		DeleteFunc: func(any) { c.pods.namespacesChanged() },
	}
	if _, err := c.namespaces.AddEventHandler(h); err != nil {
		return nil, err
	}
	go c.namespaces.RunWithContext(ctx)
	pods := client.CoreV1().Pods(metav1.NamespaceAll)
	r := cache.NewReflectorWithOptions(&cache.ListWatch{
		// The list in pages, each kept as records and let go: a whole
		// list of the cluster's pods at once would be hundreds of MB.
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return c.pods.listPaged(ctx, pods.List, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = watcher.NotHostNetwork
			return pods.Watch(ctx, o)
		},
	}, &corev1.Pod{}, c.pods, cache.ReflectorOptions{Name: "rlagent pod count"})
	go r.RunWithContext(ctx)
	go func() {
		if cache.WaitForCacheSync(ctx.Done(), c.pods.HasSynced, c.namespaces.HasSynced) {
			changed()
		}
	}()
	return c, nil
}

// count is how many ready pods l's selectors choose; ok is false until
// both watches listed (the status keeps the count it has).
func (c *podCounter) count(l *v1alpha1.Limit) (n int, ok bool) {
	if !c.pods.HasSynced() || !c.namespaces.HasSynced() {
		return 0, false
	}
	return c.pods.count(l)
}

// podCounter is the leader's podCounter, started with the first limit of
// scope pods; nil when not leading or it could not start.
func (w *StatusWriter) podCounter() *podCounter {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.pods != nil || w.leadCtx == nil {
		return w.pods
	}
	queue := w.queue
	c, err := startPodCounter(w.leadCtx, w.k.Config().Client, func() {
		limits, _ := w.k.Limits()
		for _, l := range limits {
			if l.Scope == v1alpha1.ScopePods {
				queue.Add(l.Name)
			}
		}
	})
	if err != nil {
		w.log.Warn("the pods of scope pods are not counted", "error", err)
		return nil
	}
	w.pods = c
	return c
}

// hostNetNote is the note hostNetworkNote made for one generation of a
// limit.
type hostNetNote struct {
	uid        types.UID
	generation int64
	note       string
}

// hostNetworkNote says, for the Accepted condition, which pods the
// selectors of l would choose but that use hostNetwork: they have no
// interface of their own, never match, and are not counted ("" if none).
// The counter's watch leaves them out, so it asks the API server: one
// list, filtered by the podSelector and spec.hostNetwork=true, once per
// generation of the spec, their namespaces' labels read from the
// counter's watch (a hostNetwork pod that comes later is not noted until
// the spec changes or another agent leads).
func (w *StatusWriter) hostNetworkNote(ctx context.Context, l *v1alpha1.Limit, uid types.UID, generation int64) string {
	w.mu.Lock()
	n, ok := w.hostNet[l.Name]
	w.mu.Unlock()
	if ok && n.uid == uid && n.generation == generation {
		return n.note
	}
	sel, ok := watcher.SelectionOf(&l.Match)
	if !ok {
		return ""
	}
	o := metav1.ListOptions{FieldSelector: "spec.hostNetwork=true", Limit: 500, ResourceVersion: "0"}
	if l.Match.PodSelector != nil {
		s, err := metav1.LabelSelectorAsSelector(l.Match.PodSelector)
		if err != nil {
			return ""
		}
		o.LabelSelector = s.String()
	}
	// The namespaces' labels from the counter's watch, once it listed
	// them (until then, asked again at the next sync).
	c := w.podCounter()
	if c == nil || !c.namespaces.HasSynced() {
		return ""
	}
	pods, err := w.k.Config().Client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, o)
	if err != nil {
		w.log.Debug("hostNetwork pods not listed", "limit", l.Name, "error", err)
		return "" // asked again at the next sync
	}
	var chosen []string
	for _, p := range pods.Items {
		if sel.MatchesIn(p.Labels, p.Namespace, c.namespaces.GetStore()) {
			chosen = append(chosen, p.Namespace+"/"+p.Name)
		}
	}
	note := ""
	if len(chosen) > 0 {
		more := ""
		if pods.Continue != "" {
			more = "at least "
		}
		note = fmt.Sprintf("hostNetwork pods the selectors choose never match and are not counted (no interface of their own): %s%d (%s)",
			more, len(chosen), strings.Join(chosen[:min(len(chosen), 3)], ", "))
	}
	w.mu.Lock()
	if w.hostNet == nil {
		w.hostNet = make(map[string]hostNetNote)
	}
	w.hostNet[l.Name] = hostNetNote{uid: uid, generation: generation, note: note}
	w.mu.Unlock()
	return note
}
