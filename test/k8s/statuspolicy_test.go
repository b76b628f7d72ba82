package k8s

import (
	"context"
	"fmt"
	"math"
	"path/filepath"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	coordinationv1client "k8s.io/client-go/kubernetes/typed/coordination/v1"
	"k8s.io/client-go/restmapper"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/internal/k8stest"
)

// podNameClaim is the user extra that the API server sets from a bound
// service-account token's pod claim (Kubernetes >= 1.30): the pod the
// kubelet asked the token for. An agent's identity in the election of the
// status writer is its pod's name.
const podNameClaim = "authentication.kubernetes.io/pod-name"

// applyDeployPolicies applies deploy/'s namespace, RBAC and every admission
// policy (deploy/*-policy.yaml), until the test's cleanup.
func applyDeployPolicies(t *testing.T, env *k8stest.Env) {
	t.Helper()
	admin := env.Clientset()
	d := dynamicClient(t, env)
	disc, err := discovery.NewDiscoveryClientForConfig(env.Config)
	if err != nil {
		t.Fatal(err)
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(disc))
	// Cleanups run last first: the namespace goes after what is in it.
	files := []string{filepath.Join(deployDir, "namespace.yaml"), filepath.Join(deployDir, "rbac.yaml")}
	policies, err := filepath.Glob(filepath.Join(deployDir, "*-policy.yaml"))
	if err != nil || len(policies) == 0 {
		t.Fatalf("no admission policies in deploy/: %v", err)
	}
	for _, f := range append(files, policies...) {
		for _, obj := range readManifests(t, f) {
			applyUntilCleanup(t, d, mapper, admin, obj)
		}
	}
}

// agentDynamic is agentClient's dynamic client: the agents' ServiceAccount
// with extra as its user extras.
func agentDynamic(t testing.TB, env *k8stest.Env, extra map[string][]string) dynamic.Interface {
	t.Helper()
	d, err := dynamic.NewForConfig(agentConfig(env, extra))
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestStatusWriterPolicy: deploy/status-policy.yaml, on a real API server,
// keeps the RateLimits' status (the demand allocation every node enforces
// among it) to the agent whose pod holds the Lease rlagent-status, and the
// Lease to its holder's name. Agents are impersonated with the pod-name
// and node-name extras of a kubelet-bound token: the holder, and a
// compromised agent on another node that forges an allocation (a floor of
// the whole rate for every node), a condition, and the Lease in the
// holder's name; then takes the Lease in its own name, which admission
// cannot tell from an honest election (it has no clock: docs/security.md),
// after which the old holder is denied.
func TestStatusWriterPolicy(t *testing.T) {
	env := k8stest.Shared(t)
	ctx := t.Context()
	installCRD(t, env)
	applyDeployPolicies(t, env)

	const name = "status-policy-demand"
	createRateLimit(t, env, rateLimit(name, map[string]any{
		"rate": int64(6000), "scope": "nodes", "share": "demand", "match": map[string]any{"protocol": "udp"},
	}))
	claims := func(pod, node string) map[string][]string {
		return map[string][]string{podNameClaim: {pod}, nodeNameClaim: {node}}
	}
	clients := map[string]dynamic.Interface{
		"admin":  dynamicClient(t, env),
		"holder": agentDynamic(t, env, claims("rlagent-holder", "node-a")),
		"forger": agentDynamic(t, env, claims("rlagent-forger", "node-b")),
		"none":   agentDynamic(t, env, nil),
	}
	leaseClients := map[string]coordinationv1client.LeaseInterface{
		"holder": agentClient(t, env, claims("rlagent-holder", "node-a")).CoordinationV1().Leases(agentNamespace),
		"forger": agentClient(t, env, claims("rlagent-forger", "node-b")).CoordinationV1().Leases(agentNamespace),
		"none":   agentClient(t, env, nil).CoordinationV1().Leases(agentNamespace),
	}
	leases := map[string]func() coordinationv1client.LeaseInterface{}
	for who, c := range leaseClients {
		leases[who] = func() coordinationv1client.LeaseInterface { return c }
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := env.Clientset().CoordinationV1().Leases(agentNamespace).Delete(ctx, "rlagent-status", metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete Lease rlagent-status: %v", err)
		}
	})

	// The holder is elected: it writes the Lease in its own name (as
	// client-go's leader election does), which the policy admits once
	// it is in force: until then, a write in another's name is admitted
	// (a dry run, which stores nothing).
	waitFor(t, 30*time.Second, "rlagent-status-lease to deny a Lease in another pod's name", func() (bool, string) {
		_, err := leases["forger"]().Create(ctx, statusLease("rlagent-holder"), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		if err == nil {
			return false, "admitted"
		}
		return deniedBy(err, "rlagent-status-lease"), err.Error()
	})
	if _, err := leases["holder"]().Create(ctx, statusLease("rlagent-holder"), metav1.CreateOptions{}); err != nil {
		t.Fatalf("the holder's election: %v", err)
	}
	// The parameter (the Lease) reaches the policy through its informer.
	waitFor(t, 30*time.Second, "rlagent-status-writer to deny a status write by a pod that does not hold the Lease", func() (bool, string) {
		err := writeStatus(ctx, clients["forger"], name, true, func(st map[string]any) { st["replicas"] = int64(99) })
		if err == nil {
			return false, "admitted"
		}
		return deniedBy(err, "rlagent-status-writer"), err.Error()
	})

	const (
		notHolder = `is written by the holder of the Lease rlagent-status, "rlagent-holder", not by pod "rlagent-forger"`
		noClaim   = "this request's token has no pod-name claim"
		badRound  = "may only follow round"
	)
	alloc := func(round int64, floor uint64) func(map[string]any) {
		return func(st map[string]any) {
			st["allocation"] = map[string]any{
				"round": round, "floor": int64(floor), "nodes": int64(3), "demand": int64(9000),
				"time": time.Now().UTC().Format(time.RFC3339),
			}
		}
	}
	type step struct {
		who    string
		what   string
		change func(map[string]any)
		denied string // policy, and what its denial says; "" if admitted
	}
	run := func(steps []step) {
		t.Helper()
		for i, s := range steps {
			err := writeStatus(ctx, clients[s.who], name, false, s.change)
			what := fmt.Sprintf("#%d: %s: %s", i, s.who, s.what)
			switch {
			case s.denied == "" && err != nil:
				t.Errorf("%s: %v, want it admitted", what, err)
			case s.denied != "" && err == nil:
				t.Errorf("%s: admitted, want it denied: %s", what, s.denied)
			case s.denied != "" && (!deniedBy(err, "rlagent-status-writer") || !strings.Contains(err.Error(), s.denied)):
				t.Errorf("%s: %v\nwant rlagent-status-writer's denial: %s", what, err, s.denied)
			case err != nil:
				t.Logf("%s: denied: %v", what, err)
			}
		}
	}
	run([]step{
		{"holder", "the first round", alloc(1, 20), ""},
		{"forger", "a forged round: every node's floor the whole rate", alloc(2, 6000), notHolder},
		{"forger", "the same round with a floor of 6000", alloc(1, 6000), notHolder},
		{"forger", "a forged condition", func(st map[string]any) {
			st["conditions"] = []any{map[string]any{"type": "Accepted", "status": "False", "reason": "DoesNotFit",
				"message": "forged", "lastTransitionTime": time.Now().UTC().Format(time.RFC3339)}}
		}, notHolder},
		{"forger", "the allocation removed", func(st map[string]any) { delete(st, "allocation") }, notHolder},
		{"none", "a round without the pod-name claim", alloc(2, 20), noClaim},
		{"holder", "the next round", alloc(2, 20), ""},
		{"holder", "the same round, another level", alloc(2, 30), ""},
		{"holder", "a round skipped", alloc(4, 30), badRound},
		{"holder", "the largest round", alloc(math.MaxInt64, 30), badRound},
		{"holder", "back to round 1", alloc(1, 30), ""},
		{"admin", "the largest round (another user: not the policy's business)", alloc(math.MaxInt64, 30), ""},
		{"holder", "past the largest round", alloc(math.MinInt64, 30), badRound},
		{"holder", "the largest round, again", alloc(math.MaxInt64, 20), ""},
		{"holder", "round 1 after the largest", alloc(1, 20), ""},
	})

	// The Lease: in another's name, released by another: denied. Released
	// by its holder: admitted.
	for i, l := range []struct {
		who, holder string
		denied      bool
	}{
		{"forger", "rlagent-holder", true},
		{"forger", "rlagent-someone", true},
		{"forger", "", true},
		{"none", "rlagent-forger", true},
		{"holder", "", false},
	} {
		lc := leases[l.who]()
		cur, err := lc.Get(ctx, "rlagent-status", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cur.Spec.HolderIdentity = &l.holder
		_, err = lc.Update(ctx, cur, metav1.UpdateOptions{})
		switch {
		case l.denied && (err == nil || !deniedBy(err, "rlagent-status-lease")):
			t.Errorf("Lease #%d: %s writes holder %q: %v, want rlagent-status-lease's denial", i, l.who, l.holder, err)
		case !l.denied && err != nil:
			t.Errorf("Lease #%d: %s writes holder %q: %v, want it admitted", i, l.who, l.holder, err)
		}
	}
	// Admission has no clock: the forger takes the released Lease in its
	// own name, as it could take one that had not expired. The old holder
	// is then the one denied.
	cur, err := leases["forger"]().Get(ctx, "rlagent-status", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cur.Spec.HolderIdentity = ptr("rlagent-forger")
	if _, err := leases["forger"]().Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("the forger takes the Lease in its own name: %v", err)
	}
	waitFor(t, 30*time.Second, "the old holder to be denied", func() (bool, string) {
		err := writeStatus(ctx, clients["holder"], name, true, alloc(2, 20))
		if err == nil {
			return false, "admitted"
		}
		return deniedBy(err, "rlagent-status-writer"), err.Error()
	})
	run([]step{{"forger", "a round by the new holder", alloc(2, 20), ""}})
}

// statusLease is the Lease rlagent-status as client-go's leader election
// writes it.
func statusLease(holder string) *coordinationv1.Lease {
	return &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Name: "rlagent-status", Namespace: agentNamespace},
		Spec: coordinationv1.LeaseSpec{
			HolderIdentity:       &holder,
			LeaseDurationSeconds: ptr(int32(15)),
			AcquireTime:          &metav1.MicroTime{Time: time.Now()},
			RenewTime:            &metav1.MicroTime{Time: time.Now()},
		},
	}
}

// writeStatus gets the RateLimit name with c and updates its status as
// change makes it (a dry run if dry).
func writeStatus(ctx context.Context, c dynamic.Interface, name string, dry bool, change func(map[string]any)) error {
	rl := c.Resource(v1alpha1.RateLimitResource)
	cur, err := rl.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("get: %w", err)
	}
	st, _, _ := unstructured.NestedMap(cur.Object, "status")
	if st == nil {
		st = map[string]any{}
	}
	change(st)
	cur.Object["status"] = st
	opts := metav1.UpdateOptions{}
	if dry {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	_, err = rl.UpdateStatus(ctx, cur, opts)
	return err
}

// deniedBy tells whether err is the denial of the admission policy named.
func deniedBy(err error, policy string) bool {
	return apierrors.IsForbidden(err) && strings.Contains(err.Error(), "ValidatingAdmissionPolicy '"+policy+"'")
}
