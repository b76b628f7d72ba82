package nettest

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rlagent/rlagent/internal/testenv"
)

// echoServer answers every UDP datagram with the same bytes and records
// where they came from.
type echoServer struct {
	conn *net.UDPConn
	mu   sync.Mutex
	from map[netip.Addr]int
	done chan struct{}
}

func startEcho(t *testing.T, ns *NS, addr netip.AddrPort) *echoServer {
	t.Helper()
	network := "udp4"
	if addr.Addr().Is6() {
		network = "udp6"
	}
	c, err := ns.ListenUDP(network, addr, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	e := &echoServer{conn: c, from: map[netip.Addr]int{}, done: make(chan struct{})}
	go func() {
		defer close(e.done)
		buf := make([]byte, 2048)
		for {
			n, from, err := c.ReadFromUDPAddrPort(buf)
			if errors.Is(err, net.ErrClosed) {
				return
			}
			if err != nil {
				continue
			}
			e.mu.Lock()
			e.from[from.Addr().Unmap()]++
			e.mu.Unlock()
			c.WriteToUDPAddrPort(buf[:n], from)
		}
	}()
	t.Cleanup(func() { c.Close(); <-e.done })
	return e
}

// sources is what the server received, by source address.
func (e *echoServer) sources() map[netip.Addr]int {
	e.mu.Lock()
	defer e.mu.Unlock()
	m := map[netip.Addr]int{}
	for a, n := range e.from {
		m[a] = n
	}
	return m
}

// roundTrips sends n datagrams from ns to dst on a connected socket, one at
// a time, each waiting up to a second for its echo (all of them up to 5 s),
// and returns how many came back. A connected UDP socket takes datagrams only from dst: an echo
// that comes back from another address (a DNAT not undone) is not counted.
func roundTrips(t *testing.T, ns *NS, dst netip.AddrPort, n int) int {
	t.Helper()
	c, err := ns.DialUDP(dst)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	got := 0
	buf := make([]byte, 64)
	end := time.Now().Add(5 * time.Second)
	for i := 0; i < n && time.Now().Before(end); i++ {
		msg := []byte{'r', 'l', byte(i), byte(i >> 8)}
		if _, err := c.Write(msg); err != nil {
			t.Fatalf("send to %s from %s: %v", dst, ns.Name, err)
		}
		wait := time.Now().Add(time.Second)
		if wait.After(end) {
			wait = end
		}
		c.SetReadDeadline(wait)
		for {
			m, err := c.Read(buf)
			if err != nil {
				break // timeout, or an ICMP error reported on the socket
			}
			if bytes.Equal(buf[:m], msg) {
				got++
				break
			}
		}
	}
	return got
}

func linkStats(t *testing.T, ns *NS, ifname string) LinkStats {
	t.Helper()
	s, err := ns.LinkStats(ifname)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// families runs fn for IPv4 and IPv6.
func families(t *testing.T, fn func(t *testing.T, ipv6 bool)) {
	for _, v6 := range []bool{false, true} {
		name := "ipv4"
		if v6 {
			name = "ipv6"
		}
		t.Run(name, func(t *testing.T) { fn(t, v6) })
	}
}

// routeDev is the interface index the namespace routes dst to.
func routeDev(t *testing.T, ns *NS, dst netip.Addr) int {
	t.Helper()
	nl, err := ns.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	rs, err := nl.RouteGet(dst.AsSlice())
	if err != nil || len(rs) == 0 {
		t.Fatalf("%s: route to %s: %v", ns.Name, dst, err)
	}
	return rs[0].LinkIndex
}

func ifindex(t *testing.T, ns *NS, ifname string) int {
	t.Helper()
	nl, l, err := ns.link(ifname)
	if err != nil {
		t.Fatal(err)
	}
	nl.Close()
	return l.Attrs().Index
}

const probes = 200

func TestTopologyConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  TopologyConfig
		want string
	}{
		{"overlay without uplink", TopologyConfig{Overlay: true}, "needs the uplink"},
		{"name too long", TopologyConfig{BridgePods: []string{"abcdefghijklm"}}, "want 1-12"},
		{"name with a slash", TopologyConfig{RoutedPods: []string{"a/b"}}, "want 1-12"},
		{"name twice", TopologyConfig{BridgePods: []string{"a"}, RoutedPods: []string{"a"}}, "used twice"},
		{"backend not a pod", TopologyConfig{BridgePods: []string{"a"}, Service: &ServiceConfig{Pod: "b"}}, "not one of the pods"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewTopology(tc.cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want one that says %q", err, tc.want)
			}
		})
	}
}

// A bridged pod is reachable from the remote over the uplink, both ways;
// the packets leave the node through the pod's host-side veth (and no other
// port), and the node's tables hold what an agent needs to find that veth:
// the route points at the bridge, the neighbour entry names the pod's MAC,
// the FDB puts that MAC on the veth.
func TestTopologyBridgedPodFromRemote(t *testing.T) {
	testenv.RequireRoot(t)
	topo := MustTopology(t, TopologyConfig{Uplink: true, BridgePods: []string{"a", "b"}})
	a, b := topo.Pod("a"), topo.Pod("b")
	if a.Kind != PodBridged || a.HostIf != "vb-a" || a.HostIfIndex != ifindex(t, topo.Node, "vb-a") {
		t.Fatalf("pod a: %+v", a)
	}
	if port, err := topo.BridgePort(a.MAC); err != nil || port != a.HostIfIndex {
		t.Errorf("the bridge's FDB puts pod a's MAC %s on ifindex %d (%v), want vb-a's %d", a.MAC, port, err, a.HostIfIndex)
	}
	families(t, func(t *testing.T, v6 bool) {
		if got, want := routeDev(t, topo.Node, a.Addr(v6)), ifindex(t, topo.Node, BridgeIf); got != want {
			t.Errorf("the node routes %s to ifindex %d, want the bridge's %d", a.Addr(v6), got, want)
		}
		e := startEcho(t, a.NS, netip.AddrPortFrom(a.Addr(v6), 5300))
		beforeA, beforeB := linkStats(t, topo.Node, a.HostIf), linkStats(t, topo.Node, b.HostIf)
		if got := roundTrips(t, topo.Remote, netip.AddrPortFrom(a.Addr(v6), 5300), probes); got != probes {
			t.Fatalf("%d of %d round trips remote -> pod a (%s)", got, probes, a.Addr(v6))
		}
		if src := e.sources(); src[topo.RemoteUp(v6)] != probes || len(src) != 1 {
			t.Errorf("pod a saw %v, want %d datagrams from the remote's %s", src, probes, topo.RemoteUp(v6))
		}
		dA := linkStats(t, topo.Node, a.HostIf).Sub(beforeA)
		dB := linkStats(t, topo.Node, b.HostIf).Sub(beforeB)
		t.Logf("vb-a tx %d rx %d, vb-b tx %d", dA.TxPackets, dA.RxPackets, dB.TxPackets)
		if dA.TxPackets < probes || dA.RxPackets < probes {
			t.Errorf("vb-a sent %d and received %d packets, want at least %d each way", dA.TxPackets, dA.RxPackets, probes)
		}
		if dB.TxPackets >= probes/10 {
			t.Errorf("vb-b sent %d packets: the bridge floods what it should forward to vb-a", dB.TxPackets)
		}
	})
}

// Pod-to-pod traffic on one node crosses the bridge: out of the sender's
// host-side veth into the receiver's, without going up to the node's IP
// stack (the bridge device passes nearly nothing up).
func TestTopologyBridgedPodToPodSameHost(t *testing.T) {
	testenv.RequireRoot(t)
	topo := MustTopology(t, TopologyConfig{BridgePods: []string{"a", "b"}})
	a, b := topo.Pod("a"), topo.Pod("b")
	families(t, func(t *testing.T, v6 bool) {
		e := startEcho(t, b.NS, netip.AddrPortFrom(b.Addr(v6), 5300))
		beforeA, beforeB := linkStats(t, topo.Node, a.HostIf), linkStats(t, topo.Node, b.HostIf)
		beforeBr := linkStats(t, topo.Node, BridgeIf)
		if got := roundTrips(t, a.NS, netip.AddrPortFrom(b.Addr(v6), 5300), probes); got != probes {
			t.Fatalf("%d of %d round trips pod a -> pod b", got, probes)
		}
		if src := e.sources(); src[a.Addr(v6)] != probes || len(src) != 1 {
			t.Errorf("pod b saw %v, want %d datagrams from pod a's %s", src, probes, a.Addr(v6))
		}
		dA := linkStats(t, topo.Node, a.HostIf).Sub(beforeA)
		dB := linkStats(t, topo.Node, b.HostIf).Sub(beforeB)
		dBr := linkStats(t, topo.Node, BridgeIf).Sub(beforeBr)
		t.Logf("vb-a rx %d tx %d, vb-b tx %d rx %d, %s rx %d tx %d", dA.RxPackets, dA.TxPackets, dB.TxPackets, dB.RxPackets,
			BridgeIf, dBr.RxPackets, dBr.TxPackets)
		if dA.RxPackets < probes || dB.TxPackets < probes || dB.RxPackets < probes || dA.TxPackets < probes {
			t.Errorf("vb-a received %d, vb-b sent %d (and back: %d, %d), want at least %d each",
				dA.RxPackets, dB.TxPackets, dB.RxPackets, dA.TxPackets, probes)
		}
		if dBr.RxPackets >= probes/10 {
			t.Errorf("%s passed %d packets up to the node: pod-to-pod traffic is routed, not bridged", BridgeIf, dBr.RxPackets)
		}
	})
}

// A routed (point-to-point) pod is reachable from the remote, both ways: the
// node's host route points at the pod's host-side veth, and the pod's
// default route via the link-local gateway carries the replies.
func TestTopologyRoutedPodFromRemote(t *testing.T) {
	testenv.RequireRoot(t)
	topo := MustTopology(t, TopologyConfig{Uplink: true, RoutedPods: []string{"c", "d"}})
	c, d := topo.Pod("c"), topo.Pod("d")
	if c.Kind != PodRouted || c.HostIf != "vr-c" || d.Addr4 == c.Addr4 {
		t.Fatalf("pods c %+v, d %+v", c, d)
	}
	families(t, func(t *testing.T, v6 bool) {
		if got := routeDev(t, topo.Node, c.Addr(v6)); got != c.HostIfIndex {
			t.Errorf("the node routes %s to ifindex %d, want vr-c's %d", c.Addr(v6), got, c.HostIfIndex)
		}
		e := startEcho(t, c.NS, netip.AddrPortFrom(c.Addr(v6), 5300))
		before, beforeD := linkStats(t, topo.Node, c.HostIf), linkStats(t, topo.Node, d.HostIf)
		if got := roundTrips(t, topo.Remote, netip.AddrPortFrom(c.Addr(v6), 5300), probes); got != probes {
			t.Fatalf("%d of %d round trips remote -> pod c (%s)", got, probes, c.Addr(v6))
		}
		if src := e.sources(); src[topo.RemoteUp(v6)] != probes || len(src) != 1 {
			t.Errorf("pod c saw %v, want %d datagrams from the remote's %s", src, probes, topo.RemoteUp(v6))
		}
		dC, dD := linkStats(t, topo.Node, c.HostIf).Sub(before), linkStats(t, topo.Node, d.HostIf).Sub(beforeD)
		if dC.TxPackets < probes || dC.RxPackets < probes || dD.TxPackets >= probes/10 {
			t.Errorf("vr-c sent %d and received %d packets (vr-d sent %d), want at least %d each way on vr-c only",
				dC.TxPackets, dC.RxPackets, dD.TxPackets, probes)
		}
		// Same node, routed pod to routed pod: through the node, out of
		// the receiver's veth.
		before = linkStats(t, topo.Node, c.HostIf)
		if got := roundTrips(t, d.NS, netip.AddrPortFrom(c.Addr(v6), 5300), probes); got != probes {
			t.Fatalf("%d of %d round trips pod d -> pod c", got, probes)
		}
		if dC := linkStats(t, topo.Node, c.HostIf).Sub(before); dC.TxPackets < probes {
			t.Errorf("vr-c sent %d packets for %d from pod d", dC.TxPackets, probes)
		}
		if src := e.sources(); src[d.Addr(v6)] != probes {
			t.Errorf("pod c saw %v, want %d datagrams from pod d's %s", src, probes, d.Addr(v6))
		}
	})
}

// vxlanFrame is what a frame on the uplink carries: for a VXLAN frame
// (outer IPv4, UDP to VxlanPort) the VNI and the inner source and
// destination; for any other IP frame its destination.
type vxlanFrame struct {
	vxlan    bool
	vni      uint32
	src, dst netip.Addr
}

func parseUplinkFrame(f []byte) (vxlanFrame, bool) {
	ipAt := func(b []byte, etype uint16) (src, dst netip.Addr, proto byte, l4 []byte, ok bool) {
		switch {
		case etype == 0x0800 && len(b) >= 20:
			ihl := int(b[0]&0xf) * 4
			if len(b) < ihl {
				return
			}
			return netip.AddrFrom4([4]byte(b[12:16])), netip.AddrFrom4([4]byte(b[16:20])), b[9], b[ihl:], true
		case etype == 0x86dd && len(b) >= 40:
			return netip.AddrFrom16([16]byte(b[8:24])), netip.AddrFrom16([16]byte(b[24:40])), b[6], b[40:], true
		}
		return
	}
	if len(f) < 14 {
		return vxlanFrame{}, false
	}
	_, dst, proto, l4, ok := ipAt(f[14:], binary.BigEndian.Uint16(f[12:]))
	if !ok {
		return vxlanFrame{}, false
	}
	if proto != 17 || len(l4) < 8+8+14 || binary.BigEndian.Uint16(l4[2:]) != VxlanPort {
		return vxlanFrame{dst: dst}, true
	}
	vx := l4[8:]
	inner := vx[8:]
	isrc, idst, _, _, ok := ipAt(inner[14:], binary.BigEndian.Uint16(inner[12:]))
	if !ok {
		return vxlanFrame{}, false
	}
	return vxlanFrame{vxlan: vx[0]&0x08 != 0, vni: binary.BigEndian.Uint32(vx[4:]) >> 8, src: isrc, dst: idst}, true
}

// With an overlay the remote reaches the pods only inside VXLAN: on the
// node's uplink every packet to a pod is a VXLAN datagram (UDP 4789, VNI
// 42) whose inner packet goes to the pod, none is a plain packet to it, and
// the pod sees the remote's overlay address as the source. Bridged and
// routed pods both.
func TestTopologyOverlay(t *testing.T) {
	testenv.RequireRoot(t)
	topo := MustTopology(t, TopologyConfig{Uplink: true, Overlay: true, BridgePods: []string{"a"}, RoutedPods: []string{"c"}})
	for _, pod := range topo.Pods() {
		t.Run(pod.Name, func(t *testing.T) {
			families(t, func(t *testing.T, v6 bool) {
				if got, want := routeDev(t, topo.Remote, pod.Addr(v6)), ifindex(t, topo.Remote, VxlanIf); got != want {
					t.Errorf("the remote routes %s to ifindex %d, want %s's %d", pod.Addr(v6), got, VxlanIf, want)
				}
				pc, err := topo.Node.OpenPacket(UplinkIf)
				if err != nil {
					t.Fatal(err)
				}
				defer pc.Close()
				e := startEcho(t, pod.NS, netip.AddrPortFrom(pod.Addr(v6), 5300))
				before := linkStats(t, topo.Node, pod.HostIf)
				if got := roundTrips(t, topo.Remote, netip.AddrPortFrom(pod.Addr(v6), 5300), probes); got != probes {
					t.Fatalf("%d of %d round trips remote -> pod %s through the overlay", got, probes, pod.Name)
				}
				if src := e.sources(); src[topo.RemoteSource(v6)] != probes || len(src) != 1 {
					t.Errorf("pod %s saw %v, want %d datagrams from the remote's overlay address %s", pod.Name, src, probes, topo.RemoteSource(v6))
				}
				if d := linkStats(t, topo.Node, pod.HostIf).Sub(before); d.TxPackets < probes {
					t.Errorf("%s sent %d packets for %d decapsulated", pod.HostIf, d.TxPackets, probes)
				}
				var inVxlan, plain int
				buf := make([]byte, 65536)
				for {
					n, err := pc.Recv(buf, 0)
					if err != nil {
						t.Fatal(err)
					}
					if n == 0 {
						break
					}
					f, ok := parseUplinkFrame(buf[:n])
					switch {
					case !ok:
					case f.vxlan && f.vni == VxlanVNI && f.dst == pod.Addr(v6) && f.src == topo.RemoteSource(v6):
						inVxlan++
					case !f.vxlan && f.dst == pod.Addr(v6):
						plain++
					}
				}
				t.Logf("uplink: %d VXLAN frames to %s, %d plain", inVxlan, pod.Addr(v6), plain)
				if inVxlan < probes || plain != 0 {
					t.Errorf("the node's uplink received %d VXLAN frames (VNI %d) carrying packets to %s from %s and %d plain ones; want %d and 0",
						inVxlan, VxlanVNI, pod.Addr(v6), topo.RemoteSource(v6), plain, probes)
				}
			})
		})
	}
}

// serviceTopology is a node with a service in front of bridged pod b,
// clients: the remote, bridged pod a and routed pod c.
func serviceTopology(t *testing.T) *Topology {
	t.Helper()
	if _, err := nftPath(); err != nil {
		testenv.SkipOrFail(t, "%v", err)
	}
	return MustTopology(t, TopologyConfig{
		Uplink: true, BridgePods: []string{"a", "b"}, RoutedPods: []string{"c"},
		Service: &ServiceConfig{Pod: "b", Port: 80, TargetPort: 8080},
	})
}

// The remote reaches the service address; the DNAT rule sends it to the
// backend pod (through its host-side veth, the client's address kept), and
// the replies come back from the service address (conntrack undoes the
// DNAT). UDP here; TCP in TestTCPConnectorThroughService.
func TestTopologyServiceFromRemote(t *testing.T) {
	testenv.RequireRoot(t)
	topo := serviceTopology(t)
	b := topo.Backend
	if b != topo.Pod("b") || topo.BackendPort != 8080 || topo.Service4.Port() != 80 {
		t.Fatalf("backend %+v port %d, service %s", b, topo.BackendPort, topo.Service4)
	}
	families(t, func(t *testing.T, v6 bool) {
		e := startEcho(t, b.NS, netip.AddrPortFrom(b.Addr(v6), topo.BackendPort))
		before := linkStats(t, topo.Node, b.HostIf)
		if got := roundTrips(t, topo.Remote, topo.Service(v6), probes); got != probes {
			t.Fatalf("%d of %d round trips remote -> service %s", got, probes, topo.Service(v6))
		}
		if src := e.sources(); src[topo.RemoteUp(v6)] != probes || len(src) != 1 {
			t.Errorf("the backend saw %v, want %d datagrams from the remote's %s", src, probes, topo.RemoteUp(v6))
		}
		if d := linkStats(t, topo.Node, b.HostIf).Sub(before); d.TxPackets < probes {
			t.Errorf("%s sent %d packets for %d to the service", b.HostIf, d.TxPackets, probes)
		}
		// The backend's port is not the service: nothing rewrites it.
		if got := roundTrips(t, topo.Remote, netip.AddrPortFrom(topo.Service(v6).Addr(), topo.BackendPort), 1); got != 0 {
			t.Errorf("%d round trips to the service address on the backend's port: the rule rewrites more than its port", got)
		}
	})
}

// A pod on the same node reaches the service address: bridged (the
// backend's reply is bridged back and un-DNATed through br_netfilter) and
// routed; so does the node itself (the output hook).
func TestTopologyServiceFromSameHost(t *testing.T) {
	testenv.RequireRoot(t)
	topo := serviceTopology(t)
	if !topo.BridgeNetfilter {
		t.Fatal("a topology with bridged pods and a service has br_netfilter off")
	}
	b := topo.Backend
	families(t, func(t *testing.T, v6 bool) {
		e := startEcho(t, b.NS, netip.AddrPortFrom(b.Addr(v6), topo.BackendPort))
		for _, cl := range []struct {
			name string
			ns   *NS
			src  netip.Addr
		}{
			{"bridged pod a", topo.Pod("a").NS, topo.Pod("a").Addr(v6)},
			{"routed pod c", topo.Pod("c").NS, topo.Pod("c").Addr(v6)},
			{"the node", topo.Node, topo.NodeUp(v6)},
		} {
			before := e.sources()[cl.src]
			beforeB := linkStats(t, topo.Node, b.HostIf)
			if got := roundTrips(t, cl.ns, topo.Service(v6), probes); got != probes {
				t.Errorf("%s: %d of %d round trips to the service %s", cl.name, got, probes, topo.Service(v6))
				continue
			}
			if got := e.sources()[cl.src] - before; got != probes {
				t.Errorf("%s: the backend saw %d datagrams from %s, want %d", cl.name, got, cl.src, probes)
			}
			if d := linkStats(t, topo.Node, b.HostIf).Sub(beforeB); d.TxPackets < probes {
				t.Errorf("%s: %s sent %d packets for %d", cl.name, b.HostIf, d.TxPackets, probes)
			}
		}
	})
}

// hostState is what a topology must leave alone in the test's own
// namespace.
type hostState struct {
	links   string
	sysctls string
	nft     string
}

func readHostState(t *testing.T) hostState {
	t.Helper()
	nl, err := os.ReadFile("/proc/net/dev")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, line := range strings.Split(string(nl), "\n")[2:] {
		if name, _, ok := strings.Cut(strings.TrimSpace(line), ":"); ok {
			names = append(names, name)
		}
	}
	var sys []string
	for _, k := range []string{"net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding", "net/bridge/bridge-nf-call-iptables"} {
		b, _ := os.ReadFile("/proc/sys/" + k)
		sys = append(sys, k+"="+strings.TrimSpace(string(b)))
	}
	s := hostState{links: strings.Join(names, " "), sysctls: strings.Join(sys, " ")}
	if nft, err := nftPath(); err == nil {
		out, err := exec.Command(nft, "list", "ruleset").CombinedOutput()
		if err != nil {
			t.Fatalf("nft list ruleset: %v: %s", err, out)
		}
		s.nft = string(out)
	}
	return s
}

// A topology changes nothing in the namespace it is built from (links,
// forwarding and bridge sysctls, nftables), while it exists and after
// Close, and its own node forwards.
func TestTopologyLeavesTheHostAlone(t *testing.T) {
	testenv.RequireRoot(t)
	if _, err := nftPath(); err != nil {
		testenv.SkipOrFail(t, "%v", err)
	}
	HoldTraffic(t)
	host := readHostState(t)
	topo, err := NewTopology(TopologyConfig{
		Uplink: true, Overlay: true, BridgePods: []string{"a", "b"}, RoutedPods: []string{"c"},
		Service: &ServiceConfig{Pod: "b"},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer topo.Close()
	if got := readHostState(t); got != host {
		t.Errorf("with a topology up, the host's state is\n%+v\nwas\n%+v", got, host)
	}
	var fwd []byte
	topo.Node.Do(func() error {
		fwd, err = os.ReadFile("/proc/sys/net/ipv4/ip_forward")
		return err
	})
	if strings.TrimSpace(string(fwd)) != "1" {
		t.Errorf("the node's ip_forward is %q, want 1", fwd)
	}
	if err := topo.Close(); err != nil {
		t.Fatal(err)
	}
	if err := topo.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if got := readHostState(t); got != host {
		t.Errorf("after Close, the host's state is\n%+v\nwas\n%+v", got, host)
	}
}
