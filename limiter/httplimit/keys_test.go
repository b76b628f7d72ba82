package httplimit

import (
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"
)

func TestClientKeys(t *testing.T) {
	proxies := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("fd00::/8")}
	behindProxies := Client(ClientOptions{TrustedProxies: proxies})
	prefixBehindProxies := Client(ClientOptions{V4Bits: 24, V6Bits: 48, TrustedProxies: proxies})
	for _, tc := range []struct {
		name   string
		remote string
		xff    []string
		key    KeyFunc
		want   string
	}{
		{name: "v4", remote: "192.0.2.7:5000", key: ClientIP, want: "192.0.2.7"},
		{name: "v6", remote: "[2001:db8::1]:443", key: ClientIP, want: "2001:db8::1"},
		{name: "v6 zone dropped", remote: "[fe80::1%eth0]:443", key: ClientIP, want: "fe80::1"},
		{name: "v4-mapped is v4", remote: "[::ffff:192.0.2.7]:5000", key: ClientIP, want: "192.0.2.7"},
		{name: "not an address", remote: "@", key: ClientIP, want: "@"},
		{name: "X-Forwarded-For ignored by default", remote: "192.0.2.7:5000", xff: []string{"198.51.100.1"}, key: ClientIP, want: "192.0.2.7"},
		{name: "X-Forwarded-For from an untrusted peer ignored", remote: "192.0.2.7:5000", xff: []string{"198.51.100.1"}, key: behindProxies, want: "192.0.2.7"},

		{name: "v4 /24", remote: "192.0.2.7:5000", key: ClientPrefix(24, 64), want: "192.0.2.0/24"},
		{name: "v6 /64", remote: "[2001:db8:1:2:3:4:5:6]:443", key: ClientPrefix(24, 64), want: "2001:db8:1:2::/64"},
		{name: "full lengths are addresses", remote: "192.0.2.7:5000", key: ClientPrefix(32, 128), want: "192.0.2.7"},
		{name: "out of range clamped", remote: "192.0.2.7:5000", key: ClientPrefix(99, -1), want: "192.0.2.7"},

		{name: "trusted proxy: the client", remote: "10.1.1.1:80", xff: []string{"198.51.100.1"}, key: behindProxies, want: "198.51.100.1"},
		{
			name: "trusted proxies: the rightmost untrusted", remote: "10.1.1.1:80",
			// The client wrote the first entry itself: it is not believed.
			xff: []string{"203.0.113.9, 198.51.100.1, 10.2.2.2"}, key: behindProxies, want: "198.51.100.1",
		},
		{
			name: "several header lines", remote: "10.1.1.1:80",
			xff: []string{"203.0.113.9", "198.51.100.1", "10.2.2.2, 10.3.3.3"}, key: behindProxies, want: "198.51.100.1",
		},
		{name: "all trusted: the leftmost", remote: "10.1.1.1:80", xff: []string{"10.9.9.9, 10.2.2.2"}, key: behindProxies, want: "10.9.9.9"},
		{name: "garbage stops the walk", remote: "10.1.1.1:80", xff: []string{"198.51.100.1, junk, 10.2.2.2"}, key: behindProxies, want: "10.2.2.2"},
		{name: "no header: the proxy", remote: "10.1.1.1:80", key: behindProxies, want: "10.1.1.1"},
		{name: "entry with a port", remote: "[fd00::1]:80", xff: []string{"[2001:db8::5]:1234"}, key: behindProxies, want: "2001:db8::5"},
		{name: "prefix of the forwarded client", remote: "10.1.1.1:80", xff: []string{"198.51.100.77"}, key: prefixBehindProxies, want: "198.51.100.0/24"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := httptest.NewRequest(http.MethodGet, "/", nil)
			r.RemoteAddr = tc.remote
			for _, v := range tc.xff {
				r.Header.Add("X-Forwarded-For", v)
			}
			if got := tc.key(r); got != tc.want {
				t.Fatalf("key = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestHeaderKey(t *testing.T) {
	key := Header("x-api-key")
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	if got := key(r); got != "" {
		t.Fatalf("no header: key = %q, want \"\"", got)
	}
	r.Header.Add("X-Api-Key", "alice")
	r.Header.Add("X-Api-Key", "bob")
	if got := key(r); got != "alice" {
		t.Fatalf("key = %q, want alice (the first)", got)
	}
}
