package httplimit

import (
	"net/http"
	"net/netip"
	"strings"
)

// A KeyFunc gives a request's key for one limit of the Set: the bucket of
// a keyed limit it draws from. Requests with the same key share a bucket;
// "" is a key like any other.
type KeyFunc func(r *http.Request) string

// ClientIP is the address of the connection's remote end (r.RemoteAddr,
// without its port): the client, or the last proxy in front of the server.
// It never reads X-Forwarded-For; see [Client] for servers behind proxies.
// IPv4-mapped IPv6 addresses are keyed as IPv4, zones are dropped. A
// RemoteAddr that is not an address (a Unix socket) is the key as is.
func ClientIP(r *http.Request) string {
	return clientKey(r, 32, 128, nil)
}

// ClientPrefix keys a request by the network of its remote address: the
// first v4bits bits of an IPv4 address, v6bits of an IPv6 one (for
// example 24 and 64: one bucket per IPv4 /24 and per IPv6 /64, the usual
// allocation to one site). The key is the prefix, as "192.0.2.0/24".
// Bits out of range are clamped (0 to 32, 0 to 128).
func ClientPrefix(v4bits, v6bits int) KeyFunc {
	return Client(ClientOptions{V4Bits: v4bits, V6Bits: v6bits})
}

// ClientOptions say how Client keys a request by its client's address.
type ClientOptions struct {
	// V4Bits and V6Bits are the prefix lengths the address is cut to.
	// (Optional) 0 means the whole address (32, 128).
	V4Bits, V6Bits int
	// TrustedProxies are the proxies whose X-Forwarded-For this server
	// believes. A request whose remote address is in one of them is keyed
	// by X-Forwarded-For instead: the rightmost address in it that is not
	// a trusted proxy (each trusted proxy appends the address it got the
	// request from; anything left of the first untrusted one could have
	// been written by the client). If every address in it is trusted, the
	// leftmost is the key; an entry that is not an address stops the walk
	// at the last good one. (Optional) nil: X-Forwarded-For is never read,
	// since any client can send one.
	TrustedProxies []netip.Prefix
}

// Client returns a KeyFunc that keys a request by its client's address,
// as opts say. Client(ClientOptions{}) is ClientIP.
func Client(opts ClientOptions) KeyFunc {
	v4, v6 := opts.V4Bits, opts.V6Bits
	if v4 == 0 {
		v4 = 32
	}
	if v6 == 0 {
		v6 = 128
	}
	v4, v6 = min(32, max(0, v4)), min(128, max(0, v6))
	trusted := append([]netip.Prefix(nil), opts.TrustedProxies...)
	for i, p := range trusted {
		trusted[i] = p.Masked()
	}
	return func(r *http.Request) string { return clientKey(r, v4, v6, trusted) }
}

// Header returns a KeyFunc that keys a request by the value of its header
// name (the first, if it has several); a request without it gets "". Use
// it for a header the server trusts: an API key that an authenticating
// proxy checked, a tenant set by a gateway.
func Header(name string) KeyFunc {
	name = http.CanonicalHeaderKey(name)
	return func(r *http.Request) string {
		if v := r.Header[name]; len(v) > 0 {
			return v[0]
		}
		return ""
	}
}

// clientKey is the key of r's client address, cut to v4 or v6 bits.
func clientKey(r *http.Request, v4, v6 int, trusted []netip.Prefix) string {
	addr, ok := parseAddr(r.RemoteAddr)
	if !ok {
		return r.RemoteAddr
	}
	if len(trusted) > 0 && inAny(addr, trusted) {
		addr = forwardedFor(r.Header.Values("X-Forwarded-For"), addr, trusted)
	}
	bits := v6
	if addr.Is4() {
		bits = v4
	}
	if bits == addr.BitLen() {
		return addr.String()
	}
	p, err := addr.Prefix(bits)
	if err != nil {
		return addr.String()
	}
	return p.String()
}

// forwardedFor walks the X-Forwarded-For lines from the right (the entry
// the nearest proxy appended) and returns the first address that is not a
// trusted proxy; proxy is the remote address, a trusted one.
func forwardedFor(lines []string, proxy netip.Addr, trusted []netip.Prefix) netip.Addr {
	last := proxy
	for i := len(lines) - 1; i >= 0; i-- {
		line := lines[i]
		for line != "" {
			entry := line
			if c := strings.LastIndexByte(line, ','); c >= 0 {
				entry, line = line[c+1:], line[:c]
			} else {
				line = ""
			}
			entry = strings.TrimSpace(entry)
			if entry == "" {
				continue
			}
			addr, ok := parseAddr(entry)
			if !ok {
				return last
			}
			if !inAny(addr, trusted) {
				return addr
			}
			last = addr
		}
	}
	return last
}

// parseAddr parses "ip", "ip:port" or "[ip]:port", unmapping IPv4-mapped
// IPv6 and dropping the zone.
func parseAddr(s string) (netip.Addr, bool) {
	addr, err := netip.ParseAddr(s)
	if err != nil {
		ap, err := netip.ParseAddrPort(s)
		if err != nil {
			return netip.Addr{}, false
		}
		addr = ap.Addr()
	}
	return addr.Unmap().WithZone(""), true
}

func inAny(addr netip.Addr, prefixes []netip.Prefix) bool {
	for _, p := range prefixes {
		if p.Contains(addr) {
			return true
		}
	}
	return false
}
