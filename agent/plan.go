package agent

import (
	"cmp"
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/attach"
	"github.com/rlagent/rlagent/divide"
	"github.com/rlagent/rlagent/maps"
	"github.com/rlagent/rlagent/watcher"
)

// The plan: what the data path should hold, decided from data alone.
//
// plan is pure: everything it decides from is in planInputs, which the
// agent gathers under its lock (gather), and it reads no clock, no map, no
// netlink and no API server. The reconcile applies what it returns.

// scope codes recorded in the pinned metadata (see scopeNames).
const (
	scopeStatic  = 0
	scopeFile    = 1
	scopeNodes   = 2
	scopeService = 3
	scopePods    = 4
)

// noID marks a limit that got no id: every id of the data path is taken.
const noID = ^uint32(0)

// planInputs is everything plan decides from.
type planInputs struct {
	// limits are the accepted limits, in any order.
	limits []v1alpha1.Limit
	// obs is, by limit name, the count each limit is divided by.
	obs map[string]watcher.Observation
	// service is, by name of a limit with scope service, the Service's
	// endpoints on this node and its ports.
	service map[string]serviceEndpoints
	// endpoints are this node's endpoints, resolved to interfaces, for the
	// addresses endpointQueries asked for.
	endpoints endpointTable
	// endpointHook is where an ingress limit at the endpoints runs.
	endpointHook v1alpha1.EndpointHook
	// countFile: the count source is a file (recorded in the metadata).
	countFile bool
	// demand is, by name of a limit with share demand, this node's rate
	// from the demand step; a limit without one gets the equal share.
	demand map[string]uint64
	// keyShares is, by name of a keyed limit with share demand, the rates
	// of its keys whose share is not the equal one (from the demand step).
	keyShares map[string]map[string]uint64
	// ids is the previous id assignment, by limit name.
	ids map[string]uint32
	// taken are the ids no new limit may take: names, entries and
	// metadata the data path holds (a new limit would inherit their
	// buckets).
	taken map[uint32]bool
	// installed are the ids with an entry in the data path: their limits
	// claim room first.
	installed map[uint32]bool
	// enforced is, by limit name, the version the data path enforced at
	// the last reconcile, if it is not the configured one: plan divides it
	// too (desiredLimit.prev), for a new version that does not fit.
	enforced map[string]*v1alpha1.Limit
}

// serviceEndpoints are a Service's endpoints on this node, and its ports.
type serviceEndpoints struct {
	local []watcher.Endpoint
	ports []watcher.EndpointPort
}

// endpointTable is what the attacher found for the addresses and prefixes
// of endpointQueries.
type endpointTable struct {
	// addrs: each address asked for, with its interface or the reason it
	// has none. addrsErr: the lookup failed as a whole.
	addrs    map[netip.Addr]attach.Endpoint
	addrsErr error
	// in: the endpoints inside the prefixes asked for, sorted by address.
	// inErr: that lookup failed as a whole.
	in    []attach.Endpoint
	inErr error
}

// desiredLimit is one limit of the desired state, and, once reconcile has
// tried it, what became of it.
type desiredLimit struct {
	name   string
	id     uint32          // noID: no id was free
	source *v1alpha1.Limit // as configured
	limit  maps.Limit
	meta   maps.Meta // without State and Note
	warn   string
	// unfit says why the limit cannot be installed before any write is
	// tried (no id, a spec the data path cannot express), or nil.
	unfit error
	// points are the endpoint hooks of a limit enforced at its endpoints
	// (none for one at the uplink).
	points []placement
	// atUplink says why the limit, meant for its endpoints' interfaces,
	// runs at the uplinks, or "".
	atUplink string
	// prev is the version enforced before (planInputs.enforced) divided
	// by the current count: what stays enforced if this version does not
	// fit. nil: the same version, or none.
	prev *desiredLimit
	// keyShares are the keys with a share of their own (a keyed limit
	// with share demand; none otherwise), as the data path holds them.
	keyShares map[maps.Bucket]maps.KeyShare

	// Set by reconcile: what is enforced, and why it is not the limit as
	// configured (state and note, see maps.MetaState).
	state    maps.MetaState
	note     string
	enforced *v1alpha1.Limit // the version in the data path; nil: none, or not known
	full     *maps.Limit     // the version the prefix tables had no room for, if any
	fullErr  error           // why
}

// plan computes the desired state: an id for every limit, its share and
// its map entry, in the order limits claim room in the data path (those in
// the data path first, by id, then the others by id: see reconcile). A
// limit keeps its id for life, installed or not; a new limit never takes a
// taken id (it would inherit another limit's buckets); new limits take the
// free ids in name order, and one that finds none is unfit.
func plan(in *planInputs) []*desiredLimit {
	limits := slices.Clone(in.limits)
	slices.SortFunc(limits, func(x, y v1alpha1.Limit) int { return strings.Compare(x.Name, y.Name) })
	taken := make(map[uint32]bool, len(in.taken))
	for id := range in.taken {
		taken[id] = true
	}
	out := make([]*desiredLimit, 0, len(limits))
	next := uint32(0)
	for i := range limits {
		l := &limits[i]
		d := planLimit(in, l)
		if d == nil {
			continue // nothing to enforce on this node
		}
		if e := in.enforced[l.Name]; e != nil && !reflect.DeepEqual(e, l) {
			d.prev = planLimit(in, e)
		}
		id, ok := in.ids[l.Name]
		if !ok {
			for next < maps.MaxLimits && taken[next] {
				next++
			}
			if next < maps.MaxLimits {
				id = next
				taken[id] = true
			} else {
				id = noID
				d.unfit = fmt.Errorf("the data path holds %d limits and every id is taken (new limits take the free ones in name order)", maps.MaxLimits)
			}
		}
		d.id = id
		out = append(out, d)
	}
	slices.SortStableFunc(out, func(x, y *desiredLimit) int {
		xin, yin := in.installed[x.id], in.installed[y.id]
		switch {
		case xin != yin:
			if xin {
				return -1
			}
			return 1
		case x.id != y.id:
			return cmp.Compare(x.id, y.id)
		}
		return strings.Compare(x.name, y.name)
	})
	return out
}

// planLimit divides one limit by its count. It returns nil for a
// service-scoped limit with no endpoint on this node: no traffic of that
// Service arrives here, and without endpoint addresses the limit would match
// all of the node's traffic. A share above the data path's range is clamped
// (state Clamped); a spec the data path cannot express is unfit.
func planLimit(in *planInputs, l *v1alpha1.Limit) *desiredLimit {
	spec, ok := nodeSpec(in, l)
	if !ok {
		return nil
	}
	obs := in.obs[l.Name]
	burst := l.EffectiveBurst()
	share := equalShare(&l.RateLimitSpec, obs)
	if rate, ok := in.demand[l.Name]; ok && l.Share == v1alpha1.ShareDemand {
		share = divide.ByDemand(share, l.Rate, burst, rate)
	}
	share, clamped := fit(share)
	var fallback, attachNote string
	var points []placement
	if atEndpoints(spec) {
		if points, fallback, attachNote = endpointPlacements(spec, &in.endpoints, in.endpointHook); fallback != "" {
			s := *spec
			s.Attach = v1alpha1.AttachUplink
			spec = &s
			attachNote = "enforced at the uplink: " + fallback
		}
	}
	scope := uint8(scopeStatic)
	switch spec.Scope {
	case v1alpha1.ScopeNodes:
		scope = scopeNodes
	case v1alpha1.ScopeService:
		scope = scopeService
	case v1alpha1.ScopePods:
		scope = scopePods
	default:
		if in.countFile {
			scope = scopeFile
		}
	}
	d := &desiredLimit{
		name:   l.Name,
		source: l,
		warn:   share.Warning,
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
	}
	if clamped != "" {
		d.state, d.note = maps.Clamped, clamped
	}
	if attachNote != "" {
		d.note = strings.TrimPrefix(d.note+"; "+attachNote, "; ")
		d.warn = strings.TrimPrefix(d.warn+"; "+attachNote, "; ")
	}
	if fallback == "" {
		d.points = points
	} else {
		d.atUplink = attachNote
	}
	ml, err := toMapsLimit(spec, share)
	if err != nil {
		d.unfit = err
		return d
	}
	if l.Share == v1alpha1.ShareDemand && ml.Key != maps.KeyNone && ml.Action != maps.Pace {
		// Keyed demand shares: the data path records the hot keys, and
		// the keys with an allocation get their own shares.
		ml.Hot = true
		d.keyShares = keyShares(spec, share, burst, in.keyShares[l.Name])
	}
	d.limit = ml
	return d
}

// keyShares are the data path's key shares of a keyed limit whose equal
// share is equal, from the keys' rates: each key's burst scales with its
// rate as a node's does (divide.ByDemand). A key the data path cannot
// hold (not one of the limit's) is left at the equal share.
func keyShares(spec *v1alpha1.RateLimitSpec, equal divide.Share, burst uint64, rates map[string]uint64) map[maps.Bucket]maps.KeyShare {
	if len(rates) == 0 {
		return nil
	}
	out := make(map[maps.Bucket]maps.KeyShare, len(rates))
	for key, rate := range rates {
		b, err := bucketOfKey(spec, key)
		if err != nil {
			continue
		}
		s, _ := fit(divide.ByDemand(equal, spec.Rate, burst, rate))
		ks := maps.KeyShare{Rate: s.Rate, Burst: min(s.Burst, maps.MaxBurstSeconds*s.Rate)}
		if rate == 0 {
			ks = maps.KeyShare{}
		}
		out[b] = ks
	}
	return out
}

// equalShare is a limit's equal share at this node: divided evenly by the
// count, or for scope service (pods) by the endpoints (pods) here of all
// the Service's (matching ones).
func equalShare(spec *v1alpha1.RateLimitSpec, obs watcher.Observation) divide.Share {
	if spec.Scope == v1alpha1.ScopeService || spec.Scope == v1alpha1.ScopePods {
		return divide.ByEndpoints(spec.Rate, spec.EffectiveBurst(), obs.Local, obs.Replicas)
	}
	return divide.Evenly(spec.Rate, spec.EffectiveBurst(), obs.Replicas)
}

// fit keeps a share within the data path's range: a rate above
// maps.MaxRate is lowered to it (and the burst with it, by toMapsLimit), and
// note says so; otherwise note is "".
//
// Validation bounds the global rate by the same maximum (the count can fall
// to 1), so only a spec that skipped validation gets here; a clamped share
// is still enforced, never refused: refusing it would leave the traffic
// unlimited, and a share too large for the data path is a share that does
// not limit much anyway.
func fit(s divide.Share) (_ divide.Share, note string) {
	if s.Rate <= maps.MaxRate {
		return s, ""
	}
	note = fmt.Sprintf("node share %d units/s is above the data path's maximum of %d per node: clamped to %d", s.Rate, maps.MaxRate, maps.MaxRate)
	s.Rate = maps.MaxRate
	s.Burst = min(s.Burst, maps.MaxBurstSeconds*maps.MaxRate)
	return s, note
}

// nodeSpec is l's spec as this node's data path matches it: for scope
// service, with the Service's endpoints here as its local side
// (serviceSpec); ok is false when it has none here, and for a limit with
// unit requests, which no node installs.
func nodeSpec(in *planInputs, l *v1alpha1.Limit) (_ *v1alpha1.RateLimitSpec, ok bool) {
	spec := &l.RateLimitSpec
	if spec.Unit == v1alpha1.UnitRequests {
		// Enforced per request in the Service's own processes (the
		// limiter library); no node installs it.
		return nil, false
	}
	if spec.Scope != v1alpha1.ScopeService && spec.Scope != v1alpha1.ScopePods {
		return spec, true
	}
	se := in.service[l.Name]
	if len(se.local) == 0 {
		return nil, false
	}
	return serviceSpec(spec, se.local, se.ports), true
}

// endpointQueries are the addresses and prefixes whose endpoints plan
// looks up (endpointTable): those on the endpoint side of every limit at
// its endpoints, in the version configured and in the one enforced.
func endpointQueries(in *planInputs) (addrs []netip.Addr, wide []netip.Prefix) {
	add := func(l *v1alpha1.Limit) {
		spec, ok := nodeSpec(in, l)
		if !ok || !atEndpoints(spec) {
			return
		}
		a, w := endpointSide(spec)
		addrs, wide = append(addrs, a...), append(wide, w...)
	}
	for i := range in.limits {
		add(&in.limits[i])
	}
	for _, name := range sortedKeys(in.enforced) {
		add(in.enforced[name])
	}
	slices.SortFunc(addrs, netip.Addr.Compare)
	slices.SortFunc(wide, netip.Prefix.Compare)
	return slices.Compact(addrs), slices.Compact(wide)
}

// endpointSide is the endpoint side of a limit's match: dstCIDRs for
// ingress and srcCIDRs for egress, bare addresses apart from wider
// prefixes.
func endpointSide(spec *v1alpha1.RateLimitSpec) (addrs []netip.Addr, wide []netip.Prefix) {
	side := spec.Match.DstCIDRs
	if spec.Match.Direction == v1alpha1.DirectionEgress {
		side = spec.Match.SrcCIDRs
	}
	for _, c := range side {
		p, err := v1alpha1.ParseCIDR(c)
		if err != nil {
			continue // validation reports it
		}
		if p.IsSingleIP() {
			addrs = append(addrs, p.Addr())
		} else {
			wide = append(wide, p)
		}
	}
	return addrs, wide
}

// endpointPlacements finds where a limit with attach endpoints runs: the
// hook of each local endpoint's interface that sees the limit's traffic.
// spec is the limit as the data path will match it (nodeSpec): its
// endpoints are the addresses on the endpoint's side of the match. A bare
// address must be an endpoint with an interface of its own; a wider prefix
// is the endpoints found inside it.
//
// fallback is not empty when the limit cannot run at its endpoints (an
// endpoint without an interface of its own, such as a hostNetwork pod, or
// none found at all): it then runs at the uplink, and fallback says why.
// note tells of endpoints whose pod side could not be reached with
// endpointHook pod (enforced at their host side instead).
func endpointPlacements(spec *v1alpha1.RateLimitSpec, t *endpointTable, hookAt v1alpha1.EndpointHook) (points []placement, fallback, note string) {
	dir := maps.Ingress
	if spec.Match.Direction == v1alpha1.DirectionEgress {
		dir = maps.Egress
	}
	addrs, wide := endpointSide(spec)
	if len(addrs) == 0 && len(wide) == 0 {
		return nil, "no endpoint addresses", ""
	}
	var found []attach.Endpoint
	if len(addrs) > 0 {
		if t.addrsErr != nil {
			return nil, "the endpoints' interfaces could not be looked up: " + t.addrsErr.Error(), ""
		}
		for _, a := range addrs {
			e, ok := t.addrs[a]
			if !ok {
				return nil, fmt.Sprintf("endpoint %s: not looked up", a), ""
			}
			if e.Iface == "" {
				return nil, fmt.Sprintf("endpoint %s: %s", e.Addr, e.Reason), ""
			}
			found = append(found, e)
		}
	}
	if len(wide) > 0 {
		if t.inErr != nil {
			return nil, "the endpoints' interfaces could not be looked up: " + t.inErr.Error(), ""
		}
		n := 0
		for _, e := range t.in {
			if e.Iface != "" && slices.ContainsFunc(wide, func(p netip.Prefix) bool { return p.Contains(e.Addr) }) {
				found = append(found, e)
				n++
			}
		}
		if n == 0 && len(addrs) == 0 {
			return nil, "no endpoint interface found in " + joinPrefixes(wide), ""
		}
	}

	hook := maps.Endpoints.Hook(dir)
	seen := make(map[string]bool)
	var unreached []string
	for _, e := range found {
		p := placement{hook: hook, point: attach.Point{Iface: e.Iface, Kind: attach.TCIngress}}
		if dir == maps.Ingress {
			// Traffic into the endpoint leaves the host through the
			// host side's egress hook, or enters the pod side.
			p.point.Kind = attach.TCEgress
			if hookAt == v1alpha1.EndpointHookPod {
				if pt, ok := e.Peer.Ingress(); ok {
					p.point = pt
				} else {
					unreached = append(unreached, fmt.Sprintf("%s (%s)", e.Addr, e.Peer.Reason))
				}
			}
		}
		if !seen[p.key()] {
			seen[p.key()] = true
			points = append(points, p)
		}
	}
	if len(unreached) > 0 {
		note = "endpointHook pod: the pod side of " + strings.Join(unreached, ", ") +
			" not found; enforced at the host side, which bpf_redirect_peer delivery skips"
	}
	return points, "", note
}

func joinPrefixes(ps []netip.Prefix) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = p.String()
	}
	return strings.Join(s, ", ")
}

// serviceSpec is a service-scoped spec with the Service's endpoints on this
// node as its local side: for an ingress limit its destination (their
// addresses, and the Service's ports of the spec's protocol), for an egress
// limit its source (their addresses; the destination ports stay the
// spec's, since what the endpoints send goes to other services' ports).
func serviceSpec(spec *v1alpha1.RateLimitSpec, local []watcher.Endpoint, ports []watcher.EndpointPort) *v1alpha1.RateLimitSpec {
	s := *spec
	var addrs []string
	for _, e := range local {
		addrs = append(addrs, netip.PrefixFrom(e.Addr, e.Addr.BitLen()).String())
	}
	if spec.Match.Direction == v1alpha1.DirectionEgress {
		s.Match.SrcCIDRs = addrs
		return &s
	}
	s.Match.DstCIDRs = addrs
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

// atEndpoints reports whether spec is enforced at its endpoints' interfaces
// (attach endpoints, the default of scopes service and pods).
func atEndpoints(spec *v1alpha1.RateLimitSpec) bool {
	return spec.Attach == v1alpha1.AttachEndpoints ||
		(spec.Attach == "" && (spec.Scope == v1alpha1.ScopeService || spec.Scope == v1alpha1.ScopePods))
}
