package k8s

import (
	"bytes"
	"os/exec"
	"strings"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/internal/k8stest"
)

// TestLimitsDryRunInCluster: `rlagent limits set|delete --dry-run
// --kubeconfig` are the API server's dry run. set prints the RateLimit as the
// server would store it (its defaults filled in) and stores nothing, for a
// new limit and for a change of an existing one, --share included; an
// invalid one fails with the message that names the field; delete leaves
// the object in place.
func TestLimitsDryRunInCluster(t *testing.T) {
	env := k8stest.Shared(t)
	installCRD(t, env)
	ctx := t.Context()
	rl := dynamicClient(t, env).Resource(v1alpha1.RateLimitResource)
	run := func(args ...string) (string, string, error) {
		t.Helper()
		cmd := exec.Command(rlagentBin, append(args, "--kubeconfig", env.Kubeconfig)...)
		var o, e bytes.Buffer
		cmd.Stdout, cmd.Stderr = &o, &e
		err := cmd.Run()
		return o.String(), e.String(), err
	}

	deleteInCleanup(t, env, "dry-new")
	out, stderr, err := run("limits", "set", "dry-new", "--rate", "100", "--scope", "nodes", "--protocol", "udp", "--dst-ports", "53", "--dry-run")
	if err != nil || !strings.Contains(out, "name: dry-new") || !strings.Contains(out, "unit: packets") || !strings.Contains(stderr, "not stored") {
		t.Errorf("set --dry-run of a new limit: %v\nstdout:\n%s\nstderr: %s", err, out, stderr)
	}
	if _, err := rl.Get(ctx, "dry-new", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("after set --dry-run the RateLimit exists (%v)", err)
	}

	if out, stderr, err := run("limits", "set", "dry-new", "--rate", "0", "--scope", "nodes", "--dry-run"); err == nil || !strings.Contains(stderr, "spec.rate") {
		t.Errorf("set --dry-run of an invalid limit: %v\nstdout:\n%s\nstderr: %s", err, out, stderr)
	}

	out, stderr, err = run("limits", "set", "dry-new", "--rate", "100", "--scope", "nodes", "--share", "demand", "--dry-run")
	if err != nil || !strings.Contains(out, "share: demand") {
		t.Errorf("set --share demand --dry-run: %v\nstdout:\n%s\nstderr: %s", err, out, stderr)
	}
	// Keyed demand shares: valid, and hotKeys goes with them.
	out, stderr, err = run("limits", "set", "dry-new", "--rate", "100", "--scope", "nodes", "--share", "demand", "--key", "src-ip", "--dry-run")
	if err != nil || !strings.Contains(out, "share: demand") || !strings.Contains(out, "key: src-ip") {
		t.Errorf("set --share demand --key src-ip --dry-run: %v\nstdout:\n%s\nstderr: %s", err, out, stderr)
	}

	old := createRateLimit(t, env, &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "rlagent.io/v1alpha1",
		"kind":       "RateLimit",
		"metadata":   map[string]any{"name": "dry-old"},
		"spec":       map[string]any{"rate": int64(100), "scope": "nodes", "match": map[string]any{}},
	}})
	out, stderr, err = run("limits", "set", "dry-old", "--rate", "200", "--scope", "nodes", "--dry-run")
	if err != nil || !strings.Contains(out, "rate: 200") {
		t.Errorf("set --dry-run of a change: %v\nstdout:\n%s\nstderr: %s", err, out, stderr)
	}
	if _, stderr, err := run("limits", "delete", "dry-old", "--dry-run"); err != nil || !strings.Contains(stderr, "not deleted") {
		t.Errorf("delete --dry-run: %v\n%s", err, stderr)
	}
	cur, err := rl.Get(ctx, "dry-old", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("after the dry runs: %v", err)
	}
	if rate, _, _ := unstructured.NestedInt64(cur.Object, "spec", "rate"); rate != 100 || cur.GetResourceVersion() != old.GetResourceVersion() {
		t.Errorf("after the dry runs: rate %d, resourceVersion %s; want 100 and %s unchanged", rate, cur.GetResourceVersion(), old.GetResourceVersion())
	}
}
