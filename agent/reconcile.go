package agent

import (
	"errors"
	"fmt"
	stdmaps "maps"
	"time"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/maps"
	"github.com/rlagent/rlagent/watcher"
)

// reconcile makes the maps hold cfg's limits divided by the current
// counts, and writes only what changed: gather -> plan -> apply (see
// applier.apply for the order and the isolation of limits), then the hooks
// follow. Callers hold a.mu.
//
// A limit that does not fit is not an error of the reconcile: the error
// reports failures to write the maps, which no config can fix.
func (a *Agent) reconcile() error {
	a.refreshUplinks()
	if a.k8s != nil && !a.k8s.Synced() {
		// Until the caches hold the cluster's limits, what the pins hold
		// stands: an empty cache must not delete every limit.
		return nil
	}
	a.stepDemand(time.Now())
	in := a.gather()
	defer func() {
		// What the maps hold now runs where it must; the hooks nothing
		// needs any more go.
		a.syncLinks(a.placements(a.appliedLimits(), a.ap.points()), true)
	}()

	var errs []error
	// The node's reply budget, before any limit with action reject can
	// spend it; a budget that cannot be written stops no limit.
	if b := a.cfg.RejectBudget; b.Rate != nil && b.Burst != nil {
		rb := maps.RejectBudget{PerSecond: *b.Rate, Burst: *b.Burst}
		if d := b.PerDestination; d.Rate != nil && d.Burst != nil {
			rb.PerDestination = maps.ReplyRate{PerSecond: *d.Rate, Burst: *d.Burst}
		}
		if err := a.dp.SetRejectBudget(rb); err != nil {
			errs = append(errs, fmt.Errorf("rejectBudget: %w", err))
		}
	}
	check := maps.SourceCount
	if a.cfg.EndpointSourceCheck == v1alpha1.SourceCheckDrop {
		check = maps.SourceDrop
	}
	if err := a.dp.SetSourceCheck(check); err != nil {
		errs = append(errs, fmt.Errorf("endpointSourceCheck: %w", err))
	}
	// The hot-key tick of the keyed demand-shared limits.
	if err := a.dp.SetHotTick(hotShift(a.demandParams().Interval.Duration)); err != nil {
		errs = append(errs, fmt.Errorf("demandShares.interval: %w", err))
	}
	// Before a limit reaches its hook, its program runs there: a limit
	// that moves to its endpoints (or gets a new one) is never written to
	// a hook where nothing enforces it.
	err := a.ap.apply(in, func(limits []maps.Limit, points []placement) {
		a.syncLinks(a.placements(limits, points), false)
	})
	return errors.Join(append(errs, err)...)
}

// gather collects what plan decides from: the limits, their counts, the
// endpoints and the data path's ids. It is the reconcile's only reading of
// the world (the attacher's lookups of the endpoints included). Callers
// hold a.mu.
func (a *Agent) gather() *planInputs {
	in := &planInputs{
		limits:       a.limits(),
		obs:          make(map[string]watcher.Observation),
		service:      make(map[string]serviceEndpoints),
		endpointHook: a.cfg.EndpointHook,
		countFile:    a.cfg.Count.File != "",
		demand:       make(map[string]uint64, len(a.demand)),
		keyShares:    make(map[string]map[string]uint64),
	}
	for i := range in.limits {
		l := &in.limits[i]
		in.obs[l.Name] = a.observe(l)
		if (l.Scope == v1alpha1.ScopeService || l.Scope == v1alpha1.ScopePods) && a.k8s != nil {
			var se serviceEndpoints
			se.local, se.ports = a.k8s.LocalEndpoints(l.Name)
			in.service[l.Name] = se
		}
	}
	for name, st := range a.demand {
		if st.keys != nil {
			in.keyShares[name] = stdmaps.Clone(st.shares)
			continue
		}
		in.demand[name] = st.node.Now()
	}
	// The endpoints of the versions enforced are looked up too (apply
	// re-divides them).
	in.enforced = a.ap.enforcedVersions(in.limits)
	if addrs, wide := endpointQueries(in); len(addrs) > 0 || len(wide) > 0 {
		in.endpoints = a.findEndpoints(addrs, wide)
	}
	return in
}

// limits are the limits to enforce: the config file's, or in a cluster the
// RateLimit objects the agent accepts.
func (a *Agent) limits() []v1alpha1.Limit {
	if a.k8s == nil {
		return a.cfg.Limits
	}
	all, invalid := a.k8s.Limits()
	out := all[:0:0]
	for _, l := range all {
		if err, bad := invalid[l.Name]; bad {
			if msg := err.Error(); a.warned["invalid/"+l.Name] != msg {
				a.log.Warn("RateLimit rejected", "limit", l.Name, "error", err)
				a.warned["invalid/"+l.Name] = msg
			}
			continue
		}
		out = append(out, l)
	}
	return out
}

// observe returns the count a limit is divided by: from the cluster for the
// nodes and service scopes, from the configured count source otherwise.
func (a *Agent) observe(l *v1alpha1.Limit) watcher.Observation {
	if a.k8s != nil && (l.Scope == v1alpha1.ScopeNodes || l.Scope == v1alpha1.ScopeService || l.Scope == v1alpha1.ScopePods) {
		return a.k8s.Observe(l.Name)
	}
	return a.source.Observe(l.Name)
}

// snapshot records each limit's counters, for status to compute rates.
// What it writes is the previous tick's reading, so that status always
// divides by 1 to 2 seconds of traffic, never by a fresh, near-zero interval.
//
// It also feeds the demand-shared limits' meters, and steps their shares;
// it reports whether a share changed (a reconcile is due).
func (a *Agent) snapshot() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := time.Now()
	metas, err := a.dp.Metas()
	if err != nil {
		a.logOnce("snapshot metas", "read the limits' metadata for their counters", "error", err)
	}
	set := make(map[uint32]bool)
	for _, id := range a.dp.IDs() {
		set[id] = true
	}
	limits := make(map[string]*v1alpha1.Limit)
	for _, l := range a.limits() {
		limits[l.Name] = &l
	}
	for id, m := range metas {
		// A limit without an entry (rejected) has no counters, but its
		// observation ages all the same.
		if set[id] {
			st, err := a.dp.Stats(id)
			if err != nil {
				continue
			}
			if prev, ok := a.pending[id]; ok {
				m.SnapAt, m.SnapAdmitted, m.SnapDropped, m.SnapShadow = prev.at, prev.admitted, prev.dropped, prev.shadow
			}
			a.pending[id] = counterSnap{now, st.AdmittedPackets, st.DroppedPackets, st.ShadowPackets}
			a.observeDemand(m.Name, limits[m.Name], st, now)
		}
		// The observation age moves on its own; refresh it with the counts.
		obs := a.source.Observe(m.Name)
		if l := limits[m.Name]; l != nil {
			obs = a.observe(l)
		}
		m.Observed, m.Stale = obs.At, obs.Err != nil
		a.dp.SetMeta(id, m) // the next tick writes it again
	}
	for id := range a.pending {
		if !set[id] {
			delete(a.pending, id) // its limit went
		}
	}
	return a.stepDemand(now)
}

type counterSnap struct {
	at                        time.Time
	admitted, dropped, shadow uint64
}

// readStatus is the metrics collector's view: the buckets' counts as
// a.keys last read them (keyCountEvery).
func (a *Agent) readStatus() ([]LimitStatus, maps.GlobalStats, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := time.Now()
	keys, created, err := a.keys.get(a.dp.Reader(), now)
	if err != nil {
		return nil, maps.GlobalStats{}, err
	}
	st, err := readStatusKeys(a.dp.Reader(), now, keys, created)
	if err != nil {
		return nil, maps.GlobalStats{}, err
	}
	// Limits that got no id have no metadata in the pins: only the agent
	// knows them.
	for name, o := range a.ap.outcomes {
		if o.id == noID {
			st = append(st, LimitStatus{
				Name: name, ID: noID, Scope: scopeName(o.meta.Scope), State: o.state.String(), Note: o.note,
				GlobalRate: o.meta.GlobalRate, GlobalBurst: o.meta.GlobalBurst, Replicas: o.meta.Replicas, Local: o.meta.Local,
				ObservationAge: observationAge(o.meta, now), Stale: o.meta.Stale,
			})
		}
	}
	g, err := a.dp.GlobalStats()
	return st, g, err
}
