package agent

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"reflect"
	"slices"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/maps"
)

// limitStore is the data path as the applier sees it: the limits' entries
// and their metadata. *maps.Datapath is one; tests use an in-memory one
// that passes the same contract (store_test.go).
type limitStore interface {
	// IDs lists the ids that have an entry, and Limit reads one.
	IDs() []uint32
	Limit(id uint32) (maps.Limit, error)
	// SetLimit writes an entry: all of it, or nothing (a limit the prefix
	// tables have no room for fails with maps.ErrTableFull and leaves the
	// previous entry as it was).
	SetLimit(id uint32, l maps.Limit) error
	// DeleteLimit removes an entry and its metadata; an id without an
	// entry is maps.ErrUnknownLimit.
	DeleteLimit(id uint32) error
	// Metas reads the metadata of every id that names a limit, in one
	// batch; SetMeta writes one (a zero Meta clears it).
	Metas() (map[uint32]maps.Meta, error)
	SetMeta(id uint32, m maps.Meta) error
	// KeyShares reads the keys of a keyed limit that have a share of
	// their own, and SetKeyShares makes them the given ones (the
	// decreases first, should it fail midway); an entry whose key kind
	// changes loses them.
	KeyShares(id uint32) (map[maps.Bucket]maps.KeyShare, error)
	SetKeyShares(id uint32, shares map[maps.Bucket]maps.KeyShare) error
}

// applier applies plans to a limitStore: it compares each limit of the plan
// with what the store holds, read afresh at every pass (no copy of it is
// kept between passes), and writes the difference in the order isolation
// needs. It keeps what became of each limit (outcomes), which the store
// cannot say for a limit that got no id.
type applier struct {
	store limitStore
	log   *slog.Logger
	// outcomes: limit name -> what became of it at the last pass.
	outcomes map[string]*outcome
	// warned: limit name -> the share warning logged last.
	warned map[string]string
}

func newApplier(store limitStore, log *slog.Logger) applier {
	return applier{store: store, log: log, outcomes: make(map[string]*outcome), warned: make(map[string]string)}
}

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

// held is what the store holds, read at the start of a pass; the pass's own
// writes keep it current until the pass ends.
type held struct {
	limits map[uint32]maps.Limit // entries, by id
	metas  map[uint32]maps.Meta  // named metadata, by id
}

// read reads what the store holds: the entries (maps.Datapath keeps them
// in memory) and the metadata in one batch.
func (ap *applier) read() (*held, error) {
	h := &held{limits: make(map[uint32]maps.Limit)}
	for _, id := range ap.store.IDs() {
		l, err := ap.store.Limit(id)
		if err != nil {
			return nil, err
		}
		h.limits[id] = l
	}
	var err error
	if h.metas, err = ap.store.Metas(); err != nil {
		return nil, err
	}
	return h, nil
}

// ids is the id assignment the store records: each name's id, from the
// metadata. Two ids of one name (an agent stopped between two writes) give
// the one with an entry, else the lower; the other is then no limit's, and
// goes.
func (h *held) ids() map[string]uint32 {
	out := make(map[string]uint32, len(h.metas))
	for _, id := range sortedKeys(h.metas) {
		name := h.metas[id].Name
		if cur, ok := out[name]; ok {
			if _, set := h.limits[cur]; set {
				continue
			}
			if _, set := h.limits[id]; !set {
				continue
			}
		}
		out[name] = id
	}
	return out
}

// assign puts the store's id assignment into in: what plan gives ids from.
func (h *held) assign(in *planInputs) {
	in.ids = h.ids()
	in.taken = make(map[uint32]bool, len(h.limits)+len(h.metas))
	in.installed = make(map[uint32]bool, len(h.limits))
	for id := range h.limits {
		in.taken[id], in.installed[id] = true, true
	}
	for id := range h.metas {
		in.taken[id] = true
	}
}

// known are the ids the store holds anything of, in order.
func (h *held) known() []uint32 {
	ids := make([]uint32, 0, len(h.limits)+len(h.metas))
	for id := range h.limits {
		ids = append(ids, id)
	}
	for id := range h.metas {
		if _, ok := h.limits[id]; !ok {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	return ids
}

// sortedKeys are m's keys, in order.
func sortedKeys[K cmp.Ordered, V any](m map[K]V) []K {
	keys := make([]K, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// pass is one reconcile's bookkeeping.
type pass struct {
	held *held
	// freed: a limit left the data path or changed its match in this pass,
	// so the prefix tables may have room they had not when a limit was last
	// found not to fit. Until then, what did not fit still does not (the
	// tables only gained prefixes), and is not tried again: a count change
	// does not pay a classifier build per rejected limit.
	freed bool
}

// apply plans from in, with the store's id assignment, and makes the store
// hold the plan, writing only what changed.
//
// Each limit is checked and installed alone: one that does not fit the data
// path (no free id, more prefixes than its tables hold) is reported and
// skipped, and the others are applied all the same; a share above the data
// path's range is clamped and reported. A limit whose new version does not
// fit keeps its previous version (re-divided by the current count when the
// agent knows it), so a change never leaves traffic unlimited. Limits claim
// room in a fixed order: those in the data path first, by id, then the
// others by id (new limits get ids in name order), so the ones that no
// longer fit are always the last comers. What is no longer desired goes
// first, and changes that need no new room before those that do.
//
// hooksFirst, if set, is called before any entry is written with the
// limits the store will hold (those it holds and those about to be
// written) and their endpoint hooks: a limit must never reach a hook where
// no program enforces it.
//
// A limit that does not fit is not an error: the error reports failures to
// read or write the store, which no config can fix.
func (ap *applier) apply(in *planInputs, hooksFirst func([]maps.Limit, []placement)) error {
	h, err := ap.read()
	if err != nil {
		return err
	}
	h.assign(in)
	in.enforced = ap.enforcedVersions(in.limits)
	desired := plan(in)

	var errs []error
	// What is no longer desired goes first, entry and metadata, whether it
	// was applied or only reported: it leaves nothing behind, and its room
	// is free for the limits below.
	keep := make(map[uint32]bool, len(desired))
	for _, d := range desired {
		if d.id != noID {
			keep[d.id] = true
		}
	}
	p := pass{held: h}
	for _, id := range h.known() {
		if !keep[id] {
			if err := ap.remove(&p, id); err != nil {
				errs = append(errs, err)
				continue
			}
			p.freed = true
		}
	}
	if p.freed && slices.ContainsFunc(desired, func(d *desiredLimit) bool { return d.id == noID }) {
		// The ids just freed are free now (their limits' buckets and
		// counters are gone): the limits that found none take them.
		h.assign(in)
		desired = plan(in)
	}
	if hooksFirst != nil {
		limits, points := h.values(), ap.points()
		for _, d := range desired {
			if d.unfit == nil {
				limits = append(limits, d.limit)
				points = append(points, d.points...)
			}
		}
		hooksFirst(limits, points)
	}

	// Changes that need no new room in the prefix tables (count changes
	// above all) first, then those that do, each pass in the plan's order:
	// a limit that grows is checked against tables where the others have
	// already shrunk, and before any limit that comes after it.
	grows := make([]bool, len(desired))
	for i, d := range desired {
		grows[i] = h.grows(d)
	}
	for _, growing := range []bool{false, true} {
		for i, d := range desired {
			if grows[i] != growing {
				continue
			}
			if err := ap.install(&p, d); err != nil {
				errs = append(errs, err)
			}
		}
	}
	for _, d := range desired {
		if err := ap.keyShares(&p, d); err != nil {
			errs = append(errs, err)
		}
	}
	inPlan := make(map[string]bool, len(desired))
	for _, d := range desired {
		inPlan[d.name] = true
		if err := ap.record(&p, d); err != nil {
			errs = append(errs, err)
		}
	}
	for name := range ap.outcomes {
		if !inPlan[name] {
			delete(ap.outcomes, name)
		}
	}
	return errors.Join(errs...)
}

// enforcedVersions is, by name of each of limits whose enforced version is
// not the configured one, the version the last pass left enforced: plan
// re-divides it, for a new version that does not fit.
func (ap *applier) enforcedVersions(limits []v1alpha1.Limit) map[string]*v1alpha1.Limit {
	out := make(map[string]*v1alpha1.Limit)
	for i := range limits {
		l := &limits[i]
		if o := ap.outcomes[l.Name]; o != nil && o.enforced != nil && !reflect.DeepEqual(o.enforced, l) {
			out[l.Name] = o.enforced
		}
	}
	return out
}

// values are the entries held, in id order.
func (h *held) values() []maps.Limit {
	out := make([]maps.Limit, 0, len(h.limits))
	for _, id := range sortedKeys(h.limits) {
		out = append(out, h.limits[id])
	}
	return out
}

// points are the endpoint hooks of the limits as the last pass left them,
// in name order.
func (ap *applier) points() []placement {
	var out []placement
	for _, name := range sortedKeys(ap.outcomes) {
		out = append(out, ap.outcomes[name].points...)
	}
	return out
}

// remove deletes the limit with this id: its entry if it has one, and its
// metadata in any case.
func (ap *applier) remove(p *pass, id uint32) error {
	h := p.held
	if _, ok := h.limits[id]; ok {
		// DeleteLimit clears the metadata too.
		if err := ap.store.DeleteLimit(id); err != nil && !errors.Is(err, maps.ErrUnknownLimit) {
			return err
		}
	} else if err := ap.store.SetMeta(id, maps.Meta{}); err != nil {
		return err
	}
	if m, ok := h.metas[id]; ok {
		ap.log.Info("limit removed", "limit", m.Name)
	}
	delete(h.limits, id)
	delete(h.metas, id)
	return nil
}

// grows reports whether installing d may need room the data path's prefix
// tables do not give it now: a new limit, or one whose prefixes are not all
// among those it has.
func (h *held) grows(d *desiredLimit) bool {
	cur, ok := h.limits[d.id]
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

// install writes d's entry if it changed. If it cannot, an installed limit
// keeps its previous version: re-divided by the current count when its spec
// is known (d.prev), else as it is. The error is a failed write only: a
// limit that does not fit is reported in d, not returned.
func (ap *applier) install(p *pass, d *desiredLimit) error {
	if d.id == noID {
		return nil
	}
	cur, installed := p.held.limits[d.id]
	o := ap.outcomes[d.name]
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
		if err = ap.set(p, d.id, d.name, d.limit, d.meta); err == nil {
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
			(reflect.DeepEqual(cur, prev.limit) || ap.set(p, d.id, d.name, prev.limit, prev.meta) == nil) {
			d.meta, d.enforced = prev.meta, o.enforced
			return nil
		}
	}
	// As it is: the previous version with its last share.
	if m, ok := p.held.metas[d.id]; ok {
		d.meta = m
	}
	if o != nil {
		d.enforced = o.enforced
	}
	return writeErr
}

// keyShares makes the key shares of d's entry d's, if the entry is the
// version planned and records hot keys (or did: shares to remove), and they
// differ. An entry kept from an earlier version keeps its key shares.
func (ap *applier) keyShares(p *pass, d *desiredLimit) error {
	cur, ok := p.held.limits[d.id]
	if d.id == noID || !ok || d.enforced != d.source || !reflect.DeepEqual(cur, d.limit) || !cur.Hot && len(d.keyShares) == 0 {
		return nil
	}
	held, err := ap.store.KeyShares(d.id)
	if err != nil {
		return fmt.Errorf("limit %s: %w", d.name, err)
	}
	if len(held) == len(d.keyShares) && reflect.DeepEqual(held, d.keyShares) || len(held) == 0 && len(d.keyShares) == 0 {
		return nil
	}
	if err := ap.store.SetKeyShares(d.id, d.keyShares); err != nil {
		return fmt.Errorf("limit %s: %w", d.name, err)
	}
	ap.log.Debug("key shares set", "limit", d.name, "keys", len(d.keyShares))
	return nil
}

// samePrefixes reports whether two limits have the same source and
// destination prefixes: all that decides whether a limit fits the prefix
// tables.
func samePrefixes(x, y *maps.Limit) bool {
	return slices.Equal(x.Match.SrcCIDRs, y.Match.SrcCIDRs) && slices.Equal(x.Match.DstCIDRs, y.Match.DstCIDRs)
}

// set writes l as the entry of the limit with this id.
func (ap *applier) set(p *pass, id uint32, name string, l maps.Limit, m maps.Meta) error {
	old, had := p.held.limits[id]
	if err := ap.store.SetLimit(id, l); err != nil {
		return err
	}
	if had && !reflect.DeepEqual(old.Match, l.Match) {
		p.freed = true
	}
	p.held.limits[id] = l
	ap.log.Info("limit set", "limit", name, "replicas", m.Replicas,
		"share_rate", l.Rate, "share_burst", l.Burst, "global_rate", m.GlobalRate)
	return nil
}

// record writes d's metadata, logs a change of what became of it once, and
// keeps it for status and the RateLimit's condition.
func (ap *applier) record(p *pass, d *desiredLimit) error {
	if d.id == noID {
		d.state, d.note = maps.Rejected, "does not fit: "+d.unfit.Error()
	}
	m := d.meta
	m.State, m.Note = d.state, d.note
	o, seen := ap.outcomes[d.name]
	if !seen {
		o = &outcome{}
		ap.outcomes[d.name] = o
	}
	if !seen || o.state != d.state || o.note != d.note {
		_, kept := p.held.limits[d.id]
		switch {
		case d.state == maps.Rejected && kept:
			ap.log.Warn("limit change not applied; the previous version stays enforced", "limit", d.name, "reason", d.note)
		case d.state == maps.Rejected:
			ap.log.Warn("limit not applied", "limit", d.name, "reason", d.note)
		case d.state == maps.Clamped:
			ap.log.Warn("limit clamped", "limit", d.name, "reason", d.note)
		case seen && o.state != maps.Applied:
			ap.log.Info("limit applied as configured", "limit", d.name)
		}
	}
	o.id, o.state, o.note, o.enforced, o.meta = d.id, d.state, d.note, d.enforced, m
	o.full, o.fullErr = d.full, d.fullErr
	o.points, o.atUplink = d.points, d.atUplink
	if d.warn != ap.warned[d.name] {
		if d.warn != "" {
			ap.log.Warn(d.warn, "limit", d.name, "replicas", d.meta.Replicas, "share_rate", d.limit.Rate)
		}
		ap.warned[d.name] = d.warn
	}
	if d.id == noID {
		return nil
	}
	// The counter snapshot is the snapshot loop's.
	prev, had := p.held.metas[d.id]
	m.SnapAt, m.SnapAdmitted, m.SnapDropped, m.SnapShadow = prev.SnapAt, prev.SnapAdmitted, prev.SnapDropped, prev.SnapShadow
	if had && prev.Equal(m) {
		return nil
	}
	if err := ap.store.SetMeta(d.id, m); err != nil {
		return err
	}
	p.held.metas[d.id] = m
	return nil
}
