package agent

import (
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/maps"
	"github.com/rlagent/rlagent/watcher"
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
	if a.k8s != nil && !a.k8s.Synced() {
		// Until the caches hold the cluster's limits, what the pins hold
		// stands: an empty cache must not delete every limit.
		return nil
	}
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
	limits := a.limits()
	out := make(map[uint32]*desiredLimit, len(limits))
	used := make(map[uint32]bool, len(a.applied))
	for id := range a.applied {
		used[id] = true
	}
	next := uint32(0)
	for i := range limits {
		l := &limits[i]
		d, err := a.divideLimit(l)
		if err != nil {
			return nil, fmt.Errorf("limits[%d] (%s): %w", i, l.Name, err)
		}
		if d == nil {
			continue // nothing to enforce on this node
		}
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
		out[id] = d
	}
	return out, nil
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

// divideLimit divides one limit by its count. It returns nil for a
// service-scoped limit with no endpoint on this node: no traffic of that
// Service arrives here, and without endpoint addresses the limit would match
// all of the node's traffic.
func (a *Agent) divideLimit(l *v1alpha1.Limit) (*desiredLimit, error) {
	spec := &l.RateLimitSpec
	obs := a.observe(l)
	burst := spec.EffectiveBurst()
	service := spec.Scope == v1alpha1.ScopeService
	share := divide(spec.Rate, burst, service, obs)
	if service {
		var local []watcher.Endpoint
		var ports []watcher.EndpointPort
		if a.k8s != nil {
			local, ports = a.k8s.LocalEndpoints(l.Name)
		}
		if len(local) == 0 {
			return nil, nil
		}
		spec = serviceSpec(spec, local, ports)
	}
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
		obs := a.observeName(m.Name)
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

// observeName is observe for a limit known by name only.
func (a *Agent) observeName(name string) watcher.Observation {
	for _, l := range a.limits() {
		if l.Name == name {
			return a.observe(&l)
		}
	}
	return a.source.Observe(name)
}

// serviceSpec is a service-scoped spec with the Service's endpoints on this
// node as its destination: their addresses, and the Service's ports of the
// spec's protocol.
func serviceSpec(spec *v1alpha1.RateLimitSpec, local []watcher.Endpoint, ports []watcher.EndpointPort) *v1alpha1.RateLimitSpec {
	s := *spec
	s.Match.DstCIDRs = nil
	for _, e := range local {
		s.Match.DstCIDRs = append(s.Match.DstCIDRs, netip.PrefixFrom(e.Addr, e.Addr.BitLen()).String())
	}
	if len(spec.Match.DstPorts) == 0 {
		s.Match.DstPorts = nil
		for _, p := range ports {
			proto := v1alpha1.Protocol(strings.ToLower(string(p.Protocol)))
			if spec.Match.Protocol == v1alpha1.ProtocolAny || spec.Match.Protocol == "" || spec.Match.Protocol == proto {
				s.Match.DstPorts = append(s.Match.DstPorts, strconv.Itoa(int(p.Port)))
			}
		}
	}
	return &s
}
