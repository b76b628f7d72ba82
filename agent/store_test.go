package agent

import (
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/rlagent/rlagent/internal/testenv"
	"github.com/rlagent/rlagent/maps"
)

// memStore is a limitStore in memory: the applier's tables run on it
// without root. It passes the contract *maps.Datapath passes
// (TestLimitStoreContract), the prefix tables' room included, which it
// takes as a number of distinct prefixes per side and family.
type memStore struct {
	limits map[uint32]maps.Limit
	metas  map[uint32]maps.Meta
	room   int // prefixes each of the four prefix tables holds

	// Counters for the tables: entries written, and writes refused for
	// want of room.
	sets, full int
	// failSet, if set, fails every SetLimit (a map write that fails).
	failSet error
	// log, if set, receives "set ID" and "delete ID", in order.
	log *[]string
	// keyShares: the keys with shares of their own, by limit id.
	keyShares map[uint32]map[maps.Bucket]maps.KeyShare
}

func newMemStore(room int) *memStore {
	return &memStore{limits: make(map[uint32]maps.Limit), metas: make(map[uint32]maps.Meta), room: room}
}

func (s *memStore) IDs() []uint32 { return sortedKeys(s.limits) }

func (s *memStore) Limit(id uint32) (maps.Limit, error) {
	l, ok := s.limits[id]
	if !ok {
		return maps.Limit{}, fmt.Errorf("limit %d: %w", id, maps.ErrUnknownLimit)
	}
	return cloneLimit(l), nil
}

func (s *memStore) SetLimit(id uint32, l maps.Limit) error {
	if id >= maps.MaxLimits {
		return fmt.Errorf("set limit %d: id out of range 0..%d: %w", id, maps.MaxLimits-1, maps.ErrTableFull)
	}
	if err := l.Validate(); err != nil {
		return fmt.Errorf("set limit %d: %w", id, err)
	}
	if s.failSet != nil {
		return fmt.Errorf("set limit %d: %w", id, s.failSet)
	}
	next := make(map[uint32]maps.Limit, len(s.limits)+1)
	for k, v := range s.limits {
		next[k] = v
	}
	next[id] = cloneLimit(l)
	if err := s.fits(next); err != nil {
		s.full++
		return fmt.Errorf("set limit %d: %w", id, err)
	}
	if old, had := s.limits[id]; had && (old.Key != l.Key || old.Prefix4 != l.Prefix4 || old.Prefix6 != l.Prefix6 || l.Key == maps.KeyNone || l.Action == maps.Pace) {
		delete(s.keyShares, id) // a new key kind: other buckets
	}
	s.limits = next
	s.sets++
	if s.log != nil {
		*s.log = append(*s.log, fmt.Sprintf("set %d", id))
	}
	return nil
}

// fits counts the distinct prefixes of each side and family, as the data
// path's classifier does.
func (s *memStore) fits(limits map[uint32]maps.Limit) error {
	for _, side := range []struct {
		name string
		list func(*maps.Match) []netip.Prefix
	}{{"source", func(m *maps.Match) []netip.Prefix { return m.SrcCIDRs }}, {"destination", func(m *maps.Match) []netip.Prefix { return m.DstCIDRs }}} {
		seen := make(map[netip.Prefix]bool)
		var n4, n6 int
		for _, l := range limits {
			for _, p := range side.list(&l.Match) {
				p = p.Masked()
				if seen[p] {
					continue
				}
				seen[p] = true
				if p.Addr().Is4() {
					n4++
				} else {
					n6++
				}
			}
		}
		if n4 > s.room || n6 > s.room {
			return fmt.Errorf("%s prefixes: %d IPv4 and %d IPv6 over all limits, the maps hold %d and %d: %w",
				side.name, n4, n6, s.room, s.room, maps.ErrTableFull)
		}
	}
	return nil
}

func (s *memStore) KeyShares(id uint32) (map[maps.Bucket]maps.KeyShare, error) {
	if _, ok := s.limits[id]; !ok {
		return nil, fmt.Errorf("key shares of limit %d: %w", id, maps.ErrUnknownLimit)
	}
	return cloneShares(s.keyShares[id]), nil
}

func (s *memStore) SetKeyShares(id uint32, shares map[maps.Bucket]maps.KeyShare) error {
	l, ok := s.limits[id]
	if !ok {
		return fmt.Errorf("key shares of limit %d: %w", id, maps.ErrUnknownLimit)
	}
	if l.Key == maps.KeyNone || l.Action == maps.Pace {
		return fmt.Errorf("key shares of limit %d: only a keyed limit that is not paced has them", id)
	}
	if s.keyShares == nil {
		s.keyShares = make(map[uint32]map[maps.Bucket]maps.KeyShare)
	}
	s.keyShares[id] = cloneShares(shares)
	return nil
}

func cloneShares(m map[maps.Bucket]maps.KeyShare) map[maps.Bucket]maps.KeyShare {
	out := make(map[maps.Bucket]maps.KeyShare, len(m))
	for b, ks := range m {
		out[b] = ks
	}
	return out
}

func (s *memStore) DeleteLimit(id uint32) error {
	if _, ok := s.limits[id]; !ok {
		return fmt.Errorf("delete limit %d: %w", id, maps.ErrUnknownLimit)
	}
	delete(s.keyShares, id)
	delete(s.limits, id)
	delete(s.metas, id)
	if s.log != nil {
		*s.log = append(*s.log, fmt.Sprintf("delete %d", id))
	}
	return nil
}

func (s *memStore) Metas() (map[uint32]maps.Meta, error) {
	out := make(map[uint32]maps.Meta, len(s.metas))
	for id, m := range s.metas {
		out[id] = m
	}
	return out, nil
}

func (s *memStore) SetMeta(id uint32, m maps.Meta) error {
	if id >= maps.MaxLimits {
		return fmt.Errorf("meta of limit %d: key does not exist", id)
	}
	if m.Name == "" {
		delete(s.metas, id) // an entry without a name is no limit's
		return nil
	}
	m.Observed, m.SnapAt = pinTime(m.Observed), pinTime(m.SnapAt)
	s.metas[id] = m
	return nil
}

// pinTime is a time as the pins keep it: nanoseconds since the epoch.
func pinTime(t time.Time) time.Time {
	if t.IsZero() {
		return t
	}
	return time.Unix(0, t.UnixNano())
}

func cloneLimit(l maps.Limit) maps.Limit {
	l.Match.SrcCIDRs = slices.Clone(l.Match.SrcCIDRs)
	l.Match.DstCIDRs = slices.Clone(l.Match.DstCIDRs)
	l.Match.DstPorts = slices.Clone(l.Match.DstPorts)
	return l
}

// The contract the applier relies on, for the in-memory store and for the
// data path itself (as root): what a test of the applier proves on the
// one holds for the other.
func TestLimitStoreContract(t *testing.T) {
	t.Run("memory", func(t *testing.T) { storeContract(t, newMemStore(srcTable), srcTable) })
	t.Run("datapath", func(t *testing.T) {
		testenv.RequireRoot(t)
		dp, err := maps.Load(maps.Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { dp.Close() })
		storeContract(t, dp, srcTable)
	})
}

// sources is n distinct IPv4 /32s from 10.0.0.0 + first.
func sources(first, n int) []netip.Prefix {
	out := make([]netip.Prefix, n)
	for i := range n {
		a := first + i
		out[i] = netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(a >> 16), byte(a >> 8), byte(a)}), 32)
	}
	return out
}

func storeContract(t *testing.T, s limitStore, room int) {
	if ids := s.IDs(); len(ids) != 0 {
		t.Fatalf("a new store holds %v", ids)
	}
	if m, err := s.Metas(); err != nil || len(m) != 0 {
		t.Fatalf("a new store's metas: %v, %v", m, err)
	}
	udp := maps.Limit{Rate: 100, Burst: 10, Match: maps.Match{Protocol: maps.UDP, DstPorts: []maps.PortRange{{First: 53, Last: 53}}}}
	keyed := maps.Limit{Rate: 7, Burst: 1, Key: maps.KeySrcIP, Match: maps.Match{SrcCIDRs: sources(0, 3)}}
	for id, l := range map[uint32]maps.Limit{5: udp, 2: keyed} {
		if err := s.SetLimit(id, l); err != nil {
			t.Fatalf("set %d: %v", id, err)
		}
	}
	if ids := s.IDs(); !slices.Equal(ids, []uint32{2, 5}) {
		t.Errorf("IDs %v, want [2 5] in order", ids)
	}
	for id, want := range map[uint32]maps.Limit{5: udp, 2: keyed} {
		if got, err := s.Limit(id); err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("limit %d: %+v, %v; want %+v as set", id, got, err, want)
		}
	}
	if _, err := s.Limit(3); !errors.Is(err, maps.ErrUnknownLimit) {
		t.Errorf("an id not set: %v, want ErrUnknownLimit", err)
	}

	// A write that cannot be made changes nothing.
	for _, bad := range []struct {
		what string
		id   uint32
		l    maps.Limit
		full bool
	}{
		{"invalid", 5, maps.Limit{Rate: 0, Burst: 3}, false},
		{"id out of range", maps.MaxLimits, udp, true},
		{"more prefixes than the table holds", 5, maps.Limit{Rate: 1, Burst: 1, Match: maps.Match{SrcCIDRs: sources(100, room)}}, true},
	} {
		err := s.SetLimit(bad.id, bad.l)
		if err == nil || errors.Is(err, maps.ErrTableFull) != bad.full {
			t.Errorf("%s: %v, want an error (table full: %v)", bad.what, err, bad.full)
		}
		if got, _ := s.Limit(5); !reflect.DeepEqual(got, udp) {
			t.Errorf("%s: limit 5 is %+v after the failed write, want %+v", bad.what, got, udp)
		}
	}
	// Room up to the table's size, shared prefixes counted once.
	fill := maps.Limit{Rate: 1, Burst: 1, Match: maps.Match{SrcCIDRs: append(sources(0, 3), sources(100, room-3)...)}}
	if err := s.SetLimit(9, fill); err != nil {
		t.Errorf("a limit that fills the source table exactly: %v", err)
	}
	if err := s.DeleteLimit(9); err != nil {
		t.Fatal(err)
	}

	// Metadata: named entries in one read, with or without an entry; a
	// zero Meta clears one; DeleteLimit clears its limit's.
	at := time.Now()
	metas := map[uint32]maps.Meta{
		5:  {Name: "dns", GlobalRate: 1000, Replicas: 10, Observed: at, State: maps.Applied},
		2:  {Name: "web", GlobalRate: 70, Replicas: 10, State: maps.Clamped, Note: "clamped", SnapAt: at, SnapAdmitted: 4},
		40: {Name: "rejected", GlobalRate: 9, State: maps.Rejected, Note: "does not fit"},
	}
	for id, m := range metas {
		if err := s.SetMeta(id, m); err != nil {
			t.Fatalf("meta %d: %v", id, err)
		}
	}
	got, err := s.Metas()
	if err != nil || len(got) != len(metas) {
		t.Fatalf("metas: %v, %v; want %d", got, err, len(metas))
	}
	for id, want := range metas {
		if !got[id].Equal(want) {
			t.Errorf("meta %d: %+v, want %+v", id, got[id], want)
		}
	}
	if err := s.SetMeta(40, maps.Meta{}); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteLimit(5); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteLimit(5); !errors.Is(err, maps.ErrUnknownLimit) {
		t.Errorf("delete twice: %v, want ErrUnknownLimit", err)
	}
	got, _ = s.Metas()
	if _, ok := got[2]; len(got) != 1 || !ok {
		t.Errorf("metas after clearing 40 and deleting 5: %v, want 2's alone", got)
	}
	if ids := s.IDs(); !slices.Equal(ids, []uint32{2}) {
		t.Errorf("IDs after deleting 5: %v", ids)
	}
}
