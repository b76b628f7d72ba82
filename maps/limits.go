package maps

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"math/bits"
	"net/netip"
	"reflect"
	"slices"
	"time"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/bpf"
)

// vOrigin is where a new limit's virtual clock starts. A bucket that was
// never used has v_empty 0, so it starts full as long as V >= burst: vOrigin
// is above the largest burst (MaxRate x MaxBurstSeconds = 1.44e13), and V
// stays below 2^64 for over a century at MaxRate.
const vOrigin = 1 << 44

const nsPerSec = 1_000_000_000

// vclock is V(now) of params p, as rl_vclock computes it in C.
func vclock(p *bpf.RatelimitRlParams, now uint64) uint64 {
	var dt uint64
	if now > p.BaseNs {
		dt = now - p.BaseNs
	}
	hi, lo := bits.Mul64(dt%nsPerSec, p.Rate)
	frac, _ := bits.Div64(hi, lo, nsPerSec)
	return p.BaseV + (dt/nsPerSec)*p.Rate + frac
}

// SetLimit creates the limit with this id, or changes it in place.
//
// A change of rate or burst takes effect from the moment of the write, and
// the limit's buckets keep their tokens (clamped to the new burst). A change
// of unit or key starts the limit over with new, full buckets.
func (d *Datapath) SetLimit(id uint32, l Limit) error {
	if id >= MaxLimits {
		return fmt.Errorf("set limit %d: id out of range 0..%d: %w", id, MaxLimits-1, ErrTableFull)
	}
	l = l.clone()
	l.Match.SrcCIDRs = unmapAll(l.Match.SrcCIDRs)
	l.Match.DstCIDRs = unmapAll(l.Match.DstCIDRs)
	if err := l.Validate(); err != nil {
		return fmt.Errorf("set limit %d: %w", id, err)
	}
	now, err := d.clockOf(l.Action)
	if err != nil {
		return fmt.Errorf("set limit %d: %w", id, err)
	}

	params := bpf.RatelimitRlParams{
		Rate:   l.Rate,
		Burst:  l.Burst,
		Chunk:  chunk(l.Rate, l.Burst, d.ncpu),
		BaseNs: now,
		BaseV:  vOrigin,
	}
	old := d.limits[id]
	fresh := old == nil || old.limit.needsNewBuckets(&l)
	var e bpf.RatelimitRlLimit
	lastGen := d.state.cfg.LastGen
	if fresh {
		lastGen++
		if lastGen == 0 {
			lastGen = 1
		}
		e.Gen = lastGen
		e.Seq = 1
		e.Params[0] = params
		if err := d.objs.RlPools.Put(id, &bpf.RatelimitRlPool{}); err != nil {
			return fmt.Errorf("set limit %d: reset pool: %w", id, err)
		}
	} else {
		e = old.entry
		cur := e.Params[e.Active&1]
		// V continues from where it is, at the new slope.
		params.BaseV = vclock(&cur, now)
		e.Params[(e.Active+1)&1] = params
		e.Active = (e.Active + 1) & 1
		e.Seq++
	}
	e.Unit = bpf.RatelimitRlUnit(l.Unit)
	e.KeyKind = bpf.RatelimitRlKeyKind(l.Key)
	e.Action = bpf.RatelimitRlAction(l.Action)
	e.Hot = 0
	if l.Hot {
		e.Hot = 1
	}
	e.HorizonNs = uint32(l.Horizon.Nanoseconds())
	if l.Key.prefixKey() {
		e.Prefix4 = netmask4(int(l.Prefix4))
		e.Prefix6 = netmask6(int(l.Prefix6))
	}

	next := make(map[uint32]*installed, len(d.limits)+1)
	for k, v := range d.limits {
		next[k] = v
	}
	next[id] = &installed{limit: l, entry: e}
	if !fresh && reflect.DeepEqual(old.limit.Match, l.Match) {
		// A new share, the same match: one entry to write, as fast as a
		// count change must be.
		if err := d.objs.RlLimits.Put(id, &e); err != nil {
			return fmt.Errorf("set limit %d: write entry: %w", id, err)
		}
		d.limits = next
		return nil
	}
	cls := buildClassifier(next, &d.state.cfg, lastGen)

	if err := d.checkCapacity(cls); err != nil {
		return fmt.Errorf("set limit %d: %w", id, err)
	}

	// The entry goes first: the classifier bit that sends packets to it is
	// set last, by apply.
	var prev bpf.RatelimitRlLimit
	if old != nil {
		prev = old.entry
	}
	if err := d.objs.RlLimits.Put(id, &e); err != nil {
		return fmt.Errorf("set limit %d: write entry: %w", id, err)
	}
	if err := d.apply(d.state, cls); err != nil {
		// Put back what was there, so that a failed change leaves the
		// previous limit enforced and nothing half-set.
		if rerr := d.rollback(id, &prev); rerr != nil {
			return fmt.Errorf("set limit %d: %w (and rolling back: %v)", id, err, rerr)
		}
		return fmt.Errorf("set limit %d: %w", id, err)
	}
	d.limits = next
	d.state = cls
	if fresh && old != nil {
		// A new unit or key is a new limit: its buckets and counters start over.
		if err := d.purgeBuckets(id, old.entry.Gen); err != nil {
			return fmt.Errorf("set limit %d: %w", id, err)
		}
		if err := d.clearCounters(id); err != nil {
			return fmt.Errorf("set limit %d: %w", id, err)
		}
	}
	return nil
}

// Check reports whether the data path could hold exactly these limits, by
// id, without writing anything: every limit valid, every id in range, and
// the classifier within the maps' sizes. A caller that checks a whole new
// set first never applies half of it.
func (d *Datapath) Check(limits map[uint32]Limit) error {
	set := make(map[uint32]*installed, len(limits))
	for id, l := range limits {
		if id >= MaxLimits {
			return fmt.Errorf("limit %d: id out of range 0..%d: %w", id, MaxLimits-1, ErrTableFull)
		}
		l = l.clone()
		l.Match.SrcCIDRs = unmapAll(l.Match.SrcCIDRs)
		l.Match.DstCIDRs = unmapAll(l.Match.DstCIDRs)
		if err := l.Validate(); err != nil {
			return fmt.Errorf("limit %d: %w", id, err)
		}
		set[id] = &installed{limit: l}
	}
	return d.checkCapacity(buildClassifier(set, nil, 0))
}

// DeleteLimit removes a limit: its classifier entries, its buckets and its
// counters.
func (d *Datapath) DeleteLimit(id uint32) error {
	old, ok := d.limits[id]
	if !ok {
		return fmt.Errorf("delete limit %d: %w", id, ErrUnknownLimit)
	}
	next := make(map[uint32]*installed, len(d.limits))
	for k, v := range d.limits {
		if k != id {
			next[k] = v
		}
	}
	cls := buildClassifier(next, &d.state.cfg, d.state.cfg.LastGen)
	if err := d.apply(d.state, cls); err != nil {
		return fmt.Errorf("delete limit %d: %w", id, err)
	}
	d.limits = next
	d.state = cls
	if err := d.objs.RlLimits.Put(id, &bpf.RatelimitRlLimit{}); err != nil {
		return fmt.Errorf("delete limit %d: clear entry: %w", id, err)
	}
	if err := d.clearCounters(id); err != nil {
		return fmt.Errorf("delete limit %d: %w", id, err)
	}
	if err := d.objs.RlMeta.Put(id, &bpf.RatelimitRlLimitMeta{}); err != nil {
		return fmt.Errorf("delete limit %d: clear meta: %w", id, err)
	}
	if err := d.purgeBuckets(id, old.entry.Gen); err != nil {
		return fmt.Errorf("delete limit %d: %w", id, err)
	}
	return nil
}

// Limit returns the limit with this id as it was set.
func (d *Datapath) Limit(id uint32) (Limit, error) {
	in, ok := d.limits[id]
	if !ok {
		return Limit{}, fmt.Errorf("limit %d: %w", id, ErrUnknownLimit)
	}
	return in.limit.clone(), nil
}

// IDs lists the ids of the limits that are set.
func (d *Datapath) IDs() []uint32 {
	ids := make([]uint32, 0, len(d.limits))
	for id := range d.limits {
		ids = append(ids, id)
	}
	return sortedIDs(ids)
}

func (d *Datapath) possibleCPUs() int {
	n, err := ebpf.PossibleCPU()
	if err != nil {
		return d.ncpu
	}
	return n
}

// checkCapacity fails with ErrTableFull if cls does not fit the maps.
func (d *Datapath) checkCapacity(cls *classifier) error {
	for _, t := range []struct {
		side string
		m    map[netip.Prefix]mask
		m4   *ebpf.Map
		m6   *ebpf.Map
	}{{"source", cls.src, d.objs.RlSrc4, d.objs.RlSrc6}, {"destination", cls.dst, d.objs.RlDst4, d.objs.RlDst6}} {
		var n4, n6 uint32
		for p := range t.m {
			if p.Addr().Is4() {
				n4++
			} else {
				n6++
			}
		}
		if n4 > t.m4.MaxEntries() || n6 > t.m6.MaxEntries() {
			return fmt.Errorf("%s prefixes: %d IPv4 and %d IPv6 over all limits, the maps hold %d and %d: %w",
				t.side, n4, n6, t.m4.MaxEntries(), t.m6.MaxEntries(), ErrTableFull)
		}
	}
	return nil
}

// rollback restores the maps to the mirror after a failed change of id.
func (d *Datapath) rollback(id uint32, prev *bpf.RatelimitRlLimit) error {
	cur, err := d.readClassifier()
	if err != nil {
		return err
	}
	if err := d.apply(cur, d.state); err != nil {
		return err
	}
	return d.objs.RlLimits.Put(id, prev)
}

func (d *Datapath) clearCounters(id uint32) error {
	zero := make([]bpf.RatelimitRlLimitCpu, d.possibleCPUs())
	if err := d.objs.RlPercpu.Put(id, zero); err != nil {
		return fmt.Errorf("clear counters: %w", err)
	}
	if err := d.objs.RlPace.Put(id, make([]bpf.RatelimitRlPaceStats, d.possibleCPUs())); err != nil {
		return fmt.Errorf("clear counters: %w", err)
	}
	return nil
}

func (d *Datapath) purgeBuckets(id, gen uint32) error {
	var dead []bpf.RatelimitRlBucketKey
	err := d.eachBucket(func(_ uint32, _ int, k *bpf.RatelimitRlBucketKey, _ uint64) {
		if k.Limit == id && k.Gen == gen {
			dead = append(dead, *k)
		}
	})
	if err != nil {
		return fmt.Errorf("list buckets: %w", err)
	}
	// A way a new key took meanwhile is not its any more: the
	// compare-and-swap of its tag fails, and leaves it be.
	for i := range dead {
		if err := d.clearBucket(&dead[i]); err != nil {
			return fmt.Errorf("delete bucket: %w", err)
		}
	}
	// The keys' shares of their own go with the buckets.
	return d.deleteOverrides(id, gen)
}

// adopt reads the state of maps that were already pinned, and puts right
// what an older version left (port entries without their class's port-less
// limits; no hash seed). Only a writer adopts: readers use load.
func (d *Datapath) adopt() error {
	if err := d.load(); err != nil {
		return err
	}
	cls := d.state
	if cls.unfolded {
		// Port entries without their class's port-less limits: the data
		// path would miss those limits on packets with ports.
		folded := *cls
		folded.unfolded = false
		if err := d.apply(cls, &folded); err != nil {
			return fmt.Errorf("rewrite port table: %w", err)
		}
		cls = &folded
	}
	// The first stage of the IPv4 prefix match is derived from the
	// tries. Maps of a version without it (a migration copies the tries
	// and starts it empty) get it here, before a packet of the new
	// programs reads it; so do maps where it went astray.
	derived := *cls
	derived.src4Head, derived.dst4Head = make([]head4, head4Entries), make([]head4, head4Entries)
	heads4(cls.src, derived.src4Head)
	heads4(cls.dst, derived.dst4Head)
	if !slices.Equal(derived.src4Head, cls.src4Head) || !slices.Equal(derived.dst4Head, cls.dst4Head) {
		if err := d.apply(cls, &derived); err != nil {
			return fmt.Errorf("rewrite the prefixes' first stage: %w", err)
		}
		cls = &derived
	}
	if cls.cfg.Seed == [2]uint64{} {
		// New maps: key the hash of the keyed buckets. Kept in the pinned
		// config, so that a restarted agent finds the same cache sets.
		next := *cls
		next.cfg.Seed = d.opts.HashSeed
		for next.cfg.Seed == [2]uint64{} {
			var b [16]byte
			if _, err := rand.Read(b[:]); err != nil {
				return fmt.Errorf("hash seed: %w", err)
			}
			next.cfg.Seed = [2]uint64{binary.LittleEndian.Uint64(b[:8]), binary.LittleEndian.Uint64(b[8:])}
		}
		if err := d.objs.RlCfg.Put(uint32(0), &next.cfg); err != nil {
			return fmt.Errorf("write hash seed: %w", err)
		}
		cls = &next
	}
	d.state = cls
	return nil
}

// load reads the state of the maps (pinned or new) into d: the classifier
// and the limits. It writes nothing.
func (d *Datapath) load() error {
	cls, err := d.readClassifier()
	if err != nil {
		return err
	}
	d.state = cls
	var (
		id uint32
		e  bpf.RatelimitRlLimit
	)
	it := d.objs.RlLimits.Iterate()
	for it.Next(&id, &e) {
		if e.Gen == 0 {
			continue
		}
		p := e.Params[e.Active&1]
		l := Limit{
			Rate:    p.Rate,
			Burst:   p.Burst,
			Unit:    Unit(e.Unit),
			Key:     KeyKind(e.KeyKind),
			Action:  Action(e.Action),
			Horizon: time.Duration(e.HorizonNs),
			Hot:     e.Hot != 0,
			Match:   cls.matchOf(id),
		}
		if l.Key.prefixKey() {
			l.Prefix4 = uint8(bits.OnesCount32(e.Prefix4))
			for _, w := range e.Prefix6 {
				l.Prefix6 += uint8(bits.OnesCount32(w))
			}
		}
		d.limits[id] = &installed{limit: l, entry: e}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("read limits: %w", err)
	}
	return nil
}

func unmapAll(ps []netip.Prefix) []netip.Prefix {
	for i, p := range ps {
		if p.Addr().Is4In6() {
			bits := p.Bits() - 96
			if bits < 0 {
				bits = 0
			}
			ps[i] = netip.PrefixFrom(p.Addr().Unmap(), bits)
		}
		ps[i] = ps[i].Masked()
	}
	return ps
}

func netmask4(n int) uint32 {
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], ^uint32(0)<<(32-n))
	return binary.LittleEndian.Uint32(b[:])
}

func netmask6(n int) (m [4]uint32) {
	for i := range m {
		bits := min(max(n-32*i, 0), 32)
		if bits > 0 {
			m[i] = netmask4(bits)
		}
	}
	return m
}

// Seq is the parameter sequence number of a limit: it moves on every write
// of the limit's rate or burst. 0 for an unknown limit.
func (d *Datapath) Seq(id uint32) uint32 {
	if in, ok := d.limits[id]; ok {
		return in.entry.Seq
	}
	return 0
}
