package attach

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/internal/bpftest"
	"github.com/rlagent/rlagent/internal/nettest"
)

// A CNI that delivers into a pod with bpf_redirect_peer (Cilium's BPF host
// routing) skips the host-side veth's egress hook; the pod side's ingress,
// attached inside the pod's namespace found from the veth's peer, sees
// every packet.
//
//	client (A) veth-a 10.232.0.1 -- veth-b 10.232.0.2 node (B) lxc1 -- eth0 10.232.1.2 pod
//
// First the node forwards normally (both counters see the packets, which
// proves the host-side counter works), then a program on veth-b's ingress
// redirects every packet to lxc1's peer.
func TestPodSideIngressSeesRedirectPeer(t *testing.T) {
	p := pair(t, "10.232.0.0/24")
	pod := nettest.MustNS(t, "pod")
	nlB, err := p.B.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nlB.Close()
	lxc1 := addPod(t, p.B, "lxc1", pod, "10.232.1.2/24")
	hostRoute(t, nlB, lxc1, "10.232.1.2")
	// A way back for the pod, so that reverse path filtering (inherited
	// from the host's settings) accepts the client's packets.
	nlPod, err := pod.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nlPod.Close()
	eth0, err := nlPod.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	if err := nlPod.RouteAdd(&netlink.Route{LinkIndex: eth0.Attrs().Index, Scope: netlink.SCOPE_LINK,
		Dst: &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}}); err != nil {
		t.Fatal(err)
	}
	podMAC, err := pod.MAC("eth0")
	if err != nil {
		t.Fatal(err)
	}
	if err := p.B.AddNeighbor("lxc1", netip.MustParseAddr("10.232.1.2"), podMAC); err != nil {
		t.Fatal(err)
	}
	nlA, err := p.A.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nlA.Close()
	veth, err := nlA.LinkByName("veth-a")
	if err != nil {
		t.Fatal(err)
	}
	err = nlA.RouteAdd(&netlink.Route{LinkIndex: veth.Attrs().Index, Gw: p.B4.AsSlice(),
		Dst: &net.IPNet{IP: net.IPv4(10, 232, 1, 0), Mask: net.CIDRMask(24, 32)}})
	if err != nil {
		t.Fatal(err)
	}
	// The node's own namespace: it dies with the test, its sysctl too.
	if err := p.B.Do(func() error { return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0) }); err != nil {
		t.Fatal(err)
	}

	netnsDir := t.TempDir()
	if err := os.Symlink(fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), int(pod.Handle())),
		filepath.Join(netnsDir, "cni-pod")); err != nil {
		t.Fatal(err)
	}
	a := newAttacher(t, Options{NetnsDirs: []string{netnsDir}})
	hostEgress := bpftest.NewCounter(t, ebpf.SchedCLS, "test_host_eg", bpftest.TCXNext)
	podIngress := bpftest.NewCounter(t, ebpf.SchedCLS, "test_pod_in", bpftest.TCXNext)

	// As the agent would: in the node's namespace, find the endpoint, then
	// attach at both sides of its pair.
	var ep Endpoint
	var res Attached
	var before, after uint64
	err = p.B.Do(func() error {
		eps, err := a.FindEndpoints([]netip.Addr{netip.MustParseAddr("10.232.1.2")})
		if err != nil {
			return err
		}
		ep = eps[0]
		pt, ok := ep.Peer.Ingress()
		if ep.Iface != "lxc1" || !ok {
			return fmt.Errorf("endpoint %+v: want lxc1 with its peer's namespace found", ep)
		}
		if _, err := a.Attach(Point{Iface: "lxc1", Kind: TCEgress}, hostEgress.Prog); err != nil {
			return err
		}
		before = threadNetns(t)
		res, err = a.Attach(pt, podIngress.Prog)
		after = threadNetns(t)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if before != after {
		t.Fatalf("Attach in the pod's namespace left the calling thread in namespace %d, it was in %d", after, before)
	}
	if res.Point.Netns != filepath.Join(netnsDir, "cni-pod") || res.Point.Iface != "eth0" || res.Mode != ModeTCX {
		t.Fatalf("pod-side attach = %+v", res)
	}
	if got := bpftest.TCXPrograms(t, pod, "eth0", ebpf.AttachTCXIngress); len(got) != 1 || got[0] != podIngress.ID(t) {
		t.Fatalf("the pod's eth0 ingress runs %v, want [%d]", got, podIngress.ID(t))
	}

	const n = 300
	dst := netip.AddrPortFrom(netip.MustParseAddr("10.232.1.2"), 7005)
	rc := listen(t, pod, dst)

	// Routed through the node: lxc1's egress, then the pod's ingress.
	sendUDP(t, p.A, dst, n)
	if got := hostEgress.Wait(t, n); got != n {
		t.Fatalf("forwarded: the host side's egress counted %d, want %d", got, n)
	}
	if got := podIngress.Wait(t, n); got != n {
		t.Fatalf("forwarded: the pod side's ingress counted %d, want %d", got, n)
	}
	if got := receive(t, rc, n); got != n {
		t.Fatalf("forwarded: the pod received %d datagrams, want %d", got, n)
	}

	// Redirected to the peer: the host side's egress is skipped.
	redir := bpftest.RedirectPeer(t, lxc1.Attrs().Index)
	idx := bpftest.IfIndex(t, p.B, "veth-b")
	var l link.Link
	if err := p.B.Do(func() (err error) {
		l, err = link.AttachTCX(link.TCXOptions{Interface: idx, Program: redir, Attach: ebpf.AttachTCXIngress})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	sendUDP(t, p.A, dst, n)
	if got := podIngress.Wait(t, 2*n); got != 2*n {
		t.Errorf("redirected: the pod side's ingress counted %d in all, want %d", got, 2*n)
	}
	if got := receive(t, rc, n); got != n {
		t.Errorf("redirected: the pod received %d datagrams, want %d", got, n)
	}
	if got := hostEgress.N(t); got != n {
		t.Errorf("redirected: the host side's egress counted %d in all, want %d: bpf_redirect_peer should skip it",
			got, n)
	}
}

// threadNetns is the namespace of the calling thread.
func threadNetns(t *testing.T) uint64 {
	var st unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/net", &st); err != nil {
		t.Error(err)
	}
	return st.Ino
}
