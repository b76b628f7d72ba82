package k8s

import (
	"bytes"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// TestNodesScope: a limit of scope nodes, created with `rlagent limits set
// --kubeconfig`, is divided by the ready agents: status.numberReady of the
// agents' DaemonSet (--agent-daemonset in --agent-namespace; the test writes
// its status as the DaemonSet controller would: there is no controller-
// manager). Every agent's share follows as agents become ready, not ready,
// and go away; another DaemonSet in the namespace does not count. `rlagent
// limits get` and `list` show the object, and `rlagent limits delete`
// removes it from every agent.
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
	// No DaemonSet yet: a count below 1 divides by 1.
	all3 := func(w want) []want { return []want{w, w, w} }
	a, err := c.waitShares(name, all3(want{share: rate, replicas: 0, local: 0}), created, 10*time.Second)
	if err != nil {
		t.Fatalf("limits set: %v", err)
	}
	t.Logf("limits set, with no agents' DaemonSet (a count of 0 divides as 1): %v", a)

	steps := []struct {
		what   string
		change func()
		ready  uint32
	}{
		{"3 agents ready", func() {
			// Ready, but not the agents' DaemonSet: it must not count.
			// (The agents' watch selects their DaemonSet by name: they
			// never see this one.)
			setDaemonSetReady(t, env, ns, "other", 7, 7)
			c.setAgents(3)
		}, 3},
		{"one agent not ready", func() { c.setAgents(2) }, 2},
		{"two more agents ready", func() { c.setAgents(4) }, 4},
		{"5 ready", func() { c.setAgents(5) }, 5},
		{"one gone", func() { c.setAgents(4) }, 4},
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
