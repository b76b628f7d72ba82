package watcher

import (
	"context"
	"slices"
	"strings"
	"sync"

	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/tools/cache"
)

// sliceWatch holds the EndpointSlices of the Services that RateLimits
// reference, and no others: one informer whose label selector is
// kubernetes.io/service-name in (the referenced names), in every namespace
// (a name referenced in one namespace brings its namesakes in others, which
// the counts skip), and endpointslice.kubernetes.io/managed-by the
// EndpointSlice controller. An agent's watch traffic then grows with the
// limits, not with the cluster.
//
// Only the controller's slices count: they list the pods the Service
// selects. A slice that anyone else wrote (by hand, or mirrored from
// hand-written Endpoints of a Service without a selector) would set the
// Service's count and its nodes' weights to whatever it says. That is no
// security boundary: the label is a label, and whoever may write
// EndpointSlices in the Service's namespace can set it. It keeps the
// counts to what the controller wrote as long as only the controller
// writes slices with its name.
//
// When the set of names changes, a new informer with the new selector
// lists and watches; until it has synced the old one's store stands, so a
// count never falls to "none seen" because another limit was added.
type sliceWatch struct {
	handler cache.ResourceEventHandler
	swapped func() // called when a new informer's store replaced the old one

	mu      sync.Mutex
	names   []string // the current informer's names, sorted
	cur     *sliceInformer
	pending *sliceInformer
}

type sliceInformer struct {
	names  []string
	inf    cache.SharedIndexInformer
	cancel context.CancelFunc
}

// sliceController is the value of the label discoveryv1.LabelManagedBy on
// the slices the EndpointSlice controller (kube-controller-manager)
// writes, the only ones counted.
const sliceController = "endpointslice-controller.k8s.io"

// serviceSelector is the label selector of the EndpointSlices of the named
// Services (names, not namespace/name: a label holds only the name) that
// the EndpointSlice controller manages.
func serviceSelector(names []string) (labels.Selector, error) {
	r, err := labels.NewRequirement(discoveryv1.LabelServiceName, selection.In, names)
	if err != nil {
		return nil, err
	}
	m, err := labels.NewRequirement(discoveryv1.LabelManagedBy, selection.Equals, []string{sliceController})
	if err != nil {
		return nil, err
	}
	return labels.NewSelector().Add(*r, *m), nil
}

// set makes the watched names those of services (namespace/name), starting
// a new informer if they changed, and returns the references that cannot be
// a Service's name (not watched). With no names there is no informer.
func (s *sliceWatch) set(ctx context.Context, services []string, newInformer func(sel labels.Selector) cache.SharedIndexInformer) (bad []string, err error) {
	var names []string
	for _, svc := range services {
		_, name, _ := strings.Cut(svc, "/")
		switch {
		case len(validation.IsValidLabelValue(name)) > 0 || name == "":
			// No Service has this name: one bad reference must not stop
			// the watch of the others. (Validation rejects the limit.)
			bad = append(bad, svc)
		case !slices.Contains(names, name):
			names = append(names, name)
		}
	}
	slices.Sort(names)

	s.mu.Lock()
	defer s.mu.Unlock()
	want := s.names
	if s.pending != nil {
		want = s.pending.names
	}
	if slices.Equal(want, names) {
		return bad, nil
	}
	if s.pending != nil {
		s.pending.cancel()
		s.pending = nil
	}
	if len(names) == 0 {
		if s.cur != nil {
			s.cur.cancel()
		}
		s.cur, s.names = nil, nil
		return bad, nil
	}
	if slices.Equal(s.names, names) {
		return bad, nil // back to what the current informer watches
	}
	sel, err := serviceSelector(names)
	if err != nil {
		return bad, err
	}
	ictx, cancel := context.WithCancel(ctx)
	p := &sliceInformer{names: names, inf: newInformer(sel), cancel: cancel}
	if _, err := p.inf.AddEventHandler(s.handler); err != nil {
		cancel()
		return bad, err
	}
	s.pending = p
	go p.inf.RunWithContext(ictx)
	go func() {
		if !cache.WaitForCacheSync(ictx.Done(), p.inf.HasSynced) {
			return
		}
		s.mu.Lock()
		if s.pending != p {
			s.mu.Unlock()
			return
		}
		old := s.cur
		s.cur, s.names, s.pending = p, p.names, nil
		s.mu.Unlock()
		if old != nil {
			old.cancel()
		}
		// The handler's events of the new informer's first list came
		// while the old store stood: every count is synced again.
		if s.swapped != nil {
			s.swapped()
		}
	}()
	return bad, nil
}

// synced reports whether the watched set is the one last asked for.
func (s *sliceWatch) synced() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pending == nil
}

// list returns the slices of the Service ns/name from the current store.
func (s *sliceWatch) list(ns, name string) []*discoveryv1.EndpointSlice {
	s.mu.Lock()
	cur := s.cur
	s.mu.Unlock()
	if cur == nil {
		return nil
	}
	objs, err := cur.inf.GetIndexer().ByIndex(byService, ns+"/"+name)
	if err != nil {
		return nil
	}
	out := make([]*discoveryv1.EndpointSlice, 0, len(objs))
	for _, obj := range objs {
		if sl, ok := obj.(*discoveryv1.EndpointSlice); ok {
			out = append(out, sl)
		}
	}
	return out
}

// byService indexes EndpointSlices by their Service, namespace/name: only
// the EndpointSlice controller's (the watch selects no others already).
const byService = "service"

func serviceIndex(obj any) ([]string, error) {
	sl, ok := obj.(*discoveryv1.EndpointSlice)
	if !ok || sl.Labels[discoveryv1.LabelServiceName] == "" || sl.Labels[discoveryv1.LabelManagedBy] != sliceController {
		return nil, nil
	}
	return []string{sl.Namespace + "/" + sl.Labels[discoveryv1.LabelServiceName]}, nil
}

func (s *sliceWatch) stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, i := range []*sliceInformer{s.cur, s.pending} {
		if i != nil {
			i.cancel()
		}
	}
	s.cur, s.pending, s.names = nil, nil, nil
}
