package agent

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/attach"
	"github.com/rlagent/rlagent/maps"
)

// endpointPlacements finds where a limit with attach endpoints runs: the
// hook of each local endpoint's interface that sees the limit's traffic.
// spec is the limit as the data path will match it (a scope service limit
// with its endpoints filled in, see serviceSpec): its endpoints are the
// addresses on the endpoint's side of the match, dstCIDRs for ingress and
// srcCIDRs for egress. A bare address must be an endpoint with an interface
// of its own; a wider prefix is the endpoints found inside it.
//
// fallback is not empty when the limit cannot run at its endpoints (an
// endpoint without an interface of its own, such as a hostNetwork pod, or
// none found at all): it then runs at the uplink, and fallback says why.
// note tells of endpoints whose pod side could not be reached with
// endpointHook pod (enforced at their host side instead).
func (a *Agent) endpointPlacements(spec *v1alpha1.RateLimitSpec) (points []placement, fallback, note string) {
	dir, side := maps.Ingress, spec.Match.DstCIDRs
	if spec.Match.Direction == v1alpha1.DirectionEgress {
		dir, side = maps.Egress, spec.Match.SrcCIDRs
	}
	var addrs []netip.Addr
	var wide []netip.Prefix
	for _, c := range side {
		p, err := v1alpha1.ParseCIDR(c)
		if err != nil {
			continue // validation reports it
		}
		if p.IsSingleIP() {
			addrs = append(addrs, p.Addr())
		} else {
			wide = append(wide, p)
		}
	}
	if len(addrs) == 0 && len(wide) == 0 {
		return nil, "no endpoint addresses", ""
	}
	if a.att == nil {
		return nil, "no attacher (a unit test's agent)", ""
	}
	var found []attach.Endpoint
	if len(addrs) > 0 {
		eps, err := a.att.FindEndpoints(addrs)
		if err != nil {
			return nil, "the endpoints' interfaces could not be looked up: " + err.Error(), ""
		}
		for _, e := range eps {
			if e.Iface == "" {
				return nil, fmt.Sprintf("endpoint %s: %s", e.Addr, e.Reason), ""
			}
		}
		found = append(found, eps...)
	}
	if len(wide) > 0 {
		eps, err := a.att.FindEndpointsIn(wide)
		if err != nil {
			return nil, "the endpoints' interfaces could not be looked up: " + err.Error(), ""
		}
		n := 0
		for _, e := range eps {
			if e.Iface != "" {
				found = append(found, e)
				n++
			}
		}
		if n == 0 && len(addrs) == 0 {
			return nil, "no endpoint interface found in " + joinPrefixes(wide), ""
		}
	}

	hook := maps.Endpoints.Hook(dir)
	seen := make(map[string]bool)
	var unreached []string
	for _, e := range found {
		p := placement{hook: hook, point: attach.Point{Iface: e.Iface, Kind: attach.TCIngress}}
		if dir == maps.Ingress {
			// Traffic into the endpoint leaves the host through the
			// host side's egress hook, or enters the pod side.
			p.point.Kind = attach.TCEgress
			if a.cfg.EndpointHook == v1alpha1.EndpointHookPod {
				if pt, ok := e.Peer.Ingress(); ok {
					p.point = pt
				} else {
					unreached = append(unreached, fmt.Sprintf("%s (%s)", e.Addr, e.Peer.Reason))
				}
			}
		}
		if !seen[p.key()] {
			seen[p.key()] = true
			points = append(points, p)
		}
	}
	if len(unreached) > 0 {
		note = "endpointHook pod: the pod side of " + strings.Join(unreached, ", ") +
			" not found; enforced at the host side, which bpf_redirect_peer delivery skips"
	}
	return points, "", note
}

func joinPrefixes(ps []netip.Prefix) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = p.String()
	}
	return strings.Join(s, ", ")
}
