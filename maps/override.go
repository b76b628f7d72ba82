package maps

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/bpf"
)

// Key shares.
//
// A key of a keyed limit may have a node share of its own (demand shares
// of keyed limits): its bucket then refills at the key's rate, up to the
// key's burst, instead of the limit's. The data path looks a key's share
// up when a CPU takes the key's cache way and when the limit's shares
// change (SetKeyShares bumps the limit's override epoch), then on each
// lease only for the keys that have one: a key without one costs no
// lookup. A live bucket takes a change at its CPU's next lease.

// MaxKeyShares is how many keys can have a share of their own, over all
// limits.
const MaxKeyShares = int(bpf.RatelimitRlConstRL_MAX_OVERRIDES)

// KeyShare is a key's own node share.
type KeyShare struct {
	Rate  uint64 // units per second; 0 admits nothing
	Burst uint64 // units; at least 1 unless Rate is 0
}

// SetKeyShares makes shares the keys of limit id that have a share of
// their own, keyed by Bucket (Addr for the address keys, masked to the
// limit's prefix; Protocol and Port for dst-port, Port 0 for a packet
// without ports): it writes the new and changed ones and deletes those not
// in shares. Each key's bucket goes on from its tokens now: its clock
// continues from the limit's (or its previous share's) at the moment of
// the write. Should the table fill midway (MaxKeyShares over all limits),
// the removals and the decreases are written first and take effect, and
// the error says what was not.
func (d *Datapath) SetKeyShares(id uint32, shares map[Bucket]KeyShare) error {
	in, ok := d.limits[id]
	if !ok {
		return fmt.Errorf("key shares of limit %d: %w", id, ErrUnknownLimit)
	}
	if in.limit.Key == KeyNone || in.limit.Action == Pace {
		return fmt.Errorf("key shares of limit %d: only a keyed limit that is not paced has them", id)
	}
	keys := make(map[bpf.RatelimitRlBucketKey]KeyShare, len(shares))
	for b, s := range shares {
		l := Limit{Rate: s.Rate, Burst: s.Burst}
		if err := l.Validate(); err != nil {
			return fmt.Errorf("key shares of limit %d: key %v: %w", id, b, err)
		}
		k, err := bucketKeyOf(&in.limit, b)
		if err != nil {
			return fmt.Errorf("key shares of limit %d: %w", id, err)
		}
		k.Limit, k.Gen = id, in.entry.Gen
		keys[k] = s
	}
	now, err := d.clockOf(in.limit.Action)
	if err != nil {
		return fmt.Errorf("key shares of limit %d: %w", id, err)
	}
	cur := in.entry.Params[in.entry.Active&1]
	// The keys that lose their share go first (room for the new ones),
	// then the writes, those that lower a key's rate first: a table that
	// fills midway leaves the decreases done, the increases not.
	keep := func(k bpf.RatelimitRlBucketKey) bool { _, ok := keys[k]; return ok }
	removed, err := d.overridesOf(id, in.entry.Gen, keep)
	if err != nil {
		return fmt.Errorf("key shares of limit %d: %w", id, err)
	}
	changed := false
	var werr error
	for k := range removed {
		if err := d.objs.RlOverrides.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			werr = fmt.Errorf("key shares of limit %d: delete: %w", id, err)
			delete(removed, k)
			continue
		}
		changed = true
	}
	type write struct {
		k    bpf.RatelimitRlBucketKey
		ov   bpf.RatelimitRlOverride
		down bool
	}
	var writes []write
	for k, s := range keys {
		var old bpf.RatelimitRlOverride
		had := d.objs.RlOverrides.Lookup(k, &old) == nil
		if had && old.Params.Rate == s.Rate && old.Params.Burst == s.Burst {
			continue
		}
		from := cur
		if had {
			from = old.Params
		}
		writes = append(writes, write{k: k, down: s.Rate < from.Rate, ov: bpf.RatelimitRlOverride{
			Params: bpf.RatelimitRlParams{
				Rate: s.Rate, Burst: s.Burst, Chunk: chunk(s.Rate, s.Burst, d.ncpu),
				BaseNs: now, BaseV: vclock(&from, now),
			},
			Seq: old.Seq + 1,
		}})
	}
	slices.SortFunc(writes, func(a, b write) int {
		if a.down != b.down {
			if a.down {
				return -1
			}
			return 1
		}
		return cmp.Compare(a.ov.Params.Rate, b.ov.Params.Rate)
	})
	for _, w := range writes {
		if werr != nil {
			break
		}
		if err := d.objs.RlOverrides.Put(w.k, &w.ov); err != nil {
			werr = fmt.Errorf("key shares of limit %d: write (at most %d keys over all limits): %w", id, MaxKeyShares, err)
			break
		}
		changed = true
	}
	if !changed {
		return werr
	}
	// Every CPU looks its keys up again.
	e := in.entry
	e.OvEpoch = (e.OvEpoch + 1) & 0x7fffffff
	if e.OvEpoch == 0 {
		e.OvEpoch = 1
	}
	if err := d.objs.RlLimits.Put(id, &e); err != nil {
		return errors.Join(werr, fmt.Errorf("key shares of limit %d: write entry: %w", id, err))
	}
	next := make(map[uint32]*installed, len(d.limits))
	maps.Copy(next, d.limits)
	next[id] = &installed{limit: in.limit, entry: e}
	d.limits = next
	// A key whose share went is back on the limit's clock, which is not
	// where its own was: its pool moves by the difference, so that it
	// owes what it owed. The move is a compare-and-swap of the pool, as
	// a lease is: a CPU that leases meanwhile makes it read the pool again.
	for k, ov := range removed {
		vOwn, vLim := vclock(&ov.Params, now), vclock(&cur, now)
		floor := vLim - min(vLim, cur.Burst)
		err := d.moveBucket(&k, func(vEmpty uint64) uint64 {
			owed := vEmpty - min(vEmpty, vOwn-min(vOwn, ov.Params.Burst)) // 0..burst: the tokens it lacks
			return floor + min(owed, cur.Burst)
		})
		if err != nil {
			return errors.Join(werr, fmt.Errorf("key shares of limit %d: move a bucket to the limit's clock: %w", id, err))
		}
	}
	// What was written takes effect (the epoch above), also when a write
	// failed: the caller tries the rest again.
	return werr
}

// KeyShares returns the keys of limit id that have a share of their own.
func (d *Datapath) KeyShares(id uint32) (map[Bucket]KeyShare, error) {
	in, ok := d.limits[id]
	if !ok {
		return nil, fmt.Errorf("key shares of limit %d: %w", id, ErrUnknownLimit)
	}
	out := make(map[Bucket]KeyShare)
	if d.objs.RlOverrides == nil {
		return out, nil // pins of a version without key shares
	}
	var (
		k  bpf.RatelimitRlBucketKey
		ov bpf.RatelimitRlOverride
	)
	it := d.objs.RlOverrides.Iterate()
	for it.Next(&k, &ov) {
		if k.Limit == id && k.Gen == in.entry.Gen {
			out[bucketOf(&in.limit, k.Addr)] = KeyShare{Rate: ov.Params.Rate, Burst: ov.Params.Burst}
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("key shares of limit %d: %w", id, err)
	}
	return out, nil
}

// KeyUsage returns, by limit id and key, the units each key with a share
// of its own has had from its bucket since its share was last written
// (tokens leased to the CPUs' caches, or drawn without one): two reads
// make the key's use of its share, to a lease (a millisecond of its rate).
// A key whose share is written again starts at 0.
func (d *Datapath) KeyUsage() (map[uint32]map[Bucket]uint64, error) {
	out := make(map[uint32]map[Bucket]uint64)
	if d.objs.RlOverrides == nil {
		return out, nil
	}
	var (
		k  bpf.RatelimitRlBucketKey
		ov bpf.RatelimitRlOverride
	)
	it := d.objs.RlOverrides.Iterate()
	for it.Next(&k, &ov) {
		in, ok := d.limits[k.Limit]
		if !ok || in.entry.Gen != k.Gen {
			continue
		}
		if out[k.Limit] == nil {
			out[k.Limit] = make(map[Bucket]uint64)
		}
		out[k.Limit][bucketOf(&in.limit, k.Addr)] = ov.Leased
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("key usage: %w", err)
	}
	return out, nil
}

// deleteOverrides deletes the overrides of limit id, generation gen.
func (d *Datapath) deleteOverrides(id, gen uint32) error {
	dead, err := d.overridesOf(id, gen, nil)
	if err != nil {
		return err
	}
	for k := range dead {
		if err := d.objs.RlOverrides.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("delete key share: %w", err)
		}
	}
	return nil
}

// overridesOf returns the overrides of limit id, generation gen, that keep
// does not keep (nil: all of them).
func (d *Datapath) overridesOf(id, gen uint32, keep func(bpf.RatelimitRlBucketKey) bool) (map[bpf.RatelimitRlBucketKey]bpf.RatelimitRlOverride, error) {
	var (
		k  bpf.RatelimitRlBucketKey
		ov bpf.RatelimitRlOverride
	)
	out := make(map[bpf.RatelimitRlBucketKey]bpf.RatelimitRlOverride)
	it := d.objs.RlOverrides.Iterate()
	for it.Next(&k, &ov) {
		if k.Limit == id && k.Gen == gen && (keep == nil || !keep(k)) {
			out[k] = ov
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("list key shares: %w", err)
	}
	return out, nil
}

// bucketKeyOf is the rl_bucket_key.addr of l's bucket b (bucketOf's
// inverse; an address masked to the limit's prefix).
func bucketKeyOf(l *Limit, b Bucket) (bpf.RatelimitRlBucketKey, error) {
	var k bpf.RatelimitRlBucketKey
	if l.Key == KeyDstPort {
		class := classOther
		switch b.Protocol {
		case TCP:
			class = classTCP
		case UDP:
			class = classUDP
		case ICMP:
			class = classICMP
		}
		k.Addr[0], k.Addr[1] = uint32(class), uint32(b.Port)
		if b.Port == 0 || class == classICMP || class == classOther {
			k.Addr[1] = 0x10000 // no port
		}
		return k, nil
	}
	if !b.Addr.IsValid() {
		return k, fmt.Errorf("key %v: no address", b)
	}
	a := b.Addr.Unmap()
	if l.Key.prefixKey() {
		bits := int(l.Prefix6)
		if a.Is4() {
			bits = int(l.Prefix4)
		}
		p, err := a.Prefix(bits)
		if err != nil {
			return k, fmt.Errorf("key %v: %w", b, err)
		}
		a = p.Addr()
	}
	a16 := a.As16()
	if a.Is4() {
		a16 = [16]byte{10: 0xff, 11: 0xff, 12: a16[12], 13: a16[13], 14: a16[14], 15: a16[15]}
	}
	for i := range k.Addr {
		k.Addr[i] = binary.NativeEndian.Uint32(a16[4*i:])
	}
	return k, nil
}
