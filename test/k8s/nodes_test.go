package k8s

import (
	"bytes"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// TestNodesScope: a limit of scope nodes, created with `rlagent limits set
// --kubeconfig`, is divided by the ready agents: the pods in the agents'
// namespace that --agent-selector selects (the test creates them and sets
// their Ready condition: there is no kubelet). Every agent's share follows
// as pods become ready, not ready, and go away; a ready pod the selector
// does not select does not count. `rlagent limits get` and `list` show the
// object, and `rlagent limits delete` removes it from every agent.
func TestNodesScope(t *testing.T) {
	testenv.RequireRoot(t)
	env := k8stest.Shared(t)
	installCRD(t, env)
	ns := env.Namespace(t)
	c := startCluster(t, env, ns, 3)

	const name = "nodes-cli"
	const rate = 6000
	deleteInCleanup(t, env, name) // if the test ends before limits delete
	created := time.Now()
	c.rlagent("limits", "set", name, "--rate", fmt.Sprint(rate), "--scope", "nodes", "--protocol", "udp", "--dst-ports", fmt.Sprint(svcPort))
	// No agent pod is ready yet: a count below 1 divides by 1.
	all3 := func(w want) []want { return []want{w, w, w} }
	a, err := c.waitShares(name, all3(want{share: rate, replicas: 0, local: 0}), created, 10*time.Second)
	if err != nil {
		t.Fatalf("limits set: %v", err)
	}
	t.Logf("limits set, with no ready agent pod (a count of 0 divides as 1): %v", a)

	pods := env.Clientset().CoreV1().Pods(ns)
	// Readiness as the kubelet would report it.
	setReady := func(pod string, ready bool) {
		t.Helper()
		p, err := pods.Get(t.Context(), pod, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		status := corev1.ConditionFalse
		if ready {
			status = corev1.ConditionTrue
		}
		p.Status.Phase = corev1.PodRunning
		p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: status, LastTransitionTime: metav1.Now()}}
		if _, err := pods.UpdateStatus(t.Context(), p, metav1.UpdateOptions{}); err != nil {
			t.Fatalf("set %s ready=%v: %v", pod, ready, err)
		}
	}
	createPod := func(pod string, labels map[string]string, ready bool) {
		t.Helper()
		_, err := pods.Create(t.Context(), &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: pod, Labels: labels},
			Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "rlagent", Image: "ghcr.io/rlagent/rlagent:test"}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("create pod %s: %v", pod, err)
		}
		setReady(pod, ready)
	}
	agentPod := map[string]string{agentLabel: ns}

	steps := []struct {
		what   string
		change func()
		ready  uint32
	}{
		{"3 agent pods ready", func() {
			for i := 1; i <= 3; i++ {
				createPod(fmt.Sprintf("agent-%d", i), agentPod, true)
			}
			// Ready, but not an agent pod: it must not count. (The next steps
			// prove it: the agents see the pod events in order, so they have
			// seen this one when they count agent-2's change.)
			createPod("other", map[string]string{"app": "other"}, true)
		}, 3},
		{"agent-2 not ready", func() { setReady("agent-2", false) }, 2},
		{"agent-4 and agent-5 created ready", func() {
			createPod("agent-4", agentPod, true)
			createPod("agent-5", agentPod, true)
		}, 4},
		{"agent-2 ready again", func() { setReady("agent-2", true) }, 5},
		{"agent-1 deleted", func() {
			if err := pods.Delete(t.Context(), "agent-1", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
				t.Fatal(err)
			}
		}, 4},
	}
	for _, s := range steps {
		started := time.Now()
		s.change()
		w := want{share: rate / uint64(s.ready), replicas: s.ready, local: 1}
		a, err := c.waitShares(name, all3(w), started, 5*time.Second)
		if err != nil {
			t.Fatalf("%s: %v", s.what, err)
		}
		t.Logf("%s: share %d (%d ready): %v", s.what, w.share, s.ready, a)
	}

	// limits get prints the object, with the count the agents report.
	var got struct {
		Spec   map[string]any `json:"spec"`
		Status struct {
			Replicas int `json:"replicas"`
		} `json:"status"`
	}
	waitFor(t, 15*time.Second, "limits get to show status.replicas 4", func() (bool, string) {
		out := c.rlagent("limits", "get", name)
		got.Status.Replicas = -1
		if err := yaml.Unmarshal([]byte(out), &got); err != nil {
			return false, fmt.Sprintf("%v\n%s", err, out)
		}
		return got.Status.Replicas == 4, out
	})
	if fmt.Sprint(got.Spec["rate"]) != fmt.Sprint(rate) || got.Spec["scope"] != "nodes" {
		t.Errorf("limits get: spec %v, want rate %d and scope nodes", got.Spec, rate)
	}
	list := c.rlagent("limits", "list")
	t.Logf("limits list:\n%s", list)
	if !hasRow(list, name, fmt.Sprint(rate), "nodes", "4") {
		t.Errorf("limits list has no row for %s with rate %d, scope nodes and 4 replicas:\n%s", name, rate, list)
	}

	deleted := time.Now()
	c.rlagent("limits", "delete", name)
	a, err = c.waitShares(name, all3(want{absent: true}), deleted, 5*time.Second)
	if err != nil {
		t.Fatalf("limits delete: %v", err)
	}
	t.Logf("limits delete: %v", a)
}

// rlagent runs the binary under test against the cluster (on the host:
// the API server listens there) and fails the test if it fails.
func (c *cluster) rlagent(args ...string) string {
	c.t.Helper()
	cmd := exec.Command(rlagentBin, append(args, "--kubeconfig", c.env.Kubeconfig)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		c.t.Fatalf("rlagent %s: %v\n%s%s", strings.Join(args, " "), err, stdout.String(), stderr.String())
	}
	return stdout.String()
}

// hasRow reports whether a line of table starts with name and holds every
// one of cells as a column.
func hasRow(table, name string, cells ...string) bool {
	for line := range strings.SplitSeq(table, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || f[0] != name {
			continue
		}
		ok := true
		for _, c := range cells {
			found := false
			for _, x := range f[1:] {
				found = found || x == c
			}
			ok = ok && found
		}
		if ok {
			return true
		}
	}
	return false
}
