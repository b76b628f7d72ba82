package k8s

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// globalRate is the service-scoped limit's global rate, in pkt/s: every
// layout below divides it exactly (3, 4, 5 and 6 endpoints).
const globalRate = 6000

// shareTimeout is the bound the issue sets on a re-division: a count change
// in the API server -> every agent's maps rewritten.
const shareTimeout = time.Second

// TestServiceScopeShares: three agents on three nodes divide a
// service-scoped limit by the Service's ready endpoints, weighted by those
// on their node, as the EndpointSlices scale 3 -> 6 -> 2 (a not-ready
// endpoint does not count). Each node's share follows within 1 s of each
// change, the shares add up to the global rate, and a node without a ready
// endpoint enforces nothing. A series of further changes then measures the
// re-division latency's distribution (the target: <= 1 s p99).
func TestServiceScopeShares(t *testing.T) {
	testenv.RequireRoot(t)
	env := k8stest.Shared(t)
	installCRD(t, env)
	c := startCluster(t, env, env.Namespace(t), 3)
	c.createService()
	c.setEndpoints(layout{ready: []int{1, 1, 1}, notReady: []int{3}})

	const name = "svc-shares"
	created := time.Now()
	createRateLimit(t, env, rateLimit(name, c.serviceSpec(globalRate)))
	a, err := c.waitShares(name, c.serviceWants(globalRate, layout{ready: []int{1, 1, 1}}), created, 10*time.Second)
	if err != nil {
		t.Fatalf("the new RateLimit: %v", err)
	}
	t.Logf("the new RateLimit: %v", a)
	// The endpoints are addresses of the nodes themselves, as a hostNetwork
	// pod's are: they have no interface of their own, so the limit (attach
	// endpoints, the default for scope service) runs at the uplinks, and
	// the condition says so.
	waitAccepted(t, dynamicClient(t, env).Resource(v1alpha1.RateLimitResource), 30*time.Second, name, "True",
		v1alpha1.ReasonEnforcedAtUplink, "node node-", "enforced at the uplink: ")

	steps := []layout{
		{ready: []int{1, 1, 1}, notReady: []int{3}}, // where it starts
		{ready: []int{3, 2, 1}, notReady: []int{3}}, // 3 -> 6, uneven
		{ready: []int{1, 1, 0}, notReady: []int{3}}, // 6 -> 2: node-3 has only the not-ready one
	}
	for _, l := range steps {
		what := fmt.Sprintf("%d ready endpoints %s", l.total(), l)
		if started, writes := c.setEndpoints(l); writes > 0 {
			a, err := c.waitShares(name, c.serviceWants(globalRate, l), started, 5*time.Second)
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
			t.Logf("%s, %d slice writes: %v", what, writes, a)
			if w, _ := a.slowest(); w > shareTimeout {
				t.Errorf("%s: the maps were rewritten %v after the change, want <= %v", what, w, shareTimeout)
			}
		}
		// What `rlagent status` shows, node by node.
		wants := c.serviceWants(globalRate, l)
		for i, nd := range c.nodes {
			s, ok := nd.statusCLI(t, name)
			if !wants[i].matches(s, ok) {
				t.Errorf("%s: rlagent status on %s: %s, want %s", what, nd.name, describe(s, ok), wants[i])
			}
			if ok && (s.Scope != "service" || s.GlobalRate != globalRate || s.Stale || s.ObservationAge < 0 || s.ObservationAge > 5) {
				t.Errorf("%s: rlagent status on %s: scope %q, global %d, age %.1f s, stale %v; want service, %d, a fresh observation",
					what, nd.name, s.Scope, s.GlobalRate, s.ObservationAge, s.Stale, globalRate)
			}
		}
		c.checkSum(what, name, globalRate)
	}

	// The latency's distribution: one slice write per change, each changing
	// the total, so that every node's share changes every time.
	series := []layout{
		{ready: []int{1, 1, 1}}, {ready: []int{2, 1, 1}}, {ready: []int{2, 2, 1}},
		{ready: []int{3, 2, 1}}, {ready: []int{2, 2, 1}}, {ready: []int{2, 1, 1}},
	}
	const rounds = 4
	var written, seen, perAgent []time.Duration
	for r := range rounds {
		for _, l := range series {
			l.notReady = []int{3}
			started, writes := c.setEndpoints(l)
			if writes == 0 {
				continue
			}
			a, err := c.waitShares(name, c.serviceWants(globalRate, l), started, 5*time.Second)
			if err != nil {
				t.Fatalf("latency series, round %d, %s: %v", r+1, l, err)
			}
			w, s := a.slowest()
			written, seen = append(written, w), append(seen, s)
			perAgent = append(perAgent, a.written...)
			time.Sleep(50 * time.Millisecond)
		}
	}
	t.Logf("re-division latency over %d changes, API server write -> every agent's maps rewritten: p50 %s, p99 %s, max %s "+
		"(per agent, %d samples: p50 %s, p99 %s); -> every agent's status showing it: p50 %s, p99 %s",
		len(written), ms(quantile(written, 0.50)), ms(quantile(written, 0.99)), ms(slices.Max(written)),
		len(perAgent), ms(quantile(perAgent, 0.50)), ms(quantile(perAgent, 0.99)),
		ms(quantile(seen, 0.50)), ms(quantile(seen, 0.99)))
}

// quantile is the q-quantile of ds (nearest rank).
func quantile(ds []time.Duration, q float64) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(q*float64(len(s))+0.999999) - 1
	return s[max(0, min(i, len(s)-1))]
}

func msList(ds []time.Duration) []string {
	out := make([]string, len(ds))
	for i, d := range ds {
		out[i] = ms(d)
	}
	return out
}
