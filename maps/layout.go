package maps

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	stdmaps "maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/bpf"
)

// Pin layouts.
//
// The maps of one layout are pinned in a directory of their own,
// PinDir/maps-<epoch>-<hash>, where the hash covers what the kernel checks
// of every map (type, key and value size, maximum entries, flags), and the
// epoch is layoutEpoch, which a change of what a map's bytes mean bumps.
// The symlink PinDir/maps names the current layout; readers follow it.
// (Before layouts, the maps were pinned in PinDir itself: that is epoch 1,
// found and migrated like any other layout.)
//
// An agent whose layout differs from the current one (another version of
// rlagent, or another maxBuckets) migrates: Load creates the new layout's
// maps beside the old ones and copies every map whose key and value have
// not changed (limits, counters, buckets up to the new size, the hash
// seed); what cannot be copied the agent's first reconcile rebuilds. Until
// the caller moves its hooks to the new programs (link updates, atomic),
// the old programs keep enforcing with the old maps: there is no moment
// without enforcement. FinishMigration then makes the new layout current and
// removes the old pins.

// layoutEpoch is bumped when the meaning of a map's bytes changes while
// its sizes may stay the same: nothing is copied from a layout of another
// epoch (the agent rebuilds the limits; buckets start full, counters at 0).
const layoutEpoch = 1

// currentLink is the symlink that names the current layout's directory.
const currentLink = "maps"

// layoutPrefix begins the name of a layout's directory.
const layoutPrefix = "maps-"

// layoutName names the directory of the maps spec would create, in epoch:
// maps-<epoch>-<a hash of what the kernel checks of each map>.
func layoutName(spec *ebpf.CollectionSpec, epoch uint32) string {
	h := sha256.New()
	for _, name := range slices.Sorted(stdmaps.Keys(spec.Maps)) {
		m := spec.Maps[name]
		if m.Pinning != ebpf.PinByName {
			continue
		}
		h.Write([]byte(name))
		binary.Write(h, binary.LittleEndian, [5]uint32{uint32(m.Type), m.KeySize, m.ValueSize, m.MaxEntries, m.Flags})
	}
	return fmt.Sprintf("%s%d-%s", layoutPrefix, epoch, hex.EncodeToString(h.Sum(nil)[:6]))
}

// epochOf is the epoch of the layout in dir (in pinDir); 1 for the maps
// pinned in pinDir itself.
func epochOf(pinDir, dir string) uint32 {
	if dir == pinDir {
		return 1
	}
	e, _, _ := strings.Cut(strings.TrimPrefix(filepath.Base(dir), layoutPrefix), "-")
	n, err := strconv.ParseUint(e, 10, 32)
	if err != nil {
		return 0
	}
	return uint32(n)
}

// currentDir is the directory of the current layout's maps in pinDir: the
// one the symlink names, or pinDir itself where version 1 pinned them, or
// "" when nothing is pinned.
func currentDir(pinDir string) (string, error) {
	target, err := os.Readlink(filepath.Join(pinDir, currentLink))
	switch {
	case err == nil:
		if strings.Contains(target, "/") || !strings.HasPrefix(target, layoutPrefix) {
			return "", fmt.Errorf("%s: names %q, not a layout of this directory", filepath.Join(pinDir, currentLink), target)
		}
		return filepath.Join(pinDir, target), nil
	case !errors.Is(err, fs.ErrNotExist):
		return "", err
	}
	if _, err := os.Stat(filepath.Join(pinDir, bpf.RatelimitMapRlLimits)); err == nil {
		return pinDir, nil
	}
	return "", nil
}

// setCurrent points the symlink at dir (in pinDir), atomically.
func setCurrent(pinDir, dir string) error {
	tmp := filepath.Join(pinDir, currentLink+"_new") // bpffs refuses names with dots
	os.Remove(tmp)
	if err := os.Symlink(filepath.Base(dir), tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, filepath.Join(pinDir, currentLink)); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// Migration is what Load found of an earlier layout.
type Migration struct {
	// From is the directory of the earlier layout's maps.
	From string
	// Copied and Rebuilt name the maps whose entries were copied, and
	// those left to the agent to fill again (their layout changed).
	Copied, Rebuilt []string
}

// Migrating returns the migration under way, or nil: an earlier layout's
// maps are still pinned, and the programs attached before may still use
// them.
func (d *Datapath) Migrating() *Migration { return d.migration }

// FinishMigration makes this Datapath's layout the current one and removes
// the pins of every other layout. Call it once no hook runs an earlier
// layout's program (ProgramIDs): the old maps then go with their last
// reference.
func (d *Datapath) FinishMigration() error {
	if d.opts.PinDir == "" {
		return nil
	}
	if err := setCurrent(d.opts.PinDir, d.layoutDir); err != nil {
		return fmt.Errorf("make %s current: %w", d.layoutDir, err)
	}
	if err := removeOtherLayouts(d.opts.PinDir, d.layoutDir); err != nil {
		return err
	}
	d.migration = nil
	return nil
}

// removeOtherLayouts removes the pins of every layout in pinDir but keep.
func removeOtherLayouts(pinDir, keep string) error {
	var errs []error
	if keep != pinDir {
		errs = append(errs, removeMapPins(pinDir)) // version 1's
	}
	entries, err := os.ReadDir(pinDir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		dir := filepath.Join(pinDir, e.Name())
		if !e.IsDir() || !strings.HasPrefix(e.Name(), layoutPrefix) || dir == keep {
			continue
		}
		if err := removeMapPins(dir); err != nil {
			errs = append(errs, err)
			continue
		}
		if err := os.Remove(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// removeMapPins removes the data path's map pins in dir.
func removeMapPins(dir string) error {
	var errs []error
	for _, name := range mapNames() {
		if err := os.Remove(filepath.Join(dir, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// ProgramIDs are the kernel's ids of this Datapath's programs: a hook that
// runs one of them runs this layout.
func (d *Datapath) ProgramIDs() []ebpf.ProgramID {
	var ids []ebpf.ProgramID
	for _, p := range []*ebpf.Program{d.objs.XdpRatelimit, d.objs.TcUplinkIn, d.objs.TcUplinkOut, d.objs.TcEndpointIn, d.objs.TcEndpointOut} {
		if p == nil {
			continue
		}
		if info, err := p.Info(); err == nil {
			if id, ok := info.ID(); ok {
				ids = append(ids, id)
			}
		}
	}
	return ids
}

// copyMaps copies the entries of every pinned map of the layout in from
// into the new map of d of the same name, if the epochs are the same and so
// are the type and key and value sizes (and the size, for an array), up to
// the new map's size.
func (d *Datapath) copyMaps(from string, sameEpoch bool) (*Migration, error) {
	mig := &Migration{From: from}
	for name, m := range (&mapSet{&d.objs.RatelimitMaps}).byName() {
		if ms := d.spec.Maps[name]; ms == nil || ms.Pinning != ebpf.PinByName {
			continue // per-CPU scratch space: nothing to keep
		}
		if name == bpf.RatelimitMapRlBuckets || name == bpf.RatelimitMapRlBucketKeys {
			continue // placed anew below
		}
		old, err := ebpf.LoadPinnedMap(filepath.Join(from, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if errors.Is(err, fs.ErrNotExist) {
			mig.Rebuilt = append(mig.Rebuilt, name)
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("open the earlier layout's %s: %w", name, err)
		}
		// An array indexed by a hash (the tombstones, the key cache) means
		// something else at another size; a hash map's keys do not.
		same := sameEpoch && old.Type() == m.Type() && old.KeySize() == m.KeySize() && old.ValueSize() == m.ValueSize() &&
			(old.MaxEntries() == m.MaxEntries() || isHash(m.Type()))
		if same {
			err = copyEntries(old, m)
		}
		old.Close()
		if err != nil {
			return nil, fmt.Errorf("copy %s from %s: %w", name, from, err)
		}
		if same {
			mig.Copied = append(mig.Copied, name)
		} else {
			mig.Rebuilt = append(mig.Rebuilt, name)
		}
	}
	names := []string{bpf.RatelimitMapRlBuckets, bpf.RatelimitMapRlBucketKeys}
	placed, err := d.placeBuckets(from, sameEpoch)
	if err != nil {
		return nil, fmt.Errorf("place the earlier layout's buckets: %w", err)
	}
	if placed {
		mig.Copied = append(mig.Copied, names...)
	} else {
		mig.Rebuilt = append(mig.Rebuilt, names...)
	}
	slices.Sort(mig.Copied)
	slices.Sort(mig.Rebuilt)
	return mig, nil
}

// placeBuckets puts the keyed buckets of the layout in from into d's
// table, each where its key's hash places it now: from the table of
// another size, or from the LRU hash of (limit, gen, key) -> pool that
// held them before the table. The hash's seed is the earlier config's,
// which the copy keeps. A bucket whose set is full already starts anew
// (full, or as its tombstone says). It reports whether there was a table
// to place from; nothing runs on d's maps yet.
func (d *Datapath) placeBuckets(from string, sameEpoch bool) (bool, error) {
	if !sameEpoch {
		return false, nil
	}
	open := func(name string) (*ebpf.Map, error) {
		m, err := ebpf.LoadPinnedMap(filepath.Join(from, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		return m, err
	}
	cfgMap, err := open(bpf.RatelimitMapRlCfg)
	if err != nil || cfgMap == nil {
		return false, err
	}
	defer cfgMap.Close()
	var cfg bpf.RatelimitRlConfig
	if cfgMap.ValueSize() != uint32(binary.Size(cfg)) {
		return false, nil
	}
	if err := cfgMap.Lookup(uint32(0), &cfg); err != nil {
		return false, fmt.Errorf("read the hash seed: %w", err)
	}
	old, err := open(bpf.RatelimitMapRlBuckets)
	if err != nil || old == nil {
		return false, err
	}
	defer old.Close()

	var buckets []bpf.RatelimitRlBucketKey
	var pools []uint64
	switch {
	case old.Type() == ebpf.LRUHash && old.KeySize() == uint32(binary.Size(bpf.RatelimitRlBucketKey{})) && old.ValueSize() == 8:
		var (
			k bpf.RatelimitRlBucketKey
			v bpf.RatelimitRlPool
		)
		for it := old.Iterate(); it.Next(&k, &v); {
			buckets, pools = append(buckets, k), append(pools, v.V_empty)
		}
	case old.Type() == ebpf.Array && old.ValueSize() == uint32(binary.Size(bpf.RatelimitRlBucketSet{})):
		oldKeys, err := open(bpf.RatelimitMapRlBucketKeys)
		if err != nil || oldKeys == nil {
			return false, err
		}
		defer oldKeys.Close()
		view := &Datapath{state: &classifier{cfg: cfg}}
		view.objs.RlBuckets, view.objs.RlBucketKeys = old, oldKeys
		err = view.eachBucket(func(_ uint32, _ int, k *bpf.RatelimitRlBucketKey, vEmpty uint64) {
			buckets, pools = append(buckets, *k), append(pools, vEmpty)
		})
		if err != nil {
			return false, err
		}
	default:
		return false, nil
	}

	mask := d.objs.RlBuckets.MaxEntries() - 1
	sets := make(map[uint32]*bpf.RatelimitRlBucketSet)
	keys := make(map[uint32]*bpf.RatelimitRlBucketKeyset)
	for i := range buckets {
		k := &buckets[i]
		set, tag := bucketPlace(bucketHash(cfg.Seed, k.Limit, k.Gen, k.Addr), k.Limit, k.Gen, mask)
		if sets[set] == nil {
			sets[set], keys[set] = new(bpf.RatelimitRlBucketSet), new(bpf.RatelimitRlBucketKeyset)
		}
		for w := range bucketWays {
			if sets[set].Way[w].Tag == 0 {
				sets[set].Way[w].Tag, sets[set].Way[w].Pool.V_empty = tag, pools[i]
				keys[set].Key[w] = *k
				break
			}
		}
	}
	for set, s := range sets {
		if err := d.objs.RlBucketKeys.Put(set, keys[set]); err != nil {
			return false, err
		}
		if err := d.objs.RlBuckets.Put(set, s); err != nil {
			return false, err
		}
	}
	return true, nil
}

// copyEntries copies every entry of src into dst, as many as dst holds
// (a smaller hash map keeps the first it gets; an LRU map evicts).
func copyEntries(src, dst *ebpf.Map) error {
	var key []byte
	var value any = new([]byte)
	if isPerCPU(src.Type()) {
		value = new([][]byte)
	}
	it := src.Iterate()
	for it.Next(&key, value) {
		err := dst.Put(key, derefPerCPU(value))
		switch {
		case errors.Is(err, ebpf.ErrKeyNotExist), errors.Is(err, unix.E2BIG):
			// An array entry past the new size, or a full hash map.
			continue
		case err != nil:
			return err
		}
	}
	return it.Err()
}

func derefPerCPU(v any) any {
	switch p := v.(type) {
	case *[][]byte:
		return *p
	case *[]byte:
		return *p
	}
	return v
}

// byName returns the loaded maps by their pin names.
func (m *mapSet) byName() map[string]*ebpf.Map {
	out := make(map[string]*ebpf.Map)
	v := reflect.ValueOf(m.RatelimitMaps).Elem()
	for i := range v.NumField() {
		name := v.Type().Field(i).Tag.Get("ebpf")
		if mp, ok := v.Field(i).Interface().(*ebpf.Map); ok && name != "" && mp != nil {
			out[name] = mp
		}
	}
	return out
}

type mapSet struct{ *bpf.RatelimitMaps }

func isHash(t ebpf.MapType) bool {
	switch t {
	case ebpf.Hash, ebpf.LRUHash, ebpf.PerCPUHash, ebpf.LRUCPUHash, ebpf.LPMTrie:
		return true
	}
	return false
}

func isPerCPU(t ebpf.MapType) bool {
	switch t {
	case ebpf.PerCPUArray, ebpf.PerCPUHash, ebpf.LRUCPUHash:
		return true
	}
	return false
}
