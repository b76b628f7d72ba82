package maps

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
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

	// Counters at the agent's last snapshot: status divides the growth
	// since then by the time since then.
	SnapAt       time.Time
	SnapAdmitted uint64
	SnapDropped  uint64
	SnapShadow   uint64
}

const maxName = len(bpf.RatelimitRlLimitMeta{}.Name)

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
	name := make([]byte, 0, maxName)
	for _, c := range v.Name {
		if c == 0 {
			break
		}
		name = append(name, byte(c))
	}
	return Meta{
		Name:         string(bytes.Clone(name)),
		GlobalRate:   v.GlobalRate,
		GlobalBurst:  v.GlobalBurst,
		Scope:        v.Scope,
		Replicas:     v.Replicas,
		Local:        v.Local,
		Observed:     fromUnixNano(v.ObservedUnixNs),
		Stale:        v.Stale != 0,
		SnapAt:       fromUnixNano(v.SnapUnixNs),
		SnapAdmitted: v.SnapAdmitted,
		SnapDropped:  v.SnapDropped,
		SnapShadow:   v.SnapShadow,
	}, nil
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

// ErrNotPinned means there are no pinned maps in the directory.
var ErrNotPinned = errors.New("no pinned data path")

// OpenPinned opens the maps pinned in dir without loading any program, for
// reading (status) or for removing the pins (cleanup). The result has no
// program: Now, SetLimit and Buckets' token counts are not available.
func OpenPinned(dir string) (*Datapath, error) {
	if _, err := os.Stat(filepath.Join(dir, bpf.RatelimitMapRlLimits)); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("open %s: %w", dir, ErrNotPinned)
		}
		return nil, fmt.Errorf("open %s: %w", dir, err)
	}
	d := &Datapath{opts: Options{PinDir: dir}, limits: make(map[uint32]*installed)}
	// Each field of RatelimitMaps names its map in its ebpf tag.
	v := reflect.ValueOf(&d.objs.RatelimitMaps).Elem()
	for i := range v.NumField() {
		name := v.Type().Field(i).Tag.Get("ebpf")
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), nil)
		if err != nil {
			d.objs.RatelimitMaps.Close()
			return nil, fmt.Errorf("open pinned map %s: %w", name, err)
		}
		v.Field(i).Set(reflect.ValueOf(m))
	}
	if err := d.adopt(); err != nil {
		d.objs.RatelimitMaps.Close()
		return nil, err
	}
	return d, nil
}

// Unpin removes the pinned maps of a data path opened with PinDir or
// OpenPinned. The maps live on while a program or a descriptor uses them.
func (d *Datapath) Unpin() error {
	var errs []error
	v := reflect.ValueOf(&d.objs.RatelimitMaps).Elem()
	for i := range v.NumField() {
		if m, ok := v.Field(i).Interface().(*ebpf.Map); ok && m != nil && m.IsPinned() {
			if err := m.Unpin(); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// KeyCounts counts the live buckets of every keyed limit.
func (d *Datapath) KeyCounts() (map[uint32]int, error) {
	out := make(map[uint32]int)
	var (
		cursor ebpf.MapBatchCursor
		keys   = make([]bpf.RatelimitRlBucketKey, 4096)
		vals   = make([]bpf.RatelimitRlPool, 4096)
	)
	count := func(k bpf.RatelimitRlBucketKey) {
		if in, ok := d.limits[k.Limit]; ok && in.entry.Gen == k.Gen {
			out[k.Limit]++
		}
	}
	for {
		n, err := d.objs.RlBuckets.BatchLookup(&cursor, keys, vals, nil)
		for i := range n {
			count(keys[i])
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return out, nil
		}
		if errors.Is(err, ebpf.ErrNotSupported) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("count buckets: %w", err)
		}
	}
	clear(out)
	var k bpf.RatelimitRlBucketKey
	var v bpf.RatelimitRlPool
	it := d.objs.RlBuckets.Iterate()
	for it.Next(&k, &v) {
		count(k)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("count buckets: %w", err)
	}
	return out, nil
}
