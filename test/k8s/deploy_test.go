package k8s

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/yaml"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/internal/k8stest"
)

// TestDeployDryRun: deploy/ applies to a real API server. The CRD and the
// namespace are created for real (the rest needs them); everything else the
// kustomization lists, and every example, applies as a server-side dry run
// (DryRun: All): the API server validates and admits each object, RBAC, the
// DaemonSet's pod template and the admission policy's CEL expressions
// (compiled on create) included, and stores none. What the policy admits is
// TestDemandLeasePolicy's. The CRD gives `kubectl get ratelimits` the rate,
// scope and observed replicas as columns.
func TestDeployDryRun(t *testing.T) {
	env := k8stest.Shared(t)
	ctx := t.Context()
	d := dynamicClient(t, env)
	disc, err := discovery.NewDiscoveryClientForConfig(env.Config)
	if err != nil {
		t.Fatal(err)
	}
	// Deferred: it rediscovers on a miss, so it finds the RateLimit kind
	// once the CRD is in.
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(disc))

	var kust struct {
		Resources []string `json:"resources"`
	}
	data, err := os.ReadFile(filepath.Join(deployDir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(data, &kust); err != nil {
		t.Fatalf("deploy/kustomization.yaml: %v", err)
	}
	// Everything in deploy/ is in the kustomization, so this test applies
	// what `kubectl apply -k deploy/` would.
	files, _ := filepath.Glob(filepath.Join(deployDir, "*.yaml"))
	for _, f := range files {
		if b := filepath.Base(f); b != "kustomization.yaml" && !slices.Contains(kust.Resources, b) {
			t.Errorf("deploy/%s is not in deploy/kustomization.yaml's resources", b)
		}
	}
	examples, _ := filepath.Glob(filepath.Join(deployDir, "examples", "*.yaml"))
	if len(examples) == 0 {
		t.Fatal("no deploy/examples/*.yaml")
	}

	// For real: the CRD (Established, served) and the namespace.
	installCRD(t, env)
	real := []string{"crd.yaml", "namespace.yaml"}
	for _, obj := range readManifests(t, filepath.Join(deployDir, "namespace.yaml")) {
		applyManifest(t, d, mapper, obj, false)
	}

	var paths []string
	for _, f := range kust.Resources {
		if !slices.Contains(real, f) {
			paths = append(paths, filepath.Join(deployDir, f))
		}
	}
	var applied []string
	for _, path := range append(paths, examples...) {
		for _, obj := range readManifests(t, path) {
			applyManifest(t, d, mapper, obj, true)
			applied = append(applied, obj.GetKind()+"/"+obj.GetName())
		}
	}
	t.Logf("server-side dry run accepted %d objects: %s", len(applied), strings.Join(applied, ", "))
	for _, kind := range []string{"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
		"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "ConfigMap", "DaemonSet", "RateLimit"} {
		if !slices.ContainsFunc(applied, func(s string) bool { return strings.HasPrefix(s, kind+"/") }) {
			t.Errorf("deploy/ has no %s", kind)
		}
	}

	// kubectl get ratelimits: the columns.
	var table metav1.Table
	err = disc.RESTClient().Get().AbsPath("/apis", v1alpha1.GroupName, v1alpha1.Version, "ratelimits").
		SetHeader("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io").Do(ctx).Into(&table)
	if err != nil {
		t.Fatalf("list ratelimits as a table: %v", err)
	}
	var cols []string
	for _, c := range table.ColumnDefinitions {
		cols = append(cols, c.Name)
	}
	t.Logf("kubectl get ratelimits columns: %v", cols)
	for _, c := range []string{"Rate", "Scope", "Replicas"} {
		if !slices.Contains(cols, c) {
			t.Errorf("kubectl get ratelimits has no column %s: %v", c, cols)
		}
	}
}

// applyManifest server-side applies obj, as a dry run if dryRun, and
// checks that a dry run stored nothing.
func applyManifest(t *testing.T, d *dynamic.DynamicClient, mapper *restmapper.DeferredDiscoveryRESTMapper, obj *unstructured.Unstructured, dryRun bool) {
	t.Helper()
	ctx := t.Context()
	gvk := obj.GroupVersionKind()
	what := gvk.Kind + "/" + obj.GetName()
	m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		t.Errorf("%s: no such resource on the API server: %v", what, err)
		return
	}
	var r dynamic.ResourceInterface = d.Resource(m.Resource)
	if m.Scope.Name() == meta.RESTScopeNameNamespace {
		if obj.GetNamespace() == "" {
			t.Errorf("%s: a namespaced object with no namespace in the manifest", what)
			return
		}
		r = d.Resource(m.Resource).Namespace(obj.GetNamespace())
	}
	opts := metav1.ApplyOptions{FieldManager: fieldManager, Force: true}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	if _, err := r.Apply(ctx, obj.GetName(), obj, opts); err != nil {
		t.Errorf("%s: server-side apply (dry run %v): %v", what, dryRun, err)
		return
	}
	if dryRun {
		if _, err := r.Get(ctx, obj.GetName(), metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			t.Errorf("%s: get after a dry run: %v, want NotFound", what, err)
		}
	}
}
