package v1alpha1

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// A key of a keyed limit as the nodes report it and status.allocation.keys
// lists it: the address (src-ip, dst-ip: 192.0.2.1, 2001:db8::1), the
// network, masked to the limit's prefix length (src-prefix, dst-prefix:
// 192.0.2.0/24), or the protocol and destination port (dst-port: tcp/443,
// udp/53; a packet without ports is port 0 of its class: tcp/0, udp/0,
// icmp/0, any/0). An IPv4-mapped IPv6 address is written as IPv4.

// MaxKeyLength is the longest key CanonicalKey returns (an IPv6 network).
const MaxKeyLength = len("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff/128")

// CanonicalKey checks that key is one of s's keys (s defaulted) and returns
// it as the agents write it. Keys from another node's report are checked
// with it before they count: a key that is not one cannot reach the status.
func (s *RateLimitSpec) CanonicalKey(key string) (string, error) {
	if len(key) > MaxKeyLength {
		return "", fmt.Errorf("key of %d bytes: longer than any %s key", len(key), s.Key)
	}
	switch s.Key {
	case KeySrcIP, KeyDstIP:
		a, err := netip.ParseAddr(key)
		if err != nil || a.Zone() != "" {
			return "", fmt.Errorf("key %q: not an IP address", key)
		}
		return a.Unmap().String(), nil
	case KeySrcPrefix, KeyDstPrefix:
		p, err := netip.ParsePrefix(key)
		if err != nil {
			return "", fmt.Errorf("key %q: not a network", key)
		}
		a := p.Addr().Unmap()
		bits := p.Bits()
		if p.Addr().Is4In6() {
			bits -= 96
		}
		want := 0
		if s.PrefixLength != nil {
			want = int(s.PrefixLength.IPv6)
			if a.Is4() {
				want = int(s.PrefixLength.IPv4)
			}
		}
		if bits != want {
			return "", fmt.Errorf("key %q: the limit's prefix length is /%d", key, want)
		}
		m, err := a.Prefix(bits)
		if err != nil {
			return "", fmt.Errorf("key %q: %w", key, err)
		}
		return m.String(), nil
	case KeyDstPort:
		proto, port, ok := strings.Cut(key, "/")
		n, err := strconv.ParseUint(port, 10, 16)
		if !ok || err != nil {
			return "", fmt.Errorf("key %q: not protocol/port (tcp/443)", key)
		}
		switch Protocol(proto) {
		case ProtocolTCP, ProtocolUDP:
		case ProtocolICMP, ProtocolAny:
			if n != 0 {
				return "", fmt.Errorf("key %q: %s packets have no port (%s/0)", key, proto, proto)
			}
		default:
			return "", fmt.Errorf("key %q: protocol %s", key, notOneOf(Protocol(proto), Protocols))
		}
		return proto + "/" + strconv.FormatUint(n, 10), nil
	}
	return "", fmt.Errorf("key %q: the limit has key %s", key, s.Key)
}
