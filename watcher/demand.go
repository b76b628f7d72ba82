package watcher

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"slices"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

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
	// annotationDemand holds the node's demands: {"limit": units/s}.
	annotationDemand = "rlagent.io/demand"
)

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
}

// DemandPublisher writes this node's demand Lease.
type DemandPublisher struct {
	cfg DemandConfig

	mu        sync.Mutex
	published map[string]uint64 // what the Lease says, once written
	at        time.Time         // when it was written
	tried     time.Time         // the last write, failed or not
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

// Published is the demand of each limit as the Lease last said it (nil
// before the first write): a node computes its share from what it
// reported, the same number the allocator used, not from its live
// estimate, or the shares would not sum to the rate.
func (p *DemandPublisher) Published() map[string]uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.published)
}

// Publish writes the demands if they are worth a write (see DemandConfig)
// and reports whether it wrote. A failed write is returned and leaves what
// was published as it was; a Publish one interval later tries again (an
// API server that does not answer is asked once an interval, not at every
// call).
func (p *DemandPublisher) Publish(ctx context.Context, ds []Demand) (bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.cfg.Now()
	if !p.tried.IsZero() && now.Sub(p.tried) < p.cfg.Interval {
		return false, nil
	}
	next := make(map[string]uint64, len(ds))
	changed := p.published == nil || now.Sub(p.at) >= p.cfg.KeepAlive || len(ds) != len(p.published)
	for _, d := range ds {
		next[d.Limit] = units(d.Rate)
		old, ok := p.published[d.Limit]
		changed = changed || !ok || demand.Moved(float64(old), d.Rate, p.cfg.Moved, d.Threshold)
	}
	if !changed {
		return false, nil
	}
	p.tried = now
	if err := p.write(ctx, next, now); err != nil {
		return false, err
	}
	p.published, p.at = next, now
	return true, nil
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

func (p *DemandPublisher) write(ctx context.Context, demands map[string]uint64, now time.Time) error {
	value, err := json.Marshal(demands) // sorted keys: the same demands, the same bytes
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
		if _, err := leases.Create(ctx, l, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create demand lease %s/%s: %w", p.cfg.Namespace, name, err)
		}
		return nil
	case err != nil:
		return fmt.Errorf("get demand lease %s/%s: %w", p.cfg.Namespace, name, err)
	}
	l = l.DeepCopy()
	if l.Labels == nil {
		l.Labels = map[string]string{}
	}
	if l.Annotations == nil {
		l.Annotations = map[string]string{}
	}
	l.Labels[labelDemand] = "node"
	l.Annotations[annotationDemand] = string(value)
	l.Spec.HolderIdentity, l.Spec.LeaseDurationSeconds, l.Spec.RenewTime = spec.HolderIdentity, spec.LeaseDurationSeconds, spec.RenewTime
	if _, err := leases.Update(ctx, l, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("update demand lease %s/%s: %w", p.cfg.Namespace, name, err)
	}
	return nil
}

// NodeDemand is one node's report as the allocator reads it.
type NodeDemand struct {
	Node    string
	Demands map[string]uint64
	Renewed time.Time
}

// parseDemandLease reads a demand Lease; ok is false for a Lease that is
// not one, or whose report expired at now (a node that is gone).
func parseDemandLease(l *coordinationv1.Lease, now time.Time) (NodeDemand, bool, error) {
	if l.Labels[labelDemand] != "node" || l.Spec.HolderIdentity == nil || l.Spec.RenewTime == nil || l.Spec.LeaseDurationSeconds == nil {
		return NodeDemand{}, false, nil
	}
	renewed := l.Spec.RenewTime.Time
	if now.Sub(renewed) > time.Duration(*l.Spec.LeaseDurationSeconds)*time.Second {
		return NodeDemand{}, false, nil
	}
	var d map[string]uint64
	if err := json.Unmarshal([]byte(l.Annotations[annotationDemand]), &d); err != nil {
		return NodeDemand{}, false, fmt.Errorf("demand lease %s: annotation %s: %w", l.Name, annotationDemand, err)
	}
	return NodeDemand{Node: *l.Spec.HolderIdentity, Demands: d, Renewed: renewed}, true, nil
}

// allocate computes each limit's level from the nodes' reports: the limits
// named in rates (the global rate and the floor of each), over the nodes
// that report a demand for it.
func allocate(rates map[string][2]uint64, nodes []NodeDemand) map[string]demand.Level {
	out := make(map[string]demand.Level, len(rates))
	for _, name := range slices.Sorted(maps.Keys(rates)) {
		var ds []uint64
		for _, n := range nodes {
			if d, ok := n.Demands[name]; ok {
				ds = append(ds, d)
			}
		}
		out[name] = demand.Allocate(rates[name][0], rates[name][1], ds)
	}
	return out
}
