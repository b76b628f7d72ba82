package watcher

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/netip"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/client/clientset/versioned"
	rlinformers "github.com/rlagent/rlagent/client/informers/externalversions"
	rllisters "github.com/rlagent/rlagent/client/listers/api/v1alpha1"
	"github.com/rlagent/rlagent/demand"
)

// RateLimitResource is the RateLimit custom resource.
var RateLimitResource = v1alpha1.RateLimitResource

// KubernetesConfig configures the Kubernetes source.
type KubernetesConfig struct {
	Client kubernetes.Interface
	// RateLimits is the generated clientset of the RateLimit resource.
	RateLimits versioned.Interface
	// NodeName is this node (from the downward API): the service scope
	// counts the endpoints on it.
	NodeName string
	// AgentNamespace and AgentDaemonSet name the agents' DaemonSet: the
	// nodes scope divides by its ready pods (status.numberReady).
	AgentNamespace string
	AgentDaemonSet string
	// SliceNamespace, if set, watches EndpointSlices in that namespace
	// only: the limiter library, whose Role is its own namespace's.
	// "": every namespace (the agent).
	SliceNamespace string
	// WithoutAgents watches no DaemonSet: scope nodes then has no count.
	// For the limiter library, which divides by its Service's endpoints
	// and may not read the agents' namespace.
	WithoutAgents bool
	// Resync is the informers' resync period (0: none).
	Resync time.Duration
	// ProbeInterval is how often, while a watch fails because the API
	// server does not answer, it is asked whether it is back (default
	// 2 s). It is not asked anything while the watches work.
	ProbeInterval time.Duration
	// Probe asks the API server whether it is there (default: GET /readyz).
	Probe func(context.Context) error
	Log   *slog.Logger
}

// Endpoint is a ready endpoint of a Service on this node.
type Endpoint struct {
	Addr netip.Addr
}

// EndpointPort is a port the endpoints of a Service serve.
type EndpointPort struct {
	Protocol corev1.Protocol
	Port     uint16
}

// Kubernetes is the count source of a cluster, and the source of the limits
// themselves: RateLimit objects. It follows sample-controller: the
// generated clientset, informer and lister of RateLimits, event handlers
// that only enqueue an object's key, caches synced before any work, and a
// sync per key that reads from the listers, never mutates what they hold,
// and returns its errors so that the queue retries the key with backoff.
//
// It watches three things, each as narrowly as the API allows, so that what
// an agent receives does not grow with the cluster: every RateLimit; the
// agents' DaemonSet, one object (field selector metadata.name), whose
// status.numberReady is the nodes scope's count; and the EndpointSlices of
// the Services RateLimits reference (sliceWatch), not the cluster's.
//
// The last observation stands while the API server is unreachable: the
// listers keep their content when a watch fails, and a relist replaces it
// with what is true, never with nothing. What changes is the observation's
// age, dated by the watches themselves (watchHealth).
type Kubernetes struct {
	cfg    KubernetesConfig
	log    *slog.Logger
	queue  workqueue.TypedRateLimitingInterface[string]
	health *watchHealth

	rlFactory  rlinformers.SharedInformerFactory
	rlInformer cache.SharedIndexInformer
	rlLister   rllisters.RateLimitLister
	dsInformer cache.SharedIndexInformer
	slices     sliceWatch
	pods       podWatch

	mu       sync.Mutex
	ctx      context.Context              // Run's, for the slice informers
	limits   map[string]v1alpha1.Limit    // by name, valid or not
	invalid  map[string]error             // names whose spec the agent rejects
	allocs   map[string]demand.Allocation // share demand: status.allocation, by limit name
	keys     map[string][]demand.KeyLevel // and, of a keyed limit, status.allocation.keys
	obs      map[string]Observation       // by limit name
	local    map[string][]Endpoint        // service scope: this node's ready endpoints
	ports    map[string][]EndpointPort    // service scope: the Service's ports
	counted  map[string]int               // pods scope: status.replicas, the elected agent's count
	agents   int
	desired  int // the DaemonSet's desiredNumberScheduled
	synced   bool
	notify   func()
	onChange []func() // more than notify: the status writer
	sliceErr string   // the last error of slices.set, logged once
}

// NewKubernetes returns a Kubernetes source. Run starts it.
func NewKubernetes(cfg KubernetesConfig) *Kubernetes {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.ProbeInterval <= 0 {
		cfg.ProbeInterval = 2 * time.Second
	}
	if cfg.AgentDaemonSet == "" {
		cfg.AgentDaemonSet = "rlagent"
	}
	if cfg.Probe == nil {
		client := cfg.Client
		cfg.Probe = func(ctx context.Context) error {
			return client.Discovery().RESTClient().Get().AbsPath("/readyz").Do(ctx).Error()
		}
	}
	k := &Kubernetes{
		cfg:     cfg,
		log:     cfg.Log,
		queue:   workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]()),
		limits:  make(map[string]v1alpha1.Limit),
		invalid: make(map[string]error),
		allocs:  make(map[string]demand.Allocation),
		keys:    make(map[string][]demand.KeyLevel),
		obs:     make(map[string]Observation),
		local:   make(map[string][]Endpoint),
		ports:   make(map[string][]EndpointPort),
		counted: make(map[string]int),
	}
	k.health = newWatchHealth(cfg.Log, cfg.Probe, cfg.ProbeInterval, k.healthChanged)

	// The factory's RateLimit informer, built by informer(): its lists
	// and watches date the observations (watchHealth).
	k.rlFactory = rlinformers.NewSharedInformerFactory(cfg.RateLimits, cfg.Resync)
	k.rlFactory.InformerFor(&v1alpha1.RateLimit{}, func(c versioned.Interface, _ time.Duration) cache.SharedIndexInformer {
		rls := c.RlagentV1alpha1().RateLimits()
		return k.informer("ratelimits", &v1alpha1.RateLimit{}, listOf(rls.List), rls.Watch, nil, nil)
	})
	rl := k.rlFactory.Rlagent().V1alpha1().RateLimits()
	k.rlInformer, k.rlLister = rl.Informer(), rl.Lister()
	if !cfg.WithoutAgents {
		dss := cfg.Client.AppsV1().DaemonSets(cfg.AgentNamespace)
		byName := fields.OneTermEqualSelector("metadata.name", cfg.AgentDaemonSet).String()
		k.dsInformer = k.informer("daemonset", &appsv1.DaemonSet{}, listOf(dss.List), dss.Watch,
			func(o *metav1.ListOptions) { o.FieldSelector = byName }, nil)
	}

	enqueue := func(key string) { k.queue.Add(key) }
	k.rlInformer.AddEventHandler(handler(func(obj any) {
		if rl, ok := obj.(*v1alpha1.RateLimit); ok {
			enqueue(keyLimit + rl.Name)
		}
	}))
	if k.dsInformer != nil {
		k.dsInformer.AddEventHandler(handler(func(any) { enqueue(keyAgents) }))
	}
	k.slices.swapped = func() { enqueue(keyCounts) }
	k.slices.handler = handler(func(obj any) {
		if s, ok := obj.(*discoveryv1.EndpointSlice); ok {
			if svc := s.Labels[discoveryv1.LabelServiceName]; svc != "" {
				enqueue(keyService + s.Namespace + "/" + svc)
			}
		}
	})
	return k
}

// informer is a shared informer of one resource, through watchHealth.
func (k *Kubernetes) informer(name string, obj runtime.Object,
	list func(context.Context, metav1.ListOptions) (runtime.Object, error),
	watchFn func(context.Context, metav1.ListOptions) (watch.Interface, error),
	tweak func(*metav1.ListOptions), indexers cache.Indexers,
) cache.SharedIndexInformer {
	inf := cache.NewSharedIndexInformer(k.health.listWatch(name, list, watchFn, tweak), obj, k.cfg.Resync, indexers)
	inf.SetWatchErrorHandlerWithContext(func(ctx context.Context, _ *cache.Reflector, err error) {
		if !apierrors.IsResourceExpired(err) && !apierrors.IsGone(err) {
			k.log.Debug("watch ended", "informer", name, "error", err)
		}
	})
	return inf
}

// sliceInformer is the informer of the EndpointSlices sel selects.
func (k *Kubernetes) sliceInformer(sel labels.Selector) cache.SharedIndexInformer {
	eps := k.cfg.Client.DiscoveryV1().EndpointSlices(k.cfg.SliceNamespace) // "": metav1.NamespaceAll
	s := sel.String()
	return k.informer("endpointslices", &discoveryv1.EndpointSlice{}, listOf(eps.List), eps.Watch,
		func(o *metav1.ListOptions) { o.LabelSelector = s }, cache.Indexers{byService: serviceIndex})
}

// listOf adapts a typed List to the informer's.
func listOf[T runtime.Object](list func(context.Context, metav1.ListOptions) (T, error)) func(context.Context, metav1.ListOptions) (runtime.Object, error) {
	return func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return list(ctx, o) }
}

// healthChanged tells the agent that the observations' age changed course.
func (k *Kubernetes) healthChanged() {
	k.mu.Lock()
	notify := k.notify
	k.mu.Unlock()
	if notify != nil {
		notify()
	}
}

// Config is the configuration k runs with, its defaults applied: the
// clients, this node's name and the agents' namespace, for the packages
// that write what k reads (cluster/).
func (k *Kubernetes) Config() KubernetesConfig { return k.cfg }

// RateLimits is the lister of the RateLimit objects (not to be modified).
func (k *Kubernetes) RateLimits() rllisters.RateLimitLister { return k.rlLister }

// WatchStats returns, by informer (ratelimits, daemonset, endpointslices),
// what the informers received so far.
func (k *Kubernetes) WatchStats() map[string]WatchStats { return k.health.stats() }

// The queue's keys: one RateLimit, the agents' DaemonSet, one Service's
// EndpointSlices, and every limit's count (after the slices' informer
// changed, and once the caches synced).
const (
	keyLimit   = "ratelimit/"
	keyAgents  = "agents"
	keyService = "service/"
	keyCounts  = "counts"
	keyPods    = "pods"
)

// handler enqueues on every add, update and delete, tombstones included.
func handler(f func(obj any)) cache.ResourceEventHandlerFuncs {
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    f,
		UpdateFunc: func(_, obj any) { f(obj) },
		DeleteFunc: func(obj any) {
			if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = t.Obj
			}
			f(obj)
		},
	}
}

// Run starts the informers, waits for their caches, and syncs until ctx
// ends, calling notify after every change of the limits or a count.
func (k *Kubernetes) Run(ctx context.Context, notify func()) {
	k.mu.Lock()
	k.notify, k.ctx = notify, ctx
	k.mu.Unlock()
	k.health.mu.Lock()
	k.health.run = ctx
	k.health.mu.Unlock()
	defer k.queue.ShutDown()
	defer k.slices.stop()
	defer k.rlFactory.Shutdown()
	k.rlFactory.Start(ctx.Done())
	synced := []cache.InformerSynced{k.rlInformer.HasSynced}
	if k.dsInformer != nil {
		go k.dsInformer.RunWithContext(ctx)
		synced = append(synced, k.dsInformer.HasSynced)
	}
	if !cache.WaitForCacheSync(ctx.Done(), synced...) {
		return
	}
	// Every limit, and the referenced Services' slices, before the first
	// count.
	k.mu.Lock()
	rls, err := k.rlLister.List(labels.Everything())
	for _, rl := range rls {
		k.storeLimit(rl.Name, rl)
	}
	if err == nil {
		err = errors.Join(k.watchServices(), k.watchPods())
	}
	k.mu.Unlock()
	if err != nil {
		k.log.Warn("the first sync of the limits", "error", err) // their keys are queued: retried
	}
	if !cache.WaitForCacheSync(ctx.Done(), k.slices.synced, k.pods.synced) {
		return
	}
	k.mu.Lock()
	k.synced = true
	k.mu.Unlock()
	k.queue.Add(keyCounts)
	k.queue.Add(keyAgents)
	k.queue.Add(keyPods)
	go func() {
		<-ctx.Done()
		k.queue.ShutDown()
	}()
	for k.processNext() {
	}
}

// Synced reports whether the caches have synced once.
func (k *Kubernetes) Synced() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.synced
}

func (k *Kubernetes) processNext() bool {
	key, quit := k.queue.Get()
	if quit {
		return false
	}
	defer k.queue.Done(key)
	if err := k.sync(key); err != nil {
		k.log.Warn("sync failed; retrying", "key", key, "error", err, "retries", k.queue.NumRequeues(key))
		k.queue.AddRateLimited(key)
		return true
	}
	k.queue.Forget(key)
	return true
}

// sync recomputes what key stands for, from the listers, notifies if
// anything changed, and returns what failed (the queue retries the key).
func (k *Kubernetes) sync(key string) error {
	k.mu.Lock()
	changed := false
	var err error
	switch {
	case strings.HasPrefix(key, keyLimit):
		name := strings.TrimPrefix(key, keyLimit)
		var rl *v1alpha1.RateLimit
		rl, err = k.rlLister.Get(name)
		if apierrors.IsNotFound(err) {
			rl, err = nil, nil
		}
		if err == nil {
			changed = k.storeLimit(name, rl)
			changed = k.syncObservation(name) || changed
			err = errors.Join(k.watchServices(), k.watchPods())
		}
	case key == keyAgents:
		changed = k.syncAgents()
	case key == keyCounts:
		for name := range k.limits {
			changed = k.syncObservation(name) || changed
		}
	case key == keyPods:
		for name, l := range k.limits {
			if l.Scope == v1alpha1.ScopePods {
				changed = k.syncObservation(name) || changed
			}
		}
	case strings.HasPrefix(key, keyService):
		svc := strings.TrimPrefix(key, keyService)
		for name, l := range k.limits {
			if l.Scope == v1alpha1.ScopeService && l.Match.Service == svc {
				changed = k.syncObservation(name) || changed
			}
		}
	}
	notify, more := k.notify, k.onChange
	k.mu.Unlock()
	if changed {
		if notify != nil {
			notify()
		}
		for _, f := range more {
			f()
		}
	}
	return err
}

// OnChange has f called, as Run's notify is, after every change of the
// limits or a count.
func (k *Kubernetes) OnChange(f func()) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.onChange = append(k.onChange, f)
}

// storeLimit records the RateLimit name as rl says (nil: deleted):
// defaulted and validated, valid or not, with its demand allocation, and
// reports whether that changed. It never modifies rl, which the lister
// holds. Callers hold k.mu.
func (k *Kubernetes) storeLimit(name string, rl *v1alpha1.RateLimit) bool {
	if rl == nil {
		_, had := k.limits[name]
		delete(k.limits, name)
		delete(k.invalid, name)
		delete(k.allocs, name)
		delete(k.keys, name)
		delete(k.obs, name)
		delete(k.local, name)
		delete(k.ports, name)
		delete(k.counted, name)
		return had
	}
	spec := *rl.Spec.DeepCopy()
	spec.Default()
	l := v1alpha1.Limit{Name: name, RateLimitSpec: spec}
	invalid := spec.Validate("spec")
	var alloc demand.Allocation
	var keys []demand.KeyLevel
	if a := rl.Status.Allocation; a != nil && spec.Share == v1alpha1.ShareDemand {
		alloc = AllocationOf(a)
		if spec.Key != v1alpha1.KeyNone {
			keys = KeyLevelsOf(a)
		}
	}
	counted := 0
	if spec.Scope == v1alpha1.ScopePods {
		counted = int(max(rl.Status.Replicas, 0))
	}
	prev, had := k.limits[name]
	changed := !had || !reflect.DeepEqual(prev.RateLimitSpec, spec) || k.counted[name] != counted ||
		fmt.Sprint(k.invalid[name]) != fmt.Sprint(invalid) || k.allocs[name] != alloc ||
		!slices.Equal(k.keys[name], keys)
	k.limits[name] = l
	if counted > 0 {
		k.counted[name] = counted
	} else {
		delete(k.counted, name)
	}
	if invalid != nil {
		k.invalid[name] = invalid
	} else {
		delete(k.invalid, name)
	}
	if alloc != (demand.Allocation{}) {
		k.allocs[name] = alloc
	} else {
		delete(k.allocs, name)
	}
	if len(keys) > 0 {
		k.keys[name] = keys
	} else {
		delete(k.keys, name)
	}
	return changed
}

// watchServices points the slice informer at the Services the limits
// reference, also those of limits the agent rejects: the status says what
// they would be divided by. A reference that cannot be a Service's name is
// logged once, not retried (validation rejects its limit). Callers hold
// k.mu.
func (k *Kubernetes) watchServices() error {
	if k.ctx == nil {
		return nil
	}
	var services []string
	for _, l := range k.limits {
		if l.Scope == v1alpha1.ScopeService {
			services = append(services, l.Match.Service)
		}
	}
	bad, err := k.slices.set(k.ctx, services, k.sliceInformer)
	msg := ""
	if len(bad) > 0 {
		msg = fmt.Sprintf("not Service names, not watched: %q", bad)
		if msg != k.sliceErr {
			k.log.Warn("some referenced Services' EndpointSlices are not watched", "error", msg)
		}
	}
	k.sliceErr = msg
	return err
}

// syncAgents reads the ready agents from the DaemonSet's status. Callers
// hold k.mu.
func (k *Kubernetes) syncAgents() bool {
	if k.dsInformer == nil {
		return false
	}
	n, desired := 0, 0
	for _, obj := range k.dsInformer.GetStore().List() {
		if ds, ok := obj.(*appsv1.DaemonSet); ok && ds.Name == k.cfg.AgentDaemonSet {
			n, desired = int(ds.Status.NumberReady), int(ds.Status.DesiredNumberScheduled)
		}
	}
	k.desired = desired
	if n == k.agents {
		return false
	}
	k.agents = n
	changed := false
	for name, l := range k.limits {
		if l.Scope == v1alpha1.ScopeNodes {
			changed = k.syncObservation(name) || changed
		}
	}
	return changed
}

// Agents returns the agents' DaemonSet's ready and desired pods.
func (k *Kubernetes) Agents() (ready, desired int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.agents, k.desired
}

// syncObservation recomputes one limit's count. Callers hold k.mu.
func (k *Kubernetes) syncObservation(name string) bool {
	l := k.limits[name]
	var o Observation
	var local []Endpoint
	var ports []EndpointPort
	switch l.Scope {
	case v1alpha1.ScopeNodes:
		o.Replicas, o.Local = k.agents, min(k.agents, 1)
	case v1alpha1.ScopeService:
		o.Replicas, local, ports = k.serviceEndpoints(l.Match.Service)
		o.Local = len(local)
	case v1alpha1.ScopePods:
		// The count is the elected agent's (status.replicas); the pods
		// here are this agent's own watch's, which may be ahead of it
		// for a moment: the count is at least what is here.
		o.Local, local = k.localPods(&l)
		o.Replicas = max(k.counted[name], o.Local)
	default:
		// static: the agent divides it by its own count source.
		_, had := k.obs[name]
		delete(k.obs, name)
		delete(k.local, name)
		delete(k.ports, name)
		return had
	}
	prev, had := k.obs[name]
	k.obs[name] = o
	changed := !had || prev.Replicas != o.Replicas || prev.Local != o.Local ||
		!slices.Equal(k.local[name], local) || !slices.Equal(k.ports[name], ports)
	k.local[name], k.ports[name] = local, ports
	return changed
}

// serviceEndpoints counts a Service's ready endpoints (namespace/name), all
// and on this node, from its EndpointSlices that the EndpointSlice
// controller wrote (sliceWatch holds no others).
func (k *Kubernetes) serviceEndpoints(svc string) (total int, local []Endpoint, ports []EndpointPort) {
	ns, name, _ := strings.Cut(svc, "/")
	seen := make(map[string]bool)
	for _, s := range k.slices.list(ns, name) {
		for _, p := range s.Ports {
			if p.Port == nil {
				continue
			}
			proto := corev1.ProtocolTCP
			if p.Protocol != nil {
				proto = *p.Protocol
			}
			ep := EndpointPort{Protocol: proto, Port: uint16(*p.Port)}
			if !slices.Contains(ports, ep) {
				ports = append(ports, ep)
			}
		}
		for _, e := range s.Endpoints {
			if e.Conditions.Ready != nil && !*e.Conditions.Ready {
				continue
			}
			if len(e.Addresses) == 0 || seen[e.Addresses[0]] {
				continue // an endpoint in two slices (a rollout) counts once
			}
			seen[e.Addresses[0]] = true
			total++
			// The first address only, as the API allows (they are
			// fungible; the controller writes one): an endpoint weighs one
			// on its node, however many addresses a slice lists for it,
			// so no node's weight exceeds the count.
			if e.NodeName != nil && *e.NodeName == k.cfg.NodeName {
				if addr, err := netip.ParseAddr(e.Addresses[0]); err == nil {
					local = append(local, Endpoint{Addr: addr})
				}
			}
		}
	}
	sort.Slice(local, func(i, j int) bool { return local[i].Addr.Less(local[j].Addr) })
	sort.Slice(ports, func(i, j int) bool {
		if ports[i].Protocol != ports[j].Protocol {
			return ports[i].Protocol < ports[j].Protocol
		}
		return ports[i].Port < ports[j].Port
	})
	return total, local, ports
}

// Observe returns the latest count for the named limit.
func (k *Kubernetes) Observe(limit string) Observation {
	k.mu.Lock()
	defer k.mu.Unlock()
	o := k.obs[limit]
	o.At, o.Err = k.health.state(time.Now())
	return o
}

// Limits returns the RateLimit objects as limits, sorted by name, and the
// reasons the agent rejects some of them.
func (k *Kubernetes) Limits() ([]v1alpha1.Limit, map[string]error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	out := make([]v1alpha1.Limit, 0, len(k.limits))
	for _, l := range k.limits {
		out = append(out, l)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	inv := make(map[string]error, len(k.invalid))
	for n, e := range k.invalid {
		inv[n] = e
	}
	return out, inv
}

// LocalEndpoints returns, for a service-scoped limit, the ready endpoints of
// its Service on this node and the Service's ports.
func (k *Kubernetes) LocalEndpoints(limit string) ([]Endpoint, []EndpointPort) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return slices.Clone(k.local[limit]), slices.Clone(k.ports[limit])
}

// Allocation is the last round of a demand-shared limit's allocation, as
// its status holds it (the zero Allocation: none, or not demand-shared).
func (k *Kubernetes) Allocation(limit string) demand.Allocation {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.allocs[limit]
}

// AllocationKeys is the keys' levels in the allocation of a keyed limit
// with share demand, sorted by key (nil: none). Not to be modified.
func (k *Kubernetes) AllocationKeys(limit string) []demand.KeyLevel {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.keys[limit]
}

// RateLimit returns the RateLimit object as the lister holds it (not to be
// modified), or nil.
func (k *Kubernetes) RateLimit(name string) *v1alpha1.RateLimit {
	rl, err := k.rlLister.Get(name)
	if err != nil {
		return nil
	}
	return rl
}

// AllocationOf is the round a status holds (the zero Allocation: none).
func AllocationOf(a *v1alpha1.Allocation) demand.Allocation {
	if a == nil {
		return demand.Allocation{}
	}
	r := demand.Allocation{Round: a.Round, Level: demand.Level{Water: math.MaxUint64, Floor: a.Floor}, Nodes: a.Nodes, Time: a.Time.Time}
	if a.Water != nil {
		r.Level.Water = *a.Water
	}
	return r
}

// KeyLevelsOf is the keys' levels a keyed limit's allocation holds, sorted
// by key; every key's floor is the allocation's. A key listed twice (the
// schema's list map forbids it) counts once, at its first entry.
func KeyLevelsOf(a *v1alpha1.Allocation) []demand.KeyLevel {
	if a == nil || len(a.Keys) == 0 {
		return nil
	}
	out := make([]demand.KeyLevel, 0, len(a.Keys))
	for _, ka := range a.Keys {
		kl := demand.KeyLevel{Key: ka.Key, Nodes: ka.Nodes, Level: demand.Level{Water: math.MaxUint64, Floor: a.Floor}}
		if ka.Water != nil {
			kl.Level.Water = *ka.Water
		}
		out = append(out, kl)
	}
	slices.SortStableFunc(out, func(x, y demand.KeyLevel) int { return strings.Compare(x.Key, y.Key) })
	return slices.CompactFunc(out, func(x, y demand.KeyLevel) bool { return x.Key == y.Key })
}
