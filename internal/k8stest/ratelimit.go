package k8stest

import (
	"context"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
)

// rateLimits is the RateLimit resource, named here rather than imported
// from api/v1alpha1: the helpers of internal/ import nothing of rlagent's
// own packages, which import internal/regularfile.
var rateLimits = schema.GroupVersionResource{Group: "rlagent.io", Version: "v1alpha1", Resource: "ratelimits"}

// RateLimit is the RateLimit object name with spec, unstructured: a test
// may give it fields and values the Go types would not hold.
func RateLimit(name string, spec map[string]any) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": rateLimits.GroupVersion().String(),
		"kind":       "RateLimit",
		"metadata":   map[string]any{"name": name},
		"spec":       spec,
	}}
}

// CreateRateLimit creates obj and deletes it when tb ends: RateLimits are
// cluster-scoped, and the next test on a shared Env would see it.
func (e *Env) CreateRateLimit(tb testing.TB, obj *unstructured.Unstructured) *unstructured.Unstructured {
	tb.Helper()
	rl := dynamic.NewForConfigOrDie(e.Config).Resource(rateLimits)
	created, err := rl.Create(context.Background(), obj, metav1.CreateOptions{})
	if err != nil {
		tb.Fatalf("create RateLimit %s: %v", obj.GetName(), err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := rl.Delete(ctx, obj.GetName(), metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			tb.Errorf("delete RateLimit %s: %v", obj.GetName(), err)
		}
	})
	return created
}

// WaitUntil polls cond every 10 ms until it holds, failing tb after 15 s.
func WaitUntil(tb testing.TB, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("waited 15 s for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
