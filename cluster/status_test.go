package cluster

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/internal/k8stest"
)

// agentStatus is one agent's status side: its source, its reporter and its
// candidacy for writing.
type agentStatus struct {
	*source
	rep    *Reporter
	w      *StatusWriter
	cancel context.CancelFunc
	done   chan struct{}
}

func startStatus(t *testing.T, env *k8stest.Env, ns, node string) *agentStatus {
	t.Helper()
	a := &agentStatus{source: startSource(t, env, ns, node), done: make(chan struct{})}
	a.rep = NewReporter(a.k)
	a.w = NewStatusWriter(a.k, StatusConfig{Identity: node, Log: quietLog()})
	ctx, cancel := context.WithCancel(context.Background())
	a.cancel = cancel
	go func() { a.w.Run(ctx); close(a.done) }()
	t.Cleanup(a.stop)
	return a
}

func (a *agentStatus) stop() {
	a.cancel()
	<-a.done
	a.rep.Close()
}

// statusOf reads a RateLimit's status from the API server.
func statusOf(t *testing.T, rl dynamic.ResourceInterface, name string) (v1alpha1.RateLimitStatus, int64) {
	t.Helper()
	u, err := rl.Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var st v1alpha1.RateLimitStatus
	raw, _, _ := unstructured.NestedMap(u.Object, "status")
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(raw, &st); err != nil {
		t.Fatal(err)
	}
	return st, u.GetGeneration()
}

// TestStatusOneWriter: of three agents, one holds the Lease and writes
// RateLimit status; a count change is one status write, whatever the
// number of agents. Node reports (in the nodes' Leases) reach the condition: the worst
// report stands, with how many other nodes report a problem, and
// lastTransitionTime moves only when the condition's status does. When the
// writer stops, another agent takes over and writes the next change.
func TestStatusOneWriter(t *testing.T) {
	env := sharedEnv(t)
	ns := env.Namespace(t)
	env.SetDaemonSetStatus(t, ns, "rlagent", 3, 3)
	obj := env.CreateRateLimit(t, k8stest.RateLimit("one-writer", map[string]any{"rate": int64(90), "scope": "nodes", "match": map[string]any{}}))
	rl := dynamic.NewForConfigOrDie(env.Config).Resource(v1alpha1.RateLimitResource)

	// Every status write of the RateLimit, as a watch sees it.
	w, err := rl.Watch(context.Background(), metav1.ListOptions{FieldSelector: "metadata.name=one-writer", ResourceVersion: obj.GetResourceVersion()})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	var writes atomic.Int64
	go func() {
		for ev := range w.ResultChan() {
			if ev.Type == watch.Modified {
				writes.Add(1)
			}
		}
	}()

	var agents []*agentStatus
	for _, node := range []string{"node-a", "node-b", "node-c"} {
		agents = append(agents, startStatus(t, env, ns, node))
	}
	leader := func() *agentStatus {
		var l *agentStatus
		k8stest.WaitUntil(t, "one writer", func() bool {
			l = nil
			n := 0
			for _, a := range agents {
				if a.w.Leading() {
					l, n = a, n+1
				}
			}
			return n == 1
		})
		return l
	}
	lead := leader()
	t.Logf("writer: %s", lead.w.cfg.Identity)

	cond := func() (*metav1.Condition, int32) {
		st, _ := statusOf(t, rl, "one-writer")
		return meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionAccepted), st.Replicas
	}
	waitStatus := func(what, status, reason, msg string, replicas int32) *metav1.Condition {
		t.Helper()
		var c *metav1.Condition
		k8stest.WaitUntil(t, what, func() bool {
			var n int32
			c, n = cond()
			return c != nil && string(c.Status) == status && c.Reason == reason && strings.HasPrefix(c.Message, msg) && n == replicas
		})
		t.Logf("%s: %s %s %q, replicas %d", what, c.Status, c.Reason, c.Message, replicas)
		return c
	}
	first := waitStatus("created", "True", v1alpha1.ReasonValid, "", 3)

	// A count change: one write.
	time.Sleep(time.Second) // the first writes settle
	before := writes.Load()
	env.SetDaemonSetStatus(t, ns, "rlagent", 2, 3)
	waitStatus("count 2", "True", v1alpha1.ReasonValid, "", 2)
	time.Sleep(2 * time.Second) // time for any other write to show
	if n := writes.Load() - before; n != 1 {
		t.Errorf("one count change, %d status writes; want 1", n)
	}

	// Node reports, in each node's Lease.
	cur := func() *v1alpha1.RateLimit { return agents[0].k.RateLimit("one-writer") }
	report := func(a *agentStatus, v Verdict) {
		t.Helper()
		a.rep.Report(cur(), v, time.Now())
		if err := a.rep.Flush(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	report(agents[1], Verdict{NotApplied: "the data path holds 128 limits"})
	c := waitStatus("node-b does not fit", "False", v1alpha1.ReasonDoesNotFit, "node node-b: the data path holds 128 limits", 2)
	if !c.LastTransitionTime.After(first.LastTransitionTime.Time) {
		t.Errorf("True -> False kept lastTransitionTime %v", c.LastTransitionTime)
	}
	report(agents[2], Verdict{Clamped: "share clamped to 4000000000/s"})
	waitStatus("node-c clamped too", "False", v1alpha1.ReasonDoesNotFit, "node node-b: the data path holds 128 limits (and 1 more node(s)", 2)
	report(agents[1], Verdict{})
	c2 := waitStatus("node-b applied", "True", v1alpha1.ReasonClamped, "node node-c: share clamped", 2)
	report(agents[2], Verdict{})
	c3 := waitStatus("node-c applied", "True", v1alpha1.ReasonValid, "", 2)
	if !c3.LastTransitionTime.Equal(&c2.LastTransitionTime) {
		t.Errorf("True (Clamped) -> True (Valid) moved lastTransitionTime from %v to %v", c2.LastTransitionTime, c3.LastTransitionTime)
	}

	// The writer goes: another takes over.
	lead.stop()
	var rest []*agentStatus
	for _, a := range agents {
		if a != lead {
			rest = append(rest, a)
		}
	}
	agents = rest
	took := time.Now()
	next := leader()
	t.Logf("%s took over from %s in %v", next.w.cfg.Identity, lead.w.cfg.Identity, time.Since(took).Round(time.Millisecond))
	env.SetDaemonSetStatus(t, ns, "rlagent", 1, 3)
	waitStatus("count 1, new writer", "True", v1alpha1.ReasonValid, "", 1)
}

// TestStatusInvalid: the writer writes Accepted=False, reason Invalid, with
// the validation error, for a RateLimit the schema admits and the agents
// reject.
func TestStatusInvalid(t *testing.T) {
	env := sharedEnv(t)
	ns := env.Namespace(t)
	env.CreateRateLimit(t, k8stest.RateLimit("status-invalid", map[string]any{
		"rate": int64(90), "scope": "nodes", "action": "pace", "attach": "uplink", "horizon": "10s",
		"match": map[string]any{"direction": "egress"},
	}))
	startStatus(t, env, ns, "node-a")
	rl := dynamic.NewForConfigOrDie(env.Config).Resource(v1alpha1.RateLimitResource)
	k8stest.WaitUntil(t, "Accepted=False, Invalid", func() bool {
		st, gen := statusOf(t, rl, "status-invalid")
		c := meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionAccepted)
		return c != nil && c.Status == metav1.ConditionFalse && c.Reason == v1alpha1.ReasonInvalid &&
			strings.Contains(c.Message, "horizon") && c.ObservedGeneration == gen && st.ObservedGeneration == gen
	})
}

// TestCandidates: about Candidates agents stand for election whatever the
// cluster's size, and every agent of a small cluster does.
func TestCandidates(t *testing.T) {
	for _, desired := range []int{1, 3, 8, 100, 1000, 5000} {
		n := 0
		for i := range desired {
			if candidate(fmt.Sprintf("node-%05d", i), desired, 8) {
				n++
			}
		}
		t.Logf("%d nodes: %d candidates", desired, n)
		if desired <= 8 && n != desired {
			t.Errorf("%d nodes: %d candidates, want all", desired, n)
		}
		if desired > 8 && (n < 2 || n > 24) {
			t.Errorf("%d nodes: %d candidates, want about 8", desired, n)
		}
	}
}

// TestStatusEnforcedInProcess: a RateLimit with unit requests is the
// limiter library's: the writer marks it Accepted with EnforcedInProcess
// (no node reports on it), and an invalid one Invalid, as any other.
func TestStatusEnforcedInProcess(t *testing.T) {
	env := sharedEnv(t)
	ns := env.Namespace(t)
	env.SetDaemonSetStatus(t, ns, "rlagent", 1, 1)
	env.CreateRateLimit(t, k8stest.RateLimit("in-process", map[string]any{"rate": int64(300), "unit": "requests",
		"scope": "service", "onEmpty": "wait", "match": map[string]any{"service": ns + "/api"}}))
	rl := dynamic.NewForConfigOrDie(env.Config).Resource(v1alpha1.RateLimitResource)
	startStatus(t, env, ns, "node-a")
	var c *metav1.Condition
	k8stest.WaitUntil(t, "Accepted EnforcedInProcess", func() bool {
		st, _ := statusOf(t, rl, "in-process")
		c = meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionAccepted)
		return c != nil && c.Reason == v1alpha1.ReasonEnforcedInProcess
	})
	if c.Status != metav1.ConditionTrue || !strings.Contains(c.Message, "processes of Service "+ns+"/api") {
		t.Errorf("Accepted = %s %s %q, want True with the Service named", c.Status, c.Reason, c.Message)
	}
}
