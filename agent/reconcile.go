package agent

import (
	"errors"
	"fmt"
	"reflect"
	"time"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/maps"
)

// scope codes recorded in the pinned metadata (see scopeNames).
const (
	scopeStatic  = 0
	scopeFile    = 1
	scopeNodes   = 2
	scopeService = 3
)

// desiredLimit is one limit of the desired state.
type desiredLimit struct {
	name  string
	spec  *v1alpha1.RateLimitSpec
	limit maps.Limit
	meta  maps.Meta
	warn  string
}

// reconcile makes the maps hold cfg's limits divided by the current
// counts. It checks the whole desired state before writing any of it, and
// writes only what changed. Callers hold a.mu.
func (a *Agent) reconcile() error {
	desired, err := a.desired()
	if err != nil {
		return err
	}
	byID := make(map[uint32]maps.Limit, len(desired))
	for id, d := range desired {
		byID[id] = d.limit
	}
	if err := a.dp.Check(byID); err != nil {
		return fmt.Errorf("config does not fit the data path: %w", err)
	}

	var errs []error
	for id := range a.applied {
		if _, ok := desired[id]; ok {
			continue
		}
		if err := a.dp.DeleteLimit(id); err != nil && !errors.Is(err, maps.ErrUnknownLimit) {
			errs = append(errs, err)
			continue
		}
		for name, nid := range a.ids {
			if nid == id {
				delete(a.ids, name)
				a.log.Info("limit removed", "limit", name)
			}
		}
		delete(a.applied, id)
		delete(a.meta, id)
	}
	for id, d := range desired {
		if cur, ok := a.applied[id]; !ok || !reflect.DeepEqual(cur, d.limit) {
			if err := a.dp.SetLimit(id, d.limit); err != nil {
				errs = append(errs, fmt.Errorf("limit %s: %w", d.name, err))
				continue
			}
			a.applied[id] = d.limit
			a.log.Info("limit set", "limit", d.name, "replicas", d.meta.Replicas,
				"share_rate", d.limit.Rate, "share_burst", d.limit.Burst, "global_rate", d.meta.GlobalRate)
		}
		a.ids[d.name] = id
		m := d.meta
		// The counter snapshot is the snapshot loop's.
		prev := a.meta[id]
		m.SnapAt, m.SnapAdmitted, m.SnapDropped, m.SnapShadow = prev.SnapAt, prev.SnapAdmitted, prev.SnapDropped, prev.SnapShadow
		if prev != m {
			if err := a.dp.SetMeta(id, m); err != nil {
				errs = append(errs, err)
				continue
			}
			a.meta[id] = m
		}
		if d.warn != a.warned[d.name] {
			if d.warn != "" {
				a.log.Warn(d.warn, "limit", d.name, "replicas", d.meta.Replicas, "share_rate", d.limit.Rate)
			}
			a.warned[d.name] = d.warn
		}
	}
	return errors.Join(errs...)
}

// desired computes the desired state: an id for every limit (a limit keeps
// its id for life; a new limit never takes the id of one removed in the same
// pass, which would inherit its buckets), its share and its map entry.
func (a *Agent) desired() (map[uint32]*desiredLimit, error) {
	out := make(map[uint32]*desiredLimit, len(a.cfg.Limits))
	used := make(map[uint32]bool, len(a.applied))
	for id := range a.applied {
		used[id] = true
	}
	next := uint32(0)
	for i := range a.cfg.Limits {
		l := &a.cfg.Limits[i]
		id, ok := a.ids[l.Name]
		if !ok {
			for next < maps.MaxLimits && used[next] {
				next++
			}
			if next >= maps.MaxLimits {
				return nil, fmt.Errorf("limits[%d] (%s): more than %d limits on this node", i, l.Name, maps.MaxLimits)
			}
			id = next
			used[id] = true
		}
		d, err := a.divideLimit(l)
		if err != nil {
			return nil, fmt.Errorf("limits[%d] (%s): %w", i, l.Name, err)
		}
		out[id] = d
	}
	return out, nil
}

func (a *Agent) divideLimit(l *v1alpha1.Limit) (*desiredLimit, error) {
	spec := &l.RateLimitSpec
	obs := a.source.Observe(l.Name)
	burst := spec.EffectiveBurst()
	share := divide(spec.Rate, burst, string(spec.Scope) == "service", obs)
	ml, err := toMapsLimit(spec, share)
	if err != nil {
		return nil, err
	}
	scope := uint8(scopeStatic)
	switch string(spec.Scope) {
	case "nodes":
		scope = scopeNodes
	case "service":
		scope = scopeService
	default:
		if a.cfg.Count.File != "" {
			scope = scopeFile
		}
	}
	return &desiredLimit{
		name:  l.Name,
		spec:  spec,
		limit: ml,
		warn:  share.Warning,
		meta: maps.Meta{
			Name:        l.Name,
			GlobalRate:  spec.Rate,
			GlobalBurst: burst,
			Scope:       scope,
			Replicas:    uint32(max(obs.Replicas, 0)),
			Local:       uint32(max(obs.Local, 0)),
			Observed:    obs.At,
			Stale:       obs.Err != nil,
		},
	}, nil
}

// snapshot records each limit's counters, for status to compute rates.
// What it writes is the previous tick's reading, so that status always
// divides by 1 to 2 seconds of traffic, never by a fresh, near-zero interval.
func (a *Agent) snapshot() {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := time.Now()
	for id, m := range a.meta {
		st, err := a.dp.Stats(id)
		if err != nil {
			continue
		}
		if prev, ok := a.pending[id]; ok {
			m.SnapAt, m.SnapAdmitted, m.SnapDropped, m.SnapShadow = prev.at, prev.admitted, prev.dropped, prev.shadow
		}
		a.pending[id] = counterSnap{now, st.AdmittedPackets, st.DroppedPackets, st.ShadowPackets}
		// The observation age moves on its own; refresh it with the counts.
		obs := a.source.Observe(m.Name)
		m.Observed, m.Stale = obs.At, obs.Err != nil
		if err := a.dp.SetMeta(id, m); err == nil {
			a.meta[id] = m
		}
	}
}

type counterSnap struct {
	at                        time.Time
	admitted, dropped, shadow uint64
}

// readStatus is the metrics collector's view.
func (a *Agent) readStatus() ([]LimitStatus, maps.GlobalStats, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	st, err := readStatus(a.dp, time.Now())
	if err != nil {
		return nil, maps.GlobalStats{}, err
	}
	g, err := a.dp.GlobalStats()
	return st, g, err
}
