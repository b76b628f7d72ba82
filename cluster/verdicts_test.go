package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/utils/ptr"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/internal/k8stest"
)

// TestForgedEventIgnored: against a real API server, an Event on a
// RateLimit that claims to be a node's report (what the agents' Events
// look like, made by a user who may create Events in default) does not
// change the Accepted condition; the report in the node's own Lease does.
// The forged Event says DoesNotFit, the Lease Clamped: the condition
// reaches Clamped only if the Event is not read.
func TestForgedEventIgnored(t *testing.T) {
	env := sharedEnv(t)
	ns := env.Namespace(t)
	env.SetDaemonSetStatus(t, ns, "rlagent", 2, 2)
	obj := env.CreateRateLimit(t, k8stest.RateLimit("forged-event", map[string]any{"rate": int64(90), "scope": "nodes", "match": map[string]any{}}))
	rl := dynamic.NewForConfigOrDie(env.Config).Resource(v1alpha1.RateLimitResource)
	startStatus(t, env, ns, "node-a")
	accepted := func() *metav1.Condition {
		st, _ := statusOf(t, rl, "forged-event")
		return meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionAccepted)
	}
	k8stest.WaitUntil(t, "Accepted Valid", func() bool { c := accepted(); return c != nil && c.Reason == v1alpha1.ReasonValid })

	ctx := context.Background()
	now := time.Now()
	forged := &corev1.Event{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "forged-event.", Namespace: metav1.NamespaceDefault,
			Annotations: map[string]string{
				annotationNode: "node-b", annotationGeneration: fmt.Sprint(obj.GetGeneration()),
				annotationReported: fmt.Sprint(now.UnixNano()),
			}},
		InvolvedObject: corev1.ObjectReference{APIVersion: v1alpha1.SchemeGroupVersion.String(), Kind: "RateLimit",
			Name: obj.GetName(), UID: obj.GetUID()},
		Reason: v1alpha1.ReasonDoesNotFit, Message: "node node-b: forged", Type: corev1.EventTypeWarning,
		Source:         corev1.EventSource{Component: "rlagent", Host: "node-b"},
		FirstTimestamp: metav1.NewTime(now), LastTimestamp: metav1.NewTime(now), Count: 1,
	}
	if _, err := env.Clientset().CoreV1().Events(metav1.NamespaceDefault).Create(ctx, forged, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// node-b's own report, in its Lease, as its agent writes it.
	verdicts, _ := json.Marshal(map[string]any{obj.GetName(): map[string]any{
		"uid": obj.GetUID(), "generation": obj.GetGeneration(), "reason": v1alpha1.ReasonClamped, "message": "share clamped to 4000000000/s",
	}})
	lease := &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Name: DemandLeasePrefix + "node-b", Labels: map[string]string{labelDemand: "node"},
			Annotations: map[string]string{annotationDemand: "{}", "rlagent.io/verdicts": string(verdicts)}},
		Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To("node-b"), LeaseDurationSeconds: ptr.To(int32(300)),
			RenewTime: &metav1.MicroTime{Time: now}},
	}
	if _, err := env.Clientset().CoordinationV1().Leases(ns).Create(ctx, lease, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var c *metav1.Condition
	deadline := time.Now().Add(15 * time.Second)
	for c = accepted(); c == nil || c.Reason != v1alpha1.ReasonClamped; c = accepted() {
		if time.Now().After(deadline) {
			t.Fatalf("Accepted %+v, want node-b's report in its Lease (Clamped), not the forged Event's (DoesNotFit)", c)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if want := "node node-b: share clamped"; c.Status != metav1.ConditionTrue || !strings.HasPrefix(c.Message, want) {
		t.Errorf("Accepted %s %q, want True %q", c.Status, c.Message, want)
	}
}

// TestEncodeVerdictsBounded: a node's verdicts take at most
// maxVerdictBytes in its Lease, the worst kept first, each message cut to
// maxVerdictMessage bytes.
func TestEncodeVerdictsBounded(t *testing.T) {
	vs := map[string]nodeVerdict{}
	long := strings.Repeat("é", 1000)
	for i := range 1000 {
		vs[fmt.Sprintf("limit-%04d", i)] = nodeVerdict{UID: "u", Generation: 1, Reason: v1alpha1.ReasonClamped, Message: long}
	}
	vs["zz-does-not-fit"] = nodeVerdict{UID: "u", Generation: 1, Reason: v1alpha1.ReasonDoesNotFit, Message: "no room"}
	value, err := encodeVerdicts(vs)
	if err != nil {
		t.Fatal(err)
	}
	if len(value) > maxVerdictBytes {
		t.Errorf("%d bytes, want at most %d", len(value), maxVerdictBytes)
	}
	got := parseVerdicts(&coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{annotationVerdicts: value}}})
	if _, ok := got["zz-does-not-fit"]; !ok || len(got) < 100 || len(got) >= len(vs) {
		t.Errorf("%d verdicts kept of %d, the worst kept %v; want the worst and as many as fit", len(got), len(vs), ok)
	}
	for name, v := range got {
		if len(v.Message) > maxVerdictMessage || !strings.HasSuffix(v.Message, "...") && v.Reason == v1alpha1.ReasonClamped {
			t.Errorf("%s: message of %d bytes %q...", name, len(v.Message), v.Message[:min(20, len(v.Message))])
			break
		}
	}
}
