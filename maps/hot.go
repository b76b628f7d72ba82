package maps

import (
	"cmp"
	"fmt"
	"slices"

	"github.com/rlagent/rlagent/bpf"
)

// Hot keys.
//
// A keyed limit with Hot set records the keys whose buckets run short: a
// key whose bucket turned packets away on a CPU in two consecutive ticks
// (2^shift ns of the limits' clock, SetHotTick) is recorded by that CPU
// once a tick, in a ring of HotRing records per CPU, with the units it
// turned away in the first of the two ticks. A key short in a single tick
// (a flood of keys that send a packet or two each) records nothing, and
// the rings bound what a flood of hot keys writes. HotKeys reads them.

// HotRing is how many hot-key records each CPU keeps.
const HotRing = int(bpf.RatelimitRlConstRL_HOT_RING)

// DefaultHotShift makes a hot-key tick 2^30 ns, about 1.07 s.
const DefaultHotShift = 30

// HotKey is a key that was hot in a tick, over the CPUs that recorded it.
type HotKey struct {
	ID uint32 // the limit
	// Key is the bucket's key (its Tokens are not read: 0).
	Key Bucket
	// Tick is the tick (the limits' clock >> shift) in which the key was
	// short, and Short the units its bucket turned away in it, summed over
	// the CPUs. It admitted its share meanwhile.
	Tick  uint32
	Short uint64
}

// SetHotTick makes a hot-key tick 2^shift ns (0: no key is recorded).
func (d *Datapath) SetHotTick(shift uint32) error {
	if shift > 40 {
		return fmt.Errorf("hot tick: 2^%d ns is more than 2^40 ns", shift)
	}
	if d.state.cfg.HotShift == shift {
		return nil
	}
	cfg := d.state.cfg
	cfg.HotShift = shift
	if err := d.objs.RlCfg.Put(uint32(0), &cfg); err != nil {
		return fmt.Errorf("hot tick: write config: %w", err)
	}
	d.state.cfg = cfg
	return nil
}

// HotKeys returns the hot keys recorded in the ticks from since on, one
// HotKey per limit, generation, key and tick (the CPUs' records summed),
// sorted by limit, tick and key. Records overwritten since (more than
// HotRing a CPU) are lost.
func (d *Datapath) HotKeys(since uint32) ([]HotKey, error) {
	type id struct {
		id, gen uint32
		addr    [4]uint32
		tick    uint32
	}
	sum := make(map[id]uint64)
	add := func(_ uint32, r *bpf.RatelimitRlHotRec) {
		if r.Key.Gen == 0 || int32(r.Tick-since) < 0 {
			return
		}
		sum[id{r.Key.Limit, r.Key.Gen, r.Key.Addr, r.Tick}] += r.ShortUnits
	}
	if err := readAll(d.objs.RlHot, 256, add, func() { clear(sum) }); err != nil {
		return nil, fmt.Errorf("read hot keys: %w", err)
	}
	out := make([]HotKey, 0, len(sum))
	for k, short := range sum {
		in, ok := d.limits[k.id]
		if !ok || in.entry.Gen != k.gen || in.limit.Key == KeyNone {
			continue // a record of a limit since deleted or replaced
		}
		out = append(out, HotKey{ID: k.id, Key: bucketOf(&in.limit, k.addr), Tick: k.tick, Short: short})
	}
	slices.SortFunc(out, func(a, b HotKey) int {
		return cmp.Or(cmp.Compare(a.ID, b.ID), cmp.Compare(int32(a.Tick-b.Tick), 0),
			a.Key.Addr.Compare(b.Key.Addr), cmp.Compare(a.Key.Protocol, b.Key.Protocol), cmp.Compare(a.Key.Port, b.Key.Port))
	})
	return out, nil
}
