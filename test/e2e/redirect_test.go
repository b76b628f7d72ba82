package e2e

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/rlagent/rlagent/agent"
	"github.com/rlagent/rlagent/internal/bpftest"
	"github.com/rlagent/rlagent/internal/nettest"
)

// A CNI with BPF host routing (Cilium) hands packets to a pod with
// bpf_redirect_peer: from the node's uplink TC ingress straight into the
// pod's own interface, past the node's routing and the host-side veth's
// egress hook, where endpointHook host enforces a pod's ingress limits.
//
//	remote ── uplink [tc ingress: bpf_redirect_peer to vr-pod's peer] node ── vr-pod ── eth0 pod
//
// The fixture is that redirect: a TC program on the node's uplink ingress
// (the test loads it with cilium/ebpf's asm) that hands the pod's packets
// to vr-pod's peer.

// redirectLimit is the ingress limit on the pod, attach endpoints, key
// dst-ip (the pod's IPv4 and IPv6 address each have a bucket of the
// share), at global rate global.
func redirectLimit(pod *nettest.Pod, global uint64) string {
	return fmt.Sprintf(`  - name: pod-in
    rate: %d
    attach: endpoints
    key: dst-ip
    match:
      protocol: udp
      dstPorts: ["%d-%d"]
      dstCIDRs: [%s, %s]
`, global, redirectPort4, redirectPort6, pod.Addr4, pod.Addr6)
}

// The pod's receiving ports, one per family.
const redirectPort4, redirectPort6 = 5601, 5602

// redirectStreams start a UDP stream from the remote to each of the pod's
// addresses at rate, for span.
func redirectStreams(t *testing.T, r *rig, pod *nettest.Pod, rate float64, span time.Duration) []*stream {
	t.Helper()
	return []*stream{
		startStream(t, "remote -> pod, ipv4", r.topo.Remote, netip.AddrPortFrom(pod.Addr4, redirectPort4), pod.NS, rate, 0, span),
		startStream(t, "remote -> pod, ipv6", r.topo.Remote, netip.AddrPortFrom(pod.Addr6, redirectPort6), pod.NS, rate, 0, span),
	}
}

// TestRedirectPeerEndpointHook: an attach endpoints ingress limit on a pod
// whose traffic a CNI delivers with bpf_redirect_peer.
//
//   - endpointHook host: the limit runs at the TC egress of the pod's
//     host-side veth. Routed the usual way, the pod's traffic is held to
//     the share; once the node redirects it with bpf_redirect_peer, the
//     hook sees none of it and the pod receives everything. This is the
//     known limit of endpointHook host (docs/config.md).
//   - endpointHook pod: the limit runs at the TC ingress of the pod's own
//     interface, inside its network namespace, which the agent finds as
//     /proc/PID/ns/net of a process in it (the namespace has no file under
//     /run/netns): the redirected traffic is held to the share, IPv4 and
//     IPv6, within 5%.
func TestRedirectPeerEndpointHook(t *testing.T) {
	t.Run("host", testRedirectHost)
	t.Run("pod", testRedirectPod)
}

func testRedirectHost(t *testing.T) {
	r := newRig(t, nettest.TopologyConfig{Uplink: true, RoutedPods: []string{"pod"}})
	pod := r.topo.Pod("pod")
	global := globalRate / 2
	share := float64(global / rigCount)
	r.start("", redirectLimit(pod, global))
	r.waitHooks("tc-egress " + pod.HostIf + " endpoint-in")

	phase := settle + rigWindow
	streams := redirectStreams(t, r, pod, 2*share, 2*phase+3*time.Second)

	// Routed: the host side's egress hook sees it all.
	from := streams[0].send.Sent().Start().Add(settle)
	to := from.Add(rigWindow)
	sleepUntil(to.Add(late))
	for _, s := range streams {
		s.check(t, from, to, share)
	}

	// Redirected to the peer: the hook is skipped.
	bpftest.AttachTCIngress(t, r.topo.Node, nettest.UplinkIf, bpftest.RedirectPeer(t, pod.HostIfIndex, pod.Addr4, pod.Addr6))
	redirected := time.Now()
	host0 := linkStats(t, r.topo.Node, pod.HostIf)
	from = redirected.Add(200 * time.Millisecond)
	to = from.Add(rigWindow)
	c0, c1 := r.window(from, to, late)
	host := linkStats(t, r.topo.Node, pod.HostIf).Sub(host0)
	for _, s := range streams {
		s.checkAll(t, from, to)
	}
	seen := counterRate(t, c0, c1, "pod-in", admittedPackets) + counterRate(t, c0, c1, "pod-in", droppedPackets)
	t.Logf("redirected: the limit saw %.0f pkt/s; %s sent %d packets meanwhile (the peer redirect bypasses it)",
		seen, pod.HostIf, host.TxPackets)
	if seen != 0 {
		t.Errorf("redirected: the limit at the host side saw %.0f pkt/s, want none: is the fixture redirecting?", seen)
	}
	if offered := float64(streams[0].send.Sent().Count(from, to)); float64(host.TxPackets) > 0.01*offered {
		t.Errorf("redirected: %s sent %d packets in the window, want next to none: the redirect did not bypass it",
			pod.HostIf, host.TxPackets)
	}
}

func testRedirectPod(t *testing.T) {
	r := newRig(t, nettest.TopologyConfig{Uplink: true, RoutedPods: []string{"pod"}})
	pod := r.topo.Pod("pod")
	// Before the agent starts, and before the pin directory (whose cleanup
	// detaches the pod-side hook through this process's /proc entry).
	holder := pod.NS.Hold(t)
	bpftest.AttachTCIngress(t, r.topo.Node, nettest.UplinkIf, bpftest.RedirectPeer(t, pod.HostIfIndex, pod.Addr4, pod.Addr6))
	global := globalRate / 2
	share := float64(global / rigCount)
	r.start("endpointHook: pod\n", redirectLimit(pod, global))
	ifs := r.waitHooks("tc-ingress " + nettest.PodIf + " endpoint-in")
	wantNS := fmt.Sprintf("/proc/%d/ns/net", holder)
	for _, s := range ifs {
		t.Logf("status: %s %s %s (netns %q): %s", s.Hook, s.Name, s.Program, s.Netns, s)
		if s.Program == "endpoint-in" && s.Netns != wantNS {
			t.Errorf("the endpoint-in hook is in netns %q, want the pod's, found as %s", s.Netns, wantNS)
		}
		if s.Hook == "tc-egress" && s.Name == pod.HostIf && s.State == agent.StateAttached {
			t.Errorf("with endpointHook pod the host side's egress is attached too: %+v", s)
		}
	}
	if note := r.counters().limit(t, "pod-in").Note; note != "" {
		t.Errorf("the limit's note: %q, want none (the pod side was found)", note)
	}

	streams := redirectStreams(t, r, pod, 2*share, settle+rigWindow+2*time.Second)
	host0 := linkStats(t, r.topo.Node, pod.HostIf)
	from := streams[0].send.Sent().Start().Add(settle)
	to := from.Add(rigWindow)
	c0, c1 := r.window(from, to, late)
	host := linkStats(t, r.topo.Node, pod.HostIf).Sub(host0)
	for _, s := range streams {
		s.check(t, from, to, share)
	}
	checkNear(t, "pod-in: admitted (status, 2 keys)", counterRate(t, c0, c1, "pod-in", admittedPackets), 2*share, rigTol, "pkt/s")
	t.Logf("%s sent %d packets while the pod received its streams: they were redirected past it", pod.HostIf, host.TxPackets)
	if offered := float64(streams[0].send.Sent().Total()); float64(host.TxPackets) > 0.01*offered {
		t.Errorf("%s sent %d packets, want next to none: the fixture did not redirect, the test proves nothing",
			pod.HostIf, host.TxPackets)
	}
}
