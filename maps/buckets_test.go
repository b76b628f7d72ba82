package maps

import (
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/bpf"
	"github.com/rlagent/rlagent/internal/testenv"
)

// TestMigrateBucketsFromLRU: pins of the layout before the bucket table,
// whose keyed buckets were an LRU hash of (limit, gen, key) -> pool. Load
// places each bucket where its key's hash places it in the table, with the
// pool it had: the buckets list as they were, and the new program admits
// what each held, no more (an upgrade hands out no bursts).
func TestMigrateBucketsFromLRU(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	const id = 3
	// The old agent's state: a keyed limit, and its config with the seed.
	src := loadTest(t, Options{Clock: ClockTest, CPUs: 1, HashSeed: [2]uint64{0x0123456789abcdef, 0xfedcba9876543210}})
	mustSetClock(t, src, 1e9)
	mustSetLimit(t, src, id, Limit{Rate: 5, Burst: 5, Key: KeySrcIP})
	var entry bpf.RatelimitRlLimit
	if err := src.objs.RlLimits.Lookup(uint32(id), &entry); err != nil {
		t.Fatal(err)
	}
	p := entry.Params[entry.Active&1]
	v := vclock(&p, 1e9)

	dir := testenv.BPFFS(t)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	// The old layout: src's maps, pinned in the directory itself (epoch
	// 1), but for its buckets.
	spec, err := bpf.LoadRatelimit()
	if err != nil {
		t.Fatal(err)
	}
	for name, m := range src.mapsByName() {
		if ms := spec.Maps[name]; ms == nil || ms.Pinning != ebpf.PinByName ||
			name == bpf.RatelimitMapRlBuckets || name == bpf.RatelimitMapRlBucketKeys {
			continue
		}
		c, err := m.Clone()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		if err := c.Pin(filepath.Join(dir, name)); err != nil {
			t.Fatalf("pin an old %s: %v", name, err)
		}
	}
	pin := func(ms *ebpf.MapSpec) *ebpf.Map {
		m, err := ebpf.NewMapWithOptions(ms, ebpf.MapOptions{PinPath: dir})
		if err != nil {
			t.Fatalf("pin an old %s: %v", ms.Name, err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
	lru := pin(&ebpf.MapSpec{Name: bpf.RatelimitMapRlBuckets, Type: ebpf.LRUHash, Pinning: ebpf.PinByName,
		KeySize: uint32(unsafe.Sizeof(bpf.RatelimitRlBucketKey{})), ValueSize: 8, MaxEntries: 1024})
	want := map[string]uint64{"10.0.0.1": 0, "10.0.0.2": 2, "10.0.0.3": 4, "2001:db8::7": 5}
	for addr, tokens := range want {
		k, err := bucketKeyOf(&Limit{Key: KeySrcIP}, Bucket{Addr: netip.MustParseAddr(addr)})
		if err != nil {
			t.Fatal(err)
		}
		k.Limit, k.Gen = id, entry.Gen
		if err := lru.Put(&k, &bpf.RatelimitRlPool{V_empty: v - tokens}); err != nil {
			t.Fatal(err)
		}
	}

	d := loadTest(t, Options{PinDir: dir, Clock: ClockTest, CPUs: 1})
	mustSetClock(t, d, 1e9)
	mig := d.Migrating()
	if mig == nil || !slices.Contains(mig.Copied, bpf.RatelimitMapRlBuckets) || !slices.Contains(mig.Copied, bpf.RatelimitMapRlBucketKeys) {
		t.Fatalf("migration %+v: want rl_buckets and rl_bucket_keys copied (placed)", mig)
	}
	checkBuckets(t, d, id, want)
	for addr, tokens := range want {
		dst := "192.168.0.1"
		if netip.MustParseAddr(addr).Is6() {
			dst = "2001:db8::1"
		}
		pkt := udpPacket(addr, dst, 53)
		passed := 0
		for range 8 {
			if mustRunPacket(t, d, pkt) == xdpPass {
				passed++
			}
		}
		if passed != int(tokens) {
			t.Errorf("%s: the new program passed %d of 8, want the %d its bucket held", addr, passed, tokens)
		}
	}
	if st := mustStatsOf(t, d, id); st.NewKeys+st.ReturnedKeys != 0 {
		t.Errorf("%d buckets created after the migration, want none: every key found its placed bucket", st.NewKeys+st.ReturnedKeys)
	}
}
