package agent

import (
	"fmt"
	"net/netip"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/divide"
	"github.com/rlagent/rlagent/maps"
)

// toMapsLimit turns a spec and this node's share (already fitted to the
// data path's range, see fit) into the data path's limit.
//
// Defaults live in one place, RateLimitSpec.Default: the spec is defaulted
// here (a copy; Default is idempotent), so a field left empty means what
// docs/config.md says, and every value the data path does not know is an
// error, never a silent fallback (an unknown protocol is not "any").
func toMapsLimit(in *v1alpha1.RateLimitSpec, share divide.Share) (maps.Limit, error) {
	spec := in.DeepCopy()
	spec.Default()
	l := maps.Limit{Rate: share.Rate, Burst: share.Burst}
	if l.Rate == 0 {
		l.Burst = 0 // a share of 0 admits nothing
	}
	// Rounding the share down can leave a burst longer than the data path
	// takes (e.g. burst 36000 over rate 10 and 3 replicas): clamp it.
	if l.Rate > 0 && l.Burst > maps.MaxBurstSeconds*l.Rate {
		l.Burst = maps.MaxBurstSeconds * l.Rate
	}
	if l.Rate > maps.MaxRate {
		return maps.Limit{}, fmt.Errorf("rate: node share %d is above the data path's maximum of %d units/s per node", l.Rate, maps.MaxRate)
	}
	switch spec.Unit {
	case v1alpha1.UnitBytes:
		l.Unit = maps.Bytes
	case v1alpha1.UnitPackets:
		l.Unit = maps.Packets
	case v1alpha1.UnitConnections:
		l.Unit = maps.Connections
	default:
		return maps.Limit{}, fmt.Errorf("unit: %q is not supported by the data path", spec.Unit)
	}
	switch spec.Action {
	case v1alpha1.ActionShadow:
		l.Action = maps.Shadow
	case v1alpha1.ActionDrop:
		l.Action = maps.Drop
	case v1alpha1.ActionReject:
		l.Action = maps.Reject
	case v1alpha1.ActionPace:
		l.Action = maps.Pace
		l.Horizon = v1alpha1.DefaultHorizon
		if spec.Horizon != nil {
			l.Horizon = spec.Horizon.Duration
		}
	default:
		return maps.Limit{}, fmt.Errorf("action: %q is not supported by the data path", spec.Action)
	}
	switch spec.Key {
	case v1alpha1.KeyNone:
		l.Key = maps.KeyNone
	case v1alpha1.KeySrcIP:
		l.Key = maps.KeySrcIP
	case v1alpha1.KeyDstIP:
		l.Key = maps.KeyDstIP
	case v1alpha1.KeyDstPort:
		l.Key = maps.KeyDstPort
	case v1alpha1.KeySrcPrefix, v1alpha1.KeyDstPrefix:
		l.Key = maps.KeySrcPrefix
		if spec.Key == v1alpha1.KeyDstPrefix {
			l.Key = maps.KeyDstPrefix
		}
		// Default gave a prefix key both lengths.
		l.Prefix4, l.Prefix6 = spec.PrefixLength.IPv4, spec.PrefixLength.IPv6
	default:
		return maps.Limit{}, fmt.Errorf("key: %q is not supported by the data path", spec.Key)
	}

	// Where the limit runs: the caller has resolved endpoints to uplink
	// where the endpoints have no interface of their own.
	switch spec.Attach {
	case v1alpha1.AttachUplink:
		l.Match.Attach = maps.Uplink
	case v1alpha1.AttachEndpoints:
		l.Match.Attach = maps.Endpoints
	default:
		return maps.Limit{}, fmt.Errorf("attach: %q is not supported by the data path", spec.Attach)
	}
	m := &spec.Match
	switch m.Direction {
	case v1alpha1.DirectionIngress:
		l.Match.Direction = maps.Ingress
	case v1alpha1.DirectionEgress:
		l.Match.Direction = maps.Egress
	default:
		return maps.Limit{}, fmt.Errorf("match.direction: %q is not supported by the data path", m.Direction)
	}
	var err error
	if l.Match.Protocol, err = toMapsProtocol(m.Protocol); err != nil {
		return maps.Limit{}, fmt.Errorf("match.protocol: %w", err)
	}
	if l.Match.DstPorts, err = portRanges("match.dstPorts", m.DstPorts); err != nil {
		return maps.Limit{}, err
	}
	if l.Match.SrcCIDRs, err = prefixes("match.srcCIDRs", m.SrcCIDRs); err != nil {
		return maps.Limit{}, err
	}
	if l.Match.DstCIDRs, err = prefixes("match.dstCIDRs", m.DstCIDRs); err != nil {
		return maps.Limit{}, err
	}
	return l, nil
}

// toMapsProtocol is the data path's protocol for the config's (defaulted).
func toMapsProtocol(p v1alpha1.Protocol) (maps.Protocol, error) {
	switch p {
	case v1alpha1.ProtocolTCP:
		return maps.TCP, nil
	case v1alpha1.ProtocolUDP:
		return maps.UDP, nil
	case v1alpha1.ProtocolICMP:
		return maps.ICMP, nil
	case v1alpha1.ProtocolAny:
		return maps.AnyProtocol, nil
	}
	return 0, fmt.Errorf("%q is not supported by the data path", p)
}

// portRanges parses a list of ports and ranges ("53", "8000-8080").
func portRanges(field string, in []string) ([]maps.PortRange, error) {
	var out []maps.PortRange
	for i, s := range in {
		first, last, err := v1alpha1.ParsePortRange(s)
		if err != nil {
			return nil, fmt.Errorf("%s[%d]: %w", field, i, err)
		}
		out = append(out, maps.PortRange{First: first, Last: last})
	}
	return out, nil
}

// prefixes parses a list of CIDRs.
func prefixes(field string, in []string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for i, s := range in {
		p, err := v1alpha1.ParseCIDR(s)
		if err != nil {
			return nil, fmt.Errorf("%s[%d]: %w", field, i, err)
		}
		out = append(out, p)
	}
	return out, nil
}
