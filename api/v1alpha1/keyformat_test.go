package v1alpha1

import (
	"strings"
	"testing"
)

// TestCanonicalKey: the keys a node may report, in the form the agents
// write, and what a hostile or broken report may carry instead: another
// kind's key, a zone, another prefix length, a port out of range or on a
// protocol without ports, and bytes no key has.
func TestCanonicalKey(t *testing.T) {
	spec := func(key Key) *RateLimitSpec {
		s := &RateLimitSpec{Rate: 10, Key: key}
		s.Default()
		return s
	}
	for _, tc := range []struct {
		key       Key
		in, want  string
		wantError string
	}{
		{KeySrcIP, "192.0.2.1", "192.0.2.1", ""},
		{KeySrcIP, "::ffff:192.0.2.1", "192.0.2.1", ""},
		{KeyDstIP, "2001:DB8::1", "2001:db8::1", ""},
		{KeySrcIP, "fe80::1%eth0", "", "not an IP address"},
		{KeySrcIP, "192.0.2.0/24", "", "not an IP address"},
		{KeySrcIP, "", "", "not an IP address"},
		{KeySrcPrefix, "192.0.2.0/24", "192.0.2.0/24", ""},
		{KeySrcPrefix, "::ffff:192.0.2.0/120", "192.0.2.0/24", ""},
		{KeyDstPrefix, "2001:db8:1:2::/64", "2001:db8:1:2::/64", ""},
		{KeySrcPrefix, "192.0.2.7/24", "192.0.2.0/24", ""},
		{KeySrcPrefix, "192.0.2.0/25", "", "prefix length is /24"},
		{KeySrcPrefix, "192.0.2.1", "", "not a network"},
		{KeyDstPort, "tcp/443", "tcp/443", ""},
		{KeyDstPort, "udp/0", "udp/0", ""},
		{KeyDstPort, "tcp/0443", "tcp/443", ""},
		{KeyDstPort, "icmp/0", "icmp/0", ""},
		{KeyDstPort, "icmp/8", "", "have no port"},
		{KeyDstPort, "tcp/65536", "", "not protocol/port"},
		{KeyDstPort, "sctp/9", "", `"sctp" is not one of`},
		{KeyDstPort, "443", "", "not protocol/port"},
		{KeyNone, "192.0.2.1", "", "the limit has key none"},
		{KeySrcIP, strings.Repeat("1", 1<<20), "", "longer than any"},
	} {
		got, err := spec(tc.key).CanonicalKey(tc.in)
		switch {
		case tc.wantError == "" && (err != nil || got != tc.want):
			t.Errorf("%s: CanonicalKey(%.40q) = %q, %v; want %q", tc.key, tc.in, got, err, tc.want)
		case tc.wantError != "" && (err == nil || !strings.Contains(err.Error(), tc.wantError)):
			t.Errorf("%s: CanonicalKey(%.40q) = %q, %v; want an error with %q", tc.key, tc.in, got, err, tc.wantError)
		case len(got) > MaxKeyLength:
			t.Errorf("%s: CanonicalKey(%.40q) = %q: longer than MaxKeyLength %d", tc.key, tc.in, got, MaxKeyLength)
		}
	}
}
