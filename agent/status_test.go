package agent

import (
	"encoding/binary"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/internal/testenv"
	"github.com/rlagent/rlagent/maps"
)

// udpFrom is an Ethernet/IPv4/UDP frame from src to 10.0.0.1:53.
func udpFrom(src uint32) []byte {
	p := make([]byte, 14+20+8)
	binary.BigEndian.PutUint16(p[12:], 0x0800)
	ip := p[14:]
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], 28)
	ip[8], ip[9] = 64, 17
	binary.BigEndian.PutUint32(ip[12:], src)
	binary.BigEndian.PutUint32(ip[16:], 0x0a000001)
	binary.BigEndian.PutUint16(ip[22:], 53)
	return p
}

// pinnedWithKeys is a pinned data path with n limits (one of them keyed by
// source) and keys buckets, as `rlagent status` finds it.
func pinnedWithKeys(tb testing.TB, n, keys int) string {
	tb.Helper()
	testenv.RequireRoot(tb)
	dir := testenv.BPFFS(tb)
	// Room enough that no set of the table overflows: every key keeps
	// its bucket (~1e-5 of sets of four hold five of keys/8 a way).
	dp, err := maps.Load(maps.Options{PinDir: dir, MaxBuckets: uint32(keys * 8)})
	if err != nil {
		tb.Fatal(err)
	}
	defer dp.Close()
	for id := range uint32(n) {
		l := maps.Limit{Rate: 1_000_000, Burst: 100_000, Match: maps.Match{Protocol: maps.UDP, DstPorts: []maps.PortRange{{First: uint16(1000 + id), Last: uint16(1000 + id)}}}}
		if id == 0 {
			l.Key = maps.KeySrcIP
			l.Match.DstPorts = []maps.PortRange{{First: 53, Last: 53}}
		}
		if err := dp.SetLimit(id, l); err != nil {
			tb.Fatal(err)
		}
		if err := dp.SetMeta(id, maps.Meta{Name: limitsName(int(id)), GlobalRate: l.Rate, Replicas: 1, SnapAt: time.Now()}); err != nil {
			tb.Fatal(err)
		}
	}
	for i := range keys {
		if _, err := dp.Program().Run(&ebpf.RunOptions{Data: udpFrom(0x0b000000 + uint32(i))}); err != nil {
			tb.Fatal(err)
		}
	}
	return dir
}

func TestReadStatusFromPins(t *testing.T) {
	dir := pinnedWithKeys(t, 3, 500)
	st, err := ReadStatus(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(st) != 3 {
		t.Fatalf("%d limits in status, want 3", len(st))
	}
	var keyed *LimitStatus
	for i := range st {
		if st[i].ID == 0 {
			keyed = &st[i]
		}
	}
	if keyed == nil || keyed.Keys != 500 || keyed.Totals.AdmittedPackets != 500 || keyed.Totals.NewKeys != 500 {
		t.Fatalf("keyed limit status %+v, want 500 keys, admitted and new keys", keyed)
	}
	if keyed.Name != "limits=0" || keyed.ShareRate != 1_000_000 || keyed.Evictions != 0 {
		t.Fatalf("keyed limit status %+v", keyed)
	}
	if keyed.AdmittedPerSecond <= 0 || keyed.Interval <= 0 {
		t.Fatalf("no rate since the snapshot: %+v", keyed)
	}
}

// Benchmark: what `rlagent status` does with 100 limits and 100k keys:
// open the pins, read every limit, count the keys.
func BenchmarkStatus(b *testing.B) {
	dir := pinnedWithKeys(b, 100, 100_000)
	b.ResetTimer()
	for range b.N {
		st, err := ReadStatus(dir)
		if err != nil {
			b.Fatal(err)
		}
		if len(st) != 100 {
			b.Fatalf("%d limits", len(st))
		}
	}
	b.ReportMetric(float64(b.Elapsed().Milliseconds())/float64(b.N), "ms/status")
}

// The data path's own counters are read from the pins too (status prints
// them under the limits): an IPv4 UDP first fragment too short for its UDP
// header is L4-unknown, and a later fragment of another datagram is one
// whose first was not seen.
func TestReadGlobalStatsFromPins(t *testing.T) {
	dir := pinnedWithKeys(t, 1, 1)
	dp, err := maps.Load(maps.Options{PinDir: dir, MaxBuckets: 8}) // pinnedWithKeys's
	if err != nil {
		t.Fatal(err)
	}
	defer dp.Close()
	tiny := udpFrom(0x0b000001)[:14+20+4] // 4 bytes of UDP header
	ip := tiny[14:]
	binary.BigEndian.PutUint16(ip[2:], 24)     // total length
	binary.BigEndian.PutUint16(ip[6:], 0x2000) // MF, offset 0: a first fragment
	later := udpFrom(0x0b000002)
	binary.BigEndian.PutUint16(later[14+4:], 7)      // another datagram's id
	binary.BigEndian.PutUint16(later[14+6:], 0x0005) // offset 40 bytes, the last
	for _, p := range [][]byte{tiny, later} {
		if _, err := dp.Program().Run(&ebpf.RunOptions{Data: p}); err != nil {
			t.Fatal(err)
		}
	}
	g, err := ReadGlobalStats(dir)
	if err != nil {
		t.Fatal(err)
	}
	if g.L4Unknown != 2 || g.FragFirst != 1 || g.FragUnseen != 1 {
		t.Errorf("global stats from the pins = %+v, want 2 L4-unknown, 1 first fragment, 1 unseen", g)
	}
}

// TestKeyCounterReuse: the metrics' bucket counts are read again only once
// keyCountEvery times the last count's duration (and a second) has passed:
// before that a new bucket is not counted, after it it is.
func TestKeyCounterReuse(t *testing.T) {
	dir := pinnedWithKeys(t, 1, 100)
	r, err := maps.OpenPinned(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	dp, err := maps.Load(maps.Options{PinDir: dir, MaxBuckets: 800}) // pinnedWithKeys's
	if err != nil {
		t.Fatal(err)
	}
	defer dp.Close()

	var k keyCounter
	now := time.Now()
	c, _, err := k.get(r, now)
	if err != nil || c[0] != 100 || k.took <= 0 {
		t.Fatalf("first count: %v (took %v), %v; want 100 buckets", c, k.took, err)
	}
	if _, err := dp.Program().Run(&ebpf.RunOptions{Data: udpFrom(0x0c000001)}); err != nil {
		t.Fatal(err)
	}
	due := max(time.Second, keyCountEvery*k.took)
	c, created, err := k.get(r, now.Add(due-time.Millisecond))
	if err != nil || c[0] != 100 || created[0] != 100 {
		t.Errorf("before it is due (%v): %v, created %v, %v; want the 100 counted before", due, c, created, err)
	}
	// The evictions the metrics report stay those of the count: the new
	// bucket, created since, is not taken for an eviction.
	st, err := readStatusKeys(r, now, c, created)
	if err != nil || len(st) != 1 || st[0].Evictions != 0 || st[0].Totals.NewKeys != 101 {
		t.Errorf("status over the older count: %+v, %v; want 0 evictions with 101 keys created", st, err)
	}
	if c, created, err := k.get(r, now.Add(due)); err != nil || c[0] != 101 || created[0] != 101 {
		t.Errorf("when due (%v): %v, created %v, %v; want 101, counted again", due, c, created, err)
	}
}
