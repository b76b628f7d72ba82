package maps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/bpf"
)

type mask = bpf.RatelimitRlMask

const portSpace = int(bpf.RatelimitRlConstRL_PORT_SPACE)

func setBit(m *mask, id uint32)      { m.W[id/64] |= 1 << (id % 64) }
func hasBit(m *mask, id uint32) bool { return m.W[id/64]&(1<<(id%64)) != 0 }
func and(a, b mask) (r mask) {
	for i := range r.W {
		r.W[i] = a.W[i] & b.W[i]
	}
	return r
}
func or(a, b mask) (r mask) {
	for i := range r.W {
		r.W[i] = a.W[i] | b.W[i]
	}
	return r
}
func andNot(a, b mask) (r mask) {
	for i := range r.W {
		r.W[i] = a.W[i] &^ b.W[i]
	}
	return r
}

// classifier is the content of the classifier maps: what the data path
// reads to find the limits of a packet.
//
// ports holds the limits restricted to each port. The rl_ports map holds
// more: each entry also carries its class's protoAny limits (portEntry), so
// that the data path finds a packet's candidates in one lookup.
type classifier struct {
	cfg      bpf.RatelimitRlConfig
	protoAny [bpf.RatelimitRlProtoClassRL_PROTO_ANY_ENTRIES]mask
	ports    []mask // class x 65536 + port, TCP and UDP
	src, dst map[netip.Prefix]mask
	// src4Head, dst4Head are the first stage of the IPv4 prefix match, one
	// entry per /16 (heads4): derived from src and dst, or read from the
	// maps.
	src4Head, dst4Head []head4
	// unfolded: read from a port table whose entries lack their class's
	// protoAny limits (written by an older version); apply rewrites them all.
	unfolded bool
}

// portEntry is what rl_ports holds at index i: the port's limits and the
// limits of its class that have no port restriction.
func (c *classifier) portEntry(i int) mask { return or(c.ports[i], c.protoAny[i/portSpace]) }

func newClassifier() *classifier {
	return &classifier{
		ports:    make([]mask, 2*portSpace),
		src:      make(map[netip.Prefix]mask),
		dst:      make(map[netip.Prefix]mask),
		src4Head: make([]head4, head4Entries),
		dst4Head: make([]head4, head4Entries),
	}
}

type head4 = bpf.RatelimitRlHead4

const (
	head4Bits    = int(bpf.RatelimitRlConstRL_HEAD4BITS)
	head4Entries = 1 << head4Bits
)

// heads4 derives the first stage of the IPv4 prefix match from the
// prefixes of one side (each with its limits and those of the prefixes
// covering it, as prefixMasks gives them): each /16 gets the limits of the
// longest prefix of /16 or shorter that covers it, which is what the trie
// answers for its addresses unless a longer prefix lies in the /16; then it
// is deep, and the data path asks the trie. Prefixes of one length are
// disjoint, so each length writes every entry at most once.
func heads4(prefixes map[netip.Prefix]mask, out []head4) {
	clear(out)
	var short []netip.Prefix
	for p := range prefixes {
		if !p.Addr().Is4() {
			continue
		}
		if p.Bits() > head4Bits {
			out[head4Index(p.Addr())].Deep = 1
			continue
		}
		short = append(short, p)
	}
	slices.SortFunc(short, func(a, b netip.Prefix) int { return a.Bits() - b.Bits() })
	for _, p := range short {
		first := head4Index(p.Addr())
		for i := range 1 << (head4Bits - p.Bits()) {
			out[first+i].M = prefixes[p]
		}
	}
}

// head4Index is the first-stage entry of an IPv4 address: its first 16 bits.
func head4Index(a netip.Addr) int {
	b := a.As4()
	return int(b[0])<<8 | int(b[1])
}

const (
	classTCP   = int(bpf.RatelimitRlProtoClassRL_PROTO_TCP)
	classUDP   = int(bpf.RatelimitRlProtoClassRL_PROTO_UDP)
	classICMP  = int(bpf.RatelimitRlProtoClassRL_PROTO_ICMP)
	classOther = int(bpf.RatelimitRlProtoClassRL_PROTO_OTHER)
	// classUnknown is a packet whose protocol could not be found.
	classUnknown = int(bpf.RatelimitRlProtoClassRL_PROTO_UNKNOWN)
	// anyPort is added to a class for the protoAny entry that holds every
	// limit of the class whatever its ports: what a packet of that class
	// whose ports are unknown could match.
	anyPort = int(bpf.RatelimitRlProtoClassRL_PROTO_CLASSES)
)

// classes are the protocol classes a limit's packets can be of: those its
// protocol selects; TCP only for a connections limit (a connection attempt
// is a TCP SYN).
func (l *Limit) classes() []int {
	if l.Unit == Connections {
		return []int{classTCP}
	}
	return l.Match.Protocol.classes()
}

// classes are the protocol classes a protocol selects.
func (p Protocol) classes() []int {
	switch p {
	case TCP:
		return []int{classTCP}
	case UDP:
		return []int{classUDP}
	case ICMP:
		return []int{classICMP}
	}
	return []int{classTCP, classUDP, classICMP, classOther}
}

// buildClassifier derives the classifier of a set of limits. What is not
// the limits' (the last generation, the hash seed, the protect rules, the
// endpoint source check, the hot-key tick) comes from prev, if set.
func buildClassifier(limits map[uint32]*installed, prev *bpf.RatelimitRlConfig, lastGen uint32) *classifier {
	c := newClassifier()
	if prev != nil {
		c.cfg.Seed = prev.Seed
		c.cfg.ProtectRules, c.cfg.ProtectPortless, c.cfg.ProtectPeers = prev.ProtectRules, prev.ProtectPortless, prev.ProtectPeers
		c.cfg.EpSrcCheck = prev.EpSrcCheck
		c.cfg.HotShift = prev.HotShift
	}
	c.cfg.LastGen = lastGen
	for id, in := range limits {
		m := &in.limit.Match
		// One hook: no packet is charged twice for one limit.
		setBit(&c.cfg.Hook[m.Attach.Hook(m.Direction)], id)
		if in.limit.Action != Shadow { // drop, pace and reject limits fail closed
			setBit(&c.cfg.Drop, id)
		}
		if in.limit.Unit == Connections {
			setBit(&c.cfg.Conn, id)
		}
		classes := in.limit.classes()
		// A packet whose protocol is unknown could be any limit's.
		setBit(&c.protoAny[classUnknown], id)
		setBit(&c.protoAny[anyPort+classUnknown], id)
		for _, cl := range classes {
			// A limit on ports matches only TCP and UDP, ports or not.
			if len(m.DstPorts) == 0 || cl == classTCP || cl == classUDP {
				setBit(&c.protoAny[anyPort+cl], id)
			}
		}
		if len(m.DstPorts) == 0 {
			for _, cl := range classes {
				setBit(&c.protoAny[cl], id)
			}
		} else {
			for _, cl := range classes {
				if cl != classTCP && cl != classUDP {
					continue
				}
				for _, r := range m.DstPorts {
					for p := int(r.First); p <= int(r.Last); p++ {
						setBit(&c.ports[cl*portSpace+p], id)
					}
				}
			}
		}
		if len(m.SrcCIDRs) > 0 {
			setBit(&c.cfg.SrcCidr, id)
		}
		if len(m.DstCIDRs) > 0 {
			setBit(&c.cfg.DstCidr, id)
		}
	}
	c.src = prefixMasks(limits, func(m *Match) []netip.Prefix { return m.SrcCIDRs })
	c.dst = prefixMasks(limits, func(m *Match) []netip.Prefix { return m.DstCIDRs })
	heads4(c.src, c.src4Head)
	heads4(c.dst, c.dst4Head)
	return c
}

// prefixMasks gives each prefix of any limit the set of limits that have a
// prefix covering it: the longest-prefix match then finds every limit whose
// list contains the address.
func prefixMasks(limits map[uint32]*installed, list func(*Match) []netip.Prefix) map[netip.Prefix]mask {
	out := make(map[netip.Prefix]mask)
	for _, in := range limits {
		for _, p := range list(&in.limit.Match) {
			out[p.Masked()] = mask{}
		}
	}
	for p := range out {
		var m mask
		for id, in := range limits {
			for _, q := range list(&in.limit.Match) {
				if q.Addr().Is4() == p.Addr().Is4() && q.Bits() <= p.Bits() && q.Contains(p.Addr()) {
					setBit(&m, id)
					break
				}
			}
		}
		out[p] = m
	}
	return out
}

func lpm4Key(p netip.Prefix) bpf.RatelimitRlLpm4 {
	a := p.Addr().As4()
	return bpf.RatelimitRlLpm4{Prefixlen: uint32(p.Bits()), Addr: binary.LittleEndian.Uint32(a[:])}
}

func lpm6Key(p netip.Prefix) bpf.RatelimitRlLpm6 {
	k := bpf.RatelimitRlLpm6{Prefixlen: uint32(p.Bits())}
	a := p.Addr().As16()
	for i := range k.Addr {
		k.Addr[i] = binary.LittleEndian.Uint32(a[4*i:])
	}
	return k
}

// apply writes next over the maps, which hold cur, in an order that never
// lets a packet see a limit with half of its match:
// first the hook masks lose the limits that go, then the tables change,
// then the hook masks gain the limits that come.
//
// A limit that moves to another hook (another attach point or direction)
// is in neither hook's mask while the tables change, so that no moment has
// it at two hooks; a limit that becomes or stops being a connections limit
// is in no hook's mask meanwhile either, so that no packet sees it with
// half of that change.
func (d *Datapath) apply(cur, next *classifier) error {
	var zero uint32
	interim := interimConfig(&cur.cfg, &next.cfg)
	if err := d.objs.RlCfg.Put(zero, &interim); err != nil {
		return fmt.Errorf("write classifier config: %w", err)
	}

	var keys []uint32
	var vals []mask
	for i := range next.ports {
		if v := next.portEntry(i); v != cur.portEntry(i) || cur.unfolded {
			keys = append(keys, uint32(i))
			vals = append(vals, v)
		}
	}
	if len(keys) > 0 {
		if _, err := d.objs.RlPorts.BatchUpdate(keys, vals, nil); err != nil {
			return fmt.Errorf("write port table: %w", err)
		}
	}
	for cl := range next.protoAny {
		if next.protoAny[cl] != cur.protoAny[cl] {
			if err := d.objs.RlProtoAny.Put(uint32(cl), &next.protoAny[cl]); err != nil {
				return fmt.Errorf("write protocol table: %w", err)
			}
		}
	}
	if err := d.applyPrefixes("source", d.objs.RlSrc4Head, d.objs.RlSrc4, d.objs.RlSrc6, cur.src, next.src, cur.src4Head, next.src4Head); err != nil {
		return err
	}
	if err := d.applyPrefixes("destination", d.objs.RlDst4Head, d.objs.RlDst4, d.objs.RlDst6, cur.dst, next.dst, cur.dst4Head, next.dst4Head); err != nil {
		return err
	}
	if err := d.objs.RlCfg.Put(zero, &next.cfg); err != nil {
		return fmt.Errorf("write classifier config: %w", err)
	}
	return nil
}

// interimConfig is the classifier config apply writes before it changes
// the tables: next's, where each hook keeps only the limits that stay at it
// unchanged in kind (a limit that moves to another hook, or becomes or stops
// being a connections limit, is at no hook meanwhile), and the prefix
// restrictions of both.
func interimConfig(cur, next *bpf.RatelimitRlConfig) bpf.RatelimitRlConfig {
	interim := *next
	connChanged := or(andNot(cur.Conn, next.Conn), andNot(next.Conn, cur.Conn))
	for i := range interim.Hook {
		interim.Hook[i] = andNot(and(cur.Hook[i], next.Hook[i]), connChanged)
	}
	// A limit restricted to prefixes whose entries are not written yet
	// matches nothing: safe.
	interim.SrcCidr = or(cur.SrcCidr, next.SrcCidr)
	interim.DstCidr = or(cur.DstCidr, next.DstCidr)
	return interim
}

// applyPrefixes writes one side's prefixes: the tries' new and changed
// entries, then the first stage, then the tries lose the prefixes that go.
// A /16 that becomes deep has its longer prefixes in the trie before the
// first stage sends packets there; one that stops being deep answers from
// the first stage before they leave the trie.
func (d *Datapath) applyPrefixes(side string, head, m4, m6 *ebpf.Map, cur, next map[netip.Prefix]mask, curHead, nextHead []head4) error {
	for p, m := range next {
		if old, ok := cur[p]; ok && old == m {
			continue
		}
		var err error
		if p.Addr().Is4() {
			err = m4.Put(lpm4Key(p), &m)
		} else {
			err = m6.Put(lpm6Key(p), &m)
		}
		if err != nil {
			return fmt.Errorf("write %s prefix %s: %w", side, p, tableErr(err))
		}
	}
	var keys []uint32
	var vals []head4
	for i := range nextHead {
		if nextHead[i] != curHead[i] {
			keys = append(keys, uint32(i))
			vals = append(vals, nextHead[i])
		}
	}
	if len(keys) > 0 {
		if _, err := head.BatchUpdate(keys, vals, nil); err != nil {
			return fmt.Errorf("write %s prefixes' first stage: %w", side, err)
		}
	}
	for p := range cur {
		if _, ok := next[p]; ok {
			continue
		}
		var err error
		if p.Addr().Is4() {
			err = m4.Delete(lpm4Key(p))
		} else {
			err = m6.Delete(lpm6Key(p))
		}
		if err != nil {
			return fmt.Errorf("delete %s prefix %s: %w", side, p, err)
		}
	}
	return nil
}

// readClassifier reads what the maps hold, for a Load that found them pinned.
func (d *Datapath) readClassifier() (*classifier, error) {
	c := newClassifier()
	if err := d.objs.RlCfg.Lookup(uint32(0), &c.cfg); err != nil {
		return nil, fmt.Errorf("read classifier config: %w", err)
	}
	for cl := range c.protoAny {
		if err := d.objs.RlProtoAny.Lookup(uint32(cl), &c.protoAny[cl]); err != nil {
			return nil, fmt.Errorf("read protocol table: %w", err)
		}
	}
	if err := readArray(d.objs.RlPorts, c.ports); err != nil {
		return nil, fmt.Errorf("read port table: %w", err)
	}
	for i, m := range c.ports {
		any := c.protoAny[i/portSpace]
		if and(m, any) != any {
			c.unfolded = true
		}
		c.ports[i] = andNot(m, any)
	}
	if err := readArray(d.objs.RlSrc4Head, c.src4Head); err != nil {
		return nil, fmt.Errorf("read source prefixes' first stage: %w", err)
	}
	if err := readArray(d.objs.RlDst4Head, c.dst4Head); err != nil {
		return nil, fmt.Errorf("read destination prefixes' first stage: %w", err)
	}
	var v mask
	for _, t := range []struct {
		m4, m6 *ebpf.Map
		out    map[netip.Prefix]mask
	}{{d.objs.RlSrc4, d.objs.RlSrc6, c.src}, {d.objs.RlDst4, d.objs.RlDst6, c.dst}} {
		var k4 bpf.RatelimitRlLpm4
		it := t.m4.Iterate()
		for it.Next(&k4, &v) {
			t.out[prefix4(k4)] = v
		}
		if err := it.Err(); err != nil {
			return nil, fmt.Errorf("read prefixes: %w", err)
		}
		var k6 bpf.RatelimitRlLpm6
		it = t.m6.Iterate()
		for it.Next(&k6, &v) {
			t.out[prefix6(k6)] = v
		}
		if err := it.Err(); err != nil {
			return nil, fmt.Errorf("read prefixes: %w", err)
		}
	}
	return c, nil
}

// matchOf reconstructs a limit's match from the classifier, for limits found
// in pinned maps. The result selects the same packets; CIDRs covered by
// another CIDR of the same limit are folded into it, and a connections
// limit's protocol reads back as TCP (all it sees).
func (c *classifier) matchOf(id uint32) Match {
	var m Match
	for h := range c.cfg.Hook {
		if hasBit(&c.cfg.Hook[h], id) {
			m.Attach, m.Direction = Hook(h).Attach(), Hook(h).Direction()
		}
	}
	var classes []int
	for cl := range classUnknown {
		if hasBit(&c.protoAny[cl], id) {
			classes = append(classes, cl)
		}
	}
	var portClasses []int
	for _, cl := range []int{classTCP, classUDP} {
		first := -1
		for p := 0; p <= portSpace; p++ {
			in := p < portSpace && hasBit(&c.ports[cl*portSpace+p], id)
			if in && first < 0 {
				first = p
			}
			if !in && first >= 0 {
				if !slices.Contains(portClasses, cl) {
					portClasses = append(portClasses, cl)
				}
				if cl == portClasses[0] {
					m.DstPorts = append(m.DstPorts, PortRange{uint16(first), uint16(p - 1)})
				}
				first = -1
			}
		}
	}
	if len(portClasses) > 0 {
		classes = portClasses
	}
	switch {
	case len(classes) == 1 && classes[0] == classTCP:
		m.Protocol = TCP
	case len(classes) == 1 && classes[0] == classUDP:
		m.Protocol = UDP
	case len(classes) == 1 && classes[0] == classICMP:
		m.Protocol = ICMP
	default:
		m.Protocol = AnyProtocol
	}
	m.SrcCIDRs = minimalPrefixes(c.src, id)
	m.DstCIDRs = minimalPrefixes(c.dst, id)
	return m
}

func minimalPrefixes(t map[netip.Prefix]mask, id uint32) []netip.Prefix {
	var all []netip.Prefix
	for p, m := range t {
		if hasBit(&m, id) {
			all = append(all, p)
		}
	}
	var out []netip.Prefix
	for _, p := range all {
		covered := false
		for _, q := range all {
			if q != p && q.Addr().Is4() == p.Addr().Is4() && q.Bits() < p.Bits() && q.Contains(p.Addr()) {
				covered = true
				break
			}
		}
		if !covered {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) })
	return out
}

// tableErr marks a map that has no room left.
func tableErr(err error) error {
	if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.E2BIG) {
		return fmt.Errorf("%w: %w", ErrTableFull, err)
	}
	return err
}

// readArray reads a whole array map into out (indexed by key), in batches
// where the kernel can.
func readArray[V any](m *ebpf.Map, out []V) error {
	var (
		cursor ebpf.MapBatchCursor
		keys   = make([]uint32, 8192)
		vals   = make([]V, 8192)
	)
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		for i := range n {
			if int(keys[i]) < len(out) {
				out[keys[i]] = vals[i]
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil // the end of the table
		}
		if errors.Is(err, ebpf.ErrNotSupported) {
			break
		}
		if err != nil {
			return err
		}
	}
	var (
		k uint32
		v V
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		if int(k) < len(out) {
			out[k] = v
		}
	}
	return it.Err()
}

func prefix4(k bpf.RatelimitRlLpm4) netip.Prefix {
	var a [4]byte
	binary.LittleEndian.PutUint32(a[:], k.Addr)
	return netip.PrefixFrom(netip.AddrFrom4(a), int(k.Prefixlen))
}

func prefix6(k bpf.RatelimitRlLpm6) netip.Prefix {
	var a [16]byte
	for i, w := range k.Addr {
		binary.LittleEndian.PutUint32(a[4*i:], w)
	}
	return netip.PrefixFrom(netip.AddrFrom16(a), int(k.Prefixlen))
}
