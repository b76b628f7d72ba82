package k8s

import (
	"fmt"
	"path/filepath"
	"testing"

	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/client/clientset/versioned"
	"github.com/rlagent/rlagent/internal/k8stest"
)

// limiterApp is deploy/limiter/rbac.yaml applied for an application whose
// ServiceAccount is api in namespace ns (the file's "shop"): a client
// config that impersonates it.
func limiterApp(t *testing.T, env *k8stest.Env, ns string) *rest.Config {
	t.Helper()
	d := dynamicClient(t, env)
	disc, err := discovery.NewDiscoveryClientForConfig(env.Config)
	if err != nil {
		t.Fatal(err)
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(disc))
	for _, obj := range readManifests(t, filepath.Join(deployDir, "limiter", "rbac.yaml")) {
		// The application's objects in the test's namespace; the shared
		// ClusterRole as it is; the ClusterRoleBinding named after it.
		if obj.GetNamespace() == "shop" {
			obj.SetNamespace(ns)
		}
		if obj.GetKind() == "ClusterRoleBinding" {
			obj.SetName("rlagent-limiter-" + ns + "-api")
			subjects, _, _ := unstructured.NestedSlice(obj.Object, "subjects")
			for _, s := range subjects {
				s.(map[string]any)["namespace"] = ns
			}
			unstructured.SetNestedSlice(obj.Object, subjects, "subjects")
		}
		if obj.GetKind() == "RoleBinding" {
			subjects, _, _ := unstructured.NestedSlice(obj.Object, "subjects")
			for _, s := range subjects {
				s.(map[string]any)["namespace"] = ns
			}
			unstructured.SetNestedSlice(obj.Object, subjects, "subjects")
		}
		applyUntilCleanup(t, d, mapper, env.Clientset(), obj)
	}
	cfg := rest.CopyConfig(env.Config)
	cfg.Impersonate = rest.ImpersonationConfig{
		UserName: "system:serviceaccount:" + ns + ":api",
		Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"},
	}
	// The API server's RBAC authorizer reads the bindings from its own
	// informers: a binding just written takes a moment to count.
	for _, ra := range []authorizationv1.ResourceAttributes{
		{Namespace: ns, Verb: "watch", Group: "discovery.k8s.io", Resource: "endpointslices"},
		{Verb: "watch", Group: v1alpha1.GroupName, Resource: "ratelimits"},
	} {
		k8stest.WaitUntil(t, "the application's RBAC in force", func() bool {
			sar, err := env.Clientset().AuthorizationV1().SubjectAccessReviews().Create(t.Context(), &authorizationv1.SubjectAccessReview{
				Spec: authorizationv1.SubjectAccessReviewSpec{User: cfg.Impersonate.UserName, Groups: cfg.Impersonate.Groups, ResourceAttributes: &ra},
			}, metav1.CreateOptions{})
			return err == nil && sar.Status.Allowed
		})
	}
	return cfg
}

// TestLimiterRBAC: deploy/limiter/rbac.yaml, on a real API server, lets
// an application read the RateLimits and list and watch the EndpointSlices
// of its own namespace, and nothing more: it can read nothing in another
// namespace (EndpointSlices included), nothing else in its own, and write
// nothing anywhere. Asked twice: with real calls as the application, and
// with SubjectAccessReviews over every verb of the resources that matter.
func TestLimiterRBAC(t *testing.T) {
	env := k8stest.Shared(t)
	installCRD(t, env)
	ns, other := env.Namespace(t), env.Namespace(t)
	user := "system:serviceaccount:" + ns + ":api"
	cfg := limiterApp(t, env, ns)
	app := kubernetes.NewForConfigOrDie(cfg)
	rls := versioned.NewForConfigOrDie(cfg)
	ctx := t.Context()

	// What it may do, for real.
	if _, err := app.DiscoveryV1().EndpointSlices(ns).List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("list EndpointSlices in its namespace: %v", err)
	}
	if w, err := app.DiscoveryV1().EndpointSlices(ns).Watch(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("watch EndpointSlices in its namespace: %v", err)
	} else {
		w.Stop()
	}
	if _, err := rls.RlagentV1alpha1().RateLimits().List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("list RateLimits: %v", err)
	}
	if err := app.Discovery().RESTClient().Get().AbsPath("/readyz").Do(ctx).Error(); err != nil {
		t.Errorf("GET /readyz (the watcher's probe): %v", err)
	}
	// What it may not, for real: each Forbidden.
	forbidden := func(what string, err error) {
		t.Helper()
		if !apierrors.IsForbidden(err) {
			t.Errorf("%s: %v, want Forbidden", what, err)
		}
	}
	_, err := app.DiscoveryV1().EndpointSlices(other).List(ctx, metav1.ListOptions{})
	forbidden("list EndpointSlices in another namespace", err)
	_, err = app.DiscoveryV1().EndpointSlices(metav1.NamespaceAll).List(ctx, metav1.ListOptions{})
	forbidden("list EndpointSlices in every namespace", err)
	_, err = app.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{})
	forbidden("list Secrets in its namespace", err)
	_, err = app.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	forbidden("list Pods in its namespace", err)
	_, err = app.DiscoveryV1().EndpointSlices(ns).Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: "forged", Labels: map[string]string{discoveryv1.LabelServiceName: "api"}},
		AddressType: discoveryv1.AddressTypeIPv4,
	}, metav1.CreateOptions{})
	forbidden("create an EndpointSlice (a forged count)", err)
	_, err = rls.RlagentV1alpha1().RateLimits().Create(ctx, &v1alpha1.RateLimit{
		ObjectMeta: metav1.ObjectMeta{Name: "forged-" + ns},
		Spec:       v1alpha1.RateLimitSpec{Rate: 1, Unit: v1alpha1.UnitRequests, Scope: v1alpha1.ScopeStatic},
	}, metav1.CreateOptions{})
	forbidden("create a RateLimit", err)
	_, err = app.CoreV1().Events(ns).Create(ctx, &corev1.Event{ObjectMeta: metav1.ObjectMeta{Name: "e"}, InvolvedObject: corev1.ObjectReference{Namespace: ns}}, metav1.CreateOptions{})
	forbidden("create an Event", err)

	// Every verb on the resources that matter, in its namespace, another,
	// and cluster-wide: allowed only what the Role and ClusterRole grant.
	type res struct{ group, resource, sub string }
	resources := []res{
		{"rlagent.io", "ratelimits", ""}, {"rlagent.io", "ratelimits", "status"},
		{"discovery.k8s.io", "endpointslices", ""}, {"", "endpoints", ""}, {"", "services", ""},
		{"", "pods", ""}, {"", "secrets", ""}, {"", "configmaps", ""}, {"", "events", ""},
		{"coordination.k8s.io", "leases", ""}, {"apps", "daemonsets", ""}, {"", "serviceaccounts", "token"},
	}
	verbs := []string{"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}
	allowed := func(r res, verb, namespace string) bool {
		switch {
		case r.resource == "ratelimits" && r.sub == "":
			return verb == "get" || verb == "list" || verb == "watch" // cluster-scoped: any namespace field
		case r.resource == "endpointslices" && namespace == ns:
			return verb == "list" || verb == "watch"
		}
		return false
	}
	checked, granted := 0, 0
	for _, r := range resources {
		for _, verb := range verbs {
			for _, namespace := range []string{ns, other, ""} {
				if r.resource == "ratelimits" && namespace != "" {
					continue // cluster-scoped
				}
				sar, err := env.Clientset().AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{
					Spec: authorizationv1.SubjectAccessReviewSpec{
						User:   user,
						Groups: cfg.Impersonate.Groups,
						ResourceAttributes: &authorizationv1.ResourceAttributes{
							Namespace: namespace, Verb: verb, Group: r.group, Resource: r.resource, Subresource: r.sub,
						},
					},
				}, metav1.CreateOptions{})
				if err != nil {
					t.Fatalf("SubjectAccessReview: %v", err)
				}
				checked++
				want := allowed(r, verb, namespace)
				if sar.Status.Allowed {
					granted++
				}
				if sar.Status.Allowed != want {
					what := fmt.Sprintf("%s %s/%s", verb, r.group, r.resource)
					if r.sub != "" {
						what += "/" + r.sub
					}
					t.Errorf("%s in namespace %q: allowed %v, want %v", what, namespace, sar.Status.Allowed, want)
				}
			}
		}
	}
	t.Logf("%d access reviews; granted %d: get, list, watch RateLimits; list, watch EndpointSlices in %s", checked, granted, ns)
}
