package node

import (
	"encoding/json"
	"fmt"
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/rlagent/rlagent/agent"
	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/nettest"
)

func TestMain(m *testing.M) {
	nettest.MaybeExec() // the launcher of the node's processes in its namespace
	os.Exit(m.Run())
}

// The rate limit of the test: scope nodes, one node, so the node's share is
// the global rate.
const (
	rate    = 2000 // packets/s
	burst   = 200  // the default: rate / 10
	udpPort = 5353
)

// capEff is CAP_NET_ADMIN (12), CAP_PERFMON (38) and CAP_BPF (39).
const capEff = 1<<12 | 1<<38 | 1<<39

// TestDaemonSetOnRealNode: the Helm chart (deploy/helm/rlagent) installed
// and upgraded with the Helm SDK (hack/helm install, values that name the
// test's image, attach to the test node's interfaces and shorten the
// readiness probe) on a single-node cluster of real components; the
// kubelet runs the agent with containerd from an image of make image.
// deploy/, the chart's default rendering, still applies with kubectl
// apply -k (a server-side dry run next to the release).
//
// It proves: the agent runs unprivileged with exactly CAP_BPF,
// CAP_NET_ADMIN and CAP_PERFMON effective, with its ServiceAccount's RBAC
// (its status writes and the count from its DaemonSet work); it enforces a
// RateLimit on real traffic within 5%; scope service counts the slice the
// controller-manager writes; a limit of scope pods, chosen by labels, is
// enforced at a real pod's interface within 5% of its share; readiness follows the attach state;
// `rlagent status` works through kubectl exec; a rolling update to another
// image keeps enforcing (no 100 ms bin above share + burst, none empty while
// load is offered) and the new pod adopts the pins; an update that changes
// the pin layout (maxBuckets) migrates without a gap.
func TestDaemonSetOnRealNode(t *testing.T) {
	n := k8stest.StartNode(t)
	repo := repoRoot(t)
	images := t.TempDir()
	for _, v := range []string{"node-test-1", "node-test-2"} {
		dir := filepath.Join(images, v)
		run(t, repo, nil, "make", "--no-print-directory", "-s", "image", "VERSION="+v, "IMAGE_DIR="+dir)
		n.ImportImage(filepath.Join(dir, "rlagent.tar"))
	}

	// An interface of the node that the test takes away to see readiness
	// follow (the uplink carries the API server's address).
	nl, err := n.NS.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	addProbe := func() {
		t.Helper()
		if err := nl.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "probe0"}, PeerName: "probe1"}); err != nil {
			t.Fatal(err)
		}
		for _, name := range []string{"probe0", "probe1"} {
			l, err := nl.LinkByName(name)
			if err != nil {
				t.Fatal(err)
			}
			if err := nl.LinkSetUp(l); err != nil {
				t.Fatal(err)
			}
		}
	}
	addProbe()

	helm := buildHelm(t, repo)
	apply := func(tag string, maxBuckets int) {
		t.Helper()
		started := time.Now()
		out, err := n.Output(helm, helmArgs(n, repo, tag, maxBuckets)...)
		if err != nil {
			t.Fatalf("hack/helm install (image %s, maxBuckets %d): %v\n%s", tag, maxBuckets, err, out)
		}
		t.Logf("hack/helm install (image %s, maxBuckets %d) in %v:\n%s", tag, maxBuckets, time.Since(started).Round(time.Millisecond), out)
	}
	apply("node-test-1", 65536)
	n.Kubectl("-n", "rlagent-system", "rollout", "status", "daemonset/rlagent", "--timeout=120s")
	// kubectl apply -k deploy/ as the API server would take it, next to
	// the release that holds the same objects: the kustomization builds
	// and every object passes validation and admission. Server-side, so
	// that kubectl does not look for its last-applied annotation on
	// Helm's objects; forced, because deploy/ names another image than
	// the release (a dry run: nothing changes hands).
	t.Logf("kubectl apply -k deploy/ --server-side --dry-run=server:\n%s", n.Kubectl("apply", "-k", filepath.Join(repo, "deploy"),
		"--server-side", "--force-conflicts", "--field-manager", "rlagent-node-test", "--dry-run=server"))
	pod := agentPod(t, n)
	t.Logf("agent pod %s running", pod)

	// Unprivileged, with exactly the three capabilities.
	caps := processCaps(t, pod)
	t.Logf("the agent's process: %s", caps)
	if !strings.Contains(caps, fmt.Sprintf("CapEff:\t%016x", capEff)) {
		t.Errorf("the agent's effective capabilities are not exactly BPF, NET_ADMIN and PERFMON (%016x):\n%s", capEff, caps)
	}
	var spec struct {
		Spec struct {
			Containers []struct {
				SecurityContext struct {
					Privileged *bool `json:"privileged"`
				} `json:"securityContext"`
			} `json:"containers"`
		} `json:"spec"`
	}
	if err := json.Unmarshal([]byte(n.Kubectl("-n", "rlagent-system", "get", "pod", pod, "-o", "json")), &spec); err != nil {
		t.Fatal(err)
	}
	if p := spec.Spec.Containers[0].SecurityContext.Privileged; p == nil || *p {
		t.Errorf("the agent's container is privileged (%v)", p)
	}

	// A RateLimit on real traffic: the client's UDP to the node.
	n.Kubectl("apply", "-f", writeFile(t, "ratelimit.yaml", fmt.Sprintf(`apiVersion: rlagent.io/v1alpha1
kind: RateLimit
metadata:
  name: node-udp
spec:
  rate: %d
  scope: nodes
  match:
    protocol: udp
    dstPorts: ["%d"]
`, rate, udpPort)))
	conn, err := n.NS.ListenUDP("udp4", netip.AddrPortFrom(netip.IPv4Unspecified(), udpPort), 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	recv := nettest.StartReceiver(conn, nettest.ReceiverConfig{Span: 4 * time.Minute})
	t.Cleanup(func() { recv.Close() })
	waitFor(t, 30*time.Second, "the agent to enforce node-udp at its share", func() (bool, string) {
		st, out := agentStatus(t, n, pod)
		for _, l := range st {
			if l.Name == "node-udp" && l.ShareRate == rate {
				return true, ""
			}
		}
		return false, out
	})
	sconn, err := n.Client.DialUDP(netip.AddrPortFrom(n.Addr, udpPort))
	if err != nil {
		t.Fatal(err)
	}
	sender, err := nettest.StartSender(sconn, nettest.SenderConfig{Rate: 2 * rate, Count: 2 * rate * 240, Duration: 4 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sender.Stop(); sconn.Close() })
	from := time.Now().Add(time.Second)
	to := from.Add(5 * time.Second)
	time.Sleep(time.Until(to) + 200*time.Millisecond)
	got, offered := recv.Got().Rate(from, to), sender.Sent().Rate(from, to)
	t.Logf("enforced: %.0f of %.0f pkt/s offered admitted, share %d (%+.2f%%)", got, offered, rate, 100*(got-rate)/rate)
	if math.Abs(got-rate) > 0.05*rate {
		t.Errorf("the agent admitted %.0f pkt/s, want its share %d +-5%%", got, rate)
	}

	// rlagent status through kubectl exec, and the status the agent wrote.
	out := n.Kubectl("-n", "rlagent-system", "exec", pod, "--", "rlagent", "status")
	t.Logf("kubectl exec %s -- rlagent status:\n%s", pod, out)
	if !strings.Contains(out, "node-udp") {
		t.Errorf("rlagent status through kubectl exec does not show node-udp")
	}
	waitFor(t, 30*time.Second, "RateLimit node-udp's status: 1 replica, Accepted", func() (bool, string) {
		out := n.Kubectl("get", "ratelimit", "node-udp", "-o", "jsonpath={.status.replicas} {.status.conditions[0].status}")
		return out == "1 True", out
	})

	// Scope service counts the EndpointSlice controller's slices, and the
	// controller-manager here writes them: a Service that selects the
	// agent's pod has one ready endpoint, on this node.
	svc := writeFile(t, "service.yaml", `apiVersion: v1
kind: Service
metadata:
  name: rlagent-probe
  namespace: rlagent-system
spec:
  selector:
    app.kubernetes.io/name: rlagent
  ports:
    - protocol: UDP
      port: 5399
---
apiVersion: rlagent.io/v1alpha1
kind: RateLimit
metadata:
  name: node-service
spec:
  rate: 1000
  scope: service
  match:
    service: rlagent-system/rlagent-probe
`)
	n.Kubectl("apply", "-f", svc)
	waitFor(t, 30*time.Second, "RateLimit node-service's status: 1 replica, from the controller's slice", func() (bool, string) {
		out := n.Kubectl("get", "ratelimit", "node-service", "-o", "jsonpath={.status.replicas}")
		return out == "1", out
	})
	managedBy := n.Kubectl("-n", "rlagent-system", "get", "endpointslices", "-l", "kubernetes.io/service-name=rlagent-probe",
		"-o", `jsonpath={range .items[*]}{.metadata.labels.endpointslice\.kubernetes\.io/managed-by}{"\n"}{end}`)
	t.Logf("the Service's EndpointSlices, managed by: %q", managedBy)
	if strings.TrimSpace(managedBy) != "endpointslice-controller.k8s.io" {
		t.Errorf("the Service's EndpointSlices are managed by %q, want one by endpointslice-controller.k8s.io", managedBy)
	}
	n.Kubectl("delete", "-f", svc)

	podSelectorLimit(t, n, pod)

	// Readiness follows the attach state: one of the interfaces goes, and
	// comes back.
	lk, err := nl.LinkByName("probe0")
	if err != nil {
		t.Fatal(err)
	}
	gone := time.Now()
	if err := nl.LinkDel(lk); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the agent pod to be not ready", func() (bool, string) { return !podReady(t, n, pod), "" })
	t.Logf("not ready %v after probe0 went", time.Since(gone).Round(time.Millisecond))
	back := time.Now()
	addProbe()
	waitFor(t, 30*time.Second, "the agent pod to be ready again", func() (bool, string) { return podReady(t, n, pod), "" })
	t.Logf("ready again %v after probe0 came back", time.Since(back).Round(time.Millisecond))

	// A rolling update to another image, then one that changes the pin
	// layout: the traffic stays limited throughout.
	for _, step := range []struct {
		what       string
		tag        string
		maxBuckets int
		logs       []string
	}{
		{"rolling update to node-test-2", "node-test-2", 65536, []string{"adopted pinned data path", "pinned link adopted"}},
		{"update that changes the pin layout (maxBuckets)", "node-test-1", 131072, []string{"pin layout differs: migrating", "pin layout migrated"}},
	} {
		before, _ := agentStatus(t, n, pod)
		started := time.Now()
		apply(step.tag, step.maxBuckets)
		n.Kubectl("-n", "rlagent-system", "rollout", "status", "daemonset/rlagent", "--timeout=120s")
		next := agentPod(t, n)
		if next == pod && step.maxBuckets != 65536 {
			// A ConfigMap's change alone reaches the running agent, which
			// refuses a new maxBuckets until restarted: restart it. (A new
			// image rolls the pods already, which start with the new
			// config: the install waits for that rollout.)
			n.Kubectl("-n", "rlagent-system", "rollout", "restart", "daemonset/rlagent")
			n.Kubectl("-n", "rlagent-system", "rollout", "status", "daemonset/rlagent", "--timeout=120s")
			next = agentPod(t, n)
		}
		if next == pod {
			t.Fatalf("%s: the agent pod is still %s", step.what, pod)
		}
		logs := n.Kubectl("-n", "rlagent-system", "logs", next)
		for _, want := range step.logs {
			if !strings.Contains(logs, want) {
				t.Errorf("%s: the new pod %s did not log %q:\n%s", step.what, next, want, logs)
			}
		}
		done := time.Now()
		time.Sleep(1500 * time.Millisecond)
		// 100 ms bins from 1 s before the update to 1 s after it.
		bins := recv.Got().Series(started.Add(-time.Second), done.Add(time.Second), 100*time.Millisecond)
		bound := (rate/10 + burst) * 1.1
		t.Logf("%s (%s -> %s in %v): admitted per 100 ms: min %d, max %d, bound %.0f",
			step.what, pod, next, done.Sub(started).Round(time.Millisecond), slices.Min(bins), slices.Max(bins), bound)
		for i, b := range bins {
			at := time.Duration(i)*100*time.Millisecond - time.Second
			if float64(b) > bound {
				t.Errorf("%s: %d admitted in the 100 ms at %v, above share x 0.1 s + burst + 10%% (%.0f)", step.what, b, at, bound)
			}
			if b == 0 {
				t.Errorf("%s: nothing admitted in the 100 ms at %v while load was offered", step.what, at)
			}
		}
		after, _ := agentStatus(t, n, next)
		b, a := limitTotals(before, "node-udp"), limitTotals(after, "node-udp")
		t.Logf("%s: counters admitted %d -> %d, dropped %d -> %d", step.what, b.AdmittedPackets, a.AdmittedPackets, b.DroppedPackets, a.DroppedPackets)
		if a.DroppedPackets <= b.DroppedPackets || a.AdmittedPackets <= b.AdmittedPackets {
			t.Errorf("%s: the counters did not go on", step.what)
		}
		pod = next
	}
}

// buildHelm builds hack/helm, the chart's install command (a module of
// its own: the Helm SDK needs a newer k8s.io than rlagent's).
func buildHelm(t *testing.T, repo string) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "rlagent-helm")
	run(t, repo, nil, "go", "-C", filepath.Join(repo, "hack", "helm"), "build", "-o", bin, ".")
	return bin
}

// helmArgs installs (or upgrades) the chart with the test's image
// (imagePullPolicy Never: there is no registry), the node's interfaces in
// the config, the kubelet's port alone protected, and a readiness probe
// every 2 s (the chart's is every 10 s, 3 failures).
func helmArgs(n *k8stest.Node, repo, tag string, maxBuckets int) []string {
	return []string{"install", "--kubeconfig", n.Env.Kubeconfig, "--chart", filepath.Join(repo, "deploy", "helm", "rlagent"),
		"--namespace", "rlagent-system", "--create-namespace", "--timeout", "2m",
		"--set", "image.tag=" + tag, "--set", "image.pullPolicy=Never",
		"--set", "readinessProbe.periodSeconds=2", "--set", "readinessProbe.failureThreshold=1",
		"--set", "config.maxBuckets=" + strconv.Itoa(maxBuckets),
		"--set-json", `config.interfaces=["uplink","probe0"]`,
		"--set-json", `config.protect=[{"name":"kubelet","protocol":"tcp","localPorts":[10250]}]`,
	}
}

// agentPod is the agent's running pod (the only one of the DaemonSet on
// the one node, not being deleted).
func agentPod(t *testing.T, n *k8stest.Node) string {
	t.Helper()
	var name string
	waitFor(t, 60*time.Second, "one running agent pod", func() (bool, string) {
		out := n.Kubectl("-n", "rlagent-system", "get", "pods", "-l", "app.kubernetes.io/name=rlagent",
			"-o", `jsonpath={range .items[*]}{.metadata.name} {.status.phase} {.metadata.deletionTimestamp}{"\n"}{end}`)
		var running []string
		for line := range strings.SplitSeq(strings.TrimSpace(out), "\n") {
			if f := strings.Fields(line); len(f) == 2 && f[1] == "Running" {
				running = append(running, f[0])
			}
		}
		if len(running) != 1 {
			return false, out
		}
		name = running[0]
		return true, ""
	})
	return name
}

func podReady(t *testing.T, n *k8stest.Node, pod string) bool {
	t.Helper()
	out := n.Kubectl("-n", "rlagent-system", "get", "pod", pod, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
	return out == "True"
}

// processCaps finds the agent's process on the node (its container's,
// through the pod's container ID) and returns the capability lines of its
// /proc status.
func processCaps(t *testing.T, pod string) string {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		cmdline, _ := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if !strings.HasPrefix(string(cmdline), "/usr/local/bin/rlagent\x00run\x00") {
			continue
		}
		env, _ := os.ReadFile("/proc/" + e.Name() + "/environ")
		if !strings.Contains(string(env), "POD_NAME="+pod+"\x00") {
			continue
		}
		status, err := os.ReadFile("/proc/" + e.Name() + "/status")
		if err != nil {
			t.Fatal(err)
		}
		var lines []string
		for l := range strings.SplitSeq(string(status), "\n") {
			if strings.HasPrefix(l, "Cap") || strings.HasPrefix(l, "NoNewPrivs") || strings.HasPrefix(l, "Uid") {
				lines = append(lines, l)
			}
		}
		return "pid " + e.Name() + "\n" + strings.Join(lines, "\n")
	}
	t.Fatalf("no process of %s's rlagent on the node", pod)
	return ""
}

// agentStatus is `rlagent status -o json` of the agent in pod.
func agentStatus(t *testing.T, n *k8stest.Node, pod string) ([]agent.LimitStatus, string) {
	t.Helper()
	out, err := n.KubectlErr("-n", "rlagent-system", "exec", pod, "--", "rlagent", "status", "-o", "json")
	if err != nil {
		return nil, out
	}
	var st []agent.LimitStatus
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		return nil, out
	}
	return st, out
}

func limitTotals(st []agent.LimitStatus, name string) (s struct{ AdmittedPackets, DroppedPackets uint64 }) {
	for _, l := range st {
		if l.Name == name {
			s.AdmittedPackets, s.DroppedPackets = l.Totals.AdmittedPackets, l.Totals.DroppedPackets
		}
	}
	return s
}

func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func waitFor(t *testing.T, timeout time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, why := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s: %s", timeout, what, why)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
