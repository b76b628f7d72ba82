package agent

import (
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"time"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/maps"
	"github.com/rlagent/rlagent/watcher"
)

// outcome is what became of a limit at the last reconcile: what status,
// the metrics and the RateLimit's condition report, and what is enforced.
type outcome struct {
	id       uint32
	state    maps.MetaState
	note     string
	enforced *v1alpha1.Limit
	meta     maps.Meta // as recorded (for a limit with no id, only here)
	// full is the version the prefix tables last had no room for (and
	// fullErr why): it is not tried again until room is freed.
	full    *maps.Limit
	fullErr error
	// points are the endpoint hooks the limit runs at.
	points []placement
	// atUplink says why a limit meant for the endpoints' interfaces runs
	// at the uplinks instead, or "".
	atUplink string
}

// reconcile makes the maps hold cfg's limits divided by the current
// counts, and writes only what changed. Callers hold a.mu.
//
// Each limit is checked and installed alone: one that does not fit the data
// path (no free id, more prefixes than its tables hold) is reported and
// skipped, and the others are applied all the same; a share above the data
// path's range is clamped and reported. A limit whose new version does not
// fit keeps its previous version (re-divided by the current count when the
// agent knows it), so a change never leaves traffic unlimited. Limits claim
// room in a fixed order: those in the data path first, by id, then the
// others by id (new limits get ids in name order), so the ones that no
// longer fit are always the last comers.
//
// A limit that does not fit is not an error of the reconcile: the error
// reports failures to write the maps, which no config can fix.
func (a *Agent) reconcile() error {
	if a.k8s != nil && !a.k8s.Synced() {
		// Until the caches hold the cluster's limits, what the pins hold
		// stands: an empty cache must not delete every limit.
		return nil
	}
	if a.outcomes == nil {
		a.outcomes = make(map[string]*outcome)
	}
	a.stepDemand(time.Now())
	in := a.gather()
	desired := plan(in)
	defer func() {
		// What the maps hold now runs where it must; the hooks nothing
		// needs any more go.
		a.syncLinks(a.placements(a.appliedLimits(), a.outcomePoints()), true)
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
	// What is no longer desired goes first, entry and metadata, whether it
	// was applied or only reported: it leaves nothing behind, and its room
	// is free for the limits below.
	keep := make(map[uint32]bool, len(desired))
	for _, d := range desired {
		if d.id != noID {
			keep[d.id] = true
		}
	}
	var p pass
	for _, id := range a.knownIDs() {
		if !keep[id] {
			if err := a.remove(id); err != nil {
				errs = append(errs, err)
				continue
			}
			p.freed = true
		}
	}
	if p.freed && slices.ContainsFunc(desired, func(d *desiredLimit) bool { return d.id == noID }) {
		// The ids just freed are free now (their limits' buckets and
		// counters are gone): the limits that found none take them.
		a.gatherIDs(in)
		desired = plan(in)
	}
	// Before a limit reaches its hook, its program runs there: a limit
	// that moves to its endpoints (or gets a new one) is never written to
	// a hook where nothing enforces it.
	limits, points := a.appliedLimits(), a.outcomePoints()
	for _, d := range desired {
		if d.unfit == nil {
			limits = append(limits, d.limit)
			points = append(points, d.points...)
		}
	}
	a.syncLinks(a.placements(limits, points), false)

	// Changes that need no new room in the prefix tables (count changes
	// above all) first, then those that do, each pass in the plan's order:
	// a limit that grows is checked against tables where the others have
	// already shrunk, and before any limit that comes after it.
	grows := make([]bool, len(desired))
	for i, d := range desired {
		grows[i] = a.grows(d)
	}
	for _, growing := range []bool{false, true} {
		for i, d := range desired {
			if grows[i] != growing {
				continue
			}
			if err := a.install(d, &p); err != nil {
				errs = append(errs, err)
			}
		}
	}
	inPlan := make(map[string]bool, len(desired))
	for _, d := range desired {
		inPlan[d.name] = true
		if err := a.record(d); err != nil {
			errs = append(errs, err)
		}
	}
	for name := range a.outcomes {
		if !inPlan[name] {
			delete(a.outcomes, name)
		}
	}
	return errors.Join(errs...)
}

// knownIDs are the ids the agent has given out or written: names, entries
// and metadata.
func (a *Agent) knownIDs() []uint32 {
	seen := make(map[uint32]bool, len(a.applied)+len(a.meta)+len(a.ids))
	for id := range a.applied {
		seen[id] = true
	}
	for id := range a.meta {
		seen[id] = true
	}
	for _, id := range a.ids {
		seen[id] = true
	}
	ids := make([]uint32, 0, len(seen))
	for id := range seen {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// remove deletes the limit with this id: its entry if it has one, and its
// metadata in any case.
func (a *Agent) remove(id uint32) error {
	if _, ok := a.applied[id]; ok {
		// DeleteLimit clears the metadata too.
		if err := a.dp.DeleteLimit(id); err != nil && !errors.Is(err, maps.ErrUnknownLimit) {
			return err
		}
	} else if err := a.dp.SetMeta(id, maps.Meta{}); err != nil {
		return err
	}
	for name, nid := range a.ids {
		if nid == id {
			delete(a.ids, name)
			a.log.Info("limit removed", "limit", name)
		}
	}
	delete(a.applied, id)
	delete(a.meta, id)
	delete(a.pending, id)
	return nil
}

// grows reports whether installing d may need room the data path's prefix
// tables do not give it now: a new limit, or one whose prefixes are not all
// among those it has.
func (a *Agent) grows(d *desiredLimit) bool {
	cur, ok := a.applied[d.id]
	if !ok {
		return true
	}
	return !subset(d.limit.Match.SrcCIDRs, cur.Match.SrcCIDRs) || !subset(d.limit.Match.DstCIDRs, cur.Match.DstCIDRs)
}

func subset(ps, of []netip.Prefix) bool {
	for _, p := range ps {
		if !slices.Contains(of, p) {
			return false
		}
	}
	return true
}

// pass is one reconcile's bookkeeping.
type pass struct {
	// freed: a limit left the data path or changed its match in this pass,
	// so the prefix tables may have room they had not when a limit was last
	// found not to fit. Until then, what did not fit still does not (the
	// tables only gained prefixes), and is not tried again: a count change
	// does not pay a classifier build per rejected limit.
	freed bool
}

// install writes d's entry if it changed. If it cannot, an installed limit
// keeps its previous version: re-divided by the current count when its spec
// is known, else as it is. The error is a failed map write only: a limit
// that does not fit is reported in d, not returned.
func (a *Agent) install(d *desiredLimit, p *pass) error {
	cur, installed := a.applied[d.id]
	if d.id == noID {
		return nil
	}
	o := a.outcomes[d.name]
	err := d.unfit
	if err == nil {
		if installed && reflect.DeepEqual(cur, d.limit) {
			d.enforced = d.source
			return nil
		}
		err = d.limit.Validate()
	}
	var writeErr error
	switch {
	case err != nil:
	case o != nil && o.full != nil && !p.freed && samePrefixes(o.full, &d.limit):
		d.full, err = o.full, o.fullErr // the same prefixes, no more room
	default:
		if err = a.set(p, d.id, d.name, d.limit, d.meta); err == nil {
			d.enforced = d.source
			return nil
		}
		if errors.Is(err, maps.ErrTableFull) {
			if inner := errors.Unwrap(err); inner != nil {
				err = inner // without SetLimit's "set limit ID: "
			}
			d.full = &d.limit
		} else {
			// Not a limit that does not fit: the write failed, and
			// SetLimit left the previous version, if any, as it was.
			writeErr = fmt.Errorf("limit %s: %w", d.name, err)
		}
	}
	d.fullErr = err
	d.state = maps.Rejected
	switch {
	case writeErr != nil:
		d.note = "not applied: " + err.Error()
	case installed:
		d.note = "this version does not fit, the previous one stays enforced: " + err.Error()
	default:
		d.note = "does not fit: " + err.Error()
	}
	if !installed {
		return writeErr
	}
	if writeErr == nil && o != nil && o.enforced != nil && !reflect.DeepEqual(o.enforced, d.source) {
		// The previous version, divided by the current count.
		if prev := d.prev; prev != nil && prev.unfit == nil && prev.limit.Validate() == nil &&
			(reflect.DeepEqual(cur, prev.limit) || a.set(p, d.id, d.name, prev.limit, prev.meta) == nil) {
			d.meta, d.enforced = prev.meta, o.enforced
			return nil
		}
	}
	// As it is: the previous version with its last share.
	if m, ok := a.meta[d.id]; ok {
		d.meta = m
	}
	if o != nil {
		d.enforced = o.enforced
	}
	return writeErr
}

// samePrefixes reports whether two limits have the same source and
// destination prefixes: all that decides whether a limit fits the prefix
// tables.
func samePrefixes(x, y *maps.Limit) bool {
	return slices.Equal(x.Match.SrcCIDRs, y.Match.SrcCIDRs) && slices.Equal(x.Match.DstCIDRs, y.Match.DstCIDRs)
}

// set writes l as the entry of the limit with this id.
func (a *Agent) set(p *pass, id uint32, name string, l maps.Limit, m maps.Meta) error {
	old, had := a.applied[id]
	if err := a.dp.SetLimit(id, l); err != nil {
		return err
	}
	if had && !reflect.DeepEqual(old.Match, l.Match) {
		p.freed = true
	}
	a.applied[id] = l
	a.log.Info("limit set", "limit", name, "replicas", m.Replicas,
		"share_rate", l.Rate, "share_burst", l.Burst, "global_rate", m.GlobalRate)
	return nil
}

// record writes d's metadata, logs a change of what became of it once, and
// keeps it for status and the RateLimit's condition.
func (a *Agent) record(d *desiredLimit) error {
	if d.id == noID {
		d.state, d.note = maps.Rejected, "does not fit: "+d.unfit.Error()
	}
	m := d.meta
	m.State, m.Note = d.state, d.note
	o, seen := a.outcomes[d.name]
	if !seen {
		o = &outcome{}
		a.outcomes[d.name] = o
	}
	if !seen || o.state != d.state || o.note != d.note {
		_, kept := a.applied[d.id]
		switch {
		case d.state == maps.Rejected && kept:
			a.log.Warn("limit change not applied; the previous version stays enforced", "limit", d.name, "reason", d.note)
		case d.state == maps.Rejected:
			a.log.Warn("limit not applied", "limit", d.name, "reason", d.note)
		case d.state == maps.Clamped:
			a.log.Warn("limit clamped", "limit", d.name, "reason", d.note)
		case seen && o.state != maps.Applied:
			a.log.Info("limit applied as configured", "limit", d.name)
		}
	}
	o.id, o.state, o.note, o.enforced, o.meta = d.id, d.state, d.note, d.enforced, m
	o.full, o.fullErr = d.full, d.fullErr
	o.points, o.atUplink = d.points, d.atUplink
	if d.warn != a.warned[d.name] {
		if d.warn != "" {
			a.log.Warn(d.warn, "limit", d.name, "replicas", d.meta.Replicas, "share_rate", d.limit.Rate)
		}
		a.warned[d.name] = d.warn
	}
	if d.id == noID {
		return nil
	}
	a.ids[d.name] = d.id
	// The counter snapshot is the snapshot loop's.
	prev, had := a.meta[d.id]
	m.SnapAt, m.SnapAdmitted, m.SnapDropped, m.SnapShadow = prev.SnapAt, prev.SnapAdmitted, prev.SnapDropped, prev.SnapShadow
	if had && prev == m {
		return nil
	}
	if err := a.dp.SetMeta(d.id, m); err != nil {
		return err
	}
	a.meta[d.id] = m
	return nil
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
		enforced:     make(map[string]*v1alpha1.Limit),
	}
	for i := range in.limits {
		l := &in.limits[i]
		in.obs[l.Name] = a.observe(l)
		if l.Scope == v1alpha1.ScopeService && a.k8s != nil {
			var se serviceEndpoints
			se.local, se.ports = a.k8s.LocalEndpoints(l.Name)
			in.service[l.Name] = se
		}
		if o := a.outcomes[l.Name]; o != nil && o.enforced != nil && !reflect.DeepEqual(o.enforced, l) {
			in.enforced[l.Name] = o.enforced
		}
	}
	for name, st := range a.demand {
		in.demand[name] = st.node.Now()
	}
	a.gatherIDs(in)
	if addrs, wide := endpointQueries(in); len(addrs) > 0 || len(wide) > 0 {
		in.endpoints = a.findEndpoints(addrs, wide)
	}
	return in
}

// gatherIDs sets in's id assignment from what the agent gave out and the
// data path holds. Callers hold a.mu.
func (a *Agent) gatherIDs(in *planInputs) {
	in.ids = make(map[string]uint32, len(a.ids))
	for name, id := range a.ids {
		in.ids[name] = id
	}
	in.taken = make(map[uint32]bool, len(a.applied)+len(a.meta)+len(a.ids))
	in.installed = make(map[uint32]bool, len(a.applied))
	for id := range a.applied {
		in.taken[id], in.installed[id] = true, true
	}
	for id := range a.meta {
		in.taken[id] = true
	}
	for _, id := range a.ids {
		in.taken[id] = true
	}
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
	if a.k8s != nil && (l.Scope == v1alpha1.ScopeNodes || l.Scope == v1alpha1.ScopeService) {
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
	for id, m := range a.meta {
		// A limit without an entry (rejected) has no counters, but its
		// observation ages all the same.
		if _, set := a.applied[id]; set {
			st, err := a.dp.Stats(id)
			if err != nil {
				continue
			}
			if prev, ok := a.pending[id]; ok {
				m.SnapAt, m.SnapAdmitted, m.SnapDropped, m.SnapShadow = prev.at, prev.admitted, prev.dropped, prev.shadow
			}
			a.pending[id] = counterSnap{now, st.AdmittedPackets, st.DroppedPackets, st.ShadowPackets}
			a.observeDemand(m.Name, st, now)
		}
		// The observation age moves on its own; refresh it with the counts.
		obs := a.observeName(m.Name)
		m.Observed, m.Stale = obs.At, obs.Err != nil
		if err := a.dp.SetMeta(id, m); err == nil {
			a.meta[id] = m
		}
	}
	return a.stepDemand(now)
}

type counterSnap struct {
	at                        time.Time
	admitted, dropped, shadow uint64
}

// readStatus is the metrics collector's view.
func (a *Agent) readStatus() ([]LimitStatus, maps.GlobalStats, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := time.Now()
	st, err := readStatus(a.dp.Reader(), now)
	if err != nil {
		return nil, maps.GlobalStats{}, err
	}
	// Limits that got no id have no metadata in the pins: only the agent
	// knows them.
	for name, o := range a.outcomes {
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

// observeName is observe for a limit known by name only.
func (a *Agent) observeName(name string) watcher.Observation {
	for _, l := range a.limits() {
		if l.Name == name {
			return a.observe(&l)
		}
	}
	return a.source.Observe(name)
}

// pinnedIDs are the ids an earlier agent left in the pins: the limits set,
// and those it recorded without an entry (limits it could not apply), whose
// metadata the first reconcile rewrites or removes. If the metadata cannot
// be listed, only the limits set.
func pinnedIDs(dp *maps.Datapath) []uint32 {
	ids := dp.IDs()
	meta, err := dp.MetaIDs()
	if err != nil {
		return ids
	}
	for _, id := range meta {
		if !slices.Contains(ids, id) {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	return ids
}
