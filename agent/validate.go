package agent

import (
	"cmp"
	"errors"
	"fmt"
	"math/bits"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/maps"
)

// ValidateConfig checks a config file against what the agent checks beyond
// v1alpha1.ParseConfig and can check without a kernel: the limits fit the
// data path's tables (at most maps.MaxLimits limits, and the source and
// destination prefixes of all limits together within the prefix tables).
// It returns every problem, joined, each a *v1alpha1.FieldError, and
// warnings for configs the agent runs but not as the operator may expect:
// packets that can match more limits than the data path checks on one
// packet (maps.MaxMatch), and, with a static count, node shares below one
// unit per second.
//
// cfg is a config from ParseConfig (defaulted and valid). ValidateConfig
// also takes a defaulted config that failed validation, so that a tool can
// list every problem at once: values that do not parse are left out of its
// checks, since Validate reports them.
func ValidateConfig(cfg *v1alpha1.Config) (warnings []string, err error) {
	var errs []error
	// Limits with unit requests are the limiter library's: no packet
	// matches them, and they take no room in the data path.
	n := 0
	for _, l := range cfg.Limits {
		if l.Unit != v1alpha1.UnitRequests {
			n++
		}
	}
	if n > int(maps.MaxLimits) {
		errs = append(errs, &v1alpha1.FieldError{Field: "limits",
			Detail: fmt.Sprintf("%d limits: the data path holds at most %d", n, maps.MaxLimits)})
	}
	ms := make([]limitMatch, len(cfg.Limits))
	for i := range cfg.Limits {
		ms[i] = newLimitMatch(&cfg.Limits[i].RateLimitSpec)
	}
	errs = append(errs, checkPrefixTables(ms)...)
	for _, dir := range []v1alpha1.Direction{v1alpha1.DirectionIngress, v1alpha1.DirectionEgress} {
		if w := overlapWarning(cfg, ms, dir); w != "" {
			warnings = append(warnings, w)
		}
	}
	if c := cfg.Count; c.File == "" && c.Static != nil {
		n := uint64(max(*c.Static, 1))
		for i, l := range cfg.Limits {
			if l.Rate >= 1 && l.Rate/n == 0 && l.Unit != v1alpha1.UnitRequests {
				warnings = append(warnings, fmt.Sprintf("limits[%d] (%s): rate %d over count %d is below 1 unit/s per node; each node enforces 1, so together they admit up to %d",
					i, l.Name, l.Rate, n, n))
			}
		}
	}
	for i, l := range cfg.Limits {
		if w := gsoBurstWarning(&l.RateLimitSpec); w != "" {
			warnings = append(warnings, fmt.Sprintf("limits[%d] (%s): %s", i, l.Name, w))
		}
		if w := rejectWarning(cfg, &l.RateLimitSpec); w != "" {
			warnings = append(warnings, fmt.Sprintf("limits[%d] (%s): %s", i, l.Name, w))
		}
		if w := lifelineWarning(cfg, &l.RateLimitSpec, &ms[i]); w != "" {
			warnings = append(warnings, fmt.Sprintf("limits[%d] (%s): %s", i, l.Name, w))
		}
	}
	return warnings, errors.Join(errs...)
}

// rejectWarning says when a limit with action reject can answer nothing:
// where it runs, or what it matches, gets no replies, only drops.
func rejectWarning(cfg *v1alpha1.Config, s *v1alpha1.RateLimitSpec) string {
	if s.Action != v1alpha1.ActionReject {
		return ""
	}
	switch {
	case s.Attach == v1alpha1.AttachEndpoints:
		return "action reject at attach endpoints drops unanswered: after DNAT a reply would carry the pod's address, not the one the client knows (attach uplink answers)"
	case s.Match.Protocol == v1alpha1.ProtocolICMP:
		return "action reject answers TCP SYNs and UDP datagrams only: on protocol icmp it drops, unanswered"
	case cfg.RejectBudget.Rate != nil && *cfg.RejectBudget.Rate == 0:
		return "action reject with rejectBudget.rate 0 answers nothing: it drops"
	}
	return ""
}

// lifelineWarning says when a limit matches ingress TCP to a local port of
// the default protect list (v1alpha1.DefaultProtect: SSH) at the uplinks,
// where it can drop the node's own SSH:
//   - the file's protect list does not exempt the port from every peer
//     (protect: [], or a list without such a rule): the limit can cut the
//     node off, so it is warned of, unless it only counts (shadow);
//   - the list exempts it and the limit names the port in dstPorts: the
//     limit never sees those packets, which its author may not expect.
//
// A limit that matches the port only because its match is wide (no
// dstPorts) while the port is protected is the protection working, and not
// warned of.
func lifelineWarning(cfg *v1alpha1.Config, s *v1alpha1.RateLimitSpec, m *limitMatch) string {
	if m.dir != v1alpha1.DirectionIngress || s.Attach == v1alpha1.AttachEndpoints {
		return ""
	}
	for _, d := range v1alpha1.DefaultProtect() {
		for _, ps := range d.LocalPorts {
			port, _, err := v1alpha1.ParsePortRange(ps)
			if err != nil || !m.matchesPort(classTCP, port) {
				continue
			}
			rule, protected := cfg.ProtectsLocalTCP(port)
			switch {
			case !protected && s.Action != v1alpha1.ActionShadow:
				return fmt.Sprintf("matches TCP to local port %d (%s) and the protect list does not exempt it from every peer "+
					"(protect: [] turns the default rule %s off): the limit can cut the node off %s; "+
					"add a protect rule for it, narrow the match, or leave protect out for the default",
					port, d.Name, d.Name, strings.ToUpper(d.Name))
			case protected && len(m.ports) > 0:
				return fmt.Sprintf("match.dstPorts covers TCP port %d, which the protect rule %s exempts from every limit: "+
					"the limit never sees TCP to it", port, rule)
			}
		}
	}
	return ""
}

// limitMatch is the part of a limit that decides which packets it matches,
// as the data path classifies them (none for a limit with unit requests,
// whose dir is "").
type limitMatch struct {
	dir      v1alpha1.Direction
	classes  [numClasses]bool // protocol classes, as maps.Protocol's
	ports    [][2]uint16      // inclusive ranges; none: every port
	src, dst []netip.Prefix   // none: every address
}

// The data path's protocol classes (bpf's rl_proto_class) that a limit can
// select; a packet whose protocol cannot be found is charged to every limit.
const (
	classTCP = iota
	classUDP
	classICMP
	classOther
	numClasses
)

func newLimitMatch(s *v1alpha1.RateLimitSpec) limitMatch {
	if s.Unit == v1alpha1.UnitRequests {
		return limitMatch{} // no direction: it matches no packet
	}
	m := limitMatch{dir: s.Match.Direction}
	if m.dir == "" {
		m.dir = v1alpha1.DirectionIngress
	}
	switch s.Match.Protocol {
	case v1alpha1.ProtocolTCP:
		m.classes[classTCP] = true
	case v1alpha1.ProtocolUDP:
		m.classes[classUDP] = true
	case v1alpha1.ProtocolICMP:
		m.classes[classICMP] = true
	default:
		m.classes = [numClasses]bool{true, true, true, true}
	}
	for _, r := range s.Match.DstPorts {
		if first, last, err := v1alpha1.ParsePortRange(r); err == nil {
			m.ports = append(m.ports, [2]uint16{first, last})
		}
	}
	for _, c := range s.Match.SrcCIDRs {
		if p, err := v1alpha1.ParseCIDR(c); err == nil {
			m.src = append(m.src, p)
		}
	}
	for _, c := range s.Match.DstCIDRs {
		if p, err := v1alpha1.ParseCIDR(c); err == nil {
			m.dst = append(m.dst, p)
		}
	}
	return m
}

// matchesPort reports whether a packet of class c to port p matches m's
// protocol and ports. Ports restrict TCP and UDP; a port-restricted limit
// matches no packet of another class.
func (m *limitMatch) matchesPort(c int, p uint16) bool {
	if !m.classes[c] {
		return false
	}
	if len(m.ports) == 0 {
		return true
	}
	if c != classTCP && c != classUDP {
		return false
	}
	for _, r := range m.ports {
		if r[0] <= p && p <= r[1] {
			return true
		}
	}
	return false
}

// prefixCapacity is the size of the data path's prefix tables (read once).
var prefixCapacity = sync.OnceValues(maps.PrefixTables)

// checkPrefixTables checks that the distinct prefixes of all limits fit the
// prefix tables: each distinct prefix of a side and family takes one entry.
func checkPrefixTables(ms []limitMatch) []error {
	capacity, err := prefixCapacity()
	if err != nil {
		return []error{fmt.Errorf("read the data path's table sizes: %w", err)}
	}
	var errs []error
	for _, side := range []struct {
		name, field string
		list        func(*limitMatch) []netip.Prefix
		max4, max6  uint32
	}{
		{"source", "srcCIDRs", func(m *limitMatch) []netip.Prefix { return m.src }, capacity.Src4, capacity.Src6},
		{"destination", "dstCIDRs", func(m *limitMatch) []netip.Prefix { return m.dst }, capacity.Dst4, capacity.Dst6},
	} {
		distinct := make(map[netip.Prefix]bool)
		for i := range ms {
			for _, p := range side.list(&ms[i]) {
				distinct[p] = true
			}
		}
		var n4, n6 uint32
		for p := range distinct {
			if p.Addr().Is4() {
				n4++
			} else {
				n6++
			}
		}
		for _, f := range []struct {
			family string
			n, max uint32
		}{{"IPv4", n4, side.max4}, {"IPv6", n6, side.max6}} {
			if f.n > f.max {
				errs = append(errs, &v1alpha1.FieldError{Field: "limits[*].match." + side.field,
					Detail: fmt.Sprintf("%d distinct %s %s prefixes over all limits: the data path holds at most %d", f.n, f.family, side.name, f.max)})
			}
		}
	}
	return errs
}

// overlapWarning warns when one packet of direction dir can match more
// limits than the data path checks on one packet, or returns "".
//
// The largest set of limits one packet can match is found exactly, up to a
// search budget: a limit matches when the packet's direction, protocol
// class and port, source and destination address are all in its match.
// Along each of these the packets fall into few groups (the start of every
// port range and of every prefix, and "none of them"), so the search takes
// one group per dimension and keeps the largest intersection. A packet whose
// transport header cannot be found (an IPv6 packet with a long extension
// header chain, a tiny fragment) is charged to every limit it could match,
// whatever its protocol and ports; that is the figure warned about. Beyond
// the budget the figure is an upper bound, which "up to" covers.
func overlapWarning(cfg *v1alpha1.Config, ms []limitMatch, dir v1alpha1.Direction) string {
	inDir := newBitset(len(ms))
	for i := range ms {
		if ms[i].dir == dir {
			inDir.set(i)
		}
	}
	if inDir.count() <= maps.MaxMatch {
		return ""
	}
	worst, known := largestMatch(ms, inDir)
	if worst.upper() <= maps.MaxMatch {
		return ""
	}
	if worst.best == nil {
		worst.best = inDir
	}
	var names []string
	drop := false
	for i := range ms {
		if worst.best.has(i) {
			names = append(names, cfg.Limits[i].Name)
			drop = drop || cfg.Limits[i].Action == v1alpha1.ActionDrop || cfg.Limits[i].Action == v1alpha1.ActionReject
		}
	}
	const maxNames = 32
	if len(names) > maxNames {
		names = append(names[:maxNames], fmt.Sprintf("and %d more", len(names)-maxNames))
	}
	outcome := "passes: all of them are shadow limits, and those it is not checked against do not see it"
	if drop {
		outcome = "it is dropped (fail closed) when a limit it is not checked against has action drop"
	}
	return fmt.Sprintf("%s: one packet can match up to %d limits, more than the %d the data path checks on one packet "+
		"(up to %d with its protocol and ports read; a packet whose transport header cannot be found is charged to every limit it could match): "+
		"such a packet is counted in match_overflow and %s; the limits: %s",
		dir, worst.upper(), maps.MaxMatch, known.upper(), outcome, strings.Join(names, ", "))
}

// largestMatch searches the largest set of limits of inDir that one packet
// matches: worst for any packet, known for a packet whose protocol and
// ports the data path reads.
func largestMatch(ms []limitMatch, inDir bitset) (worst, known search) {
	l4 := portMasks(ms, inDir)
	for _, is4 := range []bool{true, false} {
		src := addressMasks(ms, inDir, is4, func(m *limitMatch) []netip.Prefix { return m.src })
		dst := addressMasks(ms, inDir, is4, func(m *limitMatch) []netip.Prefix { return m.dst })
		worst.run(inDir, [][]bitset{src, dst})
		known.run(inDir, [][]bitset{src, dst, l4})
	}
	return worst, known
}

// portMasks returns, for every group of packets with known protocol class
// and destination port, the limits of inDir they match. Among TCP and UDP
// ports the groups start at each range's first port; a port in no range
// matches the class's port-less limits only, a subset of every group.
func portMasks(ms []limitMatch, inDir bitset) []bitset {
	var out []bitset
	for c := range numClasses {
		cands := []uint16{0}
		if c == classTCP || c == classUDP {
			for i := range ms {
				if inDir.has(i) && ms[i].classes[c] {
					for _, r := range ms[i].ports {
						cands = append(cands, r[0])
					}
				}
			}
		}
		slices.Sort(cands)
		for _, p := range slices.Compact(cands) {
			b := newBitset(len(ms))
			for i := range ms {
				if inDir.has(i) && ms[i].matchesPort(c, p) {
					b.set(i)
				}
			}
			out = append(out, b)
		}
	}
	return prune(out)
}

// addressMasks returns, for every group of addresses of one family on one
// side, the limits of inDir whose prefixes on that side (if any) contain
// them. The groups start at every prefix's first address (the address
// covered by that prefix and by every shorter one containing it); an
// address in no prefix matches only the limits without prefixes.
func addressMasks(ms []limitMatch, inDir bitset, is4 bool, side func(*limitMatch) []netip.Prefix) []bitset {
	unrestricted := newBitset(len(ms))
	var addrs []netip.Addr
	for i := range ms {
		if !inDir.has(i) {
			continue
		}
		ps := side(&ms[i])
		if len(ps) == 0 {
			unrestricted.set(i)
		}
		for _, p := range ps {
			if p.Addr().Is4() == is4 {
				addrs = append(addrs, p.Addr())
			}
		}
	}
	out := []bitset{unrestricted}
	slices.SortFunc(addrs, netip.Addr.Compare)
	for _, a := range slices.Compact(addrs) {
		b := unrestricted.clone()
		for i := range ms {
			if inDir.has(i) && slices.ContainsFunc(side(&ms[i]), func(p netip.Prefix) bool { return p.Contains(a) }) {
				b.set(i)
			}
		}
		out = append(out, b)
	}
	return prune(out)
}

// search finds the largest intersection of one set from each dimension,
// over several runs, by branch and bound: the sets of a dimension are tried
// largest first, and a branch is cut once it cannot beat the best found.
type search struct {
	best      bitset
	bestN     int
	steps     int
	exhausted bool
	bound     int // with exhausted: an upper bound of every run's answer
}

// searchBudget bounds the work of all runs of one search; configs of a few
// hundred limits with a few prefixes each stay far below it.
const searchBudget = 1 << 20

func (s *search) run(start bitset, dims [][]bitset) {
	for _, d := range dims {
		slices.SortStableFunc(d, func(a, b bitset) int { return cmp.Compare(b.count(), a.count()) })
	}
	var rec func(level int, cur bitset)
	rec = func(level int, cur bitset) {
		if s.steps++; s.steps > searchBudget {
			s.exhausted = true
			return
		}
		if level == len(dims) {
			if n := cur.count(); n > s.bestN {
				s.best, s.bestN = cur, n
			}
			return
		}
		for _, m := range dims[level] {
			if m.count() <= s.bestN {
				break // sorted: no later set can do better
			}
			x := cur.and(m)
			if x.count() > s.bestN {
				rec(level+1, x)
			}
			if s.exhausted {
				return
			}
		}
	}
	rec(0, start)
	if s.exhausted {
		// No intersection is larger than its smallest dimension's largest set.
		b := start.count()
		for _, d := range dims {
			if len(d) > 0 {
				b = min(b, d[0].and(start).count())
			}
		}
		s.bound = max(s.bound, b)
	}
}

// upper is the largest intersection found, or an upper bound of it when
// the budget ran out.
func (s *search) upper() int {
	if s.exhausted {
		return max(s.bound, s.bestN)
	}
	return s.bestN
}

// prune drops the sets that another set contains (they cannot give a larger
// intersection) and duplicates.
func prune(sets []bitset) []bitset {
	slices.SortStableFunc(sets, func(a, b bitset) int { return cmp.Compare(b.count(), a.count()) })
	var out []bitset
	for _, s := range sets {
		if !slices.ContainsFunc(out, s.subsetOf) {
			out = append(out, s)
		}
	}
	return out
}

// bitset is a set of limit indexes.
type bitset []uint64

func newBitset(n int) bitset    { return make(bitset, (n+63)/64) }
func (b bitset) set(i int)      { b[i/64] |= 1 << (i % 64) }
func (b bitset) has(i int) bool { return b[i/64]&(1<<(i%64)) != 0 }
func (b bitset) clone() bitset  { return slices.Clone(b) }
func (b bitset) and(c bitset) bitset {
	out := make(bitset, len(b))
	for i := range b {
		out[i] = b[i] & c[i]
	}
	return out
}
func (b bitset) count() int {
	n := 0
	for _, w := range b {
		n += bits.OnesCount64(w)
	}
	return n
}

// subsetOf reports whether every element of b is in c.
func (b bitset) subsetOf(c bitset) bool {
	for i := range b {
		if b[i]&^c[i] != 0 {
			return false
		}
	}
	return true
}

// gsoPacket is the largest packet a TC hook sees without BIG TCP: a GSO or
// GRO packet of 64 KiB and its headers.
const gsoPacket = 64<<10 + 256

// gsoBurstWarning warns of a bytes limit enforced by a TC program (egress,
// or at the endpoints) whose burst is below one GSO packet: such a packet
// costs its wire bytes at once, and a bucket that can never hold that many
// drops it every time (TCP then falls back to smaller packets only after
// losses). A paced limit waits for the bytes instead, but drops a packet
// whose wait would pass the horizon: it is warned of when a GSO packet
// beyond its burst waits longer than the horizon even on one replica (with
// N replicas each node's share is 1/N: N times as long).
func gsoBurstWarning(s *v1alpha1.RateLimitSpec) string {
	d := s.DeepCopy()
	d.Default()
	if d.Unit != v1alpha1.UnitBytes || (d.Match.Direction != v1alpha1.DirectionEgress && d.Attach != v1alpha1.AttachEndpoints) {
		return ""
	}
	if d.Action == v1alpha1.ActionPace {
		b := d.EffectiveBurst()
		wait := time.Duration(float64(gsoPacket-min(b, gsoPacket)) / float64(d.Rate) * float64(time.Second))
		if d.Horizon != nil && wait > d.Horizon.Duration {
			return fmt.Sprintf("action pace, unit bytes: a GSO packet of %d bytes beyond the burst of %d waits %v at rate %d even on one replica "+
				"(N times as long with N replicas), more than the horizon %v, and is dropped: raise the rate, the burst or the horizon",
				gsoPacket, b, wait.Round(time.Millisecond), d.Rate, d.Horizon.Duration)
		}
		return ""
	}
	if b := d.EffectiveBurst(); b < gsoPacket {
		return fmt.Sprintf("unit bytes with a global burst of %d: at a TC hook one GSO packet is up to %d bytes, which a node's bucket "+
			"of at most %d bytes never admits; set burst to at least %d per node (times the replicas)", b, gsoPacket, b, gsoPacket)
	}
	return ""
}
