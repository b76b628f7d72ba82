package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/demand"
)

// Demand shares in a cluster: many reporters, one allocator.
//
// Each agent reports its node's demand for every limit with share: demand
// in a Lease of its own (coordination.k8s.io/v1, named DemandLeasePrefix +
// node, in the agents' namespace): one annotation holding a JSON object of
// limit name -> units/s. A Lease rather than a custom object: it is
// built in (served as protobuf, no CRD to install first), its holder and
// renew time say whose report it is and how old, and it is the object
// Kubernetes itself uses for a per-node heartbeat (KEP-589). A report is
// written at most once per interval, and only when a demand moved by more
// than its threshold, or when it is KeepAlive old: the writes grow with
// the changes of demand, not with time.

const (
	// DemandLeasePrefix + node name is a node's demand Lease.
	DemandLeasePrefix = "rlagent-demand-"
	// labelDemand marks the demand Leases, so that the allocator lists
	// only them.
	labelDemand = "rlagent.io/demand"
	// annotationDemand holds the node's demands: {"limit": units/s}, as
	// of spec.renewTime.
	annotationDemand = "rlagent.io/demand"
	// annotationPrevious holds the report the write replaced:
	// {"at": time, "demands": {...}}. A round counts the latest report
	// an interval old (demand.Counted), which may be that one.
	annotationPrevious = "rlagent.io/demand-previous"
	// annotationKeyDemand holds the hot keys of the node's keyed limits
	// with share demand: {"limit": {"key": units/s}}, as of
	// spec.renewTime; a keyed limit without a hot key has {}. Absent when
	// the node has no keyed demand-shared limit.
	annotationKeyDemand = "rlagent.io/key-demand"
)

// previousReport is annotationPrevious's value.
type previousReport struct {
	At      metav1.MicroTime             `json:"at"`
	Demands map[string]uint64            `json:"demands"`
	Keys    map[string]map[string]uint64 `json:"keys,omitempty"`
}

// MaxReportKeys is how many hot keys one node reports at most, over all
// its keyed demand-shared limits (the agent gives each an equal part when
// their hotKeys sum to more): at most about 70 bytes a key (an IPv6
// network and a 20-digit demand) keep a report under 64 KiB
// (TestKeyedSizes).
const MaxReportKeys = 900

// DemandConfig configures a node's demand reports.
type DemandConfig struct {
	Client    kubernetes.Interface
	Namespace string // the agents'
	Node      string
	// Interval is the least time between two writes (default 15 s).
	Interval time.Duration
	// Moved is the fraction a demand must move by to be written again
	// (default 0.1); it must also move by more than the limit's own
	// absolute threshold (Demand.Threshold).
	Moved float64
	// KeepAlive is how old an unchanged report may get before it is
	// written again (default 10 x Interval). The Lease's duration is
	// twice that: a report older is of a node that is gone.
	KeepAlive time.Duration
	// Now is the clock (default time.Now).
	Now func() time.Time
}

// Demand is one limit's demand at this node.
type Demand struct {
	Limit string
	// Rate is the smoothed demand, units/s.
	Rate float64
	// Threshold is the least change, units/s, worth a write (the limit's
	// floor share, say).
	Threshold float64
	// Keys are, for a keyed limit, its hot keys' demands, units/s (nil:
	// not keyed; empty: keyed, no key hot). A key moves by Moved and
	// Threshold as Rate does; a key that appears or cools is a change.
	Keys map[string]float64
}

// DemandPublisher writes this node's demand Lease.
type DemandPublisher struct {
	cfg DemandConfig

	mu        sync.Mutex
	published map[string]uint64            // what the Lease says, once written
	keys      map[string]map[string]uint64 // and of the keyed limits' hot keys
	at        time.Time                    // when it was written
	tried     time.Time                    // the last write, failed or not
}

// NewDemandPublisher returns a publisher with cfg's defaults applied.
func NewDemandPublisher(cfg DemandConfig) *DemandPublisher {
	if cfg.Interval <= 0 {
		cfg.Interval = 15 * time.Second
	}
	if cfg.Moved <= 0 {
		cfg.Moved = 0.1
	}
	if cfg.KeepAlive <= 0 {
		cfg.KeepAlive = 10 * cfg.Interval
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &DemandPublisher{cfg: cfg}
}

// DemandWrite is one write of the demand Lease: the demands (and the
// keyed limits' hot keys') and the time the Lease says they are of
// (spec.renewTime, to the microsecond).
type DemandWrite struct {
	Demands map[string]uint64
	Keys    map[string]map[string]uint64
	At      time.Time
}

// Published is the demand of each limit as the Lease last said it (nil
// before the first write): a node computes its share from what it
// reported, the same number the allocator used, not from its live
// estimate, or the shares would not sum to the rate.
func (p *DemandPublisher) Published() map[string]uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.published)
}

// Configure changes the interval and keep-alive (a config reload); zero
// values keep the current ones.
func (p *DemandPublisher) Configure(interval, keepAlive time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if interval > 0 {
		p.cfg.Interval = interval
	}
	if keepAlive > 0 {
		p.cfg.KeepAlive = keepAlive
	}
}

// Publish writes the demands if they are worth a write (see DemandConfig)
// and returns the write it tried, or nil. A failed write is returned with
// its error and leaves what was published as it was (though it may have
// reached the API server: the caller takes the smaller of the two for the
// report); a Publish one interval later tries again (an API server that
// does not answer is asked once an interval, not at every call).
func (p *DemandPublisher) Publish(ctx context.Context, ds []Demand) (*DemandWrite, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.cfg.Now().Truncate(time.Microsecond) // what the Lease's MicroTime holds
	if !p.tried.IsZero() && now.Sub(p.tried) < p.cfg.Interval {
		return nil, nil
	}
	next := make(map[string]uint64, len(ds))
	var keys map[string]map[string]uint64
	changed := p.published == nil || now.Sub(p.at) >= p.cfg.KeepAlive || len(ds) != len(p.published)
	for _, d := range ds {
		next[d.Limit] = units(d.Rate)
		old, ok := p.published[d.Limit]
		changed = changed || !ok || demand.Moved(float64(old), d.Rate, p.cfg.Moved, d.Threshold)
		if d.Keys == nil {
			continue
		}
		if keys == nil {
			keys = make(map[string]map[string]uint64)
		}
		ks := make(map[string]uint64, len(d.Keys))
		was, had := p.keys[d.Limit]
		changed = changed || !had || len(was) != len(d.Keys)
		for k, rate := range d.Keys {
			ks[k] = units(rate)
			old, ok := was[k]
			changed = changed || !ok || demand.Moved(float64(old), rate, p.cfg.Moved, d.Threshold)
		}
		keys[d.Limit] = ks
	}
	changed = changed || len(keys) != len(p.keys)
	if !changed {
		return nil, nil
	}
	p.tried = now
	w := &DemandWrite{Demands: next, Keys: keys, At: now}
	if err := p.write(ctx, next, keys, now); err != nil {
		return w, err
	}
	p.published, p.keys, p.at = next, keys, now
	return w, nil
}

// units rounds a demand to whole units/s. A demand that is not a number
// (or below 0) is none, one beyond uint64 the most there is: Go leaves
// their conversion to the CPU, and a report must not depend on it.
func units(rate float64) uint64 {
	switch {
	case !(rate > 0): // NaN too
		return 0
	case rate >= math.MaxUint64:
		return math.MaxUint64
	}
	return uint64(rate + 0.5)
}

func (p *DemandPublisher) write(ctx context.Context, demands map[string]uint64, keys map[string]map[string]uint64, now time.Time) error {
	value, err := json.Marshal(demands) // sorted keys: the same demands, the same bytes
	if err != nil {
		return err
	}
	keyValue, err := json.Marshal(keys)
	if err != nil {
		return err
	}
	leases := p.cfg.Client.CoordinationV1().Leases(p.cfg.Namespace)
	name := DemandLeasePrefix + p.cfg.Node
	spec := coordinationv1.LeaseSpec{
		HolderIdentity:       ptr.To(p.cfg.Node),
		LeaseDurationSeconds: ptr.To(int32(max(1, (2 * p.cfg.KeepAlive).Seconds()))),
		RenewTime:            &metav1.MicroTime{Time: now},
	}
	l, err := leases.Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		l = &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: p.cfg.Namespace,
			Labels:      map[string]string{labelDemand: "node"},
			Annotations: map[string]string{annotationDemand: string(value)},
		}, Spec: spec}
		if keys != nil {
			l.Annotations[annotationKeyDemand] = string(keyValue)
		}
		if _, err := leases.Create(ctx, l, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create demand lease %s/%s: %w", p.cfg.Namespace, name, err)
		}
		return nil
	case err != nil:
		return fmt.Errorf("get demand lease %s/%s: %w", p.cfg.Namespace, name, err)
	}
	l = l.DeepCopy()
	prev := ""
	if l.Spec.RenewTime != nil {
		var cur map[string]uint64
		var curKeys map[string]map[string]uint64
		if raw, ok := l.Annotations[annotationKeyDemand]; ok && json.Unmarshal([]byte(raw), &curKeys) != nil {
			curKeys = nil
		}
		if json.Unmarshal([]byte(l.Annotations[annotationDemand]), &cur) == nil {
			b, err := json.Marshal(previousReport{At: *l.Spec.RenewTime, Demands: cur, Keys: curKeys})
			if err != nil {
				return err
			}
			prev = string(b)
		}
	}
	if l.Labels == nil {
		l.Labels = map[string]string{}
	}
	if l.Annotations == nil {
		l.Annotations = map[string]string{}
	}
	l.Labels[labelDemand] = "node"
	l.Annotations[annotationDemand] = string(value)
	if keys != nil {
		l.Annotations[annotationKeyDemand] = string(keyValue)
	} else {
		delete(l.Annotations, annotationKeyDemand)
	}
	if prev != "" {
		l.Annotations[annotationPrevious] = prev
	} else {
		delete(l.Annotations, annotationPrevious)
	}
	l.Spec.HolderIdentity, l.Spec.LeaseDurationSeconds, l.Spec.RenewTime = spec.HolderIdentity, spec.LeaseDurationSeconds, spec.RenewTime
	if _, err := leases.Update(ctx, l, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("update demand lease %s/%s: %w", p.cfg.Namespace, name, err)
	}
	return nil
}

// maxReportAge is how long a node's report stands after its Lease's
// renewTime at most, whatever the Lease's duration says, for the report
// interval interval: a node writes its report at least every KeepAlive
// (10 intervals) and gives it a duration of two KeepAlives (one failed
// write tolerated), so a report not renewed within that is of a node that
// is gone; a longer duration would keep a node's report counted, for
// ever, after it left.
func maxReportAge(interval time.Duration) time.Duration { return 20 * interval }

// parseDemandLease reads a demand Lease; ok is false for a Lease that is
// not one, or whose report expired at now (a node that is gone). Only a
// Lease the admission policy rlagent-demand-leases binds to its node is
// one: named DemandLeasePrefix + the node, held by that node (the status
// Lease and other Leases with the label are not reports). Its report
// stands for its duration, at most maxAge, and one dated more than
// demand.ClockSkew ahead of now is not counted (it would stand until its
// date). A previous report that cannot be read is left out (the latest
// then counts only once an interval old).
func parseDemandLease(l *coordinationv1.Lease, now time.Time, maxAge time.Duration) (demand.NodeReport, bool, error) {
	node, ok := nodeOf(l, now, maxAge)
	if !ok {
		return demand.NodeReport{}, false, nil
	}
	renewed := l.Spec.RenewTime.Time
	var d map[string]uint64
	if err := json.Unmarshal([]byte(l.Annotations[annotationDemand]), &d); err != nil {
		return demand.NodeReport{}, false, fmt.Errorf("demand lease %s: annotation %s: %w", l.Name, annotationDemand, err)
	}
	nd := demand.NodeReport{Node: node, Demands: d, Renewed: renewed}
	if raw, ok := l.Annotations[annotationKeyDemand]; ok {
		if err := json.Unmarshal([]byte(raw), &nd.Keys); err != nil {
			return demand.NodeReport{}, false, fmt.Errorf("demand lease %s: annotation %s: %w", l.Name, annotationKeyDemand, err)
		}
	}
	if raw, ok := l.Annotations[annotationPrevious]; ok {
		var p previousReport
		if err := json.Unmarshal([]byte(raw), &p); err == nil && p.At.Before(&metav1.MicroTime{Time: renewed}) {
			nd.Previous, nd.PrevAt, nd.PrevKeys = p.Demands, p.At.Time, p.Keys
		}
	}
	return nd, true, nil
}

// nodeOf is the node whose Lease l is, if it is a node's Lease that
// still stands at now: labelled, named DemandLeasePrefix + its holder (as
// the admission policy binds it to the holder's node), renewed no more than
// its duration ago, and that at most maxAge, and not more than
// demand.ClockSkew ahead of now.
func nodeOf(l *coordinationv1.Lease, now time.Time, maxAge time.Duration) (string, bool) {
	if l.Labels[labelDemand] != "node" || l.Spec.HolderIdentity == nil || l.Spec.RenewTime == nil || l.Spec.LeaseDurationSeconds == nil {
		return "", false
	}
	node := *l.Spec.HolderIdentity
	if node == "" || l.Name != DemandLeasePrefix+node {
		return "", false
	}
	renewed := l.Spec.RenewTime.Time
	age := min(time.Duration(*l.Spec.LeaseDurationSeconds)*time.Second, maxAge)
	if now.Sub(renewed) > age || renewed.Sub(now) > demand.ClockSkew {
		return "", false
	}
	return node, true
}

// allocationStatus is a round as the status holds it.
func allocationStatus(r demand.Allocation, nodes int, asked uint64, keys []demand.KeyLevel) *v1alpha1.Allocation {
	a := &v1alpha1.Allocation{Round: r.Round, Floor: r.Level.Floor, Nodes: int32(min(nodes, math.MaxInt32)), Demand: asked, Time: metav1.NewMicroTime(r.Time)}
	if r.Level.Water != math.MaxUint64 {
		a.Water = ptr.To(r.Level.Water)
	}
	for _, kl := range keys {
		ka := v1alpha1.KeyAllocation{Key: kl.Key, Nodes: kl.Nodes}
		if kl.Level.Water != math.MaxUint64 {
			ka.Water = ptr.To(kl.Level.Water)
		}
		a.Keys = append(a.Keys, ka)
	}
	return a
}
