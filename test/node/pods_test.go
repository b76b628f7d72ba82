package node

import (
	"fmt"
	"math"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/rlagent/rlagent/agent"
	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/nettest"
)

// podsRate is the rate of the limit of scope pods: one matching pod, on
// this node, so its share is the whole rate.
const (
	podsRate = 1500 // packets/s
	podsPort = 5357
)

// podSelectorLimit: a real pod (the pause image, its own network namespace
// and veth from the bridge CNI plugin), chosen by a RateLimit of scope pods
// through its labels and its namespace's. The elected agent counts it (status
// 1 replica), the agent enforces at the pod's interface (attach endpoints,
// the default of scope pods), and a receiver in the pod's namespace gets
// the share within 5% while the client offers twice as much.
func podSelectorLimit(t *testing.T, n *k8stest.Node, agentPod string) {
	t.Helper()
	manifest := writeFile(t, "pods.yaml", fmt.Sprintf(`apiVersion: v1
kind: Namespace
metadata:
  name: shop
  labels:
    team: shop
---
apiVersion: v1
kind: Pod
metadata:
  name: sink
  namespace: shop
  labels:
    app: sink
spec:
  terminationGracePeriodSeconds: 0
  containers:
    - name: sink
      image: %s
      imagePullPolicy: Never
---
apiVersion: rlagent.io/v1alpha1
kind: RateLimit
metadata:
  name: node-pods
spec:
  rate: %d
  scope: pods
  match:
    protocol: udp
    dstPorts: ["%d"]
    podSelector:
      matchLabels:
        app: sink
    namespaceSelector:
      matchLabels:
        team: shop
`, k8stest.PauseImage, podsRate, podsPort))
	n.Kubectl("apply", "-f", manifest)
	t.Cleanup(func() { n.KubectlErr("delete", "-f", manifest, "--wait=false") })
	n.Kubectl("-n", "shop", "wait", "pod/sink", "--for=condition=Ready", "--timeout=60s")
	var uid, ip string
	out := n.Kubectl("-n", "shop", "get", "pod", "sink", "-o", "jsonpath={.metadata.uid} {.status.podIP}")
	if _, err := fmt.Sscan(out, &uid, &ip); err != nil {
		t.Fatalf("the sink pod's uid and address: %q: %v", out, err)
	}
	addr := netip.MustParseAddr(ip)
	t.Logf("pod shop/sink ready at %s", addr)

	// The node finds a pod on a bridge by its neighbour entry: one packet
	// from the node makes it (until then the limit runs at the uplink,
	// and the condition says EnforcedAtUplink).
	if c, err := n.NS.DialUDP(netip.AddrPortFrom(addr, podsPort)); err == nil {
		c.Write([]byte("arp"))
		c.Close()
	}
	waitFor(t, 30*time.Second, "RateLimit node-pods's status: 1 replica, Accepted at the pod's interface (Valid)", func() (bool, string) {
		out := n.Kubectl("get", "ratelimit", "node-pods", "-o", "jsonpath={.status.replicas} {.status.conditions[0].status} {.status.conditions[0].reason}")
		return out == "1 True "+v1alpha1.ReasonValid, out
	})
	var enforced agent.LimitStatus
	waitFor(t, 30*time.Second, "the agent to enforce node-pods at the pod's interface", func() (bool, string) {
		st, out := agentStatus(t, n, agentPod)
		for _, l := range st {
			if l.Name == "node-pods" && l.ShareRate == podsRate && l.Local == 1 && l.Replicas == 1 {
				enforced = l
				return true, ""
			}
		}
		return false, out
	})
	t.Logf("node-pods enforced: scope %s, share %d (local %d of %d)", enforced.Scope, enforced.ShareRate, enforced.Local, enforced.Replicas)
	out = n.Kubectl("-n", "rlagent-system", "exec", agentPod, "--", "rlagent", "status")
	t.Logf("kubectl exec %s -- rlagent status:\n%s", agentPod, out)

	// A receiver in the pod's own network namespace, and a route from the
	// client to the pods' network through the node.
	podNS, err := nettest.OpenNS("pod shop/sink", "/proc/"+podPID(t, uid)+"/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { podNS.Close() })
	conn, err := podNS.ListenUDP("udp4", netip.AddrPortFrom(netip.IPv4Unspecified(), podsPort), 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	recv := nettest.StartReceiver(conn, nettest.ReceiverConfig{Span: time.Minute})
	t.Cleanup(func() { recv.Close() })
	nl, err := n.Client.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	podNet := netip.PrefixFrom(addr, 24).Masked()
	route := &netlink.Route{Dst: &net.IPNet{IP: podNet.Addr().AsSlice(), Mask: net.CIDRMask(podNet.Bits(), 32)}, Gw: n.Addr.AsSlice()}
	if err := nl.RouteAdd(route); err != nil {
		t.Fatalf("route %s via %s in the client: %v", podNet, n.Addr, err)
	}
	t.Cleanup(func() {
		if nl, err := n.Client.Netlink(); err == nil {
			nl.RouteDel(route)
			nl.Close()
		}
	})

	sconn, err := n.Client.DialUDP(netip.AddrPortFrom(addr, podsPort))
	if err != nil {
		t.Fatal(err)
	}
	sender, err := nettest.StartSender(sconn, nettest.SenderConfig{Rate: 2 * podsRate, Count: 2 * podsRate * 10, Duration: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { sender.Stop(); sconn.Close() }()
	from := time.Now().Add(time.Second)
	to := from.Add(5 * time.Second)
	time.Sleep(time.Until(to) + 200*time.Millisecond)
	got, offered := recv.Got().Rate(from, to), sender.Sent().Rate(from, to)
	t.Logf("scope pods at the pod's interface: %.0f of %.0f pkt/s offered reached the pod, share %d (%+.2f%%)",
		got, offered, podsRate, 100*(got-podsRate)/podsRate)
	if math.Abs(got-podsRate) > 0.05*podsRate {
		t.Errorf("the pod received %.0f pkt/s, want the share %d +-5%%", got, podsRate)
	}
	if st, _ := agentStatus(t, n, agentPod); limitTotals(st, "node-pods").DroppedPackets == 0 {
		t.Errorf("node-pods dropped nothing: the limit did not act on the pod's traffic")
	}
	n.Kubectl("delete", "-f", manifest, "--wait=false")
}

// podPID is a process of the pod with uid (its sandbox's or a container's):
// the one whose cgroup (cgroupfs driver: .../pod<uid>/...) names the pod.
func podPID(t *testing.T, uid string) string {
	t.Helper()
	want := "pod" + uid
	procs, _ := filepath.Glob("/proc/[0-9]*/cgroup")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err == nil && strings.Contains(string(b), want) {
			return filepath.Base(filepath.Dir(p))
		}
	}
	t.Fatalf("no process in the cgroup of pod %s", uid)
	return ""
}
