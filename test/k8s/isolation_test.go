package k8s

import (
	"fmt"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/testenv"
	"github.com/rlagent/rlagent/maps"
)

// TestLimitThatDoesNotFit: one RateLimit more than the data path holds
// (MaxLimits + 1, scope nodes) gets Accepted=False with reason DoesNotFit
// and a message that names the node and says why, on three real agents;
// the others are enforced and still follow the count (the agents'
// DaemonSet's ready pods) on every node. When a place frees up, the limit that did not fit is
// applied everywhere and its condition turns True.
//
// On the code before per-limit isolation, the one limit too many failed
// every reconcile on every node: no limit was applied, the object said
// Accepted=True, and counts were no longer followed.
func TestLimitThatDoesNotFit(t *testing.T) {
	testenv.RequireRoot(t)
	env := k8stest.Shared(t)
	installCRD(t, env)
	ns := env.Namespace(t)
	c := startCluster(t, env, ns, 3)
	rl := dynamicClient(t, env).Resource(v1alpha1.RateLimitResource)

	const rate = 6000
	n := int(maps.MaxLimits) + 1
	name := func(i int) string { return fmt.Sprintf("fit-%03d", i) }
	last := name(n - 1) // new limits take ids in name order: this one finds none
	created := time.Now()
	for i := range n {
		createRateLimit(t, env, rateLimit(name(i), map[string]any{
			"rate": rate, "scope": "nodes",
			"match": map[string]any{"protocol": "udp", "dstPorts": []any{fmt.Sprint(20000 + i)}},
		}))
	}
	t.Logf("%d RateLimits created in %s", n, ms(time.Since(created)))
	all3 := func(w want) []want { return []want{w, w, w} }
	// No agents' DaemonSet yet: a count of 0 divides as 1.
	for _, l := range []string{name(0), name(n - 2)} {
		a, err := c.waitShares(l, all3(want{share: rate}), created, 30*time.Second)
		if err != nil {
			t.Fatalf("%s: %v", l, err)
		}
		t.Logf("%s enforced: %v", l, a)
	}
	for _, nd := range c.nodes {
		if s, ok := nd.limit(t, last); ok {
			t.Errorf("%s enforces %s, one limit more than the data path holds: %s", nd.name, last, describe(s, ok))
		}
	}

	// The writer writes the status of every RateLimit in turn, at its
	// client's 5 requests/s: a round over 129 objects takes ~26 s.
	waitAccepted(t, rl, 90*time.Second, last, "False", v1alpha1.ReasonDoesNotFit, "node node-", fmt.Sprintf("holds %d limits", maps.MaxLimits))
	waitAccepted(t, rl, 90*time.Second, name(0), "True", v1alpha1.ReasonValid)

	// The count changes: every limit that fits follows it on every node.
	started := time.Now()
	c.setAgents(3)
	three := want{share: rate / 3, replicas: 3, local: 1}
	for _, l := range []string{name(0), name(n - 2)} {
		a, err := c.waitShares(l, all3(three), started, 15*time.Second)
		if err != nil {
			t.Fatalf("count 3: %s: %v", l, err)
		}
		t.Logf("count 3: %s re-divided: %v", l, a)
	}
	waitAccepted(t, rl, 90*time.Second, last, "False", v1alpha1.ReasonDoesNotFit)

	// A place frees up: the limit that did not fit is applied everywhere.
	deleted := time.Now()
	if err := rl.Delete(t.Context(), name(7), metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	a, err := c.waitShares(last, all3(three), deleted, 15*time.Second)
	if err != nil {
		t.Fatalf("after a place freed up: %s: %v", last, err)
	}
	t.Logf("%s applied once %s was deleted: %v", last, name(7), a)
	waitAccepted(t, rl, 90*time.Second, last, "True", v1alpha1.ReasonValid)
}
