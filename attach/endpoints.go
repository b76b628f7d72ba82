package attach

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// How an endpoint's interface was found.
const (
	// ViaRoute: the route to the address points at the interface (ptp
	// routes, one per pod, as Calico and Cilium's veth mode make them).
	ViaRoute = "route"
	// ViaBridge: the route points at a bridge (the bridge plugin, flannel's
	// cni0); the node's neighbour entry gives the address's MAC and the
	// bridge's forwarding table (FDB) the port that MAC is behind.
	ViaBridge = "bridge"
)

// Endpoint is where the traffic to one address passes on this node.
type Endpoint struct {
	// Addr is the endpoint's address.
	Addr netip.Addr
	// Iface is the host side of the pod's interface pair (a veth or a
	// netkit device) that carries traffic to Addr: packets into the pod
	// leave the host through its egress hook. "" when there is none, and
	// Reason says why.
	Iface string
	// Ifindex is Iface's index.
	Ifindex int
	// Via is ViaRoute or ViaBridge.
	Via string
	// Bridge is the bridge Iface is a port of (ViaBridge).
	Bridge string
	// Peer is the pod side of Iface (zero when Iface is "").
	Peer Peer
	// Reason says why there is no Iface: a local address of this node (a
	// hostNetwork pod), no route, a remote address, a bridge that has not
	// resolved it yet. The agent falls back to the uplink then, and status
	// shows the reason.
	Reason string
}

// Peer is the pod side of an endpoint's interface pair. Its ingress hook
// sees every packet into the pod, also those a CNI hands over with
// bpf_redirect_peer (Cilium's BPF host routing), which skip the host side's
// egress hook.
type Peer struct {
	// Ifindex is its index in its own namespace.
	Ifindex int
	// NetnsID is its namespace's ID in the caller's namespace
	// (IFLA_LINK_NETNSID); -1 when it is the caller's namespace.
	NetnsID int
	// Netns is a path to its namespace, found in NetnsDirs or as
	// /proc/PID/ns/net of a process in it. "" for the caller's namespace
	// (NetnsID -1), or when none was found, and then Reason says so.
	Netns string
	// Iface is its name in its namespace ("" when that was not found).
	Iface string
	// Reason says why Iface is "".
	Reason string
}

// Ingress is the Point of the peer's ingress hook; ok is false when its
// namespace or name was not found.
func (p Peer) Ingress() (pt Point, ok bool) {
	if p.Iface == "" {
		return Point{}, false
	}
	return Point{Iface: p.Iface, Netns: p.Netns, Kind: TCIngress}, true
}

// podLink reports whether l is the host side of a pod's interface pair.
func podLink(l netlink.Link) bool {
	switch l.Type() {
	case "veth", "netkit":
		return true
	}
	return false
}

// finder answers one discovery: one netlink socket, and each table read
// at most once.
type finder struct {
	a     *Attacher
	nl    *netlink.Handle
	links map[int]netlink.Link
	neigh map[int][]netlink.Neigh // per bridge, both families
	fdb   []netlink.Neigh
	// fdbRead: fdb was read (it may be empty).
	fdbRead bool
}

func (a *Attacher) newFinder() (*finder, error) {
	nl, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("find endpoints: netlink: %w", err)
	}
	f := &finder{a: a, nl: nl, links: make(map[int]netlink.Link), neigh: make(map[int][]netlink.Neigh)}
	ls, err := nl.LinkList()
	if err != nil {
		nl.Close()
		return nil, fmt.Errorf("find endpoints: list interfaces: %w", err)
	}
	for _, l := range ls {
		f.links[l.Attrs().Index] = l
	}
	return f, nil
}

// FindEndpoints says, for each address, which interface of the caller's
// network namespace carries the traffic to it, and the pod side of that
// interface. It reads only. The error is for netlink failing as a whole;
// an address without an interface has its Reason.
func (a *Attacher) FindEndpoints(addrs []netip.Addr) ([]Endpoint, error) {
	f, err := a.newFinder()
	if err != nil {
		return nil, err
	}
	defer f.nl.Close()
	out := make([]Endpoint, 0, len(addrs))
	for _, addr := range addrs {
		out = append(out, f.endpoint(addr))
	}
	f.peers(out)
	return out, nil
}

// FindEndpointsIn finds the endpoints inside prefixes (a limit's CIDRs
// when a file config says attach: endpoints): the routes inside them that
// point at a pod's interface, the addresses the node has neighbour entries
// for on bridges routed for them, the node's own addresses inside them
// (with their Reason), and each single-address prefix (/32, /128) as
// FindEndpoints would. The endpoints come sorted by address, each once.
func (a *Attacher) FindEndpointsIn(prefixes []netip.Prefix) ([]Endpoint, error) {
	f, err := a.newFinder()
	if err != nil {
		return nil, err
	}
	defer f.nl.Close()
	prefixes = slices.Clone(prefixes)
	for i, p := range prefixes {
		if p.Addr().Is4In6() {
			p = netip.PrefixFrom(p.Addr().Unmap(), max(p.Bits()-96, 0))
		}
		prefixes[i] = p.Masked()
	}
	inside := func(a netip.Addr) bool {
		return slices.ContainsFunc(prefixes, func(p netip.Prefix) bool { return p.Contains(a) })
	}
	var out []Endpoint
	have := make(map[netip.Addr]bool)
	add := func(e Endpoint) {
		if !have[e.Addr] {
			have[e.Addr] = true
			out = append(out, e)
		}
	}

	// All tables: policy routing may put a pod's route outside main.
	routes, err := f.nl.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return nil, fmt.Errorf("find endpoints: list routes: %w", err)
	}
	var bridges []int
	for _, r := range routes {
		if r.Type != unix.RTN_UNICAST || r.Dst == nil || r.Gw != nil || len(r.MultiPath) > 0 {
			continue
		}
		dst, ok := prefixOf(r.Dst)
		if !ok {
			continue
		}
		l := f.links[r.LinkIndex]
		if l == nil {
			continue
		}
		for _, p := range prefixes {
			switch {
			case podLink(l) && p.Contains(dst.Addr()) && dst.Bits() >= p.Bits():
				add(Endpoint{Addr: dst.Addr(), Iface: l.Attrs().Name, Ifindex: r.LinkIndex, Via: ViaRoute})
			case l.Type() == "bridge" && p.Overlaps(dst) && !slices.Contains(bridges, r.LinkIndex):
				bridges = append(bridges, r.LinkIndex)
			}
		}
	}
	for _, br := range bridges {
		for _, n := range f.neighbours(br) {
			if addr, ok := netip.AddrFromSlice(n.IP); ok && inside(addr.Unmap()) {
				add(f.endpoint(addr.Unmap()))
			}
		}
	}
	addrs, err := f.nl.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("find endpoints: list addresses: %w", err)
	}
	for _, ad := range addrs {
		if addr, ok := netip.AddrFromSlice(ad.IP); ok && inside(addr.Unmap()) {
			add(f.endpoint(addr.Unmap()))
		}
	}
	for _, p := range prefixes {
		if p.IsSingleIP() {
			add(f.endpoint(p.Addr()))
		}
	}
	slices.SortFunc(out, func(a, b Endpoint) int { return a.Addr.Compare(b.Addr) })
	f.peers(out)
	return out, nil
}

func prefixOf(n *net.IPNet) (netip.Prefix, bool) {
	a, ok := netip.AddrFromSlice(n.IP)
	if !ok {
		return netip.Prefix{}, false
	}
	bits, _ := n.Mask.Size()
	a = a.Unmap()
	return netip.PrefixFrom(a, bits).Masked(), true
}

// endpoint finds the interface of one address.
func (f *finder) endpoint(addr netip.Addr) Endpoint {
	addr = addr.Unmap()
	e := Endpoint{Addr: addr}
	routes, err := f.nl.RouteGet(addr.AsSlice())
	if err != nil || len(routes) == 0 {
		switch {
		case errors.Is(err, unix.ENETUNREACH), errors.Is(err, unix.EHOSTUNREACH), err == nil:
			e.Reason = "no route to it on this node"
		default:
			e.Reason = fmt.Sprintf("route lookup failed: %v", err)
		}
		return e
	}
	r := routes[0]
	switch r.Type {
	case unix.RTN_UNICAST:
	case unix.RTN_LOCAL:
		e.Reason = "a local address of this node (a hostNetwork endpoint): it has no interface of its own; " +
			"its traffic is seen at the uplink"
		return e
	default:
		e.Reason = fmt.Sprintf("no route to it on this node (route type %d: unreachable, blackhole or prohibit)", r.Type)
		return e
	}
	l := f.links[r.LinkIndex]
	if l == nil {
		e.Reason = fmt.Sprintf("the route to it points at interface %d, which is gone", r.LinkIndex)
		return e
	}
	if r.Gw != nil || len(r.MultiPath) > 0 {
		e.Reason = fmt.Sprintf("not on this node: routed through a gateway on %s", l.Attrs().Name)
		return e
	}
	switch {
	case podLink(l):
		e.Iface, e.Ifindex, e.Via = l.Attrs().Name, l.Attrs().Index, ViaRoute
	case l.Type() == "bridge":
		f.bridgePort(&e, l)
	default:
		e.Reason = fmt.Sprintf("not a local endpoint: the route to it points at %s (%s), not at a pod's interface",
			l.Attrs().Name, l.Type())
	}
	return e
}

// bridgePort finds the port of bridge br that e.Addr is behind: its MAC
// from the node's neighbour entry on the bridge, the port from the
// bridge's FDB.
func (f *finder) bridgePort(e *Endpoint, br netlink.Link) {
	name := br.Attrs().Name
	var mac net.HardwareAddr
	for _, n := range f.neighbours(br.Attrs().Index) {
		if ip, ok := netip.AddrFromSlice(n.IP); ok && ip.Unmap() == e.Addr {
			mac = n.HardwareAddr
			break
		}
	}
	if mac == nil {
		e.Reason = fmt.Sprintf("behind bridge %s, but this node has no neighbour entry for it yet: it is found "+
			"once traffic to it resolves its MAC address", name)
		return
	}
	if !f.fdbRead {
		// Every bridge's table at once: a dump per bridge filters on the
		// port, not on the bridge.
		f.fdb, _ = f.nl.NeighList(0, unix.AF_BRIDGE)
		f.fdbRead = true
	}
	// A VLAN-aware bridge has an entry per VLAN; any one names the port.
	for _, n := range f.fdb {
		if n.MasterIndex != br.Attrs().Index || n.LinkIndex == br.Attrs().Index || !bytes.Equal(n.HardwareAddr, mac) {
			continue
		}
		port := f.links[n.LinkIndex]
		if port == nil {
			continue
		}
		if !podLink(port) {
			e.Reason = fmt.Sprintf("not a local endpoint: behind bridge %s on port %s (%s), not a pod's interface",
				name, port.Attrs().Name, port.Type())
			return
		}
		e.Iface, e.Ifindex, e.Via, e.Bridge = port.Attrs().Name, port.Attrs().Index, ViaBridge, name
		return
	}
	e.Reason = fmt.Sprintf("behind bridge %s at MAC %s, but the bridge's forwarding table has no port for it "+
		"(aged out): it is found again with its next packet", name, mac)
}

// neighbours are the usable neighbour entries on a link, both families.
func (f *finder) neighbours(ifindex int) []netlink.Neigh {
	if ns, ok := f.neigh[ifindex]; ok {
		return ns
	}
	var out []netlink.Neigh
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		ns, _ := f.nl.NeighList(ifindex, fam)
		for _, n := range ns {
			const usable = netlink.NUD_REACHABLE | netlink.NUD_STALE | netlink.NUD_DELAY | netlink.NUD_PROBE |
				netlink.NUD_PERMANENT | netlink.NUD_NOARP
			if n.State&usable != 0 && len(n.HardwareAddr) > 0 && n.IP != nil {
				out = append(out, n)
			}
		}
	}
	f.neigh[ifindex] = out
	return out
}

// peers fills in the pod side of each endpoint with an interface.
func (f *finder) peers(eps []Endpoint) {
	want := make(map[int]bool)
	for i := range eps {
		e := &eps[i]
		if e.Iface == "" {
			continue
		}
		l := f.links[e.Ifindex]
		e.Peer = Peer{Ifindex: l.Attrs().ParentIndex, NetnsID: l.Attrs().NetNsID}
		if e.Peer.NetnsID < 0 {
			if pl := f.links[e.Peer.Ifindex]; pl != nil {
				e.Peer.Iface = pl.Attrs().Name
			} else {
				e.Peer.Reason = "its peer is not in this network namespace, and the kernel gives no namespace ID"
			}
			continue
		}
		want[e.Peer.NetnsID] = true
	}
	if len(want) == 0 || f.a.skipPeerNS {
		return
	}
	paths := f.findNetns(want)
	for i := range eps {
		p := &eps[i].Peer
		if eps[i].Iface == "" || p.NetnsID < 0 {
			continue
		}
		p.Netns = paths[p.NetnsID]
		if p.Netns == "" {
			p.Reason = fmt.Sprintf("no file of its network namespace (ID %d) was found in %v or /proc/*/ns/net: "+
				"give the agent the host's PID namespace (hostPID) or mount /var/run/netns", p.NetnsID, f.a.netnsDirs)
			continue
		}
		name, err := peerName(p.Netns, p.Ifindex)
		if err != nil {
			p.Reason = fmt.Sprintf("interface %d in %s: %v", p.Ifindex, p.Netns, err)
			continue
		}
		p.Iface = name
	}
}

// peerName is the name of interface ifindex in the namespace at path.
func peerName(path string, ifindex int) (string, error) {
	h, err := netns.GetFromPath(path)
	if err != nil {
		return "", err
	}
	defer h.Close()
	nl, err := netlink.NewHandleAt(h, unix.NETLINK_ROUTE)
	if err != nil {
		return "", err
	}
	defer nl.Close()
	l, err := nl.LinkByIndex(ifindex)
	if err != nil {
		return "", err
	}
	return l.Attrs().Name, nil
}

// findNetns finds a path for each wanted namespace ID (IDs as the caller's
// namespace numbers its peers): first among the files in NetnsDirs (bind
// mounts made by ip netns and CNI plugins: they live as long as the
// namespace), then among /proc/PID/ns/net (valid while that process lives;
// the lowest PID is taken, most often the pod's first process, its pause
// container). Namespaces are told apart by inode, so that each is asked for
// its ID once, however many processes share it. A namespace with no such
// file (held only by an open descriptor) is not found.
func (f *finder) findNetns(want map[int]bool) map[int]string {
	found := make(map[int]string)
	seen := make(map[uint64]bool)
	try := func(path string) bool {
		var st unix.Stat_t
		if unix.Stat(path, &st) != nil || seen[st.Ino] {
			return false
		}
		seen[st.Ino] = true
		fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return false
		}
		defer unix.Close(fd)
		if typ, err := unix.IoctlRetInt(fd, unix.NS_GET_NSTYPE); err != nil || typ != unix.CLONE_NEWNET {
			return false
		}
		id, err := f.nl.GetNetNsIdByFd(fd)
		if err != nil || !want[id] || found[id] != "" {
			return false
		}
		found[id] = path
		return len(found) == len(want)
	}
	for _, dir := range f.a.netnsDirs {
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			if try(filepath.Join(dir, e.Name())) {
				return found
			}
		}
	}
	ents, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range ents {
		if pid, err := strconv.Atoi(e.Name()); err == nil {
			pids = append(pids, pid)
		}
	}
	slices.Sort(pids)
	for _, pid := range pids {
		if try(fmt.Sprintf("/proc/%d/ns/net", pid)) {
			break
		}
	}
	return found
}
