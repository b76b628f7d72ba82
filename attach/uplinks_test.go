package attach

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// Uplinks reads the default routes of both families (each next hop of a
// multipath route; not a blackhole), then the interfaces of the host's
// addresses, never loopback, each once with every reason.
func TestUplinks(t *testing.T) {
	testenv.RequireRoot(t)
	ns := nettest.MustNS(t, "uplinks")
	nl, err := ns.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	// Three veth pairs inside the namespace: a, b and c are the uplinks'
	// names, their peers are never routed through.
	index := map[string]int{}
	for i, name := range []string{"a", "b", "c"} {
		if err := nl.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name + "-peer"}); err != nil {
			t.Fatal(err)
		}
		l, err := nl.LinkByName(name)
		if err != nil {
			t.Fatal(err)
		}
		if err := nl.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
		p, _ := nl.LinkByName(name + "-peer")
		nl.LinkSetUp(p)
		index[name] = l.Attrs().Index
		for _, a := range []string{fmt.Sprintf("10.212.%d.2/24", i+1), fmt.Sprintf("fd00:212:%d::2/64", i+1)} {
			addr, _ := netlink.ParseAddr(a)
			addr.Flags = unix.IFA_F_NODAD
			if err := nl.AddrAdd(l, addr); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := ns.WaitReady(testenv.Timeout(5 * time.Second)); err != nil {
		t.Fatal(err)
	}
	lo, _ := nl.LinkByName("lo")
	nl.LinkSetUp(lo)
	uplinks := func(hostIPs ...string) ([]string, error) {
		t.Helper()
		var ips []netip.Addr
		for _, s := range hostIPs {
			ips = append(ips, netip.MustParseAddr(s))
		}
		var got []Uplink
		err := ns.Do(func() (err error) {
			got, err = Uplinks(ips)
			return err
		})
		var out []string
		for _, u := range got {
			out = append(out, u.Name+": "+strings.Join(u.Why, ", "))
		}
		return out, err
	}
	check := func(what string, want []string, hostIPs ...string) {
		t.Helper()
		got, err := uplinks(hostIPs...)
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("%s: %q (%v), want %q", what, got, err, want)
		}
	}

	if got, err := uplinks(); !errors.Is(err, ErrNoUplinks) {
		t.Errorf("no default route: %q (%v), want ErrNoUplinks", got, err)
	}
	// 127.0.0.1 on lo is the node's, but lo is never an uplink.
	if got, err := uplinks("127.0.0.1"); !errors.Is(err, ErrNoUplinks) {
		t.Errorf("a host address on lo: %q (%v), want ErrNoUplinks", got, err)
	}

	v4 := &netlink.Route{Dst: &net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}, LinkIndex: index["a"],
		Gw: net.ParseIP("10.212.1.1")}
	if err := nl.RouteAdd(v4); err != nil {
		t.Fatal(err)
	}
	v6 := &netlink.Route{Dst: &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}, MultiPath: []*netlink.NexthopInfo{
		{LinkIndex: index["c"], Gw: net.ParseIP("fd00:212:3::1")},
		{LinkIndex: index["b"], Gw: net.ParseIP("fd00:212:2::1")},
	}}
	if err := nl.RouteAdd(v6); err != nil {
		t.Fatal(err)
	}
	check("IPv4 via a, IPv6 multipath via b and c", []string{"a: default route (IPv4)", "b: default route (IPv6)", "c: default route (IPv6)"})
	check("and the host's addresses", []string{"a: default route (IPv4), host address 10.212.1.2", "b: default route (IPv6)",
		"c: default route (IPv6), host address fd00:212:3::2"}, "10.212.1.2", "fd00:212:3::2", "192.0.2.1")

	// A blackhole default route leaves through nothing; a route to a
	// prefix is no default route.
	if err := nl.RouteDel(v4); err != nil {
		t.Fatal(err)
	}
	if err := nl.RouteAdd(&netlink.Route{Dst: v4.Dst, Type: unix.RTN_BLACKHOLE}); err != nil {
		t.Fatal(err)
	}
	if err := nl.RouteAdd(&netlink.Route{Dst: &net.IPNet{IP: net.IPv4(198, 51, 100, 0).To4(), Mask: net.CIDRMask(24, 32)},
		LinkIndex: index["a"], Gw: net.ParseIP("10.212.1.1")}); err != nil {
		t.Fatal(err)
	}
	check("a blackhole IPv4 default", []string{"b: default route (IPv6)", "c: default route (IPv6)"})
}
