package maps

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/bpf"
)

// MaxProtectRules is how many protect rules the data path holds.
const MaxProtectRules = int(bpf.RatelimitRlConstRL_MAX_PROTECT)

// protectSide is where the remote ports start in rl_protect_ports.
const protectSide = int(bpf.RatelimitRlConstRL_PROTECT_SIDE)

// ProtectRule selects traffic that passes before any limit is looked at:
// the node's lifeline (its API server connection, SSH, the kubelet).
//
// A packet matches a rule when its peer (the source address on ingress,
// the destination on egress) is in Peers, or Peers is empty, and:
//   - the rule lists no ports: any packet of that peer matches, whatever
//     its protocol (ICMP and packets whose transport header cannot be found
//     included);
//   - otherwise it is a TCP or UDP packet of Protocol (AnyProtocol: both)
//     whose local port (destination on ingress, source on egress) is in
//     LocalPorts or whose remote port (source on ingress, destination on
//     egress) is in RemotePorts.
type ProtectRule struct {
	Protocol    Protocol
	Peers       []netip.Prefix
	LocalPorts  []PortRange
	RemotePorts []PortRange
}

// validate reports the first thing the data path cannot take.
func (r *ProtectRule) validate() error {
	switch r.Protocol {
	case AnyProtocol, TCP, UDP:
	default:
		return fmt.Errorf("protocol: %d is not one of any, tcp, udp", r.Protocol)
	}
	if len(r.LocalPorts)+len(r.RemotePorts) == 0 {
		if len(r.Peers) == 0 {
			return errors.New("names neither ports nor peers: it would protect every packet")
		}
		for _, p := range r.Peers {
			if p.Bits() == 0 {
				return fmt.Errorf("peers: %s without ports protects every packet of its family", p)
			}
		}
	}
	for _, l := range [][]PortRange{r.LocalPorts, r.RemotePorts} {
		for i, pr := range l {
			if pr.First > pr.Last {
				return fmt.Errorf("ports[%d]: %d-%d is not a range (first > last)", i, pr.First, pr.Last)
			}
		}
	}
	for i, p := range r.Peers {
		if !p.IsValid() {
			return fmt.Errorf("peers[%d]: not a valid CIDR", i)
		}
	}
	return nil
}

// protection is the content of the protect maps.
type protection struct {
	ports    []uint32 // rl_protect_ports: side x protectSide + class x 65536 + port
	peers    map[netip.Prefix]uint32
	portless uint32
	peerMask uint32 // rules restricted to peers
	rules    uint32
}

func buildProtection(rules []ProtectRule) *protection {
	p := &protection{ports: make([]uint32, 2*protectSide), peers: make(map[netip.Prefix]uint32)}
	for i := range rules {
		r := &rules[i]
		bit := uint32(1) << i
		p.rules |= bit
		if len(r.LocalPorts)+len(r.RemotePorts) == 0 {
			p.portless |= bit
		}
		classes := []int{classTCP, classUDP}
		switch r.Protocol {
		case TCP:
			classes = []int{classTCP}
		case UDP:
			classes = []int{classUDP}
		}
		for side, list := range [][]PortRange{r.LocalPorts, r.RemotePorts} {
			for _, cl := range classes {
				for _, pr := range list {
					for port := int(pr.First); port <= int(pr.Last); port++ {
						p.ports[side*protectSide+cl*portSpace+port] |= bit
					}
				}
			}
		}
		if len(r.Peers) > 0 {
			p.peerMask |= bit
			for _, pr := range r.Peers {
				p.peers[pr.Masked()] = 0
			}
		}
	}
	// As for the classifier's prefixes: each prefix carries every rule with
	// a prefix covering it, so that the longest match finds them all.
	for pr := range p.peers {
		var m uint32
		for i := range rules {
			for _, q := range rules[i].Peers {
				if q.Addr().Is4() == pr.Addr().Is4() && q.Bits() <= pr.Bits() && q.Contains(pr.Addr()) {
					m |= 1 << i
					break
				}
			}
		}
		p.peers[pr] = m
	}
	return p
}

// SetProtected replaces the protect rules. An empty list protects nothing.
//
// A rule that stays the same stays in force throughout: the rules that
// change are switched off in the config first, the tables rewritten, then
// the new config written. On error the previous rules stay.
func (d *Datapath) SetProtected(rules []ProtectRule) error {
	if len(rules) > MaxProtectRules {
		return fmt.Errorf("protect: %d rules, the data path holds %d: %w", len(rules), MaxProtectRules, ErrTableFull)
	}
	rs := make([]ProtectRule, len(rules))
	for i, r := range rules {
		r.Peers = unmapAll(append([]netip.Prefix(nil), r.Peers...))
		if err := r.validate(); err != nil {
			return fmt.Errorf("protect rule %d: %w", i, err)
		}
		rs[i] = r
	}
	next := buildProtection(rs)
	var n4, n6 uint32
	for p := range next.peers {
		if p.Addr().Is4() {
			n4++
		} else {
			n6++
		}
	}
	if n4 > d.objs.RlProtect4.MaxEntries() || n6 > d.objs.RlProtect6.MaxEntries() {
		return fmt.Errorf("protect: %d IPv4 and %d IPv6 peer prefixes, the maps hold %d and %d: %w",
			n4, n6, d.objs.RlProtect4.MaxEntries(), d.objs.RlProtect6.MaxEntries(), ErrTableFull)
	}
	cur := d.protect
	if cur == nil {
		var err error
		if cur, err = d.readProtection(); err != nil {
			return err
		}
	}

	// Rules whose entries change anywhere are off while the tables move.
	changed := (cur.portless ^ next.portless) | (cur.peerMask ^ next.peerMask) | (cur.rules ^ next.rules)
	var keys, vals []uint32
	for i := range next.ports {
		if x := cur.ports[i] ^ next.ports[i]; x != 0 {
			changed |= x
			keys = append(keys, uint32(i))
			vals = append(vals, next.ports[i])
		}
	}
	for p, m := range next.peers {
		changed |= m ^ cur.peers[p]
	}
	for p, m := range cur.peers {
		if _, ok := next.peers[p]; !ok {
			changed |= m
		}
	}

	var zero uint32
	cfg := d.state.cfg
	cfg.ProtectRules = cur.rules &^ changed
	cfg.ProtectPortless, cfg.ProtectPeers = cur.portless, cur.peerMask
	if changed != 0 {
		if err := d.objs.RlCfg.Put(zero, &cfg); err != nil {
			return fmt.Errorf("protect: write config: %w", err)
		}
	}
	if len(keys) > 0 {
		if _, err := d.objs.RlProtectPorts.BatchUpdate(keys, vals, nil); err != nil {
			return fmt.Errorf("protect: write port table: %w", err)
		}
	}
	for p, m := range next.peers {
		if old, ok := cur.peers[p]; ok && old == m {
			continue
		}
		var err error
		if p.Addr().Is4() {
			err = d.objs.RlProtect4.Put(lpm4Key(p), &m)
		} else {
			err = d.objs.RlProtect6.Put(lpm6Key(p), &m)
		}
		if err != nil {
			return fmt.Errorf("protect: write peer %s: %w", p, tableErr(err))
		}
	}
	for p := range cur.peers {
		if _, ok := next.peers[p]; ok {
			continue
		}
		var err error
		if p.Addr().Is4() {
			err = d.objs.RlProtect4.Delete(lpm4Key(p))
		} else {
			err = d.objs.RlProtect6.Delete(lpm6Key(p))
		}
		if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("protect: delete peer %s: %w", p, err)
		}
	}
	cfg.ProtectRules, cfg.ProtectPortless, cfg.ProtectPeers = next.rules, next.portless, next.peerMask
	if err := d.objs.RlCfg.Put(zero, &cfg); err != nil {
		return fmt.Errorf("protect: write config: %w", err)
	}
	d.state.cfg = cfg
	d.protect = next
	return nil
}

// readProtection reads what the protect maps hold (left by an earlier agent).
func (d *Datapath) readProtection() (*protection, error) {
	p := &protection{ports: make([]uint32, 2*protectSide), peers: make(map[netip.Prefix]uint32)}
	p.rules, p.portless, p.peerMask = d.state.cfg.ProtectRules, d.state.cfg.ProtectPortless, d.state.cfg.ProtectPeers
	if err := readArray(d.objs.RlProtectPorts, p.ports); err != nil {
		return nil, fmt.Errorf("protect: read port table: %w", err)
	}
	var (
		k4 bpf.RatelimitRlLpm4
		k6 bpf.RatelimitRlLpm6
		v  uint32
	)
	it := d.objs.RlProtect4.Iterate()
	for it.Next(&k4, &v) {
		p.peers[prefix4(k4)] = v
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("protect: read peers: %w", err)
	}
	it = d.objs.RlProtect6.Iterate()
	for it.Next(&k6, &v) {
		p.peers[prefix6(k6)] = v
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("protect: read peers: %w", err)
	}
	return p, nil
}
