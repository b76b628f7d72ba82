package maps

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/bpf"
	"github.com/rlagent/rlagent/internal/testenv"
)

// Maps pinned in the pin directory itself, before layouts, by a version
// whose rl_cfg differs (as issue 8 left it: one mask per direction instead
// of per hook, no connections mask): Load migrates them. It copies rl_limits,
// whose layout is the same, rebuilds rl_cfg, and leaves the old pins current
// (status reads them, and refuses their rl_cfg, naming `rlagent cleanup`)
// until FinishMigration, which makes the new layout current and removes the
// old pins.
func TestOldPinsMigrated(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	dir := testenv.BPFFS(t)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	// Two hook masks and the connections mask fewer: 3 x 16 bytes.
	oldSize := uint32(unsafe.Sizeof(bpf.RatelimitRlConfig{})) - 3*uint32(unsafe.Sizeof(mask{}))
	for _, ms := range []*ebpf.MapSpec{
		{Name: bpf.RatelimitMapRlCfg, Type: ebpf.Array, KeySize: 4, ValueSize: oldSize, MaxEntries: 1, Pinning: ebpf.PinByName},
		{Name: bpf.RatelimitMapRlLimits, Type: ebpf.Array, KeySize: 4, ValueSize: uint32(unsafe.Sizeof(bpf.RatelimitRlLimit{})),
			MaxEntries: MaxLimits, Pinning: ebpf.PinByName},
	} {
		m, err := ebpf.NewMapWithOptions(ms, ebpf.MapOptions{PinPath: dir})
		if err != nil {
			t.Fatalf("pin an old %s: %v", ms.Name, err)
		}
		m.Close()
	}

	d := loadTest(t, Options{PinDir: dir, Clock: ClockTest, CPUs: 1})
	mig := d.Migrating()
	if mig == nil || mig.From != dir {
		t.Fatalf("Migrating() = %+v, want a migration from %s", mig, dir)
	}
	t.Logf("migration: %+v", mig)
	if !slices.Contains(mig.Copied, bpf.RatelimitMapRlLimits) || !slices.Contains(mig.Rebuilt, bpf.RatelimitMapRlCfg) {
		t.Errorf("copied %v, rebuilt %v; want rl_limits copied and rl_cfg rebuilt", mig.Copied, mig.Rebuilt)
	}
	_, rerr := OpenPinned(dir)
	if !errors.Is(rerr, ebpf.ErrMapIncompatible) || !strings.Contains(rerr.Error(), "`rlagent cleanup`") {
		t.Errorf("OpenPinned before the migration ends: %v; want the old pins' ebpf.ErrMapIncompatible, naming `rlagent cleanup`", rerr)
	}
	if err := d.FinishMigration(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, bpf.RatelimitMapRlCfg)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the old rl_cfg pin after FinishMigration: %v, want gone", err)
	}
	r, err := OpenPinned(dir)
	if err != nil {
		t.Fatalf("OpenPinned after the migration: %v", err)
	}
	r.Close()
}

// TestMigrateLayout: a Load whose layout differs from the pinned one (a
// larger maxBuckets; another epoch) migrates while the old programs run.
// With the same epoch the new maps start with the old limits, counters and
// buckets; across an epoch nothing is copied. Until the caller moves its
// hooks and calls FinishMigration, the old program keeps enforcing with the
// old maps; after it, readers see the new layout and the old pins are gone.
func TestMigrateLayout(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	pkt := udpPacket("10.0.0.1", "192.168.1.1", 53)
	limit := Limit{Rate: 5, Burst: 5, Key: KeyDstPort, Match: Match{Protocol: UDP, DstPorts: ports(PortRange{53, 53})}}
	for _, tc := range []struct {
		name string
		next Options
		copy bool
	}{
		{"maxBuckets", Options{MaxBuckets: 4096}, true},
		{"epoch", Options{MaxBuckets: 1024, layoutEpoch: layoutEpoch + 1}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := testenv.BPFFS(t)
			old := loadTest(t, Options{PinDir: dir, Clock: ClockTest, CPUs: 1, MaxBuckets: 1024})
			mustSetClock(t, old, 1e9)
			keyed := limit
			keyed.Hot = true // a keyed demand-shared limit: hot keys and a key's own share
			mustSetLimit(t, old, 7, keyed)
			if err := old.SetHotTick(DefaultHotShift); err != nil {
				t.Fatal(err)
			}
			own := map[Bucket]KeyShare{{Protocol: UDP, Port: 5353}: {Rate: 50, Burst: 20}}
			if err := old.SetKeyShares(7, own); err != nil {
				t.Fatal(err)
			}
			mustPass(t, old, pkt, 2) // 3 tokens left
			if old.Migrating() != nil {
				t.Fatalf("a first Load migrates: %+v", old.Migrating())
			}
			oldDir := old.layoutDir

			opts := tc.next
			opts.PinDir, opts.Clock, opts.CPUs = dir, ClockTest, 1
			d := loadTest(t, opts)
			mustSetClock(t, d, 1e9)
			mig := d.Migrating()
			if mig == nil || mig.From != oldDir || d.layoutDir == oldDir {
				t.Fatalf("Migrating() = %+v (layout %s), want a migration from %s", mig, d.layoutDir, oldDir)
			}
			t.Logf("%s -> %s: copied %v, rebuilt %v", filepath.Base(oldDir), filepath.Base(d.layoutDir), mig.Copied, mig.Rebuilt)
			if tc.copy {
				if !slices.Equal(d.IDs(), []uint32{7}) {
					t.Fatalf("IDs() = %v after the migration, want the old limit 7", d.IDs())
				}
				if s := mustStatsOf(t, d, 7); s.AdmittedPackets != 2 {
					t.Errorf("stats after the migration %+v, want the 2 admitted before", s)
				}
				if got := bucketsOf(t, d, 7); !reflect.DeepEqual(got, map[string]uint64{"53": 3}) {
					t.Errorf("buckets after the migration %v, want 53: 3", got)
				}
				if got, err := d.KeyShares(7); err != nil || !reflect.DeepEqual(got, own) {
					t.Errorf("key shares after the migration %v, %v; want %v", got, err, own)
				}
				if l, err := d.Limit(7); err != nil || !l.Hot {
					t.Errorf("limit 7 after the migration: hot %v, %v; want hot", l.Hot, err)
				}
				if d.state.cfg.HotShift != DefaultHotShift {
					t.Errorf("hot tick after the migration 2^%d ns, want 2^%d", d.state.cfg.HotShift, DefaultHotShift)
				}
			} else {
				if len(mig.Copied) != 0 || len(d.IDs()) != 0 {
					t.Errorf("across an epoch: copied %v, limits %v; want nothing", mig.Copied, d.IDs())
				}
				if got, err := d.KeyShares(7); err == nil && len(got) != 0 {
					t.Errorf("across an epoch: key shares %v, want none", got)
				}
				mustSetLimit(t, d, 7, keyed) // the agent's reconcile
			}

			// The old program still enforces, with the old maps: 3 tokens.
			passed := 0
			for range 5 {
				if mustRunPacket(t, old, pkt) == xdpPass {
					passed++
				}
			}
			if passed != 3 {
				t.Errorf("the old program passed %d of 5 during the migration, want its 3 tokens", passed)
			}
			// The new one enforces with the new maps.
			want := 5 // a fresh bucket
			if tc.copy {
				want = 3 // the copied one
			}
			passed = 0
			for range 7 {
				if mustRunPacket(t, d, pkt) == xdpPass {
					passed++
				}
			}
			if passed != want {
				t.Errorf("the new program passed %d of 7, want %d", passed, want)
			}

			if r, err := OpenPinned(dir); err != nil {
				t.Fatal(err)
			} else {
				s, _ := r.Stats(7)
				r.Close()
				if s.AdmittedPackets != 5 {
					t.Errorf("readers during the migration see %d admitted, want the old layout's 5", s.AdmittedPackets)
				}
			}
			if err := d.FinishMigration(); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(oldDir); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("the old layout's directory after FinishMigration: %v, want gone", err)
			}
			r, err := OpenPinned(dir)
			if err != nil {
				t.Fatal(err)
			}
			s, _ := r.Stats(7)
			r.Close()
			if wantAdm := uint64(want); (tc.copy && s.AdmittedPackets != 2+wantAdm) || (!tc.copy && s.AdmittedPackets != wantAdm) {
				t.Errorf("readers after the migration see %d admitted, want the new layout's", s.AdmittedPackets)
			}
			// A later Load adopts the new layout: no migration.
			d.Close()
			again := loadTest(t, opts)
			if again.Migrating() != nil || again.layoutDir != d.layoutDir {
				t.Errorf("a Load after the migration: migrating %+v, layout %s; want none, %s", again.Migrating(), again.layoutDir, d.layoutDir)
			}
		})
	}
}

// TCProgram hands out one TC program per hook, none for an unknown hook,
// and none with XDPOnly, where Program (XDP) is there either way.
func TestTCProgram(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	d := loadFull(t, Options{Clock: ClockTest, CPUs: 1})
	seen := make(map[ebpf.ProgramID]Hook)
	for h := range Hook(NumHooks) {
		p := d.TCProgram(h)
		if p == nil {
			t.Fatalf("TCProgram(%v) = nil", h)
		}
		if p.Type() != ebpf.SchedCLS {
			t.Errorf("TCProgram(%v) is a %v program, want SchedCLS", h, p.Type())
		}
		info, err := p.Info()
		if err != nil {
			t.Fatal(err)
		}
		id, _ := info.ID()
		if prev, ok := seen[id]; ok {
			t.Errorf("TCProgram(%v) is TCProgram(%v)'s program", h, prev)
		}
		seen[id] = h
		if h.Attach().Hook(h.Direction()) != h {
			t.Errorf("hook %v: attach %v and direction %v make hook %v", h, h.Attach(), h.Direction(), h.Attach().Hook(h.Direction()))
		}
	}
	if p := d.TCProgram(Hook(NumHooks)); p != nil {
		t.Errorf("TCProgram of an unknown hook = %v, want nil", p)
	}
	x := loadFull(t, Options{Clock: ClockTest, CPUs: 1, XDPOnly: true})
	if x.Program() == nil || x.TCProgram(UplinkIn) != nil {
		t.Errorf("XDPOnly: Program() = %v, TCProgram(UplinkIn) = %v; want the XDP program and nil", x.Program(), x.TCProgram(UplinkIn))
	}
}
