package e2e

import (
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/agent"
	"github.com/rlagent/rlagent/attach"
	"github.com/rlagent/rlagent/internal/agenttest"
	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// interfaces: auto. A node namespace with uplinks to routers of their
// own: the agent attaches to the interfaces of the default routes and of
// the host's addresses, follows a route change under traffic (the new
// uplink is attached before the old one goes, and an interface that stays
// an uplink keeps its hook), is not ready while it finds nothing, and puts
// an interface without native XDP (a VLAN) on generic XDP, or on TC with
// xdpFallback tc.

// autoNet is a node namespace and the routers around it.
type autoNet struct {
	t    *testing.T
	node *nettest.NS
	dir  string
	pins string
	cfg  string
}

// uplink is one link from the node to a router namespace: the node's end
// ifNode with .2 and ::2 of its subnets, the router's end with .1 and ::1.
type uplink struct {
	router         *nettest.NS
	ifNode, ifPeer string
	node4, peer4   netip.Addr
	node6, peer6   netip.Addr
}

func newAutoNet(t *testing.T) *autoNet {
	t.Helper()
	testenv.RequireRoot(t)
	nettest.HoldTraffic(t)
	n := &autoNet{t: t, dir: t.TempDir()}
	n.node = nettest.MustNS(t, "auto-node")
	n.pins = filepath.Join(n.dir, "bpf")
	n.cfg = filepath.Join(n.dir, "rlagent.yaml")
	return n
}

// link joins the node to a new router namespace over a veth pair, in the
// subnets 10.211.i.0/24 and fd00:211:i::/64, with permanent neighbour
// entries both ways. bridged puts the node's end on a bridge of its own
// and the node's addresses on the bridge (ifNode is then the bridge).
func (n *autoNet) link(i int, bridged bool) uplink {
	n.t.Helper()
	u := uplink{router: nettest.MustNS(n.t, fmt.Sprintf("auto-r%d", i)), ifNode: fmt.Sprintf("up%d", i), ifPeer: fmt.Sprintf("r%d", i)}
	u.node4 = netip.AddrFrom4([4]byte{10, 211, byte(i), 2})
	u.peer4 = netip.AddrFrom4([4]byte{10, 211, byte(i), 1})
	u.node6 = netip.MustParseAddr(fmt.Sprintf("fd00:211:%d::2", i))
	u.peer6 = netip.MustParseAddr(fmt.Sprintf("fd00:211:%d::1", i))
	nl := n.handle(n.node)
	defer nl.Close()
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: u.ifNode}, PeerName: u.ifPeer,
		PeerNamespace: netlink.NsFd(int(u.router.Handle()))}
	if err := nl.LinkAdd(veth); err != nil {
		n.t.Fatalf("veth %s/%s: %v", u.ifNode, u.ifPeer, err)
	}
	if bridged {
		n.up(n.node, u.ifNode)
		u.ifNode = n.bridge(u.ifNode, fmt.Sprintf("br%d", i))
	}
	n.address(n.node, u.ifNode, u.node4, 24, u.node6, 64)
	n.address(u.router, u.ifPeer, u.peer4, 24, u.peer6, 64)
	for _, side := range []struct {
		ns, other *nettest.NS
		ifc, ifo  string
		a4, a6    netip.Addr
	}{{n.node, u.router, u.ifNode, u.ifPeer, u.peer4, u.peer6}, {u.router, n.node, u.ifPeer, u.ifNode, u.node4, u.node6}} {
		mac, err := side.other.MAC(side.ifo)
		if err != nil {
			n.t.Fatal(err)
		}
		for _, a := range []netip.Addr{side.a4, side.a6} {
			if err := side.ns.AddNeighbor(side.ifc, a, mac); err != nil {
				n.t.Fatal(err)
			}
		}
	}
	for _, ns := range []*nettest.NS{n.node, u.router} {
		if err := ns.WaitReady(5 * time.Second); err != nil {
			n.t.Fatal(err)
		}
	}
	return u
}

func (n *autoNet) handle(ns *nettest.NS) *netlink.Handle {
	n.t.Helper()
	nl, err := ns.Netlink()
	if err != nil {
		n.t.Fatal(err)
	}
	return nl
}

func (n *autoNet) up(ns *nettest.NS, ifname string) {
	n.t.Helper()
	nl := n.handle(ns)
	defer nl.Close()
	l, err := nl.LinkByName(ifname)
	if err == nil {
		err = nl.LinkSetUp(l)
	}
	if err != nil {
		n.t.Fatalf("up %s: %v", ifname, err)
	}
}

// bridge makes a bridge called name with port as its one port, and
// returns its name.
func (n *autoNet) bridge(port, name string) string {
	n.t.Helper()
	nl := n.handle(n.node)
	defer nl.Close()
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: name}}
	p, err := nl.LinkByName(port)
	if err == nil {
		err = nl.LinkAdd(br)
	}
	if err == nil {
		err = nl.LinkSetMaster(p, br)
	}
	if err != nil {
		n.t.Fatalf("bridge %s with port %s: %v", name, port, err)
	}
	return name
}

func (n *autoNet) address(ns *nettest.NS, ifname string, a4 netip.Addr, bits4 int, a6 netip.Addr, bits6 int) {
	n.t.Helper()
	nl := n.handle(ns)
	defer nl.Close()
	l, err := nl.LinkByName(ifname)
	if err != nil {
		n.t.Fatal(err)
	}
	for _, a := range []struct {
		ip   netip.Addr
		bits int
	}{{a4, bits4}, {a6, bits6}} {
		addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.ip.AsSlice(), Mask: net.CIDRMask(a.bits, a.ip.BitLen())}}
		if a.ip.Is6() {
			addr.Flags = unix.IFA_F_NODAD
		}
		if err := nl.AddrAdd(l, addr); err != nil {
			n.t.Fatalf("address %s on %s: %v", a.ip, ifname, err)
		}
	}
	if err := nl.LinkSetUp(l); err != nil {
		n.t.Fatal(err)
	}
}

// route replaces the node's default route of gw's family by one via gw on
// u (gw invalid: deletes it).
func (n *autoNet) route(u uplink, gw netip.Addr, family int) {
	n.t.Helper()
	nl := n.handle(n.node)
	defer nl.Close()
	r := &netlink.Route{Family: family, Table: unix.RT_TABLE_MAIN, Dst: &net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}}
	if family == netlink.FAMILY_V6 {
		r.Dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
	}
	if !gw.IsValid() {
		if err := nl.RouteDel(r); err != nil {
			n.t.Fatalf("delete the default route (family %d): %v", family, err)
		}
		return
	}
	l, err := nl.LinkByName(u.ifNode)
	if err != nil {
		n.t.Fatal(err)
	}
	r.LinkIndex, r.Gw = l.Attrs().Index, gw.AsSlice()
	if err := nl.RouteReplace(r); err != nil {
		n.t.Fatalf("default route via %s: %v", gw, err)
	}
}

// start writes a config with interfaces: auto, settings (top-level lines)
// and a limit per port at rate (the count is 1: each share is its rate),
// and starts the agent with args until it is ready or, unready, serving.
func (n *autoNet) start(settings string, rate uint64, ports []uint16, args ...string) *agenttest.Agent {
	n.t.Helper()
	agenttest.PinDir(n.t, rlagentBin, n.pins)
	var limits strings.Builder
	for _, p := range ports {
		fmt.Fprintf(&limits, "  - name: port-%d\n    rate: %d\n    match:\n      protocol: udp\n      dstPorts: [\"%d\"]\n", p, rate, p)
	}
	writeAtomic(n.t, n.cfg, fmt.Sprintf("interfaces: auto\npinDir: %s\nmetricsAddress: %q\n%slimits:\n%s",
		n.pins, metricsAddr, settings, limits.String()))
	a := agenttest.StartAgent(n.t, n.node, rlagentBin, append([]string{"--config", n.cfg, "--log-level", "debug"}, args...)...)
	timeout := testenv.Timeout(agenttest.AttachTimeout)
	if !a.WaitLog(timeout, "msg=ready") {
		n.t.Fatalf("rlagent run (pid %d) did not start within %v; output:\n%s", a.PID(), timeout, a.Log())
	}
	return a
}

// hooks is the agent's interface table, as rlagent status reads it.
func (n *autoNet) hooks() []agent.InterfaceStatus {
	n.t.Helper()
	var st agent.AgentStatus
	if err := n.node.Do(func() (err error) {
		st, err = agent.ReadAgentStatus(n.pins)
		return err
	}); err != nil {
		n.t.Fatal(err)
	}
	return st.Interfaces
}

// waitUplinks waits until the attached uplink hooks are exactly want
// ("xdp up1"), and returns how long that took.
func (n *autoNet) waitUplinks(want ...string) time.Duration {
	n.t.Helper()
	start := time.Now()
	timeout := testenv.Timeout(5 * time.Second)
	slices.Sort(want)
	var got []string
	for {
		got = got[:0]
		for _, s := range n.hooks() {
			if s.State == agent.StateAttached {
				got = append(got, s.Hook+" "+s.Name)
			}
		}
		slices.Sort(got)
		if slices.Equal(got, want) {
			return time.Since(start)
		}
		if time.Since(start) > timeout {
			n.t.Fatalf("attached hooks %q after %v, want %q:\n%+v", got, timeout, want, n.hooks())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// linkID is the id of the bpf_link the agent pinned for XDP on iface.
func (n *autoNet) linkID(iface string) uint32 {
	n.t.Helper()
	var id uint32
	if err := n.node.Do(func() error {
		res, err := attach.New(attach.Options{PinDir: n.pins}).Alive(attach.Point{Iface: iface, Kind: attach.XDP})
		id = uint32(res.Link)
		return err
	}); err != nil {
		n.t.Fatalf("the XDP link of %s: %v", iface, err)
	}
	return id
}

// autoStream is a paced UDP stream from a router to a port of the node, and
// the receiver that counts it.
type autoStream struct {
	send *nettest.Sender
	recv *nettest.Receiver
}

func (n *autoNet) stream(u uplink, port uint16, rate float64) autoStream {
	n.t.Helper()
	conn, err := n.node.ListenUDP("udp", netip.AddrPortFrom(netip.IPv6Unspecified(), port), 8<<20)
	if err != nil {
		n.t.Fatal(err)
	}
	recv := nettest.StartReceiver(conn, nettest.ReceiverConfig{Span: 2 * time.Minute})
	n.t.Cleanup(func() { recv.Close() })
	out, err := u.router.DialUDP(netip.AddrPortFrom(u.node4, port))
	if err != nil {
		n.t.Fatal(err)
	}
	s, err := nettest.StartSender(out, nettest.SenderConfig{Rate: rate, Count: senderMax, Duration: senderSpan})
	if err != nil {
		out.Close()
		n.t.Fatal(err)
	}
	n.t.Cleanup(func() {
		s.Stop()
		out.Close()
	})
	return autoStream{send: s, recv: recv}
}

// admitted checks what st's receiver got over [from, from+d): want within
// tol of it, or (want 0) everything the sender offered.
func (n *autoNet) admitted(what string, st autoStream, from time.Time, d time.Duration, want float64) {
	n.t.Helper()
	to := from.Add(d)
	sleepUntil(to.Add(late))
	got, offered := st.recv.Got().Rate(from, to), st.send.Sent().Rate(from, to)
	if want == 0 {
		n.t.Logf("%s: %.0f of %.0f pkt/s offered arrived", what, got, offered)
		if offered == 0 || got < offered*0.99 {
			n.t.Errorf("%s: %.0f of %.0f pkt/s offered arrived, want all (no limit runs there)", what, got, offered)
		}
		return
	}
	n.t.Logf("%s: admitted %.0f pkt/s, share %.0f (%+.2f%%), offered %.0f", what, got, want, pct(got, want), offered)
	if offered < want*1.3 {
		n.t.Errorf("%s: the sender offered only %.0f pkt/s against a share of %.0f: the machine is too busy to measure", what, offered, want)
	}
	if got < want*(1-rigTol) || got > want*(1+rigTol) {
		n.t.Errorf("%s: admitted %.0f pkt/s, want %.0f +-%.0f%%", what, got, want, rigTol*100)
	}
}

// The uplinks follow the default routes and the host's addresses: a
// route moved under traffic attaches the new uplink before the old one
// goes, and the interface that stays an uplink (its IPv6 default route)
// keeps its hook, the same link, with no 100 ms bin empty or above the
// share.
func TestInterfacesAutoFollowsRoutes(t *testing.T) {
	n := newAutoNet(t)
	up1, up2, up3 := n.link(1, false), n.link(2, false), n.link(3, false)
	n.route(up1, up1.peer4, netlink.FAMILY_V4)
	n.route(up1, up1.peer6, netlink.FAMILY_V6)
	share := float64(globalRate / 2)
	burst := share / 10 // the default burst: 100 ms of the rate
	a := n.start("count:\n  static: 1\n", uint64(share), []uint16{53, 54}, "--host-ips", up3.node4.String())
	n.waitUplinks("xdp up1", "xdp up3")
	if !strings.Contains(a.Log(), "default route (IPv4), default route (IPv6)") || !strings.Contains(a.Log(), "host address "+up3.node4.String()) {
		t.Errorf("the agent does not log why it chose its uplinks:\n%s", a.Log())
	}
	s1, s2 := n.stream(up1, 53, 2*share), n.stream(up2, 54, 2*share)
	time.Sleep(settle)
	now := time.Now()
	n.admitted("up1 (both default routes)", s1, now, rigWindow, share)
	n.admitted("up2 (no route, no limit)", s2, now, rigWindow, 0)

	// The IPv4 default route moves to up2; up1 keeps the IPv6 one.
	before := n.linkID("up1")
	moved := time.Now()
	n.route(up2, up2.peer4, netlink.FAMILY_V4)
	took := n.waitUplinks("xdp up1", "xdp up2", "xdp up3")
	t.Logf("up2 attached %v after the IPv4 default route moved to it", took.Round(time.Millisecond))
	if after := n.linkID("up1"); after != before {
		t.Errorf("up1's XDP link changed from %d to %d: an interface that stays an uplink must keep its hook", before, after)
	}
	n.admitted("up2 (the IPv4 default route)", s2, moved.Add(settle), rigWindow, share)
	sleepUntil(moved.Add(2 * time.Second).Add(late))
	e := &env{t: t, recv: s1.recv}
	e.checkBins("up1 across the move", moved.Add(-time.Second), moved.Add(2*time.Second), moved, share, burst, true)

	// The IPv6 default route goes: up1 is no uplink any more.
	gone := time.Now()
	n.route(up1, netip.Addr{}, netlink.FAMILY_V6)
	took = n.waitUplinks("xdp up2", "xdp up3")
	t.Logf("up1 detached %v after its last default route went", took.Round(time.Millisecond))
	n.admitted("up1 (no route)", s1, gone.Add(settle), rigWindow, 0)
	n.admitted("up2 (still the IPv4 default route)", s2, gone.Add(settle), rigWindow, share)

	// No default route at all: the host address's interface stays.
	n.route(up2, netip.Addr{}, netlink.FAMILY_V4)
	n.waitUplinks("xdp up3")
}

// Finding nothing, the agent is not ready and says why; the first
// default route makes it ready. Losing every uplink later keeps the last
// ones attached, with a note.
func TestInterfacesAutoNothingFound(t *testing.T) {
	n := newAutoNet(t)
	up1 := n.link(1, false)
	a := n.start("count:\n  static: 1\n", globalRate, []uint16{53})
	code, body := agenttest.HTTPGet(t, n.node, "http://"+metricsAddr+"/readyz")
	t.Logf("/readyz without a default route: %d\n%s", code, body)
	if code != 503 || !strings.Contains(body, "interfaces auto: no uplink") || !strings.Contains(body, "HOST_IPS is not set") {
		t.Errorf("/readyz %d %q, want 503 naming interfaces auto and HOST_IPS", code, body)
	}
	if !strings.Contains(a.Log(), "interfaces auto found no uplink") {
		t.Errorf("the agent does not log that it found no uplink:\n%s", a.Log())
	}

	n.route(up1, up1.peer4, netlink.FAMILY_V4)
	n.waitUplinks("xdp up1")
	deadline := time.Now().Add(testenv.Timeout(5 * time.Second))
	for {
		if code, body = agenttest.HTTPGet(t, n.node, "http://"+metricsAddr+"/readyz"); code == 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz %d %q after the default route came, want 200", code, body)
		}
		time.Sleep(50 * time.Millisecond)
	}

	n.route(up1, netip.Addr{}, netlink.FAMILY_V4)
	deadline = time.Now().Add(testenv.Timeout(5 * time.Second))
	for !strings.Contains(body, "the last uplinks found (up1) stay attached") {
		if time.Now().After(deadline) {
			t.Fatalf("/readyz %d %q after the default route went, want a note that up1 stays", code, body)
		}
		time.Sleep(50 * time.Millisecond)
		code, body = agenttest.HTTPGet(t, n.node, "http://"+metricsAddr+"/readyz")
	}
	if code != 200 {
		t.Errorf("/readyz %d with the last uplink kept: want ready (it enforces)", code)
	}
	n.waitUplinks("xdp up1")
}

// A bridge has no native XDP (nor has a VLAN): the agent attaches
// generic XDP, or with xdpFallback tc runs the uplink's ingress limits at
// its TC ingress, says which, and enforces the share there.
func TestInterfacesAutoBridge(t *testing.T) {
	for _, tc := range []struct {
		name, settings, hook, mode string
	}{
		{"generic", "", "xdp", "generic"},
		{"xdpFallback tc", "xdpFallback: tc\n", "tc-ingress", "xdpFallback: no native XDP"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newAutoNet(t)
			up := n.link(1, true)
			n.route(up, up.peer4, netlink.FAMILY_V4)
			share := float64(globalRate / 2)
			n.start("count:\n  static: 1\n"+tc.settings, uint64(share), []uint16{53})
			n.waitUplinks(tc.hook + " br1")
			st := n.hooks()
			if len(st) != 1 || !strings.Contains(st[0].Mode, tc.mode) {
				t.Errorf("the bridge's hook %+v, want mode %q", st, tc.mode)
			}
			s := n.stream(up, 53, 2*share)
			time.Sleep(settle)
			n.admitted("through the bridge", s, time.Now(), rigWindow, share)
		})
	}
}
