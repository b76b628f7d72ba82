package cluster

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/internal/k8stest"
	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/utils/ptr"
)

// reportLease is a Lease with the demand label and a report of demands,
// renewed at renewed, for duration.
func reportLease(name, holder string, renewed time.Time, duration time.Duration, demands map[string]uint64) *coordinationv1.Lease {
	b, _ := json.Marshal(demands)
	l := &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{labelDemand: "node"},
			Annotations: map[string]string{annotationDemand: string(b)}},
		Spec: coordinationv1.LeaseSpec{
			LeaseDurationSeconds: ptr.To(int32(duration / time.Second)),
			RenewTime:            &metav1.MicroTime{Time: renewed},
		},
	}
	if holder != "" {
		l.Spec.HolderIdentity = ptr.To(holder)
	}
	return l
}

// TestParseDemandLeaseAccepts: the allocator takes a report only from a
// Lease the admission policy binds to the node it claims (named
// rlagent-demand-NODE, held by NODE), for at most maxReportAge whatever
// duration it claims, and not from the future.
func TestParseDemandLeaseAccepts(t *testing.T) {
	now := time.Unix(100_000, 0)
	const interval = 15 * time.Second
	d := map[string]uint64{"web": 700}
	for _, tc := range []struct {
		name string
		l    *coordinationv1.Lease
		ok   bool
	}{
		{"a node's own", reportLease("rlagent-demand-node-a", "node-a", now.Add(-time.Minute), 300*time.Second, d), true},
		{"at the bound", reportLease("rlagent-demand-node-a", "node-a", now.Add(-maxReportAge(interval)), 10*time.Hour, d), true},
		{"a clock a little ahead", reportLease("rlagent-demand-node-a", "node-a", now.Add(time.Second), 300*time.Second, d), true},
		{"the status Lease", reportLease("rlagent-status", "node-a", now.Add(-time.Minute), 300*time.Second, d), false},
		{"the status Lease, named as a node", reportLease("rlagent-status", "status", now.Add(-time.Minute), 300*time.Second, d), false},
		{"another node's name", reportLease("rlagent-demand-node-b", "node-a", now.Add(-time.Minute), 300*time.Second, d), false},
		{"no holder", reportLease("rlagent-demand-", "", now.Add(-time.Minute), 300*time.Second, d), false},
		{"another Lease", reportLease("node-a", "node-a", now.Add(-time.Minute), 300*time.Second, d), false},
		{"a duration of years", reportLease("rlagent-demand-node-a", "node-a", now.Add(-maxReportAge(interval)-time.Second), 1<<30*time.Second, d), false},
		{"from the future", reportLease("rlagent-demand-node-a", "node-a", now.Add(time.Hour), 300*time.Second, d), false},
	} {
		nd, ok, err := parseDemandLease(tc.l, now, maxReportAge(interval))
		if err != nil || ok != tc.ok || (ok && (nd.Node != "node-a" || nd.Demands["web"] != 700)) {
			t.Errorf("%s: %+v ok %v err %v, want ok %v", tc.name, nd, ok, err, tc.ok)
		}
	}
}

// TestAllocatorIgnoresForeignReports: against a real API server, the
// elected writer allocates a demand-shared limit from the one node's own
// report, not from Leases with the demand label that report for a node
// that is not their holder's, the status Lease, or a report whose
// duration would keep it for ever.
func TestAllocatorIgnoresForeignReports(t *testing.T) {
	env := sharedEnv(t)
	ns := env.Namespace(t)
	env.SetDaemonSetStatus(t, ns, "rlagent", 3, 3)
	env.CreateRateLimit(t, k8stest.RateLimit("foreign-reports", map[string]any{
		"rate": int64(6000), "scope": "nodes", "share": "demand", "match": map[string]any{},
	}))
	leases := env.Clientset().CoordinationV1().Leases(ns)
	ctx := context.Background()
	now := time.Now()
	huge := map[string]uint64{"foreign-reports": 1_000_000}
	for _, l := range []*coordinationv1.Lease{
		reportLease(DemandLeasePrefix+"node-a", "node-a", now.Add(-20*time.Second), 300*time.Second, map[string]uint64{"foreign-reports": 1000}),
		reportLease(DemandLeasePrefix+"node-b", "node-c", now.Add(-20*time.Second), 300*time.Second, huge),
		reportLease("rlagent-status", "node-a", now.Add(-20*time.Second), 15*time.Second, huge), // the election's: node-a takes it
		reportLease(DemandLeasePrefix+"node-d", "node-d", now.Add(-time.Hour), 1<<30*time.Second, huge),
	} {
		if _, err := leases.Create(ctx, l, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	startStatus(t, env, ns, "node-a")
	rl := dynamic.NewForConfigOrDie(env.Config).Resource(v1alpha1.RateLimitResource)
	k8stest.WaitUntil(t, "a round", func() bool {
		st, _ := statusOf(t, rl, "foreign-reports")
		return st.Allocation != nil
	})
	st, _ := statusOf(t, rl, "foreign-reports")
	if a := st.Allocation; a.Nodes != 1 || a.Demand != 1000 || a.Water != nil {
		t.Errorf("allocation: %d nodes, demand %d, water %v; want node-a's report alone: 1 node, demand 1000, no water level", a.Nodes, a.Demand, a.Water)
	}
}
