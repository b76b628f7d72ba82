package watcher

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/rlagent/rlagent/api/v1alpha1"
)

// Two agents report on one RateLimit: the condition converges on the worst
// report, a node's report is not overwritten by another node's milder one,
// and a node clears its own report when it recovers.
func TestReportStatusConverges(t *testing.T) {
	h := newHarness(t) // node-a
	b := NewKubernetes(KubernetesConfig{
		Client: h.cs, Dynamic: h.dyn, NodeName: "node-b", Log: quietLog(),
		Probe: func(context.Context) error { return nil },
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { b.Run(ctx, func() {}); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	waitFor(t, b.Synced)
	h.createRL(t, rateLimit("x", map[string]any{"rate": int64(5), "scope": "nodes", "match": map[string]any{}}))

	// cond reads the condition as an agent's cache holds it.
	cond := func(k *Kubernetes) (status, reason, message string) {
		obj, ok, _ := k.rlInformer.GetStore().GetByKey("x")
		if !ok {
			return "", "", ""
		}
		c := map[string]any{}
		if conds, _, _ := unstructured.NestedSlice(obj.(*unstructured.Unstructured).Object, "status", "conditions"); len(conds) == 1 {
			c, _ = conds[0].(map[string]any)
		}
		return fmt.Sprint(c["status"]), fmt.Sprint(c["reason"]), fmt.Sprint(c["message"])
	}
	// report has k report v, then waits until both caches show want.
	report := func(k *Kubernetes, v Verdict, wantStatus, wantReason, wantMessage string) {
		t.Helper()
		waitFor(t, func() bool { _, ok, _ := k.rlInformer.GetStore().GetByKey("x"); return ok })
		if err := k.ReportStatus(context.Background(), "x", v, 2); err != nil {
			t.Fatalf("%s reports %+v: %v", k.cfg.NodeName, v, err)
		}
		deadline := time.Now().Add(5 * time.Second)
		for {
			sa, ra, ma := cond(h.k)
			sb, rb, mb := cond(b)
			if sa == wantStatus && ra == wantReason && strings.HasPrefix(ma, wantMessage) && sa == sb && ra == rb && ma == mb {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("after %s reports %+v: condition %s %s %q (node-b's cache: %s %s %q), want %s %s %q",
					k.cfg.NodeName, v, sa, ra, ma, sb, rb, mb, wantStatus, wantReason, wantMessage)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	const noRoom = "does not fit: the data path holds 128 limits"
	report(h.k, Verdict{}, "True", v1alpha1.ReasonValid, "")
	report(b, Verdict{NotApplied: noRoom}, "False", v1alpha1.ReasonDoesNotFit, "node node-b: "+noRoom)
	// node-a's milder reports leave node-b's.
	report(h.k, Verdict{}, "False", v1alpha1.ReasonDoesNotFit, "node node-b: ")
	report(h.k, Verdict{Clamped: "clamped"}, "False", v1alpha1.ReasonDoesNotFit, "node node-b: ")
	// As severe, another node's: left too.
	report(h.k, Verdict{NotApplied: "other"}, "False", v1alpha1.ReasonDoesNotFit, "node node-b: ")
	// node-b recovers: it clears its own report; node-a's clamp then shows.
	report(b, Verdict{}, "True", v1alpha1.ReasonValid, "")
	report(h.k, Verdict{Clamped: "clamped"}, "True", v1alpha1.ReasonClamped, "node node-a: clamped")
	// A fallback to the uplink is as severe as a clamp: the first stays.
	report(b, Verdict{AtUplink: "enforced at the uplink: endpoint 10.0.0.5 has no interface of its own"}, "True",
		v1alpha1.ReasonClamped, "node node-a: clamped")
	report(h.k, Verdict{}, "True", v1alpha1.ReasonValid, "")
	report(b, Verdict{AtUplink: "enforced at the uplink: endpoint 10.0.0.5 has no interface of its own"}, "True",
		v1alpha1.ReasonEnforcedAtUplink, "node node-b: enforced at the uplink: endpoint 10.0.0.5 has no interface of its own")
	report(h.k, Verdict{Clamped: "clamped", AtUplink: "enforced at the uplink: x"}, "True",
		v1alpha1.ReasonEnforcedAtUplink, "node node-b: ")
	report(b, Verdict{}, "True", v1alpha1.ReasonValid, "")
	report(h.k, Verdict{Clamped: "clamped", AtUplink: "enforced at the uplink: x"}, "True", v1alpha1.ReasonClamped,
		"node node-a: clamped; enforced at the uplink: x")
	// Pacing ineffective on a node is as severe too.
	report(h.k, Verdict{}, "True", v1alpha1.ReasonValid, "")
	report(b, Verdict{PaceIneffective: "paced packets are not held to their departure time on eth0: root qdisc is fq_codel"}, "True",
		v1alpha1.ReasonPaceIneffective, "node node-b: paced packets are not held to their departure time on eth0: root qdisc is fq_codel")
	report(b, Verdict{}, "True", v1alpha1.ReasonValid, "")
	// An invalid spec is worse than all.
	report(b, Verdict{Invalid: errors.New("spec.rate: bad")}, "False", v1alpha1.ReasonInvalid, "spec.rate: bad")
	report(h.k, Verdict{Clamped: "clamped"}, "False", v1alpha1.ReasonInvalid, "spec.rate: bad")

	// Nothing to write when nothing changed.
	writes := func() (n int) {
		for _, a := range h.dyn.Actions() {
			if a.GetVerb() == "update" && a.GetSubresource() == "status" {
				n++
			}
		}
		return n
	}
	before := writes()
	if before == 0 {
		t.Fatal("no status write recorded: the test cannot tell a write from none")
	}
	if err := h.k.ReportStatus(context.Background(), "x", Verdict{Clamped: "clamped"}, 2); err != nil {
		t.Fatal(err)
	}
	if err := b.ReportStatus(context.Background(), "x", Verdict{}, 2); err != nil {
		t.Fatal(err)
	}
	if n := writes() - before; n != 0 {
		t.Errorf("unchanged reports wrote the status %d times", n)
	}
}
