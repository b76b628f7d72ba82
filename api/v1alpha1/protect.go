package v1alpha1

import (
	"net/netip"
	"slices"
)

// Protect is traffic that no limit touches: the node's lifeline (SSH, the
// kubelet, a monitoring scraper). Protected packets pass before any limit is
// looked at, so a limit that matches everything (or `rlagent limits set x
// --rate 1`) cannot cut the node off the connection that would carry the fix.
//
// A packet is protected when its peer (the source address of an ingress
// packet, the destination of an egress one) is in Peers, or Peers is empty,
// and:
//   - the rule lists no ports: every packet of those peers, whatever its
//     protocol;
//   - otherwise it is a TCP or UDP packet (as Protocol says) whose local
//     port (the destination port of an ingress packet) is in LocalPorts, or
//     whose remote port (the source port of an ingress packet) is in
//     RemotePorts.
//
// Protection is node policy, so it lives in the config file only; the
// RateLimit custom resource has no such field.
type Protect struct {
	// Name identifies the rule in logs and errors.
	// (Required) 1..63 lowercase letters, digits and '-', starting and ending
	// with a letter or digit; unique among the protect rules.
	Name string `json:"name"`

	// Protocol is the transport protocol the ports are of.
	// (Optional) any | tcp | udp; default any (TCP and UDP). Only with
	// localPorts or remotePorts: a rule without ports protects every packet
	// of its peers, whatever the protocol.
	Protocol Protocol `json:"protocol,omitempty"`

	// Peers are the networks at the other end, IPv4 or IPv6; a bare address
	// means /32 or /128.
	// (Optional) Empty: every peer. 0.0.0.0/0 or ::/0 only with ports.
	Peers []string `json:"peers,omitempty"`

	// LocalPorts are ports on this node, each "22" or a range "8000-8080":
	// the destination port of an ingress packet (a service the node serves,
	// such as SSH).
	// (Optional) Ports 0..65535.
	LocalPorts []string `json:"localPorts,omitempty"`

	// RemotePorts are ports at the peer, as LocalPorts: the source port of an
	// ingress packet (a service the node connects to, such as an API
	// server).
	// (Optional) Ports 0..65535.
	RemotePorts []string `json:"remotePorts,omitempty"`
}

// Bounds of the protect list. The data path holds MaxProtectRules rules
// (maps.MaxProtectRules, a test checks they agree); one of them is kept for
// the agent's own API server connection.
const (
	MaxProtectRules = 32
	MaxProtect      = MaxProtectRules - 1
	// MaxProtectPeers and MaxProtectPorts bound one rule's lists, as a
	// limit's match lists are bounded.
	MaxProtectPeers = 256
	MaxProtectPorts = 64
)

// ProtectProtocols are the valid protocols of a protect rule, in the order
// error messages list them.
var ProtectProtocols = []Protocol{ProtocolAny, ProtocolTCP, ProtocolUDP}

// Default applies a protect rule's defaults. It is idempotent.
func (p *Protect) Default() {
	if p.Protocol == "" {
		p.Protocol = ProtocolAny
	}
}

// DefaultProtect is the protect list of a file that does not say protect:
// SSH to the node (tcp, local port 22) from every peer, so that a limit
// that matches everything (rlagent limits set x --rate 1) does not cut off
// the administrator who would remove it. protect: [] turns it off.
func DefaultProtect() []Protect {
	return []Protect{{Name: "ssh", Protocol: ProtocolTCP, LocalPorts: []string{"22"}}}
}

// ProtectOff reports whether a defaulted config protects nothing of its
// own: protect: [] in the file. The agent warns at every start and reload.
func (c *Config) ProtectOff() bool {
	return len(c.Protect) == 0
}

// ProtectOffWarning is what the agent logs while ProtectOff.
const ProtectOffWarning = "protect is empty ([]): no traffic is protected from the limits, not even SSH; a limit can cut the node off the connection that would carry the fix (leave protect out for the default rule ssh, tcp port 22)"

// ProtectsLocalTCP reports whether the protect list exempts TCP to the
// node's local port from every peer, and names the rule that does.
func (c *Config) ProtectsLocalTCP(port uint16) (string, bool) {
	for _, p := range c.Protect {
		if p.Protocol == ProtocolUDP || !everyPeer(p.Peers) {
			continue
		}
		for _, s := range p.LocalPorts {
			if first, last, err := ParsePortRange(s); err == nil && first <= port && port <= last {
				return p.Name, true
			}
		}
	}
	return "", false
}

// everyPeer reports whether a protect rule's peers are every address of
// both families.
func everyPeer(peers []string) bool {
	if len(peers) == 0 {
		return true
	}
	var v4, v6 bool
	for _, s := range peers {
		if p, err := ParseCIDR(s); err == nil && p.Bits() == 0 {
			v4, v6 = v4 || p.Addr().Is4(), v6 || !p.Addr().Is4()
		}
	}
	return v4 && v6
}

// ProtectsAPIServer reports whether the agent protects its own API server
// connection: unless protectAPIServer is false, it does.
func (c *Config) ProtectsAPIServer() bool {
	return c.ProtectAPIServer == nil || *c.ProtectAPIServer
}

// validateProtect checks the protect list of a defaulted config.
func (c *Config) validateProtect() []error {
	var el errorList
	if len(c.Protect) > MaxProtect {
		el.add("protect", "%d rules is more than %d: the data path holds %d and keeps one for the agent's API server connection",
			len(c.Protect), MaxProtect, MaxProtectRules)
	}
	names := make(map[string]int)
	for i := range c.Protect {
		p := &c.Protect[i]
		at := index("protect", i)
		el.uniqueName("protect", i, p.Name, names)
		el = append(el, p.validate(at)...)
	}
	return el
}

func (p *Protect) validate(at string) []error {
	var el errorList
	hasPorts := len(p.LocalPorts) > 0 || len(p.RemotePorts) > 0
	switch p.Protocol {
	case ProtocolAny:
	case ProtocolTCP, ProtocolUDP:
		if !hasPorts {
			el.add(field(at, "protocol"), "%q needs localPorts or remotePorts: a rule without ports protects every packet of its peers, whatever the protocol", p.Protocol)
		}
	default:
		el.add(field(at, "protocol"), "%s", notOneOf(p.Protocol, ProtectProtocols))
	}

	if len(p.Peers) > MaxProtectPeers {
		el.add(field(at, "peers"), "%d networks is more than %d", len(p.Peers), MaxProtectPeers)
	}
	everyPeer := len(p.Peers) == 0
	for i, s := range p.Peers {
		pfx, err := ParseCIDR(s)
		if err != nil {
			el.add(index(field(at, "peers"), i), "%v", err)
			continue
		}
		if pfx.Bits() != 0 {
			continue
		}
		everyPeer = true
		if !hasPorts {
			el.add(index(field(at, "peers"), i), "%q without localPorts or remotePorts would protect every %s packet and so disable every limit for it: list the peers' networks, or add ports",
				s, family(pfx))
		}
	}

	for _, list := range []struct {
		name  string
		ports []string
	}{{"localPorts", p.LocalPorts}, {"remotePorts", p.RemotePorts}} {
		if len(list.ports) > MaxProtectPorts {
			el.add(field(at, list.name), "%d entries is more than %d", len(list.ports), MaxProtectPorts)
		}
		var spans []portSpan
		for i, s := range list.ports {
			first, last, err := ParsePortRange(s)
			if err != nil {
				el.add(index(field(at, list.name), i), "%v", err)
				continue
			}
			spans = append(spans, portSpan{first, last})
		}
		if everyPeer && coversEveryPort(spans) {
			el.add(field(at, list.name), "covers every port 0..65535 for every peer: the rule would protect every %s packet and so disable every limit for it; narrow the ports or list peers",
				protocolWords(p.Protocol))
		}
	}

	if !hasPorts && len(p.Peers) == 0 {
		el.add(at, "protects nothing in particular: set peers, localPorts or remotePorts (a rule with none would protect every packet)")
	}
	return el
}

type portSpan struct{ first, last uint16 }

// coversEveryPort reports whether the spans together cover 0..65535.
func coversEveryPort(spans []portSpan) bool {
	s := slices.Clone(spans)
	slices.SortFunc(s, func(a, b portSpan) int { return int(a.first) - int(b.first) })
	next := 0 // the first port not yet covered
	for _, r := range s {
		if int(r.first) > next {
			return false
		}
		next = max(next, int(r.last)+1)
	}
	return next > 65535
}

func family(p netip.Prefix) string {
	if p.Addr().Is4() {
		return "IPv4"
	}
	return "IPv6"
}

func protocolWords(p Protocol) string {
	switch p {
	case ProtocolTCP:
		return "TCP"
	case ProtocolUDP:
		return "UDP"
	}
	return "TCP and UDP"
}
