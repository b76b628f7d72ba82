package maps

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
)

// LoadReference loads the XDP program prog of another build of the data path
// (a bpf2go ELF, such as the previous release's object kept in bpf/testdata
// as a benchmark reference) over d's maps, so that both builds can be
// measured on the same limits in one run.
//
// A map whose layout is the same in both builds is shared. Where the layout
// differs, the reference gets a map of its own: for an array of structs,
// the entries d holds now are copied in member by member, by name (so call
// it after setting the limits; refAliases names the members that were
// renamed), and for an array of anything else whose value in the reference
// is a prefix of d's, byte by byte; any other map starts empty. The
// load-time constants are set as Load sets d's.
//
// For benchmarks and tests: the reference reads d's state as it was laid
// out then, and nothing keeps the copies in step with later changes.
func (d *Datapath) LoadReference(elf []byte, prog string) (*ebpf.Program, error) {
	coll, err := d.LoadReferenceCollection(elf)
	if err != nil {
		return nil, err
	}
	p, ok := coll.Programs[prog]
	if !ok {
		coll.Close()
		return nil, fmt.Errorf("load reference: no program %s", prog)
	}
	delete(coll.Programs, prog)
	// The program holds its maps; the collection's other handles go.
	coll.Close()
	return p, nil
}

// LoadReferenceCollection is LoadReference for every program of elf, with
// its maps: those d has are shared or copied as LoadReference says, the
// others are the collection's own and start empty (a benchmark's peer
// keeps its buckets there, beside d's classifier). The caller closes the
// collection.
func (d *Datapath) LoadReferenceCollection(elf []byte) (*ebpf.Collection, error) {
	spec, err := ebpf.LoadCollectionSpecFromReader(bytes.NewReader(elf))
	if err != nil {
		return nil, fmt.Errorf("load reference: %w", err)
	}
	cur, err := d.collectionSpec()
	if err != nil {
		return nil, fmt.Errorf("load reference: %w", err)
	}
	for name, v := range cur.Variables {
		rv, ok := spec.Variables[name]
		if !ok || !v.Constant() || !rv.Constant() || rv.Size() != v.Size() {
			continue
		}
		buf := make([]byte, v.Size())
		if err := v.Get(buf); err == nil {
			rv.Set(buf)
		}
	}
	own := d.mapsByName()
	repl := make(map[string]*ebpf.Map)
	var copies []func(*ebpf.Collection) error
	for name, ms := range spec.Maps {
		m, ok := own[name]
		if !ok {
			continue
		}
		ms.Pinning = ebpf.PinNone
		ms.MaxEntries = m.MaxEntries()
		if ms.Type == m.Type() && ms.KeySize == m.KeySize() && ms.ValueSize == m.ValueSize() {
			repl[name] = m
			continue
		}
		if ms.Type != ebpf.Array || m.Type() != ebpf.Array {
			continue
		}
		if plan, ok := memberPlan(ms.Value, cur.Maps[name].Value); ok {
			copies = append(copies, func(c *ebpf.Collection) error { return copyMembers(c.Maps[name], m, plan) })
		} else if ms.ValueSize < m.ValueSize() {
			copies = append(copies, func(c *ebpf.Collection) error { return copyPrefix(c.Maps[name], m) })
		}
	}
	for name, ms := range spec.Maps {
		if _, ok := repl[name]; !ok {
			ms.Pinning = ebpf.PinNone
		}
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{MapReplacements: repl})
	if err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, fmt.Errorf("load reference: %+v", ve)
		}
		return nil, fmt.Errorf("load reference: %w", err)
	}
	for _, cp := range copies {
		if err := cp(coll); err != nil {
			coll.Close()
			return nil, fmt.Errorf("load reference: %w", err)
		}
	}
	return coll, nil
}

// refAliases are struct members of an older data path by the name of the
// member of this one that holds what they held: rl_config's dir[2] (the
// limits of each direction) is hook[0..1], the uplink's hooks.
var refAliases = map[string]string{"dir": "hook"}

// memberCopy copies size bytes at src in a value of d's to dst in one of
// the reference's.
type memberCopy struct{ dst, src, size uint32 }

// memberPlan is how to fill a value of type ref from one of type cur: each
// member of ref from cur's member of the same name (or its refAliases
// name), cut to the smaller size. ok is false unless both are structs.
func memberPlan(ref, cur btf.Type) (plan []memberCopy, ok bool) {
	rs, ok1 := btf.UnderlyingType(ref).(*btf.Struct)
	cs, ok2 := btf.UnderlyingType(cur).(*btf.Struct)
	if !ok1 || !ok2 {
		return nil, false
	}
	byName := make(map[string]btf.Member, len(cs.Members))
	for _, m := range cs.Members {
		byName[m.Name] = m
	}
	for _, rm := range rs.Members {
		name := rm.Name
		if alias, ok := refAliases[name]; ok {
			name = alias
		}
		cm, ok := byName[name]
		if !ok || name == "" || rm.BitfieldSize != 0 || cm.BitfieldSize != 0 {
			continue // the reference's own: zero
		}
		rsz, err1 := btf.Sizeof(rm.Type)
		csz, err2 := btf.Sizeof(cm.Type)
		if err1 != nil || err2 != nil {
			return nil, false
		}
		plan = append(plan, memberCopy{rm.Offset.Bytes(), cm.Offset.Bytes(), uint32(min(rsz, csz))})
	}
	return plan, true
}

// copyMembers copies every entry of array src into dst by plan, for the
// entries dst has.
func copyMembers(dst, src *ebpf.Map, plan []memberCopy) error {
	val := make([]byte, src.ValueSize())
	out := make([]byte, dst.ValueSize())
	for k := uint32(0); k < min(dst.MaxEntries(), src.MaxEntries()); k++ {
		if err := src.Lookup(k, val); err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
		clear(out)
		for _, p := range plan {
			copy(out[p.dst:p.dst+p.size], val[p.src:p.src+p.size])
		}
		if err := dst.Put(k, out); err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
	}
	return nil
}

// copyPrefix copies every entry of array src into dst, each value cut to
// dst's value size, for the entries dst has.
func copyPrefix(dst, src *ebpf.Map) error {
	val := make([]byte, src.ValueSize())
	for k := uint32(0); k < min(dst.MaxEntries(), src.MaxEntries()); k++ {
		if err := src.Lookup(k, val); err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
		if err := dst.Put(k, val[:dst.ValueSize()]); err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
	}
	return nil
}
