package k8s

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	coordinationv1client "k8s.io/client-go/kubernetes/typed/coordination/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"

	"github.com/rlagent/rlagent/internal/k8stest"
)

// The agents' namespace and ServiceAccount, as deploy/ names them.
const (
	agentNamespace = "rlagent-system"
	agentUser      = "system:serviceaccount:" + agentNamespace + ":rlagent"
)

// nodeNameClaim is the user extra that the API server sets from a bound
// service-account token's node claim (Kubernetes >= 1.30): the node of the
// pod the kubelet asked the token for.
const nodeNameClaim = "authentication.kubernetes.io/node-name"

// TestDemandLeasePolicy: deploy/demand-policy.yaml, on a real API server,
// keeps an agent's writes of Leases other than rlagent-status to its own
// node's demand Lease, held by its node, which the Role rlagent cannot (its
// resourceNames are the same on every node). The agents are impersonated:
// the ServiceAccount with the node-name extra that a kubelet-bound token
// carries, and without it, as a token from a cluster older than 1.30 or
// one not bound to a pod would be.
func TestDemandLeasePolicy(t *testing.T) {
	env := k8stest.Shared(t)
	ctx := t.Context()
	admin := env.Clientset()
	d := dynamicClient(t, env)
	disc, err := discovery.NewDiscoveryClientForConfig(env.Config)
	if err != nil {
		t.Fatal(err)
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(disc))

	// Cleanups run last first: the namespace goes after what is in it.
	for _, obj := range readManifests(t, filepath.Join(deployDir, "namespace.yaml")) {
		applyUntilCleanup(t, d, mapper, admin, obj)
	}
	for _, obj := range readManifests(t, filepath.Join(deployDir, "rbac.yaml")) {
		switch obj.GetKind() {
		case "ServiceAccount", "Role", "RoleBinding":
			if obj.GetNamespace() == agentNamespace {
				applyUntilCleanup(t, d, mapper, admin, obj)
			}
		}
	}
	for _, obj := range readManifests(t, filepath.Join(deployDir, "demand-policy.yaml")) {
		applyUntilCleanup(t, d, mapper, admin, obj)
	}

	clients := map[string]kubernetes.Interface{
		"admin":  admin,
		"node-a": agentClient(t, env, map[string][]string{nodeNameClaim: {"node-a"}}),
		"none":   agentClient(t, env, nil),
	}
	leases := func(who string) coordinationv1client.LeaseInterface {
		return clients[who].CoordinationV1().Leases(agentNamespace)
	}
	written := map[string]bool{}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		for name := range written {
			if err := leases("admin").Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				t.Errorf("delete Lease %s: %v", name, err)
			}
		}
	})

	// The policy and its binding reach the admission plugin through its
	// informers, and the Role and RoleBinding the authorizer through its:
	// a denial by the policy says both are in force (admission follows
	// authorization). The probe is a dry run, so an early success stores
	// nothing.
	took := waitFor(t, 30*time.Second, "the policy to deny node-a's write of node-b's Lease", func() (bool, string) {
		_, err := leases("node-a").Create(ctx, demandLease("rlagent-demand-node-b", "node-b"),
			metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		if err == nil {
			return false, "the dry run was admitted"
		}
		return deniedByPolicy(err), err.Error()
	})
	t.Logf("the policy denied the probe %s after it was applied", ms(took))

	const (
		wrongName   = `Lease rlagent-demand-node-b: the agent on node node-a may write only its own demand Lease, rlagent-demand-node-a`
		wrongHolder = `Lease rlagent-demand-node-a: spec.holderIdentity is "node-b", want the node name "node-a"`
		noClaim     = "this request's token has no node-name claim"
	)
	for i, w := range []struct {
		who    string // the client: admin, the agent on node-a, an agent without the claim
		verb   string // create, or update after a get by the same client
		lease  string
		holder string
		denied string // what the denial says; "" if admitted
	}{
		{"node-a", "create", "rlagent-demand-node-a", "node-b", wrongHolder},
		{"node-a", "create", "rlagent-demand-node-a", "node-a", ""},
		{"node-a", "update", "rlagent-demand-node-a", "node-a", ""},
		{"node-a", "update", "rlagent-demand-node-a", "node-b", wrongHolder},
		{"node-a", "create", "rlagent-demand-node-b", "node-b", wrongName},
		{"admin", "create", "rlagent-demand-node-b", "node-b", ""},
		{"node-a", "update", "rlagent-demand-node-b", "node-b", wrongName},
		// The election of the status writer: its holder is the pod, and
		// any agent may stand, with or without the claim.
		{"node-a", "create", "rlagent-status", "rlagent-x7k2p", ""},
		{"node-a", "update", "rlagent-status", "rlagent-x7k2p", ""},
		{"none", "update", "rlagent-status", "rlagent-q4m9z", ""},
		{"none", "create", "rlagent-demand-node-c", "node-c", noClaim},
		{"none", "update", "rlagent-demand-node-a", "node-a", noClaim},
		// Other users are not the policy's business.
		{"admin", "update", "rlagent-demand-node-a", "node-b", ""},
		{"admin", "create", "rlagent-demand-node-c", "somebody", ""},
	} {
		what := fmt.Sprintf("#%d: %s: %s Lease %s held by %s", i, w.who, w.verb, w.lease, w.holder)
		var err error
		switch w.verb {
		case "create":
			_, err = leases(w.who).Create(ctx, demandLease(w.lease, w.holder), metav1.CreateOptions{})
		case "update":
			var l *coordinationv1.Lease
			if l, err = leases(w.who).Get(ctx, w.lease, metav1.GetOptions{}); err != nil {
				t.Fatalf("%s: get: %v", what, err)
			}
			l.Spec.HolderIdentity = &w.holder
			l.Spec.RenewTime = &metav1.MicroTime{Time: time.Now()}
			_, err = leases(w.who).Update(ctx, l, metav1.UpdateOptions{})
		}
		if err == nil {
			written[w.lease] = true
		}
		switch {
		case w.denied == "" && err != nil:
			t.Errorf("%s: %v, want it admitted", what, err)
		case w.denied != "" && err == nil:
			t.Errorf("%s: admitted, want it denied: %s", what, w.denied)
		case w.denied != "" && (!deniedByPolicy(err) || !strings.Contains(err.Error(), w.denied)):
			t.Errorf("%s: %v\nwant the policy's denial: %s", what, err, w.denied)
		case err != nil:
			t.Logf("%s: denied: %v", what, err)
		}
	}
}

// demandLease is a Lease as an agent writes it, without the demand itself
// (the annotation): the policy checks the name and the holder only.
func demandLease(name, holder string) *coordinationv1.Lease {
	return &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"rlagent.io/demand": "node"}},
		Spec: coordinationv1.LeaseSpec{
			HolderIdentity: &holder,
			RenewTime:      &metav1.MicroTime{Time: time.Now()},
		},
	}
}

// deniedByPolicy tells whether err is rlagent-demand-leases' denial, not
// RBAC's (both are 403 Forbidden).
func deniedByPolicy(err error) bool {
	return apierrors.IsForbidden(err) && strings.Contains(err.Error(), "ValidatingAdmissionPolicy 'rlagent-demand-leases'")
}

// agentClient is a client of env's API server that impersonates the
// agents' ServiceAccount, with extra as its user extras. The admin is in
// system:masters, which may impersonate users, groups and extras.
func agentClient(t testing.TB, env *k8stest.Env, extra map[string][]string) kubernetes.Interface {
	t.Helper()
	c, err := kubernetes.NewForConfig(agentConfig(env, extra))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// agentConfig is env's client config impersonating the agents'
// ServiceAccount, with extra as its user extras.
func agentConfig(env *k8stest.Env, extra map[string][]string) *rest.Config {
	cfg := rest.CopyConfig(env.Config)
	cfg.Impersonate = rest.ImpersonationConfig{
		UserName: agentUser,
		Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:" + agentNamespace, "system:authenticated"},
		Extra:    extra,
	}
	return cfg
}

// applyUntilCleanup server-side applies obj for real and, unless it existed
// before, deletes it in t.Cleanup. A namespace is then finalized too: there
// is no namespace controller to empty and finalize it, and it would stay
// Terminating, failing the next test that writes in it (TestDeployDryRun).
// By then the test's later cleanups have deleted what it put in it.
func applyUntilCleanup(t *testing.T, d *dynamic.DynamicClient, mapper meta.RESTMapper, admin kubernetes.Interface, obj *unstructured.Unstructured) {
	t.Helper()
	ctx := t.Context()
	gvk := obj.GroupVersionKind()
	what := gvk.Kind + "/" + obj.GetName()
	m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		t.Fatalf("%s: no such resource on the API server: %v", what, err)
	}
	var r dynamic.ResourceInterface = d.Resource(m.Resource)
	if m.Scope.Name() == meta.RESTScopeNameNamespace {
		r = d.Resource(m.Resource).Namespace(obj.GetNamespace())
	}
	_, err = r.Get(ctx, obj.GetName(), metav1.GetOptions{})
	existed := err == nil
	if err != nil && !apierrors.IsNotFound(err) {
		t.Fatalf("%s: get: %v", what, err)
	}
	if _, err := r.Apply(ctx, obj.GetName(), obj, metav1.ApplyOptions{FieldManager: fieldManager, Force: true}); err != nil {
		t.Fatalf("%s: server-side apply: %v", what, err)
	}
	if existed {
		t.Logf("%s existed: it stays", what)
		return
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := r.Delete(ctx, obj.GetName(), metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete %s: %v", what, err)
			return
		}
		if gvk.Kind == "Namespace" {
			finalizeNamespace(ctx, t, admin, obj.GetName())
		}
	})
}

// finalizeNamespace does what the namespace controller would for a deleted
// namespace once it has emptied it: it removes the finalizer kubernetes, and
// the API server then removes the namespace. The test's own cleanups have
// emptied it (one that failed said so).
func finalizeNamespace(ctx context.Context, t *testing.T, admin kubernetes.Interface, name string) {
	t.Helper()
	nss := admin.CoreV1().Namespaces()
	ns, err := nss.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return
	}
	if err != nil {
		t.Errorf("namespace %s: %v", name, err)
		return
	}
	ns.Spec.Finalizers = nil
	if _, err := nss.Finalize(ctx, ns, metav1.UpdateOptions{}); err != nil {
		t.Errorf("finalize namespace %s: %v", name, err)
		return
	}
	for {
		_, err := nss.Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return
		}
		if ctx.Err() != nil {
			t.Errorf("namespace %s is still there after it was finalized: %v", name, err)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}
