package maps

import (
	"errors"
	"fmt"
	"time"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/bpf"
)

// Meta is what the agent records of a limit next to its entry, so that
// status can be read from the pinned maps while the agent is down.
type Meta struct {
	Name        string
	GlobalRate  uint64
	GlobalBurst uint64
	Scope       uint8
	Replicas    uint32    // the count the share was divided by
	Local       uint32    // service scope: replicas on this node
	Observed    time.Time // when the count was last confirmed; zero if never
	Stale       bool      // the count source failed on its last read

	// State says whether the limit is enforced as configured, clamped to
	// the data path's range, or not enforced at all; Note says why.
	State MetaState
	Note  string

	// Counters at the agent's last snapshot: status divides the growth
	// since then by the time since then.
	SnapAt       time.Time
	SnapAdmitted uint64
	SnapDropped  uint64
	SnapShadow   uint64
}

// Equal reports whether m and o record the same: their times compared as
// instants, which is all the pins keep of them.
func (m Meta) Equal(o Meta) bool {
	if !m.Observed.Equal(o.Observed) || !m.SnapAt.Equal(o.SnapAt) {
		return false
	}
	m.Observed, m.SnapAt, o.Observed, o.SnapAt = time.Time{}, time.Time{}, time.Time{}, time.Time{}
	return m == o
}

// MetaState is what became of a limit the agent was asked to enforce.
type MetaState uint8

const (
	// Applied: enforced at its share.
	Applied = MetaState(bpf.RatelimitRlMetaStateRL_META_APPLIED)
	// Clamped: enforced, with its share clamped to the data path's range.
	Clamped = MetaState(bpf.RatelimitRlMetaStateRL_META_CLAMPED)
	// Rejected: not enforced, because it does not fit the data path.
	Rejected = MetaState(bpf.RatelimitRlMetaStateRL_META_REJECTED)
)

var metaStateNames = [...]string{Applied: "applied", Clamped: "clamped", Rejected: "rejected"}

// String names the state as status prints it.
func (s MetaState) String() string { return nameOf(metaStateNames[:], s, "state") }

const (
	maxName = len(bpf.RatelimitRlLimitMeta{}.Name)
	maxNote = len(bpf.RatelimitRlLimitMeta{}.Note)
)

// SetMeta records m for the limit with this id.
func (d *Datapath) SetMeta(id uint32, m Meta) error {
	if len(m.Name) >= maxName {
		return fmt.Errorf("meta of limit %d: name longer than %d bytes", id, maxName-1)
	}
	var v bpf.RatelimitRlLimitMeta
	for i := range len(m.Name) {
		v.Name[i] = int8(m.Name[i])
	}
	v.GlobalRate = m.GlobalRate
	v.GlobalBurst = m.GlobalBurst
	v.Scope = m.Scope
	v.Replicas = m.Replicas
	v.Local = m.Local
	v.ObservedUnixNs = unixNano(m.Observed)
	if m.Stale {
		v.Stale = 1
	}
	v.State = uint8(m.State)
	note := m.Note
	if len(note) >= maxNote {
		note = note[:maxNote-4] + "..."
	}
	for i := range len(note) {
		v.Note[i] = int8(note[i])
	}
	v.SnapUnixNs = unixNano(m.SnapAt)
	v.SnapAdmitted = m.SnapAdmitted
	v.SnapDropped = m.SnapDropped
	v.SnapShadow = m.SnapShadow
	if err := d.objs.RlMeta.Put(id, &v); err != nil {
		return fmt.Errorf("meta of limit %d: %w", id, err)
	}
	return nil
}

// Meta reads what was recorded for the limit with this id.
func (d *Datapath) Meta(id uint32) (Meta, error) {
	var v bpf.RatelimitRlLimitMeta
	if err := d.objs.RlMeta.Lookup(id, &v); err != nil {
		return Meta{}, fmt.Errorf("meta of limit %d: %w", id, err)
	}
	return metaOf(&v), nil
}

// Metas reads the metadata of every id that names a limit (see MetaIDs),
// in one batch where the kernel has batch lookups: what a reconcile
// compares its plan with.
func (d *Datapath) Metas() (map[uint32]Meta, error) {
	if d.objs.RlMeta == nil {
		return nil, fmt.Errorf("read limit meta: %s is not pinned", bpf.RatelimitMapRlMeta)
	}
	out := make(map[uint32]Meta)
	add := func(id uint32, v *bpf.RatelimitRlLimitMeta) {
		if v.Name[0] != 0 {
			out[id] = metaOf(v)
		}
	}
	if err := readAll(d.objs.RlMeta, int(MaxLimits), add, func() { clear(out) }); err != nil {
		return nil, fmt.Errorf("read limit meta: %w", err)
	}
	return out, nil
}

func metaOf(v *bpf.RatelimitRlLimitMeta) Meta {
	return Meta{
		Name:         cString(v.Name[:]),
		GlobalRate:   v.GlobalRate,
		GlobalBurst:  v.GlobalBurst,
		Scope:        v.Scope,
		Replicas:     v.Replicas,
		Local:        v.Local,
		Observed:     fromUnixNano(v.ObservedUnixNs),
		Stale:        v.Stale != 0,
		State:        MetaState(v.State),
		Note:         cString(v.Note[:]),
		SnapAt:       fromUnixNano(v.SnapUnixNs),
		SnapAdmitted: v.SnapAdmitted,
		SnapDropped:  v.SnapDropped,
		SnapShadow:   v.SnapShadow,
	}
}

func cString(b []int8) string {
	out := make([]byte, 0, len(b))
	for _, c := range b {
		if c == 0 {
			break
		}
		out = append(out, byte(c))
	}
	return string(out)
}

func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func fromUnixNano(ns int64) time.Time {
	if ns == 0 {
		return time.Time{}
	}
	return time.Unix(0, ns)
}

// KeyCounts counts the live buckets of every keyed limit.
func (d *Datapath) KeyCounts() (map[uint32]int, error) {
	out := make(map[uint32]int)
	err := d.eachBucket(func(_ uint32, _ int, k *bpf.RatelimitRlBucketKey, _ uint64) {
		if in, ok := d.limits[k.Limit]; ok && in.entry.Gen == k.Gen {
			out[k.Limit]++
		}
	})
	if err != nil {
		return nil, fmt.Errorf("count buckets: %w", err)
	}
	return out, nil
}

// readAll calls each for every entry of m (of a per-CPU map, once a CPU):
// in batches of up to batch entries where the kernel has batch lookups,
// else entry by entry. A kernel without batch lookups of m's type may say
// so after a first batch: reset is called then, before the entries are
// read again one by one.
func readAll[K, V any](m *ebpf.Map, batch int, each func(K, *V), reset func()) error {
	per := 1
	if perCPU(m.Type()) {
		n, err := ebpf.PossibleCPU()
		if err != nil {
			return err
		}
		per = n
	}
	var (
		cursor ebpf.MapBatchCursor
		keys   = make([]K, batch)
		vals   = make([]V, batch*per)
	)
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		for i := range n {
			for c := range per {
				each(keys[i], &vals[i*per+c])
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil
		}
		if errors.Is(err, ebpf.ErrNotSupported) {
			break
		}
		if err != nil {
			return err
		}
	}
	reset()
	var k K
	it := m.Iterate()
	if per > 1 {
		var vs []V
		for it.Next(&k, &vs) {
			for c := range vs {
				each(k, &vs[c])
			}
		}
		return it.Err()
	}
	var v V
	for it.Next(&k, &v) {
		each(k, &v)
	}
	return it.Err()
}

// perCPU says whether maps of type t hold a value per CPU.
func perCPU(t ebpf.MapType) bool {
	switch t {
	case ebpf.PerCPUHash, ebpf.PerCPUArray, ebpf.LRUCPUHash, ebpf.PerCPUCGroupStorage:
		return true
	}
	return false
}

// MetaIDs lists, in order, the ids whose metadata names a limit: the
// limits that are set and those the agent records without an entry (a
// limit it could not apply). IDs lists only the first kind.
func (d *Datapath) MetaIDs() ([]uint32, error) {
	metas, err := d.Metas()
	if err != nil {
		return nil, err
	}
	ids := make([]uint32, 0, len(metas))
	for id := range metas {
		ids = append(ids, id)
	}
	return sortedIDs(ids), nil
}

// MetaIDs is Datapath.MetaIDs.
func (r *Reader) MetaIDs() ([]uint32, error) { return r.d.MetaIDs() }

// Metas is Datapath.Metas.
func (r *Reader) Metas() (map[uint32]Meta, error) { return r.d.Metas() }
