package k8s

import (
	"context"
	"fmt"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// outage is how long the API server stays down.
const outage = 30 * time.Second

// TestAPIServerOutage: with the API server stopped for 30 s, every agent
// keeps its shares and counts (service scope), its observation ages by the
// time the API server has been gone and is marked stale. Once the API
// server is back, the age drops and the counts resume: a change made after
// the restart is applied on every node, within seconds.
func TestAPIServerOutage(t *testing.T) {
	testenv.RequireRoot(t)
	env := k8stest.Start(t) // its own: this test stops it
	installCRD(t, env)
	c := startCluster(t, env, env.Namespace(t), 3)
	c.createService()
	before := layout{ready: []int{1, 1, 1}}
	c.setEndpoints(before)
	const name = "outage"
	created := time.Now()
	createRateLimit(t, env, rateLimit(name, c.serviceSpec(globalRate)))
	wants := c.serviceWants(globalRate, before)
	if _, err := c.waitShares(name, wants, created, 15*time.Second); err != nil {
		t.Fatal(err)
	}

	// The agents lose the API server with their forwarders; then it stops.
	for _, nd := range c.nodes {
		nd.api.down()
	}
	if err := env.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	_, err := env.Clientset().CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	cancel()
	if err == nil {
		t.Fatal("the API server still answers after StopAPIServer")
	}

	// Every second of the outage, on every node: the same share and count;
	// stale from a few seconds in (the agents probe every 2 s); the age at
	// least the time since the stop (the last answer came before it).
	const staleWithin = 6 * time.Second
	staleSince := make([]time.Duration, len(c.nodes))
	for i := range staleSince {
		staleSince[i] = -1
	}
	var lastAge []float64
	for next := stopped.Add(time.Second); time.Since(stopped) < outage; next = next.Add(time.Second) {
		time.Sleep(time.Until(next))
		since := time.Since(stopped)
		lastAge = lastAge[:0]
		for i, nd := range c.nodes {
			s, ok := nd.limit(t, name)
			if !wants[i].matches(s, ok) {
				t.Fatalf("%v into the outage: %s: %s, want %s as before it", since.Round(time.Second), nd.name, describe(s, ok), wants[i])
			}
			if s.ObservationAge < since.Seconds() {
				t.Errorf("%v into the outage: %s: observation age %.1f s, want at least the time since the stop", since.Round(time.Second), nd.name, s.ObservationAge)
			}
			switch {
			case s.Stale && staleSince[i] < 0:
				staleSince[i] = since
			case !s.Stale && staleSince[i] >= 0:
				t.Errorf("%v into the outage: %s is no longer stale", since.Round(time.Second), nd.name)
			case !s.Stale && since > staleWithin:
				t.Errorf("%v into the outage: %s does not mark its observation stale", since.Round(time.Second), nd.name)
			}
			lastAge = append(lastAge, s.ObservationAge)
		}
		if n := int(since.Round(time.Second) / time.Second); n%10 == 0 {
			t.Logf("%2d s into the outage: shares unchanged on every node; observation ages %.1f s", n, lastAge)
		}
	}
	t.Logf("stale from %v after the stop (per node)", msList(staleSince))
	for _, nd := range c.nodes {
		s, ok := nd.statusCLI(t, name)
		t.Logf("rlagent status on %s at the end of the outage: %s", nd.name, describe(s, ok))
		if !ok || !s.Stale || s.ObservationAge < outage.Seconds() {
			t.Errorf("rlagent status on %s after %v down: %s; want stale, aged at least %v", nd.name, outage, describe(s, ok), outage)
		}
	}

	if err := env.StartAPIServer(); err != nil {
		t.Fatal(err)
	}
	for _, nd := range c.nodes {
		nd.api.up()
	}
	restarted := time.Now()
	t.Logf("the API server was down %v", restarted.Sub(stopped).Round(100*time.Millisecond))

	// The observation is fresh again as soon as a probe gets through.
	took := waitFor(t, 15*time.Second, "every node's observation to be fresh again", func() (bool, string) {
		for _, nd := range c.nodes {
			s, ok := nd.limit(t, name)
			if !ok || s.Stale || s.ObservationAge > 3 {
				return false, fmt.Sprintf("%s: %s", nd.name, describe(s, ok))
			}
		}
		return true, ""
	})
	t.Logf("every node's observation fresh (not stale, age <= 3 s) %s after the restart", ms(took))

	// The counts resume: a change made after the restart reaches every node.
	// The agents' informers wait for the API server while their probe finds
	// it unreachable, so they start again within a probe interval (2 s) of
	// its return, plus client-go's reflector backoff at its first steps
	// (a watch from before the outage has expired: relist). Without that
	// wait, the backoff grows through the outage to its 30-60 s cap, and the
	// change took 25-90 s to arrive.
	const resumeWithin = 30 * time.Second
	after := layout{ready: []int{3, 2, 1}}
	changed, _ := c.setEndpoints(after)
	a, err := c.waitShares(name, c.serviceWants(globalRate, after), changed, resumeWithin)
	if err != nil {
		t.Fatalf("after the restart: %v", err)
	}
	t.Logf("a change made %s after the restart: %v", ms(changed.Sub(restarted)), a)
	c.checkSum("after the restart", name, globalRate)
}
