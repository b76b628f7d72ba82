package attach

import (
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// LocalAddresses lists the addresses of the caller's network namespace's
// interfaces (the node's own), and the endpoints the node delivers to: the
// local pods' addresses that FindEndpointsIn finds behind an interface of
// their own, each with its interface. It reads only. Adding or removing an address
// also changes the local routing table, whose events Watch reports.
func (a *Attacher) LocalAddresses() (node []netip.Addr, endpoints []Endpoint, err error) {
	nl, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, nil, fmt.Errorf("list local addresses: netlink: %w", err)
	}
	defer nl.Close()
	addrs, err := nl.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, nil, fmt.Errorf("list local addresses: %w", err)
	}
	for _, ad := range addrs {
		if ad.IPNet == nil {
			continue
		}
		if ip, ok := netip.AddrFromSlice(ad.IP); ok {
			node = append(node, ip.Unmap())
		}
	}
	eps, err := a.FindEndpointsIn([]netip.Prefix{netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("::/0")})
	if err != nil {
		return node, nil, fmt.Errorf("list local addresses: %w", err)
	}
	for _, e := range eps {
		if e.Iface != "" {
			endpoints = append(endpoints, e)
		}
	}
	return node, endpoints, nil
}

// InterfaceMAC returns the index and MAC address of the interface name in
// the caller's network namespace.
func (a *Attacher) InterfaceMAC(name string) (int, net.HardwareAddr, error) {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return 0, nil, fmt.Errorf("interface %s: %w", name, err)
	}
	return l.Attrs().Index, l.Attrs().HardwareAddr, nil
}
