package nettest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// The addresses of a Topology. They are fixed: every topology lives in
// namespaces of its own, so two topologies (or a topology and a Pair) never
// see each other's addresses.
var (
	// uplink: the node is .1 (::1), the remote .2 (::2).
	uplink4 = netip.MustParsePrefix("10.210.0.0/24")
	uplink6 = netip.MustParsePrefix("fd00:210::/64")
	// podNet4 and podNet6 hold every pod address; the remote routes them to
	// the node (over the uplink, or inside the overlay).
	podNet4 = netip.MustParsePrefix("10.211.0.0/16")
	podNet6 = netip.MustParsePrefix("fd00:211::/48")
	// bridged pods share one subnet; the bridge holds .1 (::1), the
	// gateway, and the pods are .2 (::2) on in the order configured.
	bridgeNet4 = netip.MustParsePrefix("10.211.1.0/24")
	bridgeNet6 = netip.MustParsePrefix("fd00:211:0:1::/64")
	// routed pods get one /32 (/128) each from these, .2 (::2) on.
	routedNet4 = netip.MustParsePrefix("10.211.2.0/24")
	routedNet6 = netip.MustParsePrefix("fd00:211:0:2::/64")
	// overlay: the vxlan devices' subnet; the node is .1, the remote .2.
	overlay4 = netip.MustParsePrefix("10.212.0.0/24")
	overlay6 = netip.MustParsePrefix("fd00:212::/64")
	// The service's virtual address. The remote routes serviceNet4 (6) to
	// the node over the uplink, as a router in front of a load balancer
	// would; nothing holds the address, the DNAT rule rewrites it.
	serviceNet4 = netip.MustParsePrefix("10.213.0.0/24")
	serviceNet6 = netip.MustParsePrefix("fd00:213::/64")
	service4    = netip.MustParseAddr("10.213.0.10")
	service6    = netip.MustParseAddr("fd00:213::10")
	// A routed pod's gateway, as Calico does: a link-local IPv4 address
	// that nothing holds (the pod has a permanent neighbour entry for it
	// with the host-side veth's MAC), and fe80::1 on the host-side veth.
	routedGW4 = netip.MustParseAddr("169.254.1.1")
	routedGW6 = netip.MustParseAddr("fe80::1")
)

// Interface names of a Topology.
const (
	// UplinkIf is the uplink's name on both sides: in the node and in the
	// remote.
	UplinkIf = "uplink"
	// BridgeIf is the pods' bridge in the node.
	BridgeIf = "br-pods"
	// VxlanIf is the overlay's device, in the node and in the remote.
	VxlanIf = "vxlan0"
	// PodIf is the pod side of every pod's veth, inside the pod.
	PodIf = "eth0"
	// VxlanPort is the overlay's UDP port (IANA's VXLAN port).
	VxlanPort = 4789
	// VxlanVNI is the overlay's network identifier.
	VxlanVNI = 42
	// bridgeMAC is set on the bridge when it is made: a bridge without an
	// address of its own takes the lowest of its ports' and changes it as
	// ports come and go, which would break the pods' permanent neighbour
	// entries for the gateway.
	bridgeMAC = "02:00:0a:d3:01:01"
)

// nftPackage is the Debian package that has the nft binary.
const nftPackage = "nftables"

// TopologyConfig describes a node and what is around it. Every part is
// optional; a zero config is a lone node namespace.
type TopologyConfig struct {
	// Name names the node namespace in messages (default "node"); the
	// remote is Name+"-remote", a pod namespace is the pod's name.
	Name string
	// Uplink adds the remote namespace, a client outside the node, joined
	// to the node by a veth pair (UplinkIf on both sides) with IPv4 and
	// IPv6 addresses. The node's default route points at the remote, and
	// the remote routes the pod and service addresses to the node.
	Uplink bool
	// BridgePods names pods on a Linux bridge (BridgeIf) in the node: each
	// a namespace whose PodIf is a veth to "vb-<name>" in the node, a port
	// of the bridge. Pod-to-pod traffic between them crosses the bridge.
	BridgePods []string
	// RoutedPods names pods on a point-to-point veth, Calico-style: PodIf
	// has a /32 and a /128, the host side "vr-<name>" has no address of
	// its own, and the node routes the pod's addresses to it.
	RoutedPods []string
	// Overlay puts a VXLAN device in the node and in the remote over the
	// uplink addresses; the remote then reaches the pods only inside the
	// tunnel, from its overlay address. Needs Uplink.
	Overlay bool
	// Service, when set, puts a DNAT rule (nftables, in the node only) in
	// front of one pod.
	Service *ServiceConfig
}

// ServiceConfig is a DNAT front: TCP and UDP to the service address and
// Port are rewritten to the pod's address and TargetPort, for packets that
// arrive at the node (from the remote, from any pod: prerouting) and for
// the node's own (output).
type ServiceConfig struct {
	// Pod is the backend (Required): one of the topology's pods.
	Pod string
	// Port is the service port (default 80).
	Port uint16
	// TargetPort is the pod's port (default 8080).
	TargetPort uint16
}

// PodKind says how a pod is wired to the node.
type PodKind int

const (
	// PodBridged is a pod on the node's bridge.
	PodBridged PodKind = iota + 1
	// PodRouted is a pod on a point-to-point veth with host routes.
	PodRouted
)

func (k PodKind) String() string {
	switch k {
	case PodBridged:
		return "bridged"
	case PodRouted:
		return "routed"
	}
	return fmt.Sprintf("PodKind(%d)", int(k))
}

// Pod is one pod of a topology.
type Pod struct {
	Name string
	Kind PodKind
	// NS is the pod's namespace; its interface is PodIf.
	NS *NS
	// Addr4 and Addr6 are the pod's addresses.
	Addr4, Addr6 netip.Addr
	// MAC is PodIf's hardware address.
	MAC net.HardwareAddr
	// HostIf and HostIfIndex name the host side of the pod's veth in the
	// node namespace: where an endpoint limit attaches.
	HostIf      string
	HostIfIndex int
}

// Addr is Addr6 if ipv6, else Addr4.
func (p *Pod) Addr(ipv6 bool) netip.Addr {
	if ipv6 {
		return p.Addr6
	}
	return p.Addr4
}

// Topology is a node namespace and what is around it (see TopologyConfig).
// Forwarding is on in the node (IPv4 and IPv6), set there only.
type Topology struct {
	// Node is where an agent runs.
	Node *NS
	// Remote is the client outside the node (nil without an uplink).
	Remote *NS
	// NodeUp4, NodeUp6 are the node's uplink addresses; RemoteUp4,
	// RemoteUp6 the remote's (invalid without an uplink).
	NodeUp4, NodeUp6     netip.Addr
	RemoteUp4, RemoteUp6 netip.Addr
	// NodeOverlay4, NodeOverlay6 and RemoteOverlay4, RemoteOverlay6 are
	// the vxlan devices' addresses (invalid without an overlay). The pods
	// see the remote's packets from RemoteOverlay4 (6).
	NodeOverlay4, NodeOverlay6     netip.Addr
	RemoteOverlay4, RemoteOverlay6 netip.Addr
	// Gateway4, Gateway6 are the bridge's addresses, the bridged pods'
	// gateway (invalid without bridged pods).
	Gateway4, Gateway6 netip.Addr
	// Service4, Service6 are the service's address and port, and Backend
	// the pod behind them (nil without a service).
	Service4, Service6 netip.AddrPort
	Backend            *Pod
	// BackendPort is the pod's port the service leads to.
	BackendPort uint16
	// BridgeNetfilter (with a service and bridged pods) reports that
	// bridged IPv4 and IPv6 traffic passes the node's netfilter hooks
	// (br_netfilter, set on in the node), as kube-proxy needs for a bridged
	// pod that reaches a service whose backend is on the same bridge: the
	// backend's reply is bridged straight to the client and must meet
	// conntrack to be un-DNATed.
	BridgeNetfilter bool

	cfg  TopologyConfig // as given, with defaults applied
	pods []*Pod         // bridged, then routed, in the order configured
}

// podName is what a pod may be called: it names "vb-<name>" and
// "vr-<name>", which must fit IFNAMSIZ.
var podName = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,11}$`)

func (cfg *TopologyConfig) validate() error {
	seen := map[string]bool{}
	for _, names := range [][]string{cfg.BridgePods, cfg.RoutedPods} {
		for _, n := range names {
			if !podName.MatchString(n) {
				return fmt.Errorf("pod name %q: want 1-12 of a-z, 0-9, '-' (it names the host-side veth)", n)
			}
			if seen[n] {
				return fmt.Errorf("pod name %q used twice", n)
			}
			seen[n] = true
		}
	}
	if len(cfg.BridgePods) > 250 || len(cfg.RoutedPods) > 250 {
		return fmt.Errorf("%d bridged and %d routed pods: at most 250 of each", len(cfg.BridgePods), len(cfg.RoutedPods))
	}
	if cfg.Overlay && !cfg.Uplink {
		return errors.New("an overlay needs the uplink (Uplink: true): the tunnel runs over its addresses")
	}
	if s := cfg.Service; s != nil && !seen[s.Pod] {
		return fmt.Errorf("service backend %q is not one of the pods", s.Pod)
	}
	return nil
}

// NewTopology builds the topology. On error nothing is left behind. The
// caller closes it.
func NewTopology(cfg TopologyConfig) (_ *Topology, err error) {
	if cfg.Name == "" {
		cfg.Name = "node"
	}
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("topology %s: %w", cfg.Name, err)
	}
	if cfg.Service != nil {
		cfg.Service = &ServiceConfig{Pod: cfg.Service.Pod, Port: cfg.Service.Port, TargetPort: cfg.Service.TargetPort}
		if cfg.Service.Port == 0 {
			cfg.Service.Port = 80
		}
		if cfg.Service.TargetPort == 0 {
			cfg.Service.TargetPort = 8080
		}
		// Fail before building anything.
		if _, err := nftPath(); err != nil {
			return nil, fmt.Errorf("topology %s: service: %w", cfg.Name, err)
		}
	}
	t := &Topology{cfg: cfg}
	defer func() {
		if err != nil {
			t.Close()
			err = fmt.Errorf("topology %s: %w", cfg.Name, err)
		}
	}()
	if cfg.Uplink {
		p, err := NewPair(PairConfig{
			NameA: cfg.Name, NameB: cfg.Name + "-remote", IfA: UplinkIf, IfB: UplinkIf,
			Subnet4: uplink4, Subnet6: uplink6,
		})
		if err != nil {
			return nil, err
		}
		t.Node, t.Remote = p.A, p.B
		t.NodeUp4, t.NodeUp6, t.RemoteUp4, t.RemoteUp6 = p.A4, p.A6, p.B4, p.B6
	} else if t.Node, err = NewNS(cfg.Name); err != nil {
		return nil, err
	}
	if err := t.setForwarding(); err != nil {
		return nil, err
	}
	if cfg.Uplink {
		if err := t.routeUplink(); err != nil {
			return nil, err
		}
	}
	if cfg.Overlay {
		if err := t.addOverlay(); err != nil {
			return nil, err
		}
	}
	if len(cfg.BridgePods) > 0 {
		if err := t.addBridge(); err != nil {
			return nil, err
		}
	}
	for i, name := range cfg.BridgePods {
		if err := t.addBridgedPod(name, i); err != nil {
			return nil, err
		}
	}
	for i, name := range cfg.RoutedPods {
		if err := t.addRoutedPod(name, i); err != nil {
			return nil, err
		}
	}
	if cfg.Service != nil {
		if err := t.addService(); err != nil {
			return nil, err
		}
	}
	if err := t.waitReady(5 * time.Second); err != nil {
		return nil, err
	}
	if err := t.primeBridge(3 * time.Second); err != nil {
		return nil, err
	}
	return t, nil
}

// MustTopology is NewTopology for a test: it fails tb on error and closes
// the topology in tb.Cleanup, which runs also when the test fails. The test
// holds the traffic lock (HoldTraffic) until then.
func MustTopology(tb testing.TB, cfg TopologyConfig) *Topology {
	tb.Helper()
	HoldTraffic(tb)
	t, err := NewTopology(cfg)
	if err != nil {
		tb.Fatalf("%v", err)
	}
	tb.Cleanup(func() { t.Close() })
	return t
}

// Close closes every namespace of the topology; the interfaces, routes,
// sysctls and nftables rules go with them. It is idempotent.
func (t *Topology) Close() error {
	var errs []error
	for _, p := range t.pods {
		errs = append(errs, p.NS.Close())
	}
	errs = append(errs, t.Remote.Close(), t.Node.Close())
	return errors.Join(errs...)
}

// Pods are the topology's pods: the bridged ones, then the routed ones, in
// the order configured.
func (t *Topology) Pods() []*Pod { return t.pods }

// Pod is the pod called name, or nil.
func (t *Topology) Pod(name string) *Pod {
	for _, p := range t.pods {
		if p.Name == name {
			return p
		}
	}
	return nil
}

// RemoteSource is the address the pods see the remote's packets come from:
// its overlay address with an overlay, else its uplink address.
func (t *Topology) RemoteSource(ipv6 bool) netip.Addr {
	switch {
	case t.cfg.Overlay && ipv6:
		return t.RemoteOverlay6
	case t.cfg.Overlay:
		return t.RemoteOverlay4
	case ipv6:
		return t.RemoteUp6
	}
	return t.RemoteUp4
}

// RemoteUp is RemoteUp6 if ipv6, else RemoteUp4.
func (t *Topology) RemoteUp(ipv6 bool) netip.Addr {
	if ipv6 {
		return t.RemoteUp6
	}
	return t.RemoteUp4
}

// NodeUp is NodeUp6 if ipv6, else NodeUp4.
func (t *Topology) NodeUp(ipv6 bool) netip.Addr {
	if ipv6 {
		return t.NodeUp6
	}
	return t.NodeUp4
}

// Service is Service6 if ipv6, else Service4.
func (t *Topology) Service(ipv6 bool) netip.AddrPort {
	if ipv6 {
		return t.Service6
	}
	return t.Service4
}

// LinkStats are an interface's counters. A veth counts an skb once,
// whatever it carries: a GSO or GRO packet of many segments is one packet
// of all their bytes, so bytes per packet above the MTU shows such packets.
type LinkStats struct {
	RxPackets, RxBytes, TxPackets, TxBytes uint64
	RxDropped, TxDropped                   uint64
}

// Sub is s - o, field by field.
func (s LinkStats) Sub(o LinkStats) LinkStats {
	return LinkStats{
		RxPackets: s.RxPackets - o.RxPackets, RxBytes: s.RxBytes - o.RxBytes,
		TxPackets: s.TxPackets - o.TxPackets, TxBytes: s.TxBytes - o.TxBytes,
		RxDropped: s.RxDropped - o.RxDropped, TxDropped: s.TxDropped - o.TxDropped,
	}
}

// LinkStats reads ifname's counters in the namespace.
func (ns *NS) LinkStats(ifname string) (LinkStats, error) {
	nl, l, err := ns.link(ifname)
	if err != nil {
		return LinkStats{}, err
	}
	defer nl.Close()
	st := l.Attrs().Statistics
	if st == nil {
		return LinkStats{}, fmt.Errorf("%s in %s: no statistics", ifname, ns.Name)
	}
	return LinkStats{
		RxPackets: st.RxPackets, RxBytes: st.RxBytes, TxPackets: st.TxPackets, TxBytes: st.TxBytes,
		RxDropped: st.RxDropped, TxDropped: st.TxDropped,
	}, nil
}

// WriteSysctl writes value to /proc/sys/<key> (key with slashes, e.g.
// "net/ipv4/ip_forward") in the namespace. The net.* sysctls are the
// namespace's own: nothing outside it changes, and they go with it.
func (ns *NS) WriteSysctl(key, value string) error {
	err := ns.Do(func() error {
		// /proc/sys/net resolves against the writing thread's namespace.
		return os.WriteFile("/proc/sys/"+key, []byte(value), 0o644)
	})
	if err != nil {
		return fmt.Errorf("sysctl %s=%s in %s: %w", key, value, ns.Name, err)
	}
	return nil
}

// setForwarding makes the node a router, for IPv4 and IPv6, on the
// interfaces it has and the ones it will get. A new namespace copies the
// host's IPv4 settings, so this is set, not assumed.
func (t *Topology) setForwarding() error {
	for _, kv := range [][2]string{
		{"net/ipv4/ip_forward", "1"}, // sets conf/all and conf/default
		{"net/ipv6/conf/all/forwarding", "1"},
		{"net/ipv6/conf/default/forwarding", "1"},
	} {
		if err := t.Node.WriteSysctl(kv[0], kv[1]); err != nil {
			return err
		}
	}
	return nil
}

// routeUplink gives the node its default route (the remote, as a node's
// upstream router) and the remote its routes to the services and, without
// an overlay, to the pods.
func (t *Topology) routeUplink() error {
	if err := addRoutes(t.Node, UplinkIf,
		route{gw: t.RemoteUp4}, route{gw: t.RemoteUp6}); err != nil {
		return err
	}
	routes := []route{{dst: serviceNet4, gw: t.NodeUp4}, {dst: serviceNet6, gw: t.NodeUp6}}
	if !t.cfg.Overlay {
		routes = append(routes, route{dst: podNet4, gw: t.NodeUp4}, route{dst: podNet6, gw: t.NodeUp6})
	}
	return addRoutes(t.Remote, UplinkIf, routes...)
}

// route is one route on an interface: to dst (invalid: the default route)
// via gw (invalid: on the link).
type route struct {
	dst netip.Prefix
	gw  netip.Addr
}

func addRoutes(ns *NS, ifname string, routes ...route) error {
	nl, l, err := ns.link(ifname)
	if err != nil {
		return err
	}
	defer nl.Close()
	for _, r := range routes {
		nr := &netlink.Route{LinkIndex: l.Attrs().Index}
		if r.dst.IsValid() {
			nr.Dst = ipNet(r.dst)
		} else {
			nr.Family = unix.AF_INET6
			if r.gw.Is4() {
				nr.Family = unix.AF_INET
			}
		}
		if r.gw.IsValid() {
			nr.Gw = r.gw.AsSlice()
		} else {
			nr.Scope = netlink.SCOPE_LINK
		}
		if err := nl.RouteAdd(nr); err != nil {
			return fmt.Errorf("%s: route to %s via %s on %s: %w", ns.Name, r.dst, r.gw, ifname, err)
		}
	}
	return nil
}

func ipNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// addOverlay makes a vxlan device on each side of the uplink, unicast to
// the other side's uplink address, addresses in the overlay subnet, and the
// remote's routes to the pods through it.
func (t *Topology) addOverlay() error {
	type side struct {
		ns            *NS
		local, remote netip.Addr
		addr4, addr6  netip.Addr
	}
	o4, o6 := overlay4.Addr().Next(), overlay6.Addr().Next()
	t.NodeOverlay4, t.NodeOverlay6 = o4, o6
	t.RemoteOverlay4, t.RemoteOverlay6 = o4.Next(), o6.Next()
	sides := []side{
		{t.Node, t.NodeUp4, t.RemoteUp4, t.NodeOverlay4, t.NodeOverlay6},
		{t.Remote, t.RemoteUp4, t.NodeUp4, t.RemoteOverlay4, t.RemoteOverlay6},
	}
	macs := make([]net.HardwareAddr, 2)
	for i, s := range sides {
		nl, up, err := s.ns.link(UplinkIf)
		if err != nil {
			return err
		}
		vx := &netlink.Vxlan{
			// 50 bytes of outer headers (Ethernet, IPv4, UDP, VXLAN) fit
			// the uplink's 1500.
			LinkAttrs:    netlink.LinkAttrs{Name: VxlanIf, MTU: up.Attrs().MTU - 50},
			VxlanId:      VxlanVNI,
			VtepDevIndex: up.Attrs().Index,
			SrcAddr:      s.local.AsSlice(),
			Group:        s.remote.AsSlice(), // unicast: the one peer VTEP
			Port:         VxlanPort,
		}
		err = nl.LinkAdd(vx)
		nl.Close()
		if err != nil {
			return fmt.Errorf("%s: add %s: %w", s.ns.Name, VxlanIf, err)
		}
		if err := setUp(s.ns, VxlanIf, netip.PrefixFrom(s.addr4, overlay4.Bits()), netip.PrefixFrom(s.addr6, overlay6.Bits())); err != nil {
			return err
		}
		if macs[i], err = s.ns.MAC(VxlanIf); err != nil {
			return err
		}
	}
	// Permanent neighbour entries across the tunnel: no ARP or neighbour
	// discovery delays the first packets.
	for i, s := range sides {
		peer := sides[1-i]
		for _, a := range []netip.Addr{peer.addr4, peer.addr6} {
			if err := s.ns.AddNeighbor(VxlanIf, a, macs[1-i]); err != nil {
				return err
			}
		}
	}
	return addRoutes(t.Remote, VxlanIf,
		route{dst: podNet4, gw: t.NodeOverlay4}, route{dst: podNet6, gw: t.NodeOverlay6})
}

// addBridge makes the bridge in the node with the gateway addresses.
func (t *Topology) addBridge() error {
	nl, err := t.Node.Netlink()
	if err != nil {
		return err
	}
	defer nl.Close()
	mac, _ := net.ParseMAC(bridgeMAC)
	if err := nl.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: BridgeIf, HardwareAddr: mac}}); err != nil {
		return fmt.Errorf("%s: add bridge %s: %w", t.Node.Name, BridgeIf, err)
	}
	t.Gateway4, t.Gateway6 = bridgeNet4.Addr().Next(), bridgeNet6.Addr().Next()
	return setUp(t.Node, BridgeIf, netip.PrefixFrom(t.Gateway4, bridgeNet4.Bits()), netip.PrefixFrom(t.Gateway6, bridgeNet6.Bits()))
}

// newPodNS makes the pod's namespace and its veth: PodIf inside, hostIf in
// the node (down, no address). It records the pod (so Close closes it).
func (t *Topology) newPodNS(name string, kind PodKind, hostIf string) (*Pod, error) {
	ns, err := NewNS(name)
	if err != nil {
		return nil, err
	}
	p := &Pod{Name: name, Kind: kind, NS: ns, HostIf: hostIf}
	t.pods = append(t.pods, p)
	nl, err := t.Node.Netlink()
	if err != nil {
		return nil, err
	}
	defer nl.Close()
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: hostIf},
		PeerName:      PodIf,
		PeerNamespace: netlink.NsFd(int(ns.Handle())),
	}
	if err := nl.LinkAdd(veth); err != nil {
		return nil, fmt.Errorf("%s: veth %s to pod %s: %w", t.Node.Name, hostIf, name, err)
	}
	l, err := nl.LinkByName(hostIf)
	if err != nil {
		return nil, fmt.Errorf("%s: %s: %w", t.Node.Name, hostIf, err)
	}
	p.HostIfIndex = l.Attrs().Index
	return p, nil
}

// addBridgedPod makes pod i on the bridge: the host side a bridge port, the
// pod's addresses in the bridge's subnet, its default routes via the
// gateway.
func (t *Topology) addBridgedPod(name string, i int) error {
	p, err := t.newPodNS(name, PodBridged, "vb-"+name)
	if err != nil {
		return err
	}
	p.Addr4, p.Addr6 = nthAddr(bridgeNet4, 2+i), nthAddr(bridgeNet6, 2+i)
	nl, err := t.Node.Netlink()
	if err != nil {
		return err
	}
	defer nl.Close()
	host, err := nl.LinkByIndex(p.HostIfIndex)
	if err == nil {
		var br netlink.Link
		if br, err = nl.LinkByName(BridgeIf); err == nil {
			err = nl.LinkSetMaster(host, br)
		}
	}
	if err == nil {
		err = nl.LinkSetUp(host)
	}
	if err != nil {
		return fmt.Errorf("%s: %s on %s: %w", t.Node.Name, p.HostIf, BridgeIf, err)
	}
	if err := setUp(p.NS, PodIf, netip.PrefixFrom(p.Addr4, bridgeNet4.Bits()), netip.PrefixFrom(p.Addr6, bridgeNet6.Bits())); err != nil {
		return err
	}
	if err := addRoutes(p.NS, PodIf, route{gw: t.Gateway4}, route{gw: t.Gateway6}); err != nil {
		return err
	}
	if p.MAC, err = p.NS.MAC(PodIf); err != nil {
		return err
	}
	// Permanent neighbour entries for the gateway in the pod and for the
	// pod on the bridge: no neighbour discovery delays or loses the first
	// packets, and the node's neighbour table names the pod's MAC from the
	// start (an agent maps it to a bridge port through the FDB).
	gwMAC, _ := net.ParseMAC(bridgeMAC)
	for _, a := range []netip.Addr{t.Gateway4, t.Gateway6} {
		if err := p.NS.AddNeighbor(PodIf, a, gwMAC); err != nil {
			return err
		}
	}
	for _, a := range []netip.Addr{p.Addr4, p.Addr6} {
		if err := t.Node.AddNeighbor(BridgeIf, a, p.MAC); err != nil {
			return err
		}
	}
	return nil
}

// addRoutedPod makes pod i on a point-to-point veth: /32 and /128 in the
// pod, default routes via routedGW4 (on the link, permanent neighbour with
// the host side's MAC) and routedGW6 (held by the host side), and host
// routes in the node to the host side.
func (t *Topology) addRoutedPod(name string, i int) error {
	p, err := t.newPodNS(name, PodRouted, "vr-"+name)
	if err != nil {
		return err
	}
	p.Addr4, p.Addr6 = nthAddr(routedNet4, 2+i), nthAddr(routedNet6, 2+i)
	// The host side holds only the IPv6 gateway, a link-local address: no
	// IPv4 address, as with Calico.
	if err := setUp(t.Node, p.HostIf, netip.PrefixFrom(routedGW6, 64)); err != nil {
		return err
	}
	if err := setUp(p.NS, PodIf, netip.PrefixFrom(p.Addr4, 32), netip.PrefixFrom(p.Addr6, 128)); err != nil {
		return err
	}
	if err := addRoutes(p.NS, PodIf,
		route{dst: netip.PrefixFrom(routedGW4, 32)}, // the gateway is on the link
		route{gw: routedGW4}, route{gw: routedGW6}); err != nil {
		return err
	}
	if err := addRoutes(t.Node, p.HostIf,
		route{dst: netip.PrefixFrom(p.Addr4, 32)}, route{dst: netip.PrefixFrom(p.Addr6, 128)}); err != nil {
		return err
	}
	if p.MAC, err = p.NS.MAC(PodIf); err != nil {
		return err
	}
	hostMAC, err := t.Node.MAC(p.HostIf)
	if err != nil {
		return err
	}
	// Permanent neighbour entries both ways. Calico answers the pod's ARP
	// for 169.254.1.1 with proxy ARP on the host side; proxy ARP needs a
	// route to that address in the node, which a node without an uplink
	// has not, and a static entry needs nothing.
	for _, a := range []netip.Addr{routedGW4, routedGW6} {
		if err := p.NS.AddNeighbor(PodIf, a, hostMAC); err != nil {
			return err
		}
	}
	for _, a := range []netip.Addr{p.Addr4, p.Addr6} {
		if err := t.Node.AddNeighbor(p.HostIf, a, p.MAC); err != nil {
			return err
		}
	}
	return nil
}

// nthAddr is the n-th address of the prefix (0 is the prefix's own).
func nthAddr(p netip.Prefix, n int) netip.Addr {
	a := p.Masked().Addr()
	for range n {
		a = a.Next()
	}
	return a
}

// addService loads the DNAT rules into the node's nftables (and turns on
// br_netfilter in the node where a bridged pod may reach a bridged backend).
func (t *Topology) addService() error {
	s := t.cfg.Service
	b := t.Pod(s.Pod)
	t.Backend, t.BackendPort = b, s.TargetPort
	t.Service4, t.Service6 = netip.AddrPortFrom(service4, s.Port), netip.AddrPortFrom(service6, s.Port)
	if len(t.cfg.BridgePods) > 0 {
		err := errors.Join(
			t.Node.WriteSysctl("net/bridge/bridge-nf-call-iptables", "1"),
			t.Node.WriteSysctl("net/bridge/bridge-nf-call-ip6tables", "1"))
		t.BridgeNetfilter = err == nil
		if err != nil && b.Kind == PodBridged && len(t.cfg.BridgePods) > 1 {
			return fmt.Errorf("a bridged pod's traffic to a bridged backend needs br_netfilter "+
				"(/proc/sys/net/bridge, CONFIG_BRIDGE_NETFILTER) so the backend's bridged reply is un-DNATed: %w", err)
		}
	}
	rules := fmt.Sprintf(`table inet rlagent_nettest {
	chain prerouting {
		type nat hook prerouting priority dstnat; policy accept;
		%[1]s
	}
	chain output {
		type nat hook output priority -100; policy accept;
		%[1]s
	}
}
`, fmt.Sprintf(`ip daddr %s meta l4proto { tcp, udp } th dport %d dnat ip to %s
		ip6 daddr %s meta l4proto { tcp, udp } th dport %d dnat ip6 to %s`,
		service4, s.Port, netip.AddrPortFrom(b.Addr4, s.TargetPort),
		service6, s.Port, netip.AddrPortFrom(b.Addr6, s.TargetPort)))
	return t.Node.Nft(rules)
}

// Nft loads a ruleset (nft -f syntax) into the namespace's nftables with
// the nft binary, run on a thread inside the namespace. Rules live in the
// namespace only and go with it.
func (ns *NS) Nft(rules string) error {
	nft, err := nftPath()
	if err != nil {
		return err
	}
	return ns.Do(func() error {
		// The child is forked from this thread, so it starts in the
		// namespace.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, nft, "-f", "-")
		cmd.Stdin = strings.NewReader(rules)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("nft -f in %s: %w: %s", ns.Name, err, strings.TrimSpace(string(out)))
		}
		return nil
	})
}

// nftPath finds the nft binary, also where $PATH lacks the sbin folders.
func nftPath() (string, error) {
	if p, err := exec.LookPath("nft"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/sbin/nft", "/sbin/nft"} {
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("the nft binary is missing: install the package %s (Debian/Ubuntu: apt-get install %s; `make deps-test` does it)",
		nftPackage, nftPackage)
}

// waitReady waits until every namespace of the topology is ready (see
// NS.WaitReady), for up to timeout in all.
func (t *Topology) waitReady(timeout time.Duration) error {
	nss := []*NS{t.Node}
	if t.Remote != nil {
		nss = append(nss, t.Remote)
	}
	for _, p := range t.pods {
		nss = append(nss, p.NS)
	}
	deadline := time.Now().Add(timeout)
	for _, ns := range nss {
		if err := ns.WaitReady(time.Until(deadline)); err != nil {
			return err
		}
	}
	return nil
}

// WaitReady waits, for up to timeout, until every interface that is up in
// the namespace has its carrier on and its queue attached, and every
// address its local route. All three happen after "set up" returns: in the
// kernel's link-watch work (up to a second later) and then, for IPv6
// addresses (even without duplicate address detection), in addrconf's work
// queue. Until then a device drops what it is given to send (its qdisc is
// still noop), a bridge port neither forwards nor learns, and a packet to
// an IPv6 address is dropped (InAddrErrors): the first packets of a test
// would be lost.
func (ns *NS) WaitReady(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		waiting, err := linksNotReady(ns)
		if err != nil {
			return err
		}
		if len(waiting) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: interfaces or addresses not ready after %s: %s",
				ns.Name, timeout, strings.Join(waiting, ", "))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// linksNotReady lists the interfaces of ns that are set up but not yet
// operationally up, or have no qdisc attached yet (a virtual device gets
// noqueue when it is activated; before, the dump shows none).
func linksNotReady(ns *NS) ([]string, error) {
	nl, err := ns.Netlink()
	if err != nil {
		return nil, err
	}
	defer nl.Close()
	links, err := nl.LinkList()
	if errors.Is(err, netlink.ErrDumpInterrupted) {
		return []string{"links (dump interrupted)"}, nil // changed during the dump: look again
	}
	if err != nil {
		return nil, fmt.Errorf("%s: list links: %w", ns.Name, err)
	}
	var waiting []string
	for _, l := range links {
		a := l.Attrs()
		if a.Flags&net.FlagUp == 0 {
			continue
		}
		if a.OperState != netlink.OperUp && a.OperState != netlink.OperUnknown {
			waiting = append(waiting, fmt.Sprintf("%s (%s)", a.Name, a.OperState))
			continue
		}
		qs, err := nl.QdiscList(l)
		if err != nil {
			return nil, fmt.Errorf("%s: qdiscs of %s: %w", ns.Name, a.Name, err)
		}
		if len(qs) == 0 {
			waiting = append(waiting, a.Name+" (no qdisc)")
		}
	}
	addrs, err := nl.AddrList(nil, netlink.FAMILY_ALL)
	if errors.Is(err, netlink.ErrDumpInterrupted) {
		// The addresses changed during the dump (the kernel is still
		// setting the namespace up): not ready, look again.
		return append(waiting, "addresses (dump interrupted)"), nil
	}
	if err != nil {
		return nil, fmt.Errorf("%s: list addresses: %w", ns.Name, err)
	}
	for _, a := range addrs {
		ip, ok := netip.AddrFromSlice(a.IP)
		if !ok || ip.IsLinkLocalUnicast() || ip.IsLoopback() {
			continue // a route lookup needs an interface for these; no test sends to them
		}
		ip = ip.Unmap()
		rs, err := nl.RouteGet(ip.AsSlice())
		if err != nil || len(rs) == 0 || rs[0].Type != unix.RTN_LOCAL {
			waiting = append(waiting, ip.String()+" (no local route)")
		}
	}
	return waiting, nil
}

// primeBridge has every bridged pod send a frame through the bridge until
// the bridge has learnt the pod's MAC on its port, as it has once a real
// pod has sent anything: an agent finds a bridged pod's interface through
// that FDB entry.
func (t *Topology) primeBridge(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for _, p := range t.pods {
		if p.Kind != PodBridged {
			continue
		}
		for {
			c, err := p.NS.DialUDP(netip.AddrPortFrom(t.Gateway4, 9)) // discard
			if err != nil {
				return err
			}
			_, err = c.Write([]byte{0})
			c.Close()
			if err != nil {
				return fmt.Errorf("pod %s: prime the bridge: %w", p.Name, err)
			}
			port, err := t.BridgePort(p.MAC)
			if err != nil {
				return err
			}
			if port == p.HostIfIndex {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("pod %s: the bridge has not learnt its MAC %s on %s after %s (port %d)",
					p.Name, p.MAC, p.HostIf, timeout, port)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return nil
}

// BridgePort is the bridge port (ifindex in the node) on which the
// bridge's FDB has learnt mac, or 0 if it has not.
func (t *Topology) BridgePort(mac net.HardwareAddr) (int, error) {
	nl, err := t.Node.Netlink()
	if err != nil {
		return 0, err
	}
	defer nl.Close()
	fdb, err := nl.NeighList(0, unix.AF_BRIDGE)
	if err != nil {
		return 0, fmt.Errorf("%s: bridge fdb: %w", t.Node.Name, err)
	}
	for _, n := range fdb {
		if n.HardwareAddr.String() == mac.String() && n.MasterIndex != 0 {
			return n.LinkIndex, nil
		}
	}
	return 0, nil
}
