package maps

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/bpf"
)

// Reader is a read-only view of a data path's maps, for `rlagent status`,
// the metrics and any other reader. It has no method that writes, and the
// Reader of OpenPinned holds read-only descriptors (BPF_F_RDONLY): the kernel
// refuses a write through them, whatever the caller does.
type Reader struct {
	d   *Datapath
	own bool // Close closes d
}

// Reader returns a read-only view of d, valid while d is open.
func (d *Datapath) Reader() *Reader { return &Reader{d: d} }

// ErrNotPinned means there are no pinned maps in the directory.
var ErrNotPinned = errors.New("no pinned data path")

// mapNames are the pin names of the data path's maps, from the ebpf tags of
// the generated struct.
func mapNames() []string {
	t := reflect.TypeFor[bpf.RatelimitMaps]()
	names := make([]string, 0, t.NumField())
	for i := range t.NumField() {
		if name := t.Field(i).Tag.Get("ebpf"); name != "" {
			names = append(names, name)
		}
	}
	return names
}

// OpenPinned opens the maps pinned in dir for reading, without loading any
// program and without writing anything, even what an agent would put right
// on adopting them. It works while the agent is down.
func OpenPinned(pinDir string) (*Reader, error) {
	dir, err := currentDir(pinDir)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", pinDir, err)
	}
	if dir == "" {
		return nil, fmt.Errorf("open %s: %w", pinDir, ErrNotPinned)
	}
	if _, err := os.Stat(filepath.Join(dir, bpf.RatelimitMapRlLimits)); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("open %s: %w", dir, ErrNotPinned)
		}
		return nil, fmt.Errorf("open %s: %w", dir, err)
	}
	spec, err := bpf.LoadRatelimit()
	if err != nil {
		return nil, fmt.Errorf("read data path ELF: %w", err)
	}
	d := &Datapath{opts: Options{PinDir: dir}, limits: make(map[uint32]*installed)}
	v := reflect.ValueOf(&d.objs.RatelimitMaps).Elem()
	for i := range v.NumField() {
		name := v.Type().Field(i).Tag.Get("ebpf")
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if errors.Is(err, os.ErrNotExist) {
			// A map this version has and the pinning agent's had not:
			// left nil; readers of it report it missing.
			continue
		}
		if err != nil {
			d.objs.RatelimitMaps.Close()
			return nil, fmt.Errorf("open pinned map %s: %w", name, err)
		}
		v.Field(i).Set(reflect.ValueOf(m))
		if err := compatible(m, spec.Maps[name]); err != nil {
			d.objs.RatelimitMaps.Close()
			return nil, fmt.Errorf("open pinned map %s in %s: %w", name, dir, err)
		}
	}
	// The maps every layout has had: one missing means the directory was
	// being replaced while it was read (an agent moving its state to a
	// new layout removes the old pins), not an older layout. A reader
	// then fails, never reads a nil map.
	o := &d.objs.RatelimitMaps
	for name, m := range map[string]*ebpf.Map{
		bpf.RatelimitMapRlCfg: o.RlCfg, bpf.RatelimitMapRlLimits: o.RlLimits, bpf.RatelimitMapRlProtoAny: o.RlProtoAny,
		bpf.RatelimitMapRlPorts: o.RlPorts, bpf.RatelimitMapRlSrc4: o.RlSrc4, bpf.RatelimitMapRlSrc6: o.RlSrc6,
		bpf.RatelimitMapRlDst4: o.RlDst4, bpf.RatelimitMapRlDst6: o.RlDst6,
		bpf.RatelimitMapRlSrc4Head: o.RlSrc4Head, bpf.RatelimitMapRlDst4Head: o.RlDst4Head,
	} {
		if m == nil {
			o.Close()
			return nil, fmt.Errorf("open %s: %s went away while the pins were read (an agent replacing them?); read again: %w", dir, name, ErrNotPinned)
		}
	}
	if err := d.load(); err != nil {
		d.objs.RatelimitMaps.Close()
		return nil, fmt.Errorf("read pinned maps in %s: %w", dir, err)
	}
	return &Reader{d: d, own: true}, nil
}

// compatible fails with ebpf.ErrMapIncompatible, and says what to do,
// unless the pinned map m has the layout of ms (its size may differ: some
// are sized by options).
func compatible(m *ebpf.Map, ms *ebpf.MapSpec) error {
	if ms == nil || (m.Type() == ms.Type && m.KeySize() == ms.KeySize && m.ValueSize() == ms.ValueSize) {
		return nil
	}
	return fmt.Errorf("pinned by another version of rlagent (%v, key %d bytes, value %d; this version's: %v, %d, %d; "+
		"`rlagent cleanup` removes the pins, and the agent pins its own when it starts): %w",
		m.Type(), m.KeySize(), m.ValueSize(), ms.Type, ms.KeySize, ms.ValueSize, ebpf.ErrMapIncompatible)
}

// Close releases the descriptors of a Reader from OpenPinned. A view of a
// Datapath (Datapath.Reader) leaves it open.
func (r *Reader) Close() error {
	if !r.own {
		return nil
	}
	return r.d.objs.RatelimitMaps.Close()
}

// IDs lists the ids of the limits that are set.
func (r *Reader) IDs() []uint32 { return r.d.IDs() }

// Limit returns the limit with this id.
func (r *Reader) Limit(id uint32) (Limit, error) { return r.d.Limit(id) }

// Meta reads what the agent recorded for the limit with this id.
func (r *Reader) Meta(id uint32) (Meta, error) { return r.d.Meta(id) }

// Stats reads a limit's counters.
func (r *Reader) Stats(id uint32) (Stats, error) { return r.d.Stats(id) }

// GlobalStats reads the counters that belong to no limit.
func (r *Reader) GlobalStats() (GlobalStats, error) { return r.d.GlobalStats() }

// KeyCounts counts the live buckets of every keyed limit.
func (r *Reader) KeyCounts() (map[uint32]int, error) { return r.d.KeyCounts() }

// KeyShares reads the keys of limit id that have a share of their own.
func (r *Reader) KeyShares(id uint32) (map[Bucket]KeyShare, error) { return r.d.KeyShares(id) }

// RemovePins removes the pinned maps in pinDir, of every layout, and the
// symlink to the current one (rlagent cleanup). A map lives on while a
// program or a descriptor uses it; links are removed by the caller first.
// Missing pins are not an error.
func RemovePins(pinDir string) error {
	err := removeOtherLayouts(pinDir, "")
	if rerr := os.Remove(filepath.Join(pinDir, currentLink)); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
		err = errors.Join(err, rerr)
	}
	return err
}
