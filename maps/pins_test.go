package maps

import (
	"errors"
	"os"
	"strings"
	"testing"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/bpf"
	"github.com/rlagent/rlagent/internal/testenv"
)

// Maps pinned by a version whose layout differs (here rl_cfg as issue 8
// left it: one mask per direction instead of per hook, no connections
// mask) are refused, by the agent's Load and by status's OpenPinned, with
// ebpf.ErrMapIncompatible and a message that names `rlagent cleanup`.
func TestOldPinsRefused(t *testing.T) {
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

	d, err := Load(Options{PinDir: dir, Clock: ClockTest, CPUs: 1, XDPOnly: true})
	if err == nil {
		d.Close()
		t.Fatal("Load over old pins succeeded")
	}
	r, rerr := OpenPinned(dir)
	if rerr == nil {
		r.Close()
		t.Fatal("OpenPinned of old pins succeeded")
	}
	for what, err := range map[string]error{"Load": err, "OpenPinned": rerr} {
		if !errors.Is(err, ebpf.ErrMapIncompatible) || !strings.Contains(err.Error(), "`rlagent cleanup`") {
			t.Errorf("%s: %v; want ebpf.ErrMapIncompatible and a message naming `rlagent cleanup`", what, err)
		}
		t.Logf("%s: %v", what, err)
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
