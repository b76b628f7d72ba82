package watcher

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"

	"github.com/rlagent/rlagent/api/v1alpha1"
)

// RateLimitResource is the RateLimit custom resource.
var RateLimitResource = v1alpha1.RateLimitResource

// KubernetesConfig configures the Kubernetes source.
type KubernetesConfig struct {
	Client  kubernetes.Interface
	Dynamic dynamic.Interface
	// NodeName is this node (from the downward API): the service scope
	// counts the endpoints on it.
	NodeName string
	// AgentNamespace and AgentSelector find the agents' own pods: the nodes
	// scope divides by the ready ones.
	AgentNamespace string
	AgentSelector  labels.Selector
	// Resync is the informers' resync period (0: none).
	Resync time.Duration
	// ProbeInterval is how often the API server is asked whether it is
	// there, to date the observations (default 2 s).
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
// themselves: RateLimit objects. It follows sample-controller: informers
// and listers, event handlers that only enqueue a key, caches synced before
// any work, and a sync that reads from the listers and never mutates them.
//
// The last observation stands while the API server is unreachable: the
// listers keep their content when a watch fails, and a relist replaces it
// with what is true, never with nothing. What changes is the observation's
// age: At is the last time the API server answered.
type Kubernetes struct {
	cfg   KubernetesConfig
	log   *slog.Logger
	queue workqueue.TypedRateLimitingInterface[string]

	rlInformer    cache.SharedIndexInformer
	sliceInformer cache.SharedIndexInformer
	podInformer   cache.SharedIndexInformer

	mu        sync.Mutex
	limits    map[string]v1alpha1.Limit // by name, valid or not
	invalid   map[string]error          // names whose spec the agent rejects
	obs       map[string]Observation    // by limit name
	local     map[string][]Endpoint     // service scope: this node's ready endpoints
	ports     map[string][]EndpointPort // service scope: the Service's ports
	agents    int
	contacted time.Time
	probeErr  error
	synced    bool
	notify    func()
}

// NewKubernetes returns a Kubernetes source. Run starts it.
func NewKubernetes(cfg KubernetesConfig) *Kubernetes {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.ProbeInterval <= 0 {
		cfg.ProbeInterval = 2 * time.Second
	}
	if cfg.AgentSelector == nil {
		cfg.AgentSelector = labels.Everything()
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
		obs:     make(map[string]Observation),
		local:   make(map[string][]Endpoint),
		ports:   make(map[string][]EndpointPort),
	}

	rls := cfg.Dynamic.Resource(RateLimitResource)
	k.rlInformer = k.informer(&unstructured.Unstructured{}, listOf(rls.List), rls.Watch, nil)
	eps := cfg.Client.DiscoveryV1().EndpointSlices(metav1.NamespaceAll)
	k.sliceInformer = k.informer(&discoveryv1.EndpointSlice{}, listOf(eps.List), eps.Watch, nil)
	pods := cfg.Client.CoreV1().Pods(cfg.AgentNamespace)
	k.podInformer = k.informer(&corev1.Pod{}, listOf(pods.List), pods.Watch,
		func(o *metav1.ListOptions) { o.LabelSelector = cfg.AgentSelector.String() })

	enqueue := func(key string) { k.queue.Add(key) }
	k.rlInformer.AddEventHandler(handler(func(any) { enqueue(keyLimits) }))
	k.sliceInformer.AddEventHandler(handler(func(obj any) {
		if s, ok := obj.(*discoveryv1.EndpointSlice); ok {
			if svc := s.Labels[discoveryv1.LabelServiceName]; svc != "" {
				enqueue(keyService + s.Namespace + "/" + svc)
			}
		}
	}))
	k.podInformer.AddEventHandler(handler(func(any) { enqueue(keyAgents) }))
	for _, inf := range []cache.SharedIndexInformer{k.rlInformer, k.sliceInformer, k.podInformer} {
		inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
			k.log.Warn("watch failed; the last observed counts stand", "error", err)
		})
	}
	return k
}

// informer is a shared informer of one resource whose list and watch
// calls wait while the probe finds the API server unreachable.
//
// Why: client-go's reflector retries a refused watch with an exponential
// backoff (0.8 s doubling to 30 s, jittered up to twice that) and relists
// after an expired one with the same backoff, so after an outage of half a
// minute the informers came back 25-90 s after the API server did (measured
// in test/k8s), while the observation already looked fresh. Held here
// instead, the calls fail only until the probe notices the outage (one
// ProbeInterval), the backoff stays at its first steps, and the informers
// resume seconds after the API server's return (4-6 s in test/k8s).
func (k *Kubernetes) informer(obj runtime.Object,
	list func(context.Context, metav1.ListOptions) (runtime.Object, error),
	watchFn func(context.Context, metav1.ListOptions) (watch.Interface, error),
	tweak func(*metav1.ListOptions),
) cache.SharedIndexInformer {
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			if err := k.waitReachable(ctx); err != nil {
				return nil, err
			}
			if tweak != nil {
				tweak(&o)
			}
			return list(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			if err := k.waitReachable(ctx); err != nil {
				return nil, err
			}
			if tweak != nil {
				tweak(&o)
			}
			return watchFn(ctx, o)
		},
	}
	return cache.NewSharedIndexInformer(lw, obj, k.cfg.Resync, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
}

// listOf adapts a typed List to the informer's.
func listOf[T runtime.Object](list func(context.Context, metav1.ListOptions) (T, error)) func(context.Context, metav1.ListOptions) (runtime.Object, error) {
	return func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return list(ctx, o) }
}

// waitReachable returns when the last probe found the API server answering
// (or none has run yet), or with ctx's error.
func (k *Kubernetes) waitReachable(ctx context.Context) error {
	for {
		k.mu.Lock()
		down := notAnswering(k.probeErr)
		k.mu.Unlock()
		if !down {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// notAnswering reports whether a probe error means that the API server is
// not there or not ready (no answer, or a 5xx). An answer that refuses the
// probe itself (401, 403) shows it is there: holding the informers on it
// would stop them for good where /readyz is not readable.
func notAnswering(err error) bool {
	var st apierrors.APIStatus
	if errors.As(err, &st) {
		return st.Status().Code >= 500
	}
	return err != nil
}

const (
	keyLimits  = "ratelimits"
	keyAgents  = "agents"
	keyService = "service/"
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
	k.notify = notify
	k.mu.Unlock()
	defer k.queue.ShutDown()
	for _, inf := range []cache.SharedIndexInformer{k.rlInformer, k.sliceInformer, k.podInformer} {
		go inf.RunWithContext(ctx)
	}
	go k.probe(ctx)
	if !cache.WaitForCacheSync(ctx.Done(), k.rlInformer.HasSynced, k.sliceInformer.HasSynced, k.podInformer.HasSynced) {
		return
	}
	k.mu.Lock()
	k.synced = true
	k.contacted = time.Now()
	k.mu.Unlock()
	k.queue.Add(keyLimits)
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
		k.log.Error("sync", "key", key, "error", err)
		k.queue.AddRateLimited(key)
		return true
	}
	k.queue.Forget(key)
	return true
}

// sync recomputes what key stands for, from the listers, and notifies if
// anything changed.
func (k *Kubernetes) sync(key string) error {
	k.mu.Lock()
	changed := false
	switch {
	case key == keyLimits:
		changed = k.syncLimits()
		for name := range k.limits {
			changed = k.syncObservation(name) || changed
		}
	case key == keyAgents:
		changed = k.syncAgents()
	case strings.HasPrefix(key, keyService):
		svc := strings.TrimPrefix(key, keyService)
		for name, l := range k.limits {
			if l.Scope == v1alpha1.ScopeService && l.Match.Service == svc {
				changed = k.syncObservation(name) || changed
			}
		}
	}
	notify := k.notify
	k.mu.Unlock()
	if changed && notify != nil {
		notify()
	}
	return nil
}

func (k *Kubernetes) syncLimits() bool {
	next := make(map[string]v1alpha1.Limit)
	invalid := make(map[string]error)
	for _, obj := range k.rlInformer.GetStore().List() {
		u, ok := obj.(*unstructured.Unstructured)
		if !ok {
			continue
		}
		var spec v1alpha1.RateLimitSpec
		raw, _, _ := unstructured.NestedMap(u.Object, "spec")
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(raw, &spec); err != nil {
			invalid[u.GetName()] = fmt.Errorf("spec: %w", err)
			continue
		}
		spec.Default()
		if err := spec.Validate("spec"); err != nil {
			invalid[u.GetName()] = err
		}
		next[u.GetName()] = v1alpha1.Limit{Name: u.GetName(), RateLimitSpec: spec}
	}
	changed := !equalLimits(k.limits, next) || !equalErrs(k.invalid, invalid)
	k.limits, k.invalid = next, invalid
	for name := range k.obs {
		if _, ok := next[name]; !ok {
			delete(k.obs, name)
			delete(k.local, name)
			delete(k.ports, name)
		}
	}
	return changed
}

func (k *Kubernetes) syncAgents() bool {
	n := 0
	for _, obj := range k.podInformer.GetStore().List() {
		p, ok := obj.(*corev1.Pod)
		if !ok || p.DeletionTimestamp != nil || !k.cfg.AgentSelector.Matches(labels.Set(p.Labels)) {
			continue
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				n++
				break
			}
		}
	}
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
	default:
		// static: the agent divides it by its own count source.
		return false
	}
	prev, had := k.obs[name]
	k.obs[name] = o
	changed := !had || prev.Replicas != o.Replicas || prev.Local != o.Local ||
		!slices.Equal(k.local[name], local) || !slices.Equal(k.ports[name], ports)
	k.local[name], k.ports[name] = local, ports
	return changed
}

// serviceEndpoints counts a Service's ready endpoints (namespace/name), all
// and on this node, from its EndpointSlices.
func (k *Kubernetes) serviceEndpoints(svc string) (total int, local []Endpoint, ports []EndpointPort) {
	ns, name, _ := strings.Cut(svc, "/")
	seen := make(map[string]bool)
	for _, obj := range k.sliceInformer.GetStore().List() {
		s, ok := obj.(*discoveryv1.EndpointSlice)
		if !ok || s.Namespace != ns || s.Labels[discoveryv1.LabelServiceName] != name {
			continue
		}
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
			if e.NodeName != nil && *e.NodeName == k.cfg.NodeName {
				for _, a := range e.Addresses {
					if addr, err := netip.ParseAddr(a); err == nil {
						local = append(local, Endpoint{Addr: addr})
					}
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

// probe dates the observations: At is the last time the API server
// answered. While it does not, the counts stand and their age grows.
func (k *Kubernetes) probe(ctx context.Context) {
	t := time.NewTicker(k.cfg.ProbeInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		pctx, cancel := context.WithTimeout(ctx, k.cfg.ProbeInterval)
		err := k.cfg.Probe(pctx)
		cancel()
		k.mu.Lock()
		was := k.probeErr
		if err == nil {
			k.contacted = time.Now()
		}
		k.probeErr = err
		notify := k.notify
		k.mu.Unlock()
		if (was == nil) != (err == nil) {
			if err != nil {
				k.log.Warn("API server unreachable; the last observed counts stand", "error", err)
			} else {
				k.log.Info("API server reachable again")
			}
			if notify != nil {
				notify()
			}
		}
	}
}

// Observe returns the latest count for the named limit.
func (k *Kubernetes) Observe(limit string) Observation {
	k.mu.Lock()
	defer k.mu.Unlock()
	o := k.obs[limit]
	o.At, o.Err = k.contacted, k.probeErr
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

func equalLimits(a, b map[string]v1alpha1.Limit) bool {
	if len(a) != len(b) {
		return false
	}
	for n, l := range a {
		m, ok := b[n]
		if !ok || !reflect.DeepEqual(l.RateLimitSpec, m.RateLimitSpec) {
			return false
		}
	}
	return true
}

func equalErrs(a, b map[string]error) bool {
	if len(a) != len(b) {
		return false
	}
	for n, e := range a {
		f, ok := b[n]
		if !ok || e.Error() != f.Error() {
			return false
		}
	}
	return true
}

// Verdict is what one agent says of a RateLimit.
type Verdict struct {
	// Invalid is the validation error; every agent finds the same.
	Invalid error
	// NotApplied says why this node could not apply the limit, or "".
	NotApplied string
	// Clamped says how this node clamped the limit's share, or "".
	Clamped string
	// AtUplink says why this node enforces a limit meant for its endpoints'
	// interfaces at its uplinks, or "".
	AtUplink string
	// PaceIneffective says why this node's uplinks do not hold a paced
	// limit's packets to their departure times (no fq), or "".
	PaceIneffective string
}

// condition is the Accepted condition v stands for, with its severity
// (higher is worse). The node-specific reasons carry the node's name.
func (v Verdict) condition(node string) (cond map[string]any, severity int) {
	switch {
	case v.Invalid != nil:
		return map[string]any{"status": "False", "reason": v1alpha1.ReasonInvalid, "message": v.Invalid.Error()}, 3
	case v.NotApplied != "":
		return map[string]any{"status": "False", "reason": v1alpha1.ReasonDoesNotFit, "message": nodeMessage(node, v.NotApplied)}, 2
	case v.Clamped != "":
		msg := strings.TrimSuffix(v.Clamped+"; "+v.AtUplink, "; ")
		return map[string]any{"status": "True", "reason": v1alpha1.ReasonClamped, "message": nodeMessage(node, msg)}, 1
	case v.AtUplink != "":
		return map[string]any{"status": "True", "reason": v1alpha1.ReasonEnforcedAtUplink, "message": nodeMessage(node, v.AtUplink)}, 1
	case v.PaceIneffective != "":
		return map[string]any{"status": "True", "reason": v1alpha1.ReasonPaceIneffective, "message": nodeMessage(node, v.PaceIneffective)}, 1
	}
	return map[string]any{"status": "True", "reason": v1alpha1.ReasonValid, "message": ""}, 0
}

func nodeMessage(node, msg string) string { return "node " + node + ": " + msg }

// reasonSeverity ranks a reason as Verdict.condition does; unknown: 0.
func reasonSeverity(reason any) int {
	switch reason {
	case v1alpha1.ReasonInvalid:
		return 3
	case v1alpha1.ReasonDoesNotFit:
		return 2
	case v1alpha1.ReasonClamped, v1alpha1.ReasonEnforcedAtUplink, v1alpha1.ReasonPaceIneffective:
		return 1
	}
	return 0
}

// ReportStatus records on a RateLimit this agent's verdict and the count it
// is divided by, if that differs from what the object says.
//
// Every agent writes, so the writes must converge. Validity and the count
// are the same on every agent. Whether a limit fits is a node's own
// (service-scoped limits differ from node to node), so the condition holds
// the worst report: an agent leaves the recorded condition (and writes only
// the count) when it is about the current generation, not its own node's,
// and more severe than its own, or as severe and another node's; otherwise
// it writes its own. A node that recovers clears its own report, and
// another node that still cannot apply the limit then writes its own. A
// report of a node whose agent is gone stands until the spec changes.
func (k *Kubernetes) ReportStatus(ctx context.Context, name string, v Verdict, replicas int32) error {
	obj, ok, err := k.rlInformer.GetStore().GetByKey(name)
	if err != nil || !ok {
		return err
	}
	cur, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return nil
	}
	gen := cur.GetGeneration()
	mine, severity := v.condition(k.cfg.NodeName)
	mine["type"], mine["observedGeneration"] = v1alpha1.ConditionAccepted, gen

	oldConds, _, _ := unstructured.NestedSlice(cur.Object, "status", "conditions")
	oldReplicas, _, _ := unstructured.NestedInt64(cur.Object, "status", "replicas")
	oldGen, _, _ := unstructured.NestedInt64(cur.Object, "status", "observedGeneration")
	var old map[string]any
	if len(oldConds) == 1 {
		old, _ = oldConds[0].(map[string]any)
	}
	cond := mine
	if old != nil && old["observedGeneration"] == gen {
		msg, _ := old["message"].(string)
		oldSeverity := reasonSeverity(old["reason"])
		nodeSpecific := old["reason"] == v1alpha1.ReasonDoesNotFit || old["reason"] == v1alpha1.ReasonClamped ||
			old["reason"] == v1alpha1.ReasonEnforcedAtUplink || old["reason"] == v1alpha1.ReasonPaceIneffective
		ours := strings.HasPrefix(msg, nodeMessage(k.cfg.NodeName, ""))
		if !ours && (oldSeverity > severity || (oldSeverity == severity && nodeSpecific)) {
			cond = maps.Clone(old) // another node's report of something at least as bad (a copy: old is the cache's)
		}
	}
	if oldReplicas == int64(replicas) && oldGen == gen && old != nil &&
		old["status"] == cond["status"] && old["reason"] == cond["reason"] && old["message"] == cond["message"] &&
		old["observedGeneration"] == cond["observedGeneration"] {
		return nil
	}
	if old == nil || old["status"] != cond["status"] {
		cond["lastTransitionTime"] = metav1.Now().UTC().Format(time.RFC3339)
	} else if t, ok := old["lastTransitionTime"]; ok {
		cond["lastTransitionTime"] = t
	} else {
		cond["lastTransitionTime"] = metav1.Now().UTC().Format(time.RFC3339)
	}
	next := cur.DeepCopy()
	if err := unstructured.SetNestedField(next.Object, int64(replicas), "status", "replicas"); err != nil {
		return err
	}
	if err := unstructured.SetNestedField(next.Object, gen, "status", "observedGeneration"); err != nil {
		return err
	}
	if err := unstructured.SetNestedSlice(next.Object, []any{cond}, "status", "conditions"); err != nil {
		return err
	}
	_, err = k.cfg.Dynamic.Resource(RateLimitResource).UpdateStatus(ctx, next, metav1.UpdateOptions{})
	return err
}
