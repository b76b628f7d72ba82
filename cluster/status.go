package cluster

import (
	"context"
	"fmt"
	"hash/fnv"
	"log/slog"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/demand"
	"github.com/rlagent/rlagent/watcher"
)

// Status in a cluster: one writer, many reporters.
//
// Every agent reports what became of each limit on its node when that is
// not plainly "applied" (it did not fit, it was clamped, it runs at the
// uplinks instead of the endpoints, its pacing has no fq) in its node's
// own Lease (see verdicts.go), and as an Event on the RateLimit for
// people: client-go's event recorder deduplicates repeats into one Event's
// count and rate-limits a node that reports too much. One agent, elected
// with a Lease, writes each RateLimit's status: the count, and the
// Accepted condition, which reflects the worst node report for the current
// generation, read from the nodes' Leases (never from Events, which anyone
// who may create Events in default could forge). Writes then grow with
// the changes, not with the nodes.

// Annotations of a node's Event: who reported, for which generation, and
// when (in Unix nanoseconds). For people and tools; the status writer
// reads the nodes' Leases.
const (
	annotationNode       = "rlagent.io/node"
	annotationGeneration = "rlagent.io/generation"
	annotationReported   = "rlagent.io/reported"
)

// ReasonApplied is a node report that clears an earlier one.
const ReasonApplied = "Applied"

// ReasonAllocationRefused is a node's report that it does not follow the
// demand allocation in the status (a Warning Event; not a condition).
const ReasonAllocationRefused = "AllocationRefused"

// reportEvery is how often a node repeats the Event of a problem that
// lasts. Its Lease's verdicts need no repeating: they stand while the
// Lease does (a node that is gone stops renewing it, and an agent that
// restarts writes its verdicts anew).
const reportEvery = 10 * time.Minute

// Verdict is what one node says of a limit it tried to apply.
type Verdict struct {
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
	// AllocationRefused says why this node does not follow the demand
	// allocation in the limit's status (demand.Check), or "": output for
	// people; it does not change the Accepted condition.
	AllocationRefused string
}

// report is the reason, message and severity (higher is worse) of v;
// reason Applied, severity 0, when there is nothing to say.
func (v Verdict) report() (reason, message string, severity int) {
	switch {
	case v.NotApplied != "":
		return v1alpha1.ReasonDoesNotFit, v.NotApplied, 2
	case v.Clamped != "":
		return v1alpha1.ReasonClamped, joinNotes(v.Clamped, v.AtUplink), 1
	case v.AtUplink != "":
		return v1alpha1.ReasonEnforcedAtUplink, v.AtUplink, 1
	case v.PaceIneffective != "":
		return v1alpha1.ReasonPaceIneffective, v.PaceIneffective, 1
	case v.AllocationRefused != "":
		return ReasonAllocationRefused, v.AllocationRefused, 0
	}
	return ReasonApplied, "", 0
}

func joinNotes(a, b string) string {
	if b == "" {
		return a
	}
	return a + "; " + b
}

// severity ranks a node report's reason as Verdict.report does.
func severity(reason string) int {
	switch reason {
	case v1alpha1.ReasonDoesNotFit:
		return 2
	case v1alpha1.ReasonClamped, v1alpha1.ReasonEnforcedAtUplink, v1alpha1.ReasonPaceIneffective:
		return 1
	}
	return 0
}

// Reporter reports this node's verdicts: in the node's own Lease (Flush),
// which the status writer reads into the Accepted condition, and as Events
// on the RateLimits, for people.
type Reporter struct {
	k           *watcher.Kubernetes
	node        string
	broadcaster record.EventBroadcaster
	recorder    record.EventRecorder

	mu       sync.Mutex
	last     map[string]sent        // Events, by limit name
	verdicts map[string]nodeVerdict // for the Lease: the limits not plainly applied
	written  *string                // the Lease's verdicts as last written (nil: not yet)
}

type sent struct {
	uid        types.UID
	generation int64
	reason     string
	message    string
	at         time.Time
}

// NewReporter returns a Reporter for node; Close stops it.
func NewReporter(k *watcher.Kubernetes) *Reporter {
	b := record.NewBroadcaster()
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: k.Config().Client.CoreV1().Events("")})
	return &Reporter{
		k:           k,
		node:        k.Config().NodeName,
		broadcaster: b,
		recorder:    b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "rlagent", Host: k.Config().NodeName}),
		last:        make(map[string]sent),
		verdicts:    make(map[string]nodeVerdict),
	}
}

// Flush writes this node's verdicts into its Lease if they changed since
// the last write that succeeded (a failed write is tried again by the
// next Flush).
func (r *Reporter) Flush(ctx context.Context) error {
	r.mu.Lock()
	value, err := encodeVerdicts(r.verdicts)
	same := r.written != nil && *r.written == value
	r.mu.Unlock()
	if err != nil || same {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	// A new Lease lasts as long as the demand report's default (two
	// keep-alives of 15 s intervals), until the publisher's write.
	if err := writeVerdicts(ctx, r.k, value, time.Now(), maxReportAge(15*time.Second)); err != nil {
		return err
	}
	r.mu.Lock()
	r.written = &value
	r.mu.Unlock()
	return nil
}

// Close flushes and stops the event broadcaster.
func (r *Reporter) Close() { r.broadcaster.Shutdown() }

// Report records v for the RateLimit obj if it differs from what this node
// last reported for obj's generation, or if a problem was last reported
// reportEvery ago. A node with nothing to report sends nothing, unless it
// reported a problem before (then Applied, which clears it).
func (r *Reporter) Report(obj *v1alpha1.RateLimit, v Verdict, now time.Time) {
	reason, message, sev := v.report()
	r.mu.Lock()
	defer r.mu.Unlock()
	if sev > 0 {
		r.verdicts[obj.GetName()] = nodeVerdict{UID: obj.GetUID(), Generation: obj.GetGeneration(), Reason: reason, Message: message}
	} else {
		delete(r.verdicts, obj.GetName())
	}
	prev, had := r.last[obj.GetName()]
	same := had && prev.uid == obj.GetUID() && prev.generation == obj.GetGeneration()
	switch {
	case reason == ReasonApplied && (!same || prev.reason == ReasonApplied):
		if !same {
			delete(r.last, obj.GetName())
		}
		return // nothing reported for this generation, or already cleared
	case same && prev.reason == reason && prev.message == message && (reason == ReasonApplied || now.Sub(prev.at) < reportEvery):
		return
	}
	r.last[obj.GetName()] = sent{uid: obj.GetUID(), generation: obj.GetGeneration(), reason: reason, message: message, at: now}
	ref := &corev1.ObjectReference{
		APIVersion: v1alpha1.SchemeGroupVersion.String(), Kind: "RateLimit",
		Name: obj.GetName(), UID: obj.GetUID(), ResourceVersion: obj.GetResourceVersion(),
	}
	typ := corev1.EventTypeWarning
	if reason == ReasonApplied || reason == v1alpha1.ReasonEnforcedAtUplink {
		typ = corev1.EventTypeNormal
	}
	if message == "" {
		message = "applied"
	}
	r.recorder.AnnotatedEventf(ref, map[string]string{
		annotationNode:       r.node,
		annotationGeneration: strconv.FormatInt(obj.GetGeneration(), 10),
		annotationReported:   strconv.FormatInt(now.UnixNano(), 10),
	}, typ, reason, "node %s: %s", r.node, message)
}

// Forget drops what was reported of limits no longer present.
func (r *Reporter) Forget(keep func(name string) bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for name := range r.last {
		if !keep(name) {
			delete(r.last, name)
		}
	}
	for name := range r.verdicts {
		if !keep(name) {
			delete(r.verdicts, name)
		}
	}
}

// StatusConfig configures the status writer.
type StatusConfig struct {
	// Namespace and LeaseName are the Lease the candidates elect the writer
	// with (the agents' namespace; default name rlagent-status).
	Namespace string
	LeaseName string
	// Identity is this agent's in the election (its pod's name).
	Identity string
	// Candidates is about how many agents stand for election (default 8):
	// an agent stands if its node's name hashes into a share of
	// Candidates/desired agents of the DaemonSet. Every candidate asks for
	// the Lease every RetryPeriod, so the election's load on the API server
	// stays flat however many nodes there are; the chance that no agent
	// stands is about e^-Candidates.
	Candidates int
	Log        *slog.Logger
}

// StatusWriter writes RateLimit status from the agent that holds the Lease.
type StatusWriter struct {
	k   *watcher.Kubernetes
	cfg StatusConfig
	log *slog.Logger

	mu      sync.Mutex
	leading bool
	queue   workqueue.TypedRateLimitingInterface[string]
	// What the agent's config says (Configure): the count source of the
	// limits of a static scope (nil: none counted yet), and the demand
	// shares' parameters.
	counts watcher.Source
	params v1alpha1.DemandShares

	// While leading: the nodes' Leases (their demand reports and
	// verdicts), and the allocator of each demand-shared limit (used by
	// sync alone).
	leases cache.SharedIndexInformer
	allocs map[string]*demand.Allocator
	// While leading: the leadership's context, and the count of the pods
	// of scope pods (podCounter), started with the first such limit; and
	// the note on the hostNetwork pods the selectors choose, by limit, of
	// the generation it was made for (hostNetworkNote).
	leadCtx context.Context
	pods    *podCounter
	hostNet map[string]hostNetNote
}

// NewStatusWriter returns a writer over k's limits and counts. Run starts it.
func NewStatusWriter(k *watcher.Kubernetes, cfg StatusConfig) *StatusWriter {
	if cfg.LeaseName == "" {
		cfg.LeaseName = "rlagent-status"
	}
	if cfg.Candidates <= 0 {
		cfg.Candidates = 8
	}
	if cfg.Log == nil {
		cfg.Log = k.Config().Log
	}
	if cfg.Namespace == "" {
		cfg.Namespace = k.Config().AgentNamespace
	}
	w := &StatusWriter{k: k, cfg: cfg, log: cfg.Log}
	k.OnChange(w.Changed)
	return w
}

// Configure sets what the writer takes from the agent's config: the count
// source a limit of a static scope is divided by, and the demand shares'
// parameters. The agent calls it when it starts the writer and after every
// reload, so that the writer never calls into the agent.
func (w *StatusWriter) Configure(counts watcher.Source, params v1alpha1.DemandShares) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.counts, w.params = counts, params
}

// candidate reports whether this node stands for election, with desired
// agents in the cluster.
func candidate(node string, desired, candidates int) bool {
	groups := max(1, (desired+candidates-1)/candidates)
	h := fnv.New32a()
	h.Write([]byte(node))
	return h.Sum32()%uint32(groups) == 0
}

// Leading reports whether this agent writes the status now.
func (w *StatusWriter) Leading() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.leading
}

// Changed asks the writer, if leading, to look at every limit again.
func (w *StatusWriter) Changed() {
	w.mu.Lock()
	q := w.queue
	w.mu.Unlock()
	if q == nil {
		return
	}
	limits, _ := w.k.Limits()
	for _, l := range limits {
		q.Add(l.Name)
	}
}

// Run stands for election while this node is a candidate, and writes while
// it leads, until ctx ends.
func (w *StatusWriter) Run(ctx context.Context) {
	var stop context.CancelFunc
	var done chan struct{}
	// Whether to stand is decided locally (the caches, the DaemonSet's
	// desired count): looked at every second, so that the first election
	// begins within a second of the caches' sync.
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		_, desired := w.k.Agents()
		stand := w.k.Synced() && candidate(w.k.Config().NodeName, desired, w.cfg.Candidates)
		switch {
		case stand && stop == nil:
			var ectx context.Context
			ectx, stop = context.WithCancel(ctx)
			done = make(chan struct{})
			go func() { defer close(done); w.elect(ectx) }()
		case !stand && stop != nil:
			stop()
			<-done
			stop = nil
		}
		select {
		case <-ctx.Done():
			if stop != nil {
				stop()
				<-done
			}
			return
		case <-t.C:
		}
	}
}

// elect runs one candidacy: leader election on the Lease until ctx ends.
func (w *StatusWriter) elect(ctx context.Context) {
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: w.cfg.Namespace, Name: w.cfg.LeaseName},
		Client:     w.k.Config().Client.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: w.cfg.Identity},
	}
	for ctx.Err() == nil {
		le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
			Lock:            lock,
			LeaseDuration:   15 * time.Second,
			RenewDeadline:   10 * time.Second,
			RetryPeriod:     2 * time.Second,
			ReleaseOnCancel: true,
			Name:            w.cfg.LeaseName,
			Callbacks: leaderelection.LeaderCallbacks{
				OnStartedLeading: w.lead,
				OnStoppedLeading: func() {},
			},
		})
		if err != nil {
			w.log.Error("status writer election", "error", err)
			return
		}
		le.Run(ctx) // returns when leadership is lost or ctx ends
	}
}

// lead writes status until ctx ends (leadership lost, or stopping).
func (w *StatusWriter) lead(ctx context.Context) {
	w.log.Info("writing RateLimit status (this agent holds the Lease)", "lease", w.cfg.Namespace+"/"+w.cfg.LeaseName)
	queue := workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]())
	// The nodes' Leases, watched only by the agent that writes status: a
	// report changes the allocation of the limits with share demand, and
	// a node's verdicts the Accepted condition of the limits they name.
	leases := cache.NewSharedIndexInformer(cache.NewFilteredListWatchFromClient(
		w.k.Config().Client.CoordinationV1().RESTClient(), "leases", w.cfg.Namespace,
		func(o *metav1.ListOptions) { o.LabelSelector = labelDemand + "=node" },
	), &coordinationv1.Lease{}, 0, cache.Indexers{byLimit: verdictLimits})
	changed := func(objs ...any) {
		limits, _ := w.k.Limits()
		for _, l := range limits {
			if l.Share == v1alpha1.ShareDemand {
				queue.Add(l.Name)
			}
		}
		for _, obj := range objs {
			if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = t.Obj
			}
			if l, ok := obj.(*coordinationv1.Lease); ok {
				for name := range parseVerdicts(l) {
					queue.Add(name)
				}
			}
		}
	}
	leases.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { changed(obj) },
		UpdateFunc: func(old, obj any) { changed(old, obj) },
		DeleteFunc: func(obj any) { changed(obj) },
	})
	go leases.RunWithContext(ctx)
	defer queue.ShutDown()
	if !cache.WaitForCacheSync(ctx.Done(), leases.HasSynced) {
		return
	}
	w.mu.Lock()
	w.leading, w.queue = true, queue
	w.leases, w.allocs = leases, make(map[string]*demand.Allocator)
	w.leadCtx = ctx
	w.mu.Unlock()
	defer func() {
		w.mu.Lock()
		w.leading, w.queue = false, nil
		w.leases, w.allocs = nil, nil
		w.leadCtx, w.pods, w.hostNet = nil, nil, nil
		w.mu.Unlock()
	}()
	w.Changed()
	go func() {
		// The Leases expire: look at every limit again now and then.
		t := time.NewTicker(time.Minute)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				queue.ShutDown()
				return
			case <-t.C:
				w.Changed()
			}
		}
	}()
	for {
		name, quit := queue.Get()
		if quit {
			return
		}
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := w.sync(rctx, queue, leases, name)
		cancel()
		if err != nil {
			n := queue.NumRequeues(name)
			w.log.Log(ctx, writeFailedLevel(err, n), "RateLimit status not written; retrying", "limit", name, "error", err, "retries", n)
			queue.AddRateLimited(name)
		} else {
			queue.Forget(name)
		}
		queue.Done(name)
	}
}

const byLimit = "limit"

// writeFailedLevel is the level a failed status write is logged at, after
// retries earlier attempts for the same RateLimit: a conflict is optimistic
// concurrency at work (the object moved since the informer saw it; the
// retry reads it again), Debug; anything else, or a conflict that keeps
// coming, is for an operator to see, Warn.
func writeFailedLevel(err error, retries int) slog.Level {
	if apierrors.IsConflict(err) && retries < 3 {
		return slog.LevelDebug
	}
	return slog.LevelWarn
}

// sync writes one RateLimit's status if it is not what the writer sees.
func (w *StatusWriter) sync(ctx context.Context, queue workqueue.TypedRateLimitingInterface[string],
	leases cache.SharedIndexInformer, name string) error {
	cur, err := w.k.RateLimits().Get(name)
	if apierrors.IsNotFound(err) {
		w.mu.Lock()
		if c := w.pods; c != nil {
			c.pods.forget(func(n string) bool { return n != name })
		}
		delete(w.hostNet, name)
		w.mu.Unlock()
		return nil // deleted: nothing to write
	}
	if err != nil {
		return err
	}
	old := &cur.Status
	next := old.DeepCopy()
	gen := cur.GetGeneration()
	next.ObservedGeneration = gen
	cond := metav1.Condition{Type: v1alpha1.ConditionAccepted, ObservedGeneration: gen}

	limits, invalid := w.k.Limits()
	i := slices.IndexFunc(limits, func(l v1alpha1.Limit) bool { return l.Name == name })
	switch {
	case invalid[name] != nil:
		cond.Status, cond.Reason, cond.Message = metav1.ConditionFalse, v1alpha1.ReasonInvalid, invalid[name].Error()
	case i >= 0 && limits[i].Unit == v1alpha1.UnitRequests:
		// No node installs it: no node reports on it.
		cond.Status, cond.Reason, cond.Message = metav1.ConditionTrue, v1alpha1.ReasonEnforcedInProcess, inProcessMessage(&limits[i].RateLimitSpec)
	default:
		cond.Status, cond.Reason, cond.Message = w.accepted(leases, cur, time.Now())
		if i >= 0 && limits[i].Scope == v1alpha1.ScopePods {
			cond.Message = joinNotes(cond.Message, w.hostNetworkNote(ctx, &limits[i], cur.GetUID(), gen))
			cond.Message = strings.TrimPrefix(cond.Message, "; ")
		}
	}
	// The count, also of a limit the agents reject: it says what the
	// limit would be divided by.
	if i >= 0 {
		l := limits[i]
		var n int
		switch l.Scope {
		case v1alpha1.ScopeNodes, v1alpha1.ScopeService:
			n = w.k.Observe(name).Replicas
		case v1alpha1.ScopePods:
			// This writer's own count: the agents divide by it. Until
			// the pods are listed, the count stands as it is.
			n = int(old.Replicas)
			if c := w.podCounter(); c != nil {
				if counted, ok := c.count(&l); ok {
					n = counted
				}
			}
		default:
			w.mu.Lock()
			counts := w.counts
			w.mu.Unlock()
			if counts != nil {
				n = counts.Observe(name).Replicas
			}
		}
		next.Replicas = int32(max(n, 0))
	}
	var round *demand.Allocation
	if i >= 0 && limits[i].Share == v1alpha1.ShareDemand && invalid[name] == nil {
		if r, ok := w.allocate(queue, leases, limits[i], old.Allocation, next); ok {
			round = &r
		}
	} else {
		next.Allocation = nil
		w.mu.Lock()
		delete(w.allocs, name)
		w.mu.Unlock()
	}
	meta.SetStatusCondition(&next.Conditions, cond)
	if equality.Semantic.DeepEqual(old, next) {
		return nil
	}
	upd := cur.DeepCopy()
	upd.Status = *next
	if _, err = w.k.Config().RateLimits.RlagentV1alpha1().RateLimits().UpdateStatus(ctx, upd, metav1.UpdateOptions{}); err != nil {
		return err
	}
	if round != nil {
		w.published(name, *round)
		if a := next.Allocation; a != nil && len(a.Keys) > 0 {
			w.log.Debug("keyed allocation written", "limit", name, "round", a.Round, "floor", a.Floor, "nodes", a.Nodes, "keys", len(a.Keys))
		}
	}
	return nil
}

// allocate computes the round of a demand-shared limit that is due now,
// if one is, into next.Allocation, and returns it to be recorded once
// written (published). It has the limit looked at again when the same
// inputs would make a round, or a report will start to count.
func (w *StatusWriter) allocate(queue workqueue.TypedRateLimitingInterface[string], leases cache.SharedIndexInformer,
	l v1alpha1.Limit, last *v1alpha1.Allocation, next *v1alpha1.RateLimitStatus) (demand.Allocation, bool) {
	p := w.demandParams()
	// To the microsecond, as the status holds it: the nodes apply Counted
	// to the time they read.
	now := time.Now().Truncate(time.Microsecond)
	var nodes []demand.NodeReport
	for _, obj := range leases.GetStore().List() {
		lease, ok := obj.(*coordinationv1.Lease)
		if !ok {
			continue
		}
		if lease.Namespace != w.cfg.Namespace {
			continue
		}
		nd, ok, err := parseDemandLease(lease, now, maxReportAge(p.Interval.Duration))
		if err != nil {
			w.log.Debug("demand lease not read", "error", err)
			continue
		}
		if ok {
			nodes = append(nodes, nd)
		}
	}
	// Rounds, and the lag of a report, are half the report interval: a
	// change is served in about a report interval (the lag, then the
	// release round), and writes stay at most two a report interval.
	round := p.Interval.Duration / 2
	var (
		level       demand.Level
		fingerprint uint64
		counted     int
		asked       uint64
		countable   time.Time
		keys        []demand.KeyLevel
	)
	if l.Key == v1alpha1.KeyNone {
		in := demand.Round(nodes, l.Name, l.Rate, *p.FloorPerMille, int(next.Replicas), now, round)
		level, fingerprint, counted, asked, countable = in.Level, in.Fingerprint, len(in.Demands), in.Asked, in.Countable
	} else {
		// Each key a round of its own: the limit's level is the keys'
		// floor alone (a key not listed is at its equal share).
		in := demand.KeyRound(canonicalKeys(nodes, &l), l.Name, l.Rate, *p.FloorPerMille, int(next.Replicas), l.HotKeyLimit(), now, round)
		level = demand.Level{Water: math.MaxUint64, Floor: in.Floor}
		fingerprint, counted, asked, countable, keys = in.Fingerprint, in.Nodes, in.Asked, in.Countable, in.Keys
	}

	w.mu.Lock()
	a := w.allocs[l.Name]
	if a == nil {
		a = &demand.Allocator{}
		if last != nil {
			a.Resume(watcher.AllocationOf(last))
		}
		w.allocs[l.Name] = a
	}
	a.Interval, a.KeepAlive = round, p.StaleAfter.Duration/3
	r, write, again := a.Next(level, fingerprint, now)
	if counted == 0 {
		// No node counted yet (a new limit: the first reports are on
		// their way): the nodes keep what they enforce until a round
		// counts some.
		write, again = false, time.Time{}
	}
	w.mu.Unlock()

	wake := again
	if write {
		wake = now.Add(round) // the round that releases its increases
	}
	if !countable.IsZero() && (wake.IsZero() || countable.Before(wake)) {
		wake = countable
	}
	if !wake.IsZero() {
		queue.AddAfter(l.Name, time.Until(wake)+10*time.Millisecond)
	}
	if !write {
		return demand.Allocation{}, false
	}
	next.Allocation = allocationStatus(r, counted, asked, keys)
	return r, true
}

// canonicalKeys is nodes with l's hot keys in their canonical form
// (v1alpha1.RateLimitSpec.CanonicalKey), those that are not keys of l left
// out: a node's report, read from its own Lease, must not put into the
// status what the schema or the other nodes cannot take. A key reported
// twice in two forms counts once, with the higher demand.
func canonicalKeys(nodes []demand.NodeReport, l *v1alpha1.Limit) []demand.NodeReport {
	canon := func(keys map[string]uint64) map[string]uint64 {
		if keys == nil {
			return nil
		}
		out := make(map[string]uint64, len(keys))
		for k, d := range keys {
			if c, err := l.CanonicalKey(k); err == nil {
				out[c] = max(out[c], d)
			}
		}
		return out
	}
	out := make([]demand.NodeReport, len(nodes))
	for i, n := range nodes {
		out[i] = n
		out[i].Keys, out[i].PrevKeys = nil, nil
		if ks, ok := n.Keys[l.Name]; ok {
			out[i].Keys = map[string]map[string]uint64{l.Name: canon(ks)}
		}
		if ks, ok := n.PrevKeys[l.Name]; ok {
			out[i].PrevKeys = map[string]map[string]uint64{l.Name: canon(ks)}
		}
	}
	return out
}

// published records a round written to a limit's status.
func (w *StatusWriter) published(name string, r demand.Allocation) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if a := w.allocs[name]; a != nil {
		a.Published(r)
	}
}

// demandParams are the demand shares' parameters, defaulted.
func (w *StatusWriter) demandParams() v1alpha1.DemandShares {
	w.mu.Lock()
	p := w.params
	w.mu.Unlock()
	p.Default()
	return p
}

// inProcessMessage is the Accepted condition's message of a valid limit
// with unit requests.
func inProcessMessage(s *v1alpha1.RateLimitSpec) string {
	if s.Scope == v1alpha1.ScopeService {
		return fmt.Sprintf("unit requests: enforced per request by the limiter library in the processes of Service %s, each taking rate / its ready endpoints; no node installs it", s.Match.Service)
	}
	return "unit requests: enforced per request by the limiter library in the processes that name it; no node installs it"
}

// accepted is the Accepted condition of a valid limit from the verdicts
// of its current generation in the nodes' Leases (a Lease counts as
// parseDemandLease accepts it: its node's own, not expired): the worst one
// stands (ties: the first node by name), with how many other nodes report
// a problem.
func (w *StatusWriter) accepted(leases cache.SharedIndexInformer, rl *v1alpha1.RateLimit, now time.Time) (metav1.ConditionStatus, string, string) {
	p := w.demandParams()
	type report struct{ node, reason, message string }
	var reports []report
	objs, _ := leases.GetIndexer().ByIndex(byLimit, rl.GetName())
	for _, obj := range objs {
		l, ok := obj.(*coordinationv1.Lease)
		if !ok || l.Namespace != w.cfg.Namespace {
			continue
		}
		node, ok := nodeOf(l, now, maxReportAge(p.Interval.Duration))
		if !ok {
			continue
		}
		v, ok := parseVerdicts(l)[rl.GetName()]
		if !ok || v.UID != rl.GetUID() || v.Generation != rl.GetGeneration() || severity(v.Reason) == 0 {
			continue
		}
		reports = append(reports, report{node, v.Reason, v.Message})
	}
	slices.SortFunc(reports, func(a, b report) int { return strings.Compare(a.node, b.node) })
	var worst *report
	others := 0
	for i := range reports {
		r := &reports[i]
		if worst == nil || severity(r.reason) > severity(worst.reason) {
			if worst != nil {
				others++
			}
			worst = r
		} else {
			others++
		}
	}
	if worst == nil {
		return metav1.ConditionTrue, v1alpha1.ReasonValid, ""
	}
	msg := fmt.Sprintf("node %s: %s", worst.node, worst.message)
	if others > 0 {
		msg += fmt.Sprintf(" (and %d more node(s); see the RateLimit's events)", others)
	}
	status := metav1.ConditionTrue
	if worst.reason == v1alpha1.ReasonDoesNotFit {
		status = metav1.ConditionFalse
	}
	return status, worst.reason, msg
}
