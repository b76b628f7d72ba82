package k8stest

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/yaml"
)

var crdResource = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// InstallCRD creates or updates the CustomResourceDefinition in the file
// at path (one YAML document, as controller-gen writes deploy/crd.yaml)
// with a server-side apply, and waits until it is Established and its
// resource can be listed. It is idempotent: tests on a shared Env each call
// it.
func (e *Env) InstallCRD(tb testing.TB, path string) {
	tb.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		tb.Fatal(err)
	}
	crd := &unstructured.Unstructured{}
	if err := yaml.Unmarshal(data, &crd.Object); err != nil || crd.GetKind() != "CustomResourceDefinition" {
		tb.Fatalf("%s: want one CustomResourceDefinition (%v)", path, err)
	}
	d, err := dynamic.NewForConfig(e.Config)
	if err != nil {
		tb.Fatal(err)
	}
	ctx := context.Background()
	if _, err := d.Resource(crdResource).Apply(ctx, crd.GetName(), crd, metav1.ApplyOptions{FieldManager: "k8stest", Force: true}); err != nil {
		tb.Fatalf("apply %s: %v", path, err)
	}
	group, _, _ := unstructured.NestedString(crd.Object, "spec", "group")
	plural, _, _ := unstructured.NestedString(crd.Object, "spec", "names", "plural")
	versions, _, _ := unstructured.NestedSlice(crd.Object, "spec", "versions")
	var version string
	if len(versions) > 0 {
		version, _, _ = unstructured.NestedString(versions[0].(map[string]any), "name")
	}
	res := schema.GroupVersionResource{Group: group, Version: version, Resource: plural}
	deadline := time.Now().Add(30 * time.Second)
	for {
		why := ""
		cur, err := d.Resource(crdResource).Get(ctx, crd.GetName(), metav1.GetOptions{})
		if err == nil {
			why = "not Established"
			conds, _, _ := unstructured.NestedSlice(cur.Object, "status", "conditions")
			for _, c := range conds {
				if m, ok := c.(map[string]any); ok && m["type"] == "Established" && m["status"] == "True" {
					why = ""
				}
			}
			if why == "" {
				if _, err := d.Resource(res).List(ctx, metav1.ListOptions{Limit: 1}); err != nil {
					why = err.Error()
				}
			}
		} else {
			why = err.Error()
		}
		if why == "" {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("the CRD %s: %s after 30 s", crd.GetName(), strings.TrimSpace(why))
		}
		time.Sleep(20 * time.Millisecond)
	}
}
