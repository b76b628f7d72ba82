package cluster

import (
	"context"
	"sync"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/pager"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/watcher"
)

// podStore is the pod count's store: the cache.Store a Reflector fills
// with the cluster's pods, which keeps of each only its namespace, its
// labels (one map for all the pods that carry the same ones: a
// Deployment's replicas) and whether it counts (watcher.CountsPod), and
// keeps each limit's count as the pods come, change and go: a pod's event
// costs a selector match per limit, not a pass over every pod. A count is
// made afresh (one pass) for a limit it has not counted, a changed
// selector, a relist, and, for a limit with a namespaceSelector, after a
// namespace changed.
type podStore struct {
	nss     cache.Store // the namespaces' labels
	changed func()      // a pod changed: the limits to count again

	mu     sync.Mutex
	pods   map[string]podRecord
	shared map[string]*sharedLabels
	counts map[string]*podCount // by limit name
	nsGen  uint64               // namespace changes seen
	synced bool                 // listed once
	// staged is the pods of a list made in pages (listPaged), until the
	// Reflector's Replace puts them in place.
	staged *podStore
}

// podPage is how many pods a page of the paged list holds.
const podPage = 500

// listPaged lists the pods that can match in pages of podPage, keeping
// each as a record (staged) and letting the page go, and returns an empty
// list at the list's resource version: the Reflector's Replace with it
// puts the staged records in place, and its watch starts from there. A
// list of all the pods of a 5,000-node cluster at once, as a Reflector
// makes it, would hold every pod whole (kilobytes each) at one time.
func (s *podStore) listPaged(ctx context.Context, list func(context.Context, metav1.ListOptions) (*corev1.PodList, error),
	o metav1.ListOptions) (runtime.Object, error) {
	// A consistent list, in pages (a list at resourceVersion 0 comes from
	// the watch cache in one piece, whatever the limit).
	o.FieldSelector = watcher.NotHostNetwork
	o.ResourceVersion, o.ResourceVersionMatch, o.Limit, o.Continue = "", "", podPage, ""
	staged := newPodStore(s.nss, func() {})
	var rv string
	p := pager.New(func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
		l, err := list(ctx, o)
		if err == nil && rv == "" {
			rv = l.ResourceVersion
		}
		return l, err
	})
	p.PageBufferSize = 1
	err := p.EachListItem(ctx, o, func(obj runtime.Object) error {
		if pod, ok := obj.(*corev1.Pod); ok {
			staged.put(pod.Namespace+"/"+pod.Name, pod)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.staged = staged
	s.mu.Unlock()
	return &corev1.PodList{ListMeta: metav1.ListMeta{ResourceVersion: rv}}, nil
}

// podRecord is what the store keeps of a pod.
type podRecord struct {
	ns     string
	labels *sharedLabels
	counts bool
}

// sharedLabels is one set of labels and how many pods carry it.
type sharedLabels struct {
	set  map[string]string
	key  string
	refs int
}

// podCount is one limit's count, and what it was made with.
type podCount struct {
	selectors string // the selectors, written out
	sel       watcher.PodSelection
	nsGen     uint64
	n         int
}

func newPodStore(nss cache.Store, changed func()) *podStore {
	return &podStore{nss: nss, changed: changed, pods: make(map[string]podRecord),
		shared: make(map[string]*sharedLabels), counts: make(map[string]*podCount)}
}

// count is how many pods l's selectors choose that count.
func (s *podStore) count(l *v1alpha1.Limit) (int, bool) {
	sel, ok := watcher.SelectionOf(&l.Match)
	if !ok {
		return 0, false
	}
	key := metav1.FormatLabelSelector(l.Match.PodSelector) + " " + metav1.FormatLabelSelector(l.Match.NamespaceSelector)
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.counts[l.Name]
	if c != nil && c.selectors == key && (!sel.NeedsNamespaces() || c.nsGen == s.nsGen) {
		return c.n, true
	}
	c = &podCount{selectors: key, sel: sel, nsGen: s.nsGen}
	for _, r := range s.pods {
		if s.matches(c, r) {
			c.n++
		}
	}
	s.counts[l.Name] = c
	return c.n, true
}

// forget drops the counts of the limits keep does not keep.
func (s *podStore) forget(keep func(name string) bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for name := range s.counts {
		if !keep(name) {
			delete(s.counts, name)
		}
	}
}

// matches reports whether r counts for c. Callers hold s.mu.
func (s *podStore) matches(c *podCount, r podRecord) bool {
	return r.counts && c.sel.MatchesIn(r.labels.set, r.ns, s.nss)
}

// namespacesChanged has the counts that read namespaces made afresh.
func (s *podStore) namespacesChanged() {
	s.mu.Lock()
	s.nsGen++
	s.mu.Unlock()
	s.changed()
}

// HasSynced reports whether the first list is in.
func (s *podStore) HasSynced() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.synced
}

// record is what the store keeps of pod. Callers hold s.mu.
func (s *podStore) record(pod *corev1.Pod) podRecord {
	key := labels.Set(pod.Labels).String()
	sl := s.shared[key]
	if sl == nil {
		sl = &sharedLabels{set: pod.Labels, key: key}
		s.shared[key] = sl
	}
	sl.refs++
	return podRecord{ns: pod.Namespace, labels: sl, counts: watcher.CountsPod(pod)}
}

// release drops r's hold on its labels. Callers hold s.mu.
func (s *podStore) release(r podRecord) {
	if r.labels.refs--; r.labels.refs == 0 {
		delete(s.shared, r.labels.key)
	}
}

// put stores (or with pod nil, removes) the pod under key and moves every
// count by the difference. Callers hold s.mu.
func (s *podStore) put(key string, pod *corev1.Pod) {
	old, had := s.pods[key]
	var rec podRecord
	if pod != nil {
		rec = s.record(pod)
		s.pods[key] = rec
	} else {
		delete(s.pods, key)
	}
	for _, c := range s.counts {
		if had && s.matches(c, old) {
			c.n--
		}
		if pod != nil && s.matches(c, rec) {
			c.n++
		}
	}
	if had {
		s.release(old)
	}
}

func podOf(obj any) (*corev1.Pod, string, bool) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return nil, "", false
	}
	return p, p.Namespace + "/" + p.Name, true
}

// The cache.Store the Reflector calls.

func (s *podStore) Add(obj any) error {
	p, key, ok := podOf(obj)
	if !ok {
		return nil
	}
	s.mu.Lock()
	s.put(key, p)
	s.mu.Unlock()
	s.changed()
	return nil
}

func (s *podStore) Update(obj any) error { return s.Add(obj) }

func (s *podStore) Delete(obj any) error {
	_, key, ok := podOf(obj)
	if !ok {
		return nil
	}
	s.mu.Lock()
	s.put(key, nil)
	s.mu.Unlock()
	s.changed()
	return nil
}

// Replace is a relist: every pod anew (those listPaged staged, and those
// of list), every count made afresh.
func (s *podStore) Replace(list []any, _ string) error {
	s.mu.Lock()
	s.pods, s.shared, s.counts = make(map[string]podRecord, len(list)), make(map[string]*sharedLabels), make(map[string]*podCount)
	if st := s.staged; st != nil {
		s.pods, s.shared, s.staged = st.pods, st.shared, nil
	}
	for _, obj := range list {
		if p, key, ok := podOf(obj); ok {
			s.put(key, p)
		}
	}
	s.synced = true
	s.mu.Unlock()
	s.changed()
	return nil
}

func (s *podStore) List() []any {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]any, 0, len(s.pods))
	for _, r := range s.pods {
		out = append(out, r)
	}
	return out
}

func (s *podStore) ListKeys() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.pods))
	for k := range s.pods {
		out = append(out, k)
	}
	return out
}

func (s *podStore) Get(obj any) (any, bool, error) {
	_, key, ok := podOf(obj)
	if !ok {
		return nil, false, nil
	}
	return s.GetByKey(key)
}

func (s *podStore) GetByKey(key string) (any, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.pods[key]
	return r, ok, nil
}

func (s *podStore) Resync() error { return nil }
