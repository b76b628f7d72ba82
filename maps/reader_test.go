package maps

import (
	"bytes"
	"errors"
	"slices"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/bpf"
	"github.com/rlagent/rlagent/internal/testenv"
)

// A reader never writes. Issue 8, item 6: OpenPinned adopted the pins as an
// agent does, and adopting rewrites a port table it finds "unfolded" (port
// entries without their class's port-less limits, as an older agent wrote
// them, or as a reader catches them in the middle of an agent's change).
// Run during a limit removal, that rewrite put back classifier bits of the
// removed limit. Now OpenPinned reads what is there and changes nothing, and
// its descriptors are read-only, so the kernel refuses a write.
func TestReaderDoesNotWrite(t *testing.T) {
	testenv.RequireRoot(t)
	opts := Options{PinDir: testenv.BPFFS(t), Clock: ClockTest, CPUs: 1}
	d := loadTest(t, opts)
	mustSetLimit(t, d, 0, Limit{Rate: 10, Burst: 10, Match: Match{Protocol: UDP}})
	mustSetLimit(t, d, 1, Limit{Rate: 10, Burst: 10, Match: Match{Protocol: UDP, DstPorts: ports(PortRange{7777, 7777})}})

	// What a reader may catch in the middle of DeleteLimit(0): limit 0
	// gone from the UDP port entries, still in the protocol table. An
	// adopting reader took that for an old agent's unfolded table and
	// folded limit 0 back into all 65,536 UDP port entries, behind the
	// agent's back: a later limit that got id 0 then matched every UDP port.
	var keys []uint32
	var vals []mask
	for p := range portSpace {
		keys = append(keys, uint32(classUDP*portSpace+p))
		vals = append(vals, d.state.ports[classUDP*portSpace+p])
	}
	if _, err := d.objs.RlPorts.BatchUpdate(keys, vals, nil); err != nil {
		t.Fatal(err)
	}
	before := dumpMaps(t, d)
	r, err := OpenPinned(opts.PinDir)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if ids := r.IDs(); !slices.Equal(ids, []uint32{0, 1}) {
		t.Errorf("reader sees limits %v, want [0 1]", ids)
	}
	if _, err := r.Stats(1); err != nil {
		t.Errorf("reader stats: %v", err)
	}
	if _, err := r.GlobalStats(); err != nil {
		t.Errorf("reader global stats: %v", err)
	}
	after := dumpMaps(t, d)
	for name, b := range before {
		if !bytes.Equal(b, after[name]) {
			t.Errorf("opening a reader changed map %s", name)
		}
	}

	// The descriptors are read-only: a write through one fails.
	if err := r.d.objs.RlPorts.Put(uint32(0), &mask{}); err == nil {
		t.Error("a write through the reader's rl_ports succeeded")
	}
}

// dumpMaps reads the classifier and limit maps as bytes.
func dumpMaps(tb testing.TB, d *Datapath) map[string][]byte {
	tb.Helper()
	out := make(map[string][]byte)
	for name, m := range map[string]*ebpf.Map{
		bpf.RatelimitMapRlPorts: d.objs.RlPorts, bpf.RatelimitMapRlProtoAny: d.objs.RlProtoAny,
		bpf.RatelimitMapRlCfg: d.objs.RlCfg, bpf.RatelimitMapRlLimits: d.objs.RlLimits,
	} {
		var buf bytes.Buffer
		val := make([]byte, m.ValueSize())
		for k := range m.MaxEntries() {
			if err := m.Lookup(k, val); err != nil {
				tb.Fatalf("read %s: %v", name, err)
			}
			buf.Write(val)
		}
		out[name] = buf.Bytes()
	}
	return out
}

// The hash seed is drawn once, kept with the pins and found again by the
// next agent: its cached tokens and tombstones stay where they were.
func TestSeedKeptWithPins(t *testing.T) {
	testenv.RequireRoot(t)
	opts := Options{PinDir: testenv.BPFFS(t), Clock: ClockTest, CPUs: 1}
	d := loadTest(t, opts)
	seed := d.state.cfg.Seed
	if seed == [2]uint64{} {
		t.Fatal("new maps have no hash seed")
	}
	mustSetLimit(t, d, 0, Limit{Rate: 10, Burst: 10, Key: KeySrcIP})
	if d.state.cfg.Seed != seed {
		t.Errorf("setting a limit changed the seed")
	}
	d.Close()
	opts.HashSeed = [2]uint64{1, 2} // only for new maps
	d = loadTest(t, opts)
	if d.state.cfg.Seed != seed {
		t.Errorf("seed after reload = %x, want the pinned %x", d.state.cfg.Seed, seed)
	}
	var cfg bpf.RatelimitRlConfig
	if err := d.objs.RlCfg.Lookup(uint32(0), &cfg); err != nil || cfg.Seed != seed {
		t.Errorf("pinned config seed = %x (%v), want %x", cfg.Seed, err, seed)
	}
	other := loadTest(t, Options{Clock: ClockTest})
	if other.state.cfg.Seed == seed {
		t.Errorf("two data paths drew the same seed %x", seed)
	}
}

// SetProtected keeps a rule that stays the same in force while others
// change, and a restarted agent's SetProtected starts from what the pins
// hold.
func TestProtectTables(t *testing.T) {
	testenv.RequireRoot(t)
	opts := Options{PinDir: testenv.BPFFS(t), Clock: ClockTest, CPUs: 1}
	d := loadTest(t, opts)
	ssh := ProtectRule{Protocol: TCP, LocalPorts: ports(PortRange{22, 22})}
	api := ProtectRule{Protocol: TCP, Peers: prefixes("10.0.0.1/32"), RemotePorts: ports(PortRange{6443, 6443})}
	if err := d.SetProtected([]ProtectRule{ssh, api}); err != nil {
		t.Fatal(err)
	}
	want := buildProtection([]ProtectRule{ssh, api})
	checkProtection(t, d, want)
	d.Close()

	d = loadTest(t, opts)
	if err := d.SetProtected([]ProtectRule{ssh}); err != nil {
		t.Fatal(err)
	}
	checkProtection(t, d, buildProtection([]ProtectRule{ssh}))
	if err := d.SetProtected(nil); err != nil {
		t.Fatal(err)
	}
	checkProtection(t, d, buildProtection(nil))
}

func checkProtection(tb testing.TB, d *Datapath, want *protection) {
	tb.Helper()
	got, err := d.readProtection()
	if err != nil {
		tb.Fatal(err)
	}
	if got.rules != want.rules || got.portless != want.portless || got.peerMask != want.peerMask {
		tb.Errorf("protect config: rules %b portless %b peers %b, want %b %b %b",
			got.rules, got.portless, got.peerMask, want.rules, want.portless, want.peerMask)
	}
	if !slices.Equal(got.ports, want.ports) {
		tb.Errorf("protect port table differs")
	}
	if len(got.peers) != len(want.peers) {
		tb.Errorf("protect peers %v, want %v", got.peers, want.peers)
	}
	for p, m := range want.peers {
		if got.peers[p] != m {
			tb.Errorf("protect peer %s = %b, want %b", p, got.peers[p], m)
		}
	}
}

var _ = errors.New
