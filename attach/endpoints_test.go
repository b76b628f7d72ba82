package attach

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// addPod joins pod to node with a veth pair: hostIf in node (up, no
// address: the host side of a pod's pair), eth0 in pod with addrs. It
// returns the host side.
func addPod(t *testing.T, node *nettest.NS, hostIf string, pod *nettest.NS, addrs ...string) netlink.Link {
	t.Helper()
	nl, err := node.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	err = nl.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: hostIf}, PeerName: "eth0",
		PeerNamespace: netlink.NsFd(int(pod.Handle()))})
	if err != nil {
		t.Fatalf("veth %s: %v", hostIf, err)
	}
	host, err := nl.LinkByName(hostIf)
	if err != nil {
		t.Fatal(err)
	}
	if err := nl.LinkSetUp(host); err != nil {
		t.Fatal(err)
	}
	pnl, err := pod.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer pnl.Close()
	eth0, err := pnl.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		addAddr(t, pnl, eth0, a)
	}
	if err := pnl.LinkSetUp(eth0); err != nil {
		t.Fatal(err)
	}
	return host
}

func addAddr(t *testing.T, nl *netlink.Handle, l netlink.Link, prefix string) {
	t.Helper()
	p := netip.MustParsePrefix(prefix)
	a := &netlink.Addr{IPNet: &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}}
	if p.Addr().Is6() {
		a.Flags = unix.IFA_F_NODAD
	}
	if err := nl.AddrAdd(l, a); err != nil {
		t.Fatalf("add %s to %s: %v", prefix, l.Attrs().Name, err)
	}
}

// hostRoute routes a single address at an interface (scope link), as
// Calico does for each local pod.
func hostRoute(t *testing.T, nl *netlink.Handle, l netlink.Link, addr string) {
	t.Helper()
	a := netip.MustParseAddr(addr)
	err := nl.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Scope: netlink.SCOPE_LINK,
		Dst: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(a.BitLen(), a.BitLen())}})
	if err != nil {
		t.Fatalf("route %s dev %s: %v", addr, l.Attrs().Name, err)
	}
}

// endpointNode is a node namespace with pods behind a ptp route, pods on
// a bridge, and a local address:
//
//	pod1  eth0 10.230.1.5/32, fd00:230:1::5/128 <- cali1, routes /32, /128 (Calico style)
//	pod2  eth0 10.230.2.2/24 <- vp2 -+- br0 10.230.2.1/24 (the bridge plugin)
//	pod3  eth0 10.230.2.3/24 <- vp3 -+
//	lo    10.230.9.9/32 (an address of the node: a hostNetwork pod's)
//
// pod1's namespace has a file in a NetnsDirs directory, pod2's a process
// in it (found in /proc), pod3's nothing.
type endpointNode struct {
	node, pod1, pod2, pod3 *nettest.NS
	a                      *Attacher
	netnsDir               string
	pod2PID                int
}

func newEndpointNode(t *testing.T) *endpointNode {
	t.Helper()
	testenv.RequireRoot(t)
	nettest.HoldTraffic(t)
	e := &endpointNode{node: nettest.MustNS(t, "node"), pod1: nettest.MustNS(t, "pod1"), pod2: nettest.MustNS(t, "pod2"), pod3: nettest.MustNS(t, "pod3")}
	nl, err := e.node.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()

	cali1 := addPod(t, e.node, "cali1", e.pod1, "10.230.1.5/32", "fd00:230:1::5/128")
	hostRoute(t, nl, cali1, "10.230.1.5")
	hostRoute(t, nl, cali1, "fd00:230:1::5")

	if err := nl.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "br0"}}); err != nil {
		t.Fatal(err)
	}
	br, err := nl.LinkByName("br0")
	if err != nil {
		t.Fatal(err)
	}
	addAddr(t, nl, br, "10.230.2.1/24")
	if err := nl.LinkSetUp(br); err != nil {
		t.Fatal(err)
	}
	for i, pod := range []*nettest.NS{e.pod2, e.pod3} {
		port := addPod(t, e.node, fmt.Sprintf("vp%d", i+2), pod, fmt.Sprintf("10.230.2.%d/24", i+2))
		if err := nl.LinkSetMaster(port, br); err != nil {
			t.Fatal(err)
		}
	}
	// Remote pods, behind another node reached through pod2's address.
	err = nl.RouteAdd(&netlink.Route{Gw: net.IPv4(10, 230, 2, 2),
		Dst: &net.IPNet{IP: net.IPv4(10, 240, 0, 0), Mask: net.CIDRMask(16, 32)}})
	if err != nil {
		t.Fatal(err)
	}
	lo, err := nl.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	addAddr(t, nl, lo, "10.230.9.9/32")

	e.netnsDir = t.TempDir()
	// A symlink does what a bind mount (ip netns add) does for a reader.
	if err := os.Symlink(fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), int(e.pod1.Handle())),
		filepath.Join(e.netnsDir, "cni-pod1")); err != nil {
		t.Fatal(err)
	}
	e.pod2PID = e.pod2.Hold(t)
	e.a = newAttacher(t, Options{NetnsDirs: []string{e.netnsDir}})
	return e
}

// resolveBridged makes the node resolve the bridged pods' MACs (one
// datagram to each) and waits until its neighbour entries and the
// bridge's forwarding table have them.
func (e *endpointNode) resolveBridged(t *testing.T) {
	t.Helper()
	for _, addr := range []string{"10.230.2.2", "10.230.2.3"} {
		c, err := e.node.DialUDP(netip.MustParseAddrPort(addr + ":9"))
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte("arp"))
		c.Close()
	}
	deadline := time.Now().Add(3 * time.Second)
	for {
		eps := e.find(t, netip.MustParseAddr("10.230.2.2"), netip.MustParseAddr("10.230.2.3"))
		if eps[0].Iface != "" && eps[1].Iface != "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the bridged pods were not resolved: %+v", eps)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// find runs FindEndpoints in the node's namespace.
func (e *endpointNode) find(t *testing.T, addrs ...netip.Addr) []Endpoint {
	t.Helper()
	var eps []Endpoint
	if err := e.node.Do(func() (err error) {
		eps, err = e.a.FindEndpoints(addrs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return eps
}

// Endpoint discovery: a ptp route's veth, bridged pods through neighbour
// entries and the FDB, a local address, an address behind the bridge that
// was never resolved, and one with no route; the pod side's namespace found
// through a file, through a process, or not at all.
func TestFindEndpoints(t *testing.T) {
	e := newEndpointNode(t)
	e.resolveBridged(t)
	addrs := []string{"10.230.1.5", "fd00:230:1::5", "10.230.2.2", "10.230.2.3", "10.230.2.9", "10.230.9.9",
		"10.230.2.1", "10.230.250.1", "10.240.0.5"}
	var in []netip.Addr
	for _, a := range addrs {
		in = append(in, netip.MustParseAddr(a))
	}
	eps := e.find(t, in...)
	if len(eps) != len(addrs) {
		t.Fatalf("%d endpoints for %d addresses", len(eps), len(addrs))
	}
	byAddr := make(map[string]Endpoint)
	for i, ep := range eps {
		if ep.Addr != in[i] {
			t.Errorf("endpoint %d is %s, want %s (input order)", i, ep.Addr, in[i])
		}
		byAddr[ep.Addr.String()] = ep
		t.Logf("%s: iface %q via %q bridge %q peer %+v reason %q", ep.Addr, ep.Iface, ep.Via, ep.Bridge, ep.Peer, ep.Reason)
	}
	pod1Path := filepath.Join(e.netnsDir, "cni-pod1")
	pod2Path := fmt.Sprintf("/proc/%d/ns/net", e.pod2PID)
	for _, tc := range []struct {
		addr, iface, via, bridge, peerNetns, peerWhy string
	}{
		{"10.230.1.5", "cali1", ViaRoute, "", pod1Path, ""},
		{"fd00:230:1::5", "cali1", ViaRoute, "", pod1Path, ""},
		{"10.230.2.2", "vp2", ViaBridge, "br0", pod2Path, ""},
		{"10.230.2.3", "vp3", ViaBridge, "br0", "", "no file of its network namespace"},
	} {
		ep := byAddr[tc.addr]
		if ep.Iface != tc.iface || ep.Via != tc.via || ep.Bridge != tc.bridge || ep.Reason != "" {
			t.Errorf("%s: iface %q via %q bridge %q reason %q; want %q via %q bridge %q", tc.addr, ep.Iface, ep.Via,
				ep.Bridge, ep.Reason, tc.iface, tc.via, tc.bridge)
		}
		if ep.Peer.NetnsID < 0 || ep.Peer.Ifindex == 0 || ep.Peer.Netns != tc.peerNetns ||
			!strings.Contains(ep.Peer.Reason, tc.peerWhy) || (tc.peerWhy == "") != (ep.Peer.Reason == "") {
			t.Errorf("%s: peer %+v, want netns %q, reason %q", tc.addr, ep.Peer, tc.peerNetns, tc.peerWhy)
		}
		if pt, ok := ep.Peer.Ingress(); ok != (tc.peerNetns != "") ||
			(ok && pt != (Point{Iface: "eth0", Netns: tc.peerNetns, Kind: TCIngress})) {
			t.Errorf("%s: peer ingress %v %v, want eth0 in %q", tc.addr, pt, ok, tc.peerNetns)
		}
	}
	for addr, why := range map[string]string{
		"10.240.0.5":   "routed through a gateway",
		"10.230.2.9":   "no neighbour entry",
		"10.230.9.9":   "local address of this node",
		"10.230.2.1":   "local address of this node",
		"10.230.250.1": "no route",
	} {
		if ep := byAddr[addr]; ep.Iface != "" || !strings.Contains(ep.Reason, why) {
			t.Errorf("%s: iface %q reason %q, want no interface because %q", addr, ep.Iface, ep.Reason, why)
		}
	}
}

// A bridged pod whose MAC left the bridge's forwarding table (aged out)
// while the node's neighbour entry stays: no interface, and the reason
// says the next packet finds it again.
func TestFindEndpointsFDBAgedOut(t *testing.T) {
	e := newEndpointNode(t)
	e.resolveBridged(t)
	nl, err := e.node.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	vp3, err := nl.LinkByName("vp3")
	if err != nil {
		t.Fatal(err)
	}
	// No learning on the port: the pod's own chatter (IPv6 router
	// solicitations) would put its MAC back at once.
	if err := nl.LinkSetLearning(vp3, false); err != nil {
		t.Fatal(err)
	}
	mac, err := e.pod3.MAC("eth0")
	if err != nil {
		t.Fatal(err)
	}
	fdb, err := nl.NeighList(vp3.Attrs().Index, unix.AF_BRIDGE)
	if err != nil {
		t.Fatal(err)
	}
	deleted := 0
	for _, n := range fdb {
		if n.HardwareAddr.String() == mac.String() {
			if err := nl.NeighDel(&n); err != nil {
				t.Fatalf("delete FDB entry %s: %v", mac, err)
			}
			deleted++
		}
	}
	if deleted == 0 {
		t.Fatalf("pod3's MAC %s was not in the FDB: %+v", mac, fdb)
	}
	ep := e.find(t, netip.MustParseAddr("10.230.2.3"))[0]
	if ep.Iface != "" || !strings.Contains(ep.Reason, "aged out") {
		t.Errorf("iface %q reason %q, want none because the FDB has no port for its MAC", ep.Iface, ep.Reason)
	}
}

// The endpoints inside a limit's prefixes: the routed and bridged pods,
// and the node's own addresses (with their reason), sorted, each once.
func TestFindEndpointsIn(t *testing.T) {
	e := newEndpointNode(t)
	e.resolveBridged(t)
	var eps []Endpoint
	prefixes := []netip.Prefix{
		netip.MustParsePrefix("10.230.1.0/24"),
		netip.MustParsePrefix("10.230.2.0/24"),
		netip.MustParsePrefix("fd00:230:1::/64"),
		netip.MustParsePrefix("10.230.9.9/32"),
		netip.MustParsePrefix("10.230.250.1/32"),
	}
	if err := e.node.Do(func() (err error) {
		eps, err = e.a.FindEndpointsIn(prefixes)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, ep := range eps {
		s := ep.Addr.String() + " " + ep.Iface
		if ep.Reason != "" {
			s = ep.Addr.String() + " (" + strings.SplitN(ep.Reason, " ", 4)[1] + ")" // "local", "route"
		}
		got = append(got, s)
	}
	want := []string{
		"10.230.1.5 cali1",
		"10.230.2.1 (local)",
		"10.230.2.2 vp2",
		"10.230.2.3 vp3",
		"10.230.9.9 (local)",
		"10.230.250.1 (route)",
		"fd00:230:1::5 cali1",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("FindEndpointsIn:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	for _, ep := range eps {
		if ep.Iface == "vp2" && ep.Peer.Iface != "eth0" {
			t.Errorf("vp2's peer is %+v, want eth0", ep.Peer)
		}
	}
}
