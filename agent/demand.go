package agent

import (
	"context"
	"strconv"
	"time"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/cluster"
	"github.com/rlagent/rlagent/demand"
	"github.com/rlagent/rlagent/maps"
)

// Demand shares (share: demand), this node's part: measure the limit's
// demand from the counters the data path keeps, report it (the demand
// Lease, demandLoop), and enforce the share the allocation in the
// RateLimit's status gives it (demand.Node). The allocation itself is the
// elected status writer's (cluster.StatusWriter).

// demandState is one demand-shared limit's state on this node.
type demandState struct {
	meter demand.Meter
	node  demand.Node
	// unsettled is since when the meter has not settled (zero: settled):
	// a moving demand is reported once it settles, or an interval later.
	unsettled time.Time
	equal     uint64 // the equal share at the last step: the report's threshold
	hotKeys   int    // a keyed limit's hotKeys at the last step (RateLimitSpec.HotKeyLimit)
	// refused is why the allocation in the status is not followed
	// (demand.Check), or ""; refusals counts the rounds refused.
	refused   string
	refusedAt int64 // the round refused last
	refusals  uint64

	// Of a keyed limit: each followed key's Node (keys), the keys this
	// node finds hot (hot, from the data path's records), and the shares
	// to enforce of the keys whose share is not the equal one (shares).
	keys   *demand.KeyNodes
	hot    map[string]*hotKey
	shares map[string]uint64
	// use is what the keys with a share of their own take of it, and
	// floor the allocation's floor (0: none fresh): a key that takes more
	// than the floor is reported while it does, hot or not (not reported,
	// it would fall to the floor).
	use   map[string]*keyUse
	floor uint64
}

// demandParams are the configured parameters, defaulted. Callers hold a.mu.
func (a *Agent) demandParams() v1alpha1.DemandShares {
	p := a.cfg.DemandShares
	p.Default()
	return p
}

// stepDemand steps the share of every demand-shared limit this node
// enforces (demand.Node.Share: a new round, a stale allocation), and
// forgets the state of the limits no longer demand-shared. It reports
// whether a share changed. Callers hold a.mu.
func (a *Agent) stepDemand(now time.Time) bool {
	if a.k8s == nil {
		return false
	}
	p := a.demandParams()
	changed := false
	seen := make(map[string]bool)
	for _, l := range a.limits() {
		if l.Share != v1alpha1.ShareDemand {
			continue
		}
		seen[l.Name] = true
		obs := a.observe(&l)
		equal := equalShare(&l.RateLimitSpec, obs).Rate
		alloc := a.k8s.Allocation(l.Name)
		st := a.demand[l.Name]
		if st == nil {
			st = &demandState{}
			st.node = demand.Node{Interval: p.Interval.Duration / 2, StaleAfter: p.StaleAfter.Duration}
			if rate := a.enforcedRates()[l.Name]; rate > 0 {
				// A restarted agent: the share the data path holds.
				st.node.Start(rate, now)
			} else if st.node.Fresh(alloc, now) && demand.Check(alloc, demand.Bounds{Rate: l.Rate, Count: obs.Replicas, FloorPerMille: *p.FloorPerMille}, equal, now) == nil {
				// A node joining an allocation: its floor, until a
				// round counts it.
				st.node.Start(alloc.Level.Floor, now)
			} // else: the equal share, until the first round
			a.demand[l.Name] = st
		}
		// The rounds' interval, and a report's lag, are half the report
		// interval (as the allocator's: cluster.StatusWriter).
		st.node.Interval, st.node.StaleAfter = p.Interval.Duration/2, p.StaleAfter.Duration
		st.node.Bounds = demand.Bounds{Rate: l.Rate, Count: obs.Replicas, FloorPerMille: *p.FloorPerMille}
		st.equal, st.hotKeys = equal, l.HotKeyLimit()
		before := st.node.Now()
		if st.node.Share(alloc, equal, now) != before && l.Key == v1alpha1.KeyNone {
			changed = true
		}
		a.refuseDemand(l.Name, st, alloc)
		if l.Key != v1alpha1.KeyNone && a.stepKeys(&l, st, alloc, now) {
			changed = true
		}
	}
	for name := range a.demand {
		if !seen[name] {
			delete(a.demand, name)
			changed = true
		}
	}
	return changed
}

// demandDown lowers, as the agent stops, every demand share of this node
// above its equal share to it, the keys' included, and applies that. With
// no agent, nothing steps this node's shares when the allocation goes
// stale, while the other nodes fall back to their equal shares: a share
// above it left behind would lift the sum above the rate (a restart that
// takes the allocator with it takes longer than the stale age). A
// decrease is always safe; the next agent starts from what the data path
// holds. Callers hold a.mu.
func (a *Agent) demandDown(now time.Time) {
	lowered := 0
	for _, st := range a.demand {
		if st.equal == 0 {
			continue // never stepped: nothing above it
		}
		if st.keys != nil {
			for key, rate := range st.shares {
				if rate > st.equal {
					st.keys.Start(key, st.equal, now)
					lowered++
				}
			}
			continue
		}
		if st.node.Now() > st.equal {
			st.node.Start(st.equal, now)
			lowered++
		}
	}
	if lowered == 0 {
		return
	}
	if err := a.reconcile(); err != nil {
		a.log.Warn("demand shares above the equal share not lowered as the agent stops", "shares", lowered, "error", err)
		return
	}
	a.log.Info("demand shares above the equal share lowered to it as the agent stops", "shares", lowered)
}

// refuseDemand logs and counts an allocation the node does not follow
// (demand.Node.Refused: it enforces as if the allocation were stale), once
// a round, and its end. The status loop reports it as an Event on the
// RateLimit. Callers hold a.mu.
func (a *Agent) refuseDemand(name string, st *demandState, alloc demand.Allocation) {
	err := st.node.Refused()
	switch {
	case err == nil && st.refused != "":
		a.log.Info("demand allocation followed again", "limit", name, "round", alloc.Round)
		st.refused = ""
	case err != nil && (st.refused == "" || st.refusedAt != alloc.Round):
		st.refusals++
		a.log.Warn("demand allocation refused: not one an allocator writes; enforcing as if it were stale (the equal share)",
			"limit", name, "round", alloc.Round, "reason", err.Error())
		fallthrough
	case err != nil:
		st.refused, st.refusedAt = "demand allocation round "+strconv.FormatInt(alloc.Round, 10)+" refused ("+err.Error()+"): enforcing the equal share", alloc.Round
	}
}

// demandRefusals is, by limit, how many rounds of its allocation this node
// refused (rlagent_demand_allocation_refused_total).
func (a *Agent) demandRefusals() map[string]uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[string]uint64, len(a.demand))
	for name, st := range a.demand {
		out[name] = st.refusals
	}
	return out
}

// demandRefused is why this node does not follow the allocation of the
// limit name, or "". Callers hold a.mu.
func (a *Agent) demandRefused(name string) string {
	if st := a.demand[name]; st != nil {
		return st.refused
	}
	return ""
}

// enforcedRates is, by limit name, the rate of the entry the data path
// holds for it. Callers hold a.mu.
func (a *Agent) enforcedRates() map[string]uint64 {
	metas, err := a.dp.Metas()
	if err != nil {
		return nil
	}
	out := make(map[string]uint64, len(metas))
	for id, m := range metas {
		if l, err := a.dp.Limit(id); err == nil {
			out[m.Name] = l.Rate
		}
	}
	return out
}

// observeDemand feeds a limit's counters (what was offered to it, in its
// unit) to its meter; l is the limit (nil: no longer configured). Callers
// hold a.mu.
func (a *Agent) observeDemand(name string, l *v1alpha1.Limit, st maps.Stats, now time.Time) {
	d := a.demand[name]
	if d == nil {
		return
	}
	offered := st.AdmittedPackets + st.DroppedPackets + st.ShadowPackets
	if l != nil && l.Unit == v1alpha1.UnitBytes {
		offered = st.AdmittedBytes + st.DroppedBytes + st.ShadowBytes
	}
	p := a.demandParams()
	d.meter.Tau = min(max(p.Interval.Duration/8, 500*time.Millisecond), 5*time.Second)
	d.meter.Observe(offered, now)
	switch {
	case d.meter.Settled(demandMoved):
		d.unsettled = time.Time{}
	case d.unsettled.IsZero():
		d.unsettled = now
	}
}

// demandMoved is the fraction a demand must move by to be reported again.
const demandMoved = 0.1

// demandLoop reports this node's demands (the demand Lease, which every
// node writes, with or without demand-shared limits: it holds the node's
// verdicts as well) while the agent runs in a cluster, apart from the reconcile loop: an API server
// that does not answer must not hold up enforcement.
func (a *Agent) demandLoop(ctx context.Context) {
	a.mu.Lock()
	p := a.demandParams()
	a.mu.Unlock()
	kc := a.k8s.Config()
	pub := cluster.NewDemandPublisher(cluster.DemandConfig{
		Client: kc.Client, Namespace: kc.AgentNamespace, Node: kc.NodeName,
		Interval: p.Interval.Duration, Moved: demandMoved,
	})
	// A quarter of the interval, 100 ms to 1 s: a hot key is reported
	// within a quarter of an interval of turning hot (the publisher
	// writes at most once an interval all the same).
	period := func(p v1alpha1.DemandShares) time.Duration {
		return min(max(p.Interval.Duration/4, 100*time.Millisecond), time.Second)
	}
	every := period(p)
	t := time.NewTicker(every)
	defer t.Stop()
	var failing bool
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := time.Now()
		a.mu.Lock()
		p := a.demandParams()
		if d := period(p); d != every {
			every = d
			t.Reset(every)
		}
		pub.Configure(p.Interval.Duration, 10*p.Interval.Duration)
		if metas, err := a.dp.Metas(); err == nil {
			a.observeHotKeys(metas, now)
		}
		// The shares step at this period too (a stale allocation, a
		// round's release): the reconcile writes what changed.
		if a.stepDemand(now) {
			a.wake()
		}
		published := pub.Published()
		var ds []cluster.Demand
		rates := a.enforcedRates()
		keyed, hotKeysSum := 0, 0
		for _, st := range a.demand {
			if st.keys != nil {
				keyed++
				hotKeysSum += st.hotKeys
			}
		}
		for name, st := range a.demand {
			if rates[name] == 0 {
				continue // not enforced here: nothing to measure
			}
			if st.keys != nil {
				// A keyed limit's demand is its hot keys': the limit's
				// own (all keys together) is not reported, so that
				// traffic spread over keys under their shares writes
				// nothing.
				n := st.hotKeys
				if hotKeysSum > cluster.MaxReportKeys {
					n = min(n, max(1, cluster.MaxReportKeys/keyed))
				}
				ds = append(ds, cluster.Demand{Limit: name, Threshold: max(1, float64(st.equal)/100),
					Keys: st.hotDemands(n, now, p.Interval.Duration+every, 2*hotTick(p.Interval.Duration)+every, hotTick(p.Interval.Duration))})
				continue
			}
			rate, warm := st.meter.Demand()
			if !warm {
				continue
			}
			if old, ok := published[name]; ok && !st.unsettled.IsZero() && now.Sub(st.unsettled) < p.Interval.Duration {
				// On its way to a new level: what was reported stands
				// until it settles, or for an interval.
				rate = float64(old)
			}
			ds = append(ds, cluster.Demand{Limit: name, Rate: rate, Threshold: max(1, float64(st.equal)/100)})
		}
		a.mu.Unlock()
		// Also without demands: the Lease carries the node's verdicts too
		// (cluster.Reporter), and its keep-alives keep them standing.
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		w, err := pub.Publish(wctx, ds)
		cancel()
		if w == nil {
			continue
		}
		if len(w.Keys) > 0 {
			a.log.Debug("hot keys reported", "keys", w.Keys, "error", err)
		}
		if err != nil && !failing {
			a.log.Warn("demand report not written; the allocation counts the last one until it expires", "error", err)
		} else if err == nil && failing {
			a.log.Info("demand report written again")
		}
		failing = err != nil
		a.mu.Lock()
		for name, keys := range w.Keys {
			if st := a.demand[name]; st != nil && st.keys != nil {
				if err != nil {
					// As for a limit's demand (below), per key.
					for key, d := range keys {
						r, ok := st.keys.LastReport(key)
						keys[key] = min(d, r.Demand)
						if !ok {
							keys[key] = 0
						}
					}
				}
				st.keys.Reported(keys, w.At)
			}
		}
		for name, d := range w.Demands {
			st := a.demand[name]
			if st == nil || st.keys != nil {
				continue
			}
			if err != nil {
				// It may have reached the API server all the same: no
				// more than either counts.
				if r, ok := st.node.LastReport(); ok {
					d = min(d, r.Demand)
				} else {
					d = 0
				}
			}
			st.node.Reported(d, w.At)
		}
		a.mu.Unlock()
	}
}
