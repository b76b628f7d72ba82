package agent

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"

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
	var err error
	if l.Unit, err = lookup("unit", units, spec.Unit); err != nil {
		return maps.Limit{}, err
	}
	if l.Action, err = lookup("action", actions, spec.Action); err != nil {
		return maps.Limit{}, err
	}
	if l.Action == maps.Pace {
		l.Horizon = v1alpha1.DefaultHorizon
		if spec.Horizon != nil {
			l.Horizon = spec.Horizon.Duration
		}
	}
	if l.Key, err = lookup("key", keys, spec.Key); err != nil {
		return maps.Limit{}, err
	}
	if l.Key == maps.KeySrcPrefix || l.Key == maps.KeyDstPrefix {
		// Default gave a prefix key both lengths.
		l.Prefix4, l.Prefix6 = spec.PrefixLength.IPv4, spec.PrefixLength.IPv6
	}

	// Where the limit runs: the caller has resolved endpoints to uplink
	// where the endpoints have no interface of their own.
	if l.Match.Attach, err = lookup("attach", attaches, spec.Attach); err != nil {
		return maps.Limit{}, err
	}
	m := &spec.Match
	if l.Match.Direction, err = lookup("match.direction", directions, m.Direction); err != nil {
		return maps.Limit{}, err
	}
	if l.Match.Protocol, err = lookup("match.protocol", protocols, m.Protocol); err != nil {
		return maps.Limit{}, err
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

// The data path's value of each of the config's enums: one table each.
// TestEnumTables fails when a value api/v1alpha1 accepts has none here, or
// when the data path names a value no config word maps to.
var (
	units      = map[v1alpha1.Unit]maps.Unit{v1alpha1.UnitPackets: maps.Packets, v1alpha1.UnitBytes: maps.Bytes, v1alpha1.UnitConnections: maps.Connections}
	actions    = map[v1alpha1.Action]maps.Action{v1alpha1.ActionDrop: maps.Drop, v1alpha1.ActionShadow: maps.Shadow, v1alpha1.ActionPace: maps.Pace, v1alpha1.ActionReject: maps.Reject}
	keys       = map[v1alpha1.Key]maps.KeyKind{v1alpha1.KeyNone: maps.KeyNone, v1alpha1.KeySrcIP: maps.KeySrcIP, v1alpha1.KeyDstIP: maps.KeyDstIP, v1alpha1.KeySrcPrefix: maps.KeySrcPrefix, v1alpha1.KeyDstPrefix: maps.KeyDstPrefix, v1alpha1.KeyDstPort: maps.KeyDstPort}
	attaches   = map[v1alpha1.Attach]maps.Attach{v1alpha1.AttachUplink: maps.Uplink, v1alpha1.AttachEndpoints: maps.Endpoints}
	directions = map[v1alpha1.Direction]maps.Direction{v1alpha1.DirectionIngress: maps.Ingress, v1alpha1.DirectionEgress: maps.Egress}
	protocols  = map[v1alpha1.Protocol]maps.Protocol{v1alpha1.ProtocolAny: maps.AnyProtocol, v1alpha1.ProtocolTCP: maps.TCP, v1alpha1.ProtocolUDP: maps.UDP, v1alpha1.ProtocolICMP: maps.ICMP}
)

// lookup is the data path's value of a config word (defaulted: an empty
// one is an error too), or an error naming the field.
func lookup[K ~string, V any](field string, table map[K]V, k K) (V, error) {
	v, ok := table[k]
	if !ok {
		return v, fmt.Errorf("%s: %q is not supported by the data path", field, k)
	}
	return v, nil
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

// bucketOfKey is the data path's bucket of a key of spec's limit as the
// nodes report it and the allocation lists it (v1alpha1's key format).
func bucketOfKey(spec *v1alpha1.RateLimitSpec, key string) (maps.Bucket, error) {
	key, err := spec.CanonicalKey(key)
	if err != nil {
		return maps.Bucket{}, err
	}
	switch spec.Key {
	case v1alpha1.KeySrcPrefix, v1alpha1.KeyDstPrefix:
		p := netip.MustParsePrefix(key)
		return maps.Bucket{Addr: p.Addr(), Prefix: p.Bits()}, nil
	case v1alpha1.KeyDstPort:
		proto, port, _ := strings.Cut(key, "/")
		n, _ := strconv.ParseUint(port, 10, 16)
		return maps.Bucket{Protocol: protocols[v1alpha1.Protocol(proto)], Port: uint16(n)}, nil
	}
	return maps.Bucket{Addr: netip.MustParseAddr(key)}, nil
}

// keyOfBucket is a bucket's key in v1alpha1's key format, bucketOfKey's
// inverse.
func keyOfBucket(b maps.Bucket) string {
	switch {
	case !b.Addr.IsValid():
		return b.Protocol.String() + "/" + strconv.FormatUint(uint64(b.Port), 10)
	case b.Prefix > 0:
		return netip.PrefixFrom(b.Addr, b.Prefix).Masked().String()
	}
	return b.Addr.String()
}
