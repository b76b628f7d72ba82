package attach

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Uplink is an interface Uplinks found, and why it is one.
type Uplink struct {
	Name string
	// Type is the kind of link (netlink's word: device, veth, bond, vlan,
	// bridge, ...): bonds, VLANs and bridges may have no native XDP.
	Type string
	// Why are the reasons: "default route (IPv4)", "default route (IPv6)",
	// "host address 10.0.0.5".
	Why []string
}

// ErrNoUplinks is Uplinks finding none: no default route and no interface
// that holds a host address.
var ErrNoUplinks = errors.New("no uplink: no default route in the main table and no interface holds a host address")

// Uplinks finds the node's uplinks in the caller's network namespace: the
// interfaces of the default routes of the main routing table, IPv4 and
// IPv6 (each next hop of a multipath route), then those that hold one of
// hostIPs (the node's InternalIP: a node whose default route leaves
// through a management interface still receives its cluster traffic
// there). Loopback never counts: a node address on lo (anycast, BGP) is
// reached through the interfaces of the routes. It reads only; the
// answer changes with the routes and addresses, whose events Watch
// reports. With nothing found it returns ErrNoUplinks.
func Uplinks(hostIPs []netip.Addr) ([]Uplink, error) {
	nl, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("find uplinks: netlink: %w", err)
	}
	defer nl.Close()

	var out []Uplink
	add := func(index int, why string) error {
		l, err := nl.LinkByIndex(index)
		if err != nil {
			var nf netlink.LinkNotFoundError
			if errors.As(err, &nf) {
				return nil // deleted since the dump: the next event says so
			}
			return fmt.Errorf("find uplinks: link %d: %w", index, err)
		}
		a := l.Attrs()
		if a.Flags&net.FlagLoopback != 0 {
			return nil
		}
		if i := slices.IndexFunc(out, func(u Uplink) bool { return u.Name == a.Name }); i >= 0 {
			if !slices.Contains(out[i].Why, why) {
				out[i].Why = append(out[i].Why, why)
			}
			return nil
		}
		out = append(out, Uplink{Name: a.Name, Type: l.Type(), Why: []string{why}})
		return nil
	}

	for _, fam := range []struct {
		family int
		name   string
	}{{netlink.FAMILY_V4, "IPv4"}, {netlink.FAMILY_V6, "IPv6"}} {
		routes, err := nl.RouteListFiltered(fam.family, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
		if err != nil {
			return nil, fmt.Errorf("find uplinks: list %s routes: %w", fam.name, err)
		}
		var links []int
		for _, r := range routes {
			if !isDefault(r) || r.Type != unix.RTN_UNICAST {
				continue // an unreachable or blackhole default leaves through nothing
			}
			if r.LinkIndex > 0 {
				links = append(links, r.LinkIndex)
			}
			for _, nh := range r.MultiPath {
				if nh.LinkIndex > 0 {
					links = append(links, nh.LinkIndex)
				}
			}
		}
		slices.Sort(links)
		for _, idx := range slices.Compact(links) {
			if err := add(idx, "default route ("+fam.name+")"); err != nil {
				return nil, err
			}
		}
	}

	if len(hostIPs) > 0 {
		addrs, err := nl.AddrList(nil, netlink.FAMILY_ALL)
		if err != nil {
			return nil, fmt.Errorf("find uplinks: list addresses: %w", err)
		}
		for _, want := range hostIPs {
			for _, ad := range addrs {
				ip, ok := netip.AddrFromSlice(ad.IP)
				if ad.IPNet == nil || !ok || ip.Unmap() != want.Unmap() {
					continue
				}
				if err := add(ad.LinkIndex, "host address "+want.String()); err != nil {
					return nil, err
				}
			}
		}
	}
	if len(out) == 0 {
		return nil, ErrNoUplinks
	}
	return out, nil
}

// isDefault reports whether r is a default route: no destination, or a
// destination of length 0.
func isDefault(r netlink.Route) bool {
	if r.Dst == nil {
		return true
	}
	ones, _ := r.Dst.Mask.Size()
	return ones == 0
}

// String is "eth0 (device: default route (IPv4), host address 10.0.0.5)".
func (u Uplink) String() string {
	return u.Name + " (" + u.Type + ": " + strings.Join(u.Why, ", ") + ")"
}
