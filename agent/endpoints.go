package agent

import (
	"net/netip"

	"github.com/rlagent/rlagent/attach"
)

// findEndpoints asks the attacher where the endpoints of addrs and wide
// are (endpointQueries): the one lookup of the reconcile's plan that reads
// netlink. The placements are plan's (endpointPlacements).
func (a *Agent) findEndpoints(addrs []netip.Addr, wide []netip.Prefix) endpointTable {
	var t endpointTable
	if len(addrs) > 0 {
		eps, err := a.att.FindEndpoints(addrs)
		t.addrs, t.addrsErr = make(map[netip.Addr]attach.Endpoint, len(eps)), err
		for _, e := range eps {
			t.addrs[e.Addr] = e
		}
	}
	if len(wide) > 0 {
		t.in, t.inErr = a.att.FindEndpointsIn(wide)
	}
	return t
}
