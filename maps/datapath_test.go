package maps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/bpf"
	"github.com/rlagent/rlagent/internal/testenv"
)

const (
	xdpDrop = 1
	xdpPass = 2
)

// loadTest loads the data path's maps and XDP programs, unpinned unless
// opts says otherwise, and closes it when the test ends. The TC programs
// are left out (XDPOnly): what the tests here check is the maps, and the
// verifier takes four times as long for them (TestTCProgram loads them).
func loadTest(tb testing.TB, opts Options) *Datapath {
	tb.Helper()
	opts.XDPOnly = true
	return loadFull(tb, opts)
}

// loadFull is loadTest with the programs opts says.
func loadFull(tb testing.TB, opts Options) *Datapath {
	tb.Helper()
	testenv.RequireRoot(tb)
	d, err := Load(opts)
	if err != nil {
		tb.Fatalf("load data path: %v", err)
	}
	tb.Cleanup(func() { d.Close() })
	return d
}

// loadTestClock loads the data path with the test clock at 1 s, standing
// still, and leases sized for one CPU (chunk = min(rate/1000, burst/8)).
func loadTestClock(tb testing.TB) *Datapath {
	tb.Helper()
	d := loadTest(tb, Options{Clock: ClockTest, CPUs: 1})
	mustSetClock(tb, d, 1e9)
	return d
}

func mustSetClock(tb testing.TB, d *Datapath, now uint64) {
	tb.Helper()
	if err := d.SetTestClock(now, 0); err != nil {
		tb.Fatal(err)
	}
}

func mustSetLimit(tb testing.TB, d *Datapath, id uint32, l Limit) {
	tb.Helper()
	if err := d.SetLimit(id, l); err != nil {
		tb.Fatalf("set limit %d: %v", id, err)
	}
}

func mustStatsOf(tb testing.TB, d *Datapath, id uint32) Stats {
	tb.Helper()
	s, err := d.Stats(id)
	if err != nil {
		tb.Fatal(err)
	}
	return s
}

// entryOf reads limit id's entry from the map, not from the mirror.
func entryOf(tb testing.TB, d *Datapath, id uint32) bpf.RatelimitRlLimit {
	tb.Helper()
	var e bpf.RatelimitRlLimit
	if err := d.objs.RlLimits.Lookup(id, &e); err != nil {
		tb.Fatalf("read limit entry %d: %v", id, err)
	}
	return e
}

// mustRunPacket runs the program once on pkt and returns the verdict.
func mustRunPacket(tb testing.TB, d *Datapath, pkt []byte) uint32 {
	tb.Helper()
	ret, err := d.Program().Run(&ebpf.RunOptions{Data: pkt})
	if err != nil {
		tb.Fatalf("run: %v", err)
	}
	return ret
}

// mustPass runs pkt n times and fails unless every run passes.
func mustPass(tb testing.TB, d *Datapath, pkt []byte, n int) {
	tb.Helper()
	for i := range n {
		if v := mustRunPacket(tb, d, pkt); v != xdpPass {
			tb.Fatalf("run %d of %d: verdict %d, want XDP_PASS", i+1, n, v)
		}
	}
}

// udpPacket builds an Ethernet frame with an IPv4 or IPv6 UDP header. No
// checksums: the data path does not read them.
func udpPacket(src, dst string, dport uint16) []byte {
	s, d := netip.MustParseAddr(src), netip.MustParseAddr(dst)
	udp := make([]byte, 8)
	binary.BigEndian.PutUint16(udp[0:], 40000)
	binary.BigEndian.PutUint16(udp[2:], dport)
	binary.BigEndian.PutUint16(udp[4:], 8)
	var l3 []byte
	etype := uint16(0x0800)
	if s.Is4() {
		l3 = make([]byte, 20)
		l3[0] = 0x45
		binary.BigEndian.PutUint16(l3[2:], 20+8)
		l3[8], l3[9] = 64, 17
		a, b := s.As4(), d.As4()
		copy(l3[12:], a[:])
		copy(l3[16:], b[:])
	} else {
		etype = 0x86dd
		l3 = make([]byte, 40)
		l3[0] = 0x60
		binary.BigEndian.PutUint16(l3[4:], 8)
		l3[6], l3[7] = 17, 64
		a, b := s.As16(), d.As16()
		copy(l3[8:], a[:])
		copy(l3[24:], b[:])
	}
	frame := []byte{2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2}
	frame = binary.BigEndian.AppendUint16(frame, etype)
	frame = append(frame, l3...)
	return append(frame, udp...)
}

// sameLimit compares a limit as read back with the one that was set: the
// match only has to be equivalent (ports merged, CIDRs minimal).
func sameLimit(tb testing.TB, id uint32, got, want Limit) {
	tb.Helper()
	gm, wm := matchString(canonMatch(got.Match)), matchString(canonMatch(want.Match))
	got.Match, want.Match = Match{}, Match{}
	if !reflect.DeepEqual(got, want) || gm != wm {
		tb.Errorf("limit %d = %+v match %s\nwant %+v match %s", id, got, gm, want, wm)
	}
}

// diffClassifier lists how two classifiers differ.
func diffClassifier(a, b *classifier) []string {
	var out []string
	if a.cfg != b.cfg {
		out = append(out, fmt.Sprintf("cfg %+v != %+v", a.cfg, b.cfg))
	}
	for cl := range a.protoAny {
		if a.protoAny[cl] != b.protoAny[cl] {
			out = append(out, fmt.Sprintf("protoAny[%d] %v != %v", cl, idsOf(a.protoAny[cl]), idsOf(b.protoAny[cl])))
		}
	}
	for i := range a.ports {
		if a.ports[i] != b.ports[i] {
			out = append(out, fmt.Sprintf("ports[class %d, port %d] %v != %v", i/portSpace, i%portSpace, idsOf(a.ports[i]), idsOf(b.ports[i])))
		}
	}
	for _, side := range []struct {
		name string
		a, b map[netip.Prefix]mask
	}{{"src", a.src, b.src}, {"dst", a.dst, b.dst}} {
		if !reflect.DeepEqual(side.a, side.b) {
			out = append(out, fmt.Sprintf("%s prefixes %v != %v", side.name, side.a, side.b))
		}
	}
	for _, side := range []struct {
		name string
		a, b []head4
	}{{"src", a.src4Head, b.src4Head}, {"dst", a.dst4Head, b.dst4Head}} {
		for i := range side.a {
			if side.a[i] != side.b[i] {
				out = append(out, fmt.Sprintf("%s first stage [%d.%d] %+v != %+v", side.name, i>>8, i&255, side.a[i], side.b[i]))
			}
		}
	}
	return out
}

// checkClassifier reads the classifier maps and compares them with what
// the limits the Datapath holds derive to. It reads 128 Ki port entries:
// about a quarter of a second.
func checkClassifier(tb testing.TB, d *Datapath) *classifier {
	tb.Helper()
	got, err := d.readClassifier()
	if err != nil {
		tb.Fatal(err)
	}
	want := buildClassifier(d.limits, &d.state.cfg, d.state.cfg.LastGen)
	if diff := diffClassifier(got, want); len(diff) > 0 {
		tb.Errorf("classifier maps differ from the limits' classifier (maps != want):\n%s", strings.Join(diff, "\n"))
	}
	return got
}

func TestLoadClocks(t *testing.T) {
	t.Parallel()
	monotonic := func(clock int32) uint64 {
		var ts unix.Timespec
		if err := unix.ClockGettime(clock, &ts); err != nil {
			panic(err) // cannot fail for these clocks
		}
		return uint64(ts.Nano())
	}
	now := func(t *testing.T, d *Datapath) uint64 {
		t.Helper()
		n, err := d.Now()
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	// increases polls the clock until it moves: jiffies move once a tick.
	increases := func(t *testing.T, d *Datapath) {
		t.Helper()
		first := now(t, d)
		for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			n := now(t, d)
			if n > first {
				return
			}
			if n < first {
				t.Fatalf("clock went back from %d to %d", first, n)
			}
		}
		t.Fatalf("clock stayed at %d for a second", first)
	}
	var res unix.Timespec
	if err := unix.ClockGetres(unix.CLOCK_MONOTONIC_COARSE, &res); err != nil {
		t.Fatal(err)
	}
	jiffy := uint64(res.Nano())

	t.Run("default is jiffies", func(t *testing.T) {
		t.Parallel()
		d := loadTest(t, Options{})
		if cpus, err := ebpf.PossibleCPU(); err != nil || d.CPUs() != cpus {
			t.Errorf("CPUs() = %d, want the %d possible CPUs (%v)", d.CPUs(), cpus, err)
		}
		increases(t, d)
		// jiffies x ns_per_jiffy: every reading is a whole number of ticks,
		// and the clock runs at the speed of CLOCK_MONOTONIC. Each reading
		// is bracketed by two of CLOCK_MONOTONIC, so that a preemption
		// widens the bounds instead of failing the test.
		m1a, n1, m1b := monotonic(unix.CLOCK_MONOTONIC), now(t, d), monotonic(unix.CLOCK_MONOTONIC)
		time.Sleep(40 * time.Millisecond)
		m2a, n2, m2b := monotonic(unix.CLOCK_MONOTONIC), now(t, d), monotonic(unix.CLOCK_MONOTONIC)
		if n1%jiffy != 0 || n2%jiffy != 0 {
			t.Errorf("Now() = %d, %d: not multiples of the jiffy, %d ns", n1, n2, jiffy)
		}
		if dn, lo, hi := n2-n1, m2a-m1b, m2b-m1a; dn+2*jiffy < lo || dn > hi+2*jiffy {
			t.Errorf("data path clock moved %d ns while CLOCK_MONOTONIC moved %d..%d ns (jiffy %d ns)", dn, lo, hi, jiffy)
		}
		if err := d.SetTestClock(1, 1); err == nil {
			t.Error("SetTestClock without ClockTest: no error")
		}
	})
	t.Run("ktime", func(t *testing.T) {
		t.Parallel()
		d := loadTest(t, Options{Clock: ClockKtime})
		increases(t, d)
		before := monotonic(unix.CLOCK_MONOTONIC)
		n := now(t, d)
		after := monotonic(unix.CLOCK_MONOTONIC)
		if n < before || n > after {
			t.Errorf("ktime Now() = %d, not within CLOCK_MONOTONIC %d..%d", n, before, after)
		}
		if err := d.SetTestClock(1, 1); err == nil {
			t.Error("SetTestClock without ClockTest: no error")
		}
	})
	t.Run("coarse", func(t *testing.T) {
		t.Parallel()
		d := loadTest(t, Options{Clock: ClockCoarse})
		increases(t, d)
		before := monotonic(unix.CLOCK_MONOTONIC_COARSE)
		n := now(t, d)
		after := monotonic(unix.CLOCK_MONOTONIC)
		if n < before || n > after {
			t.Errorf("coarse Now() = %d, not within CLOCK_MONOTONIC_COARSE %d..CLOCK_MONOTONIC %d", n, before, after)
		}
	})
	t.Run("test", func(t *testing.T) {
		t.Parallel()
		d := loadTest(t, Options{Clock: ClockTest, CPUs: 3})
		if d.CPUs() != 3 {
			t.Errorf("CPUs() = %d, want 3 as set", d.CPUs())
		}
		if err := d.SetTestClock(12_345, 7); err != nil {
			t.Fatal(err)
		}
		// Reading the clock does not advance it; a packet does, by step.
		if n := now(t, d); n != 12_345 {
			t.Errorf("Now() = %d, want the test clock 12345", n)
		}
		if n := now(t, d); n != 12_345 {
			t.Errorf("second Now() = %d, want 12345", n)
		}
		mustPass(t, d, udpPacket("10.0.0.1", "10.0.0.2", 53), 2)
		if n, err := d.TestClock(); err != nil || n != 12_345+2*7 {
			t.Errorf("TestClock() after 2 packets = %d, %v; want %d", n, err, 12_345+2*7)
		}
		if n := now(t, d); n != 12_345+2*7 {
			t.Errorf("Now() after 2 packets = %d, want %d", n, 12_345+2*7)
		}
	})
	t.Run("unknown clock", func(t *testing.T) {
		t.Parallel()
		testenv.RequireRoot(t)
		d, err := Load(Options{Clock: ClockTest + 1})
		if err == nil {
			d.Close()
			t.Fatal("Load with clock 4: no error")
		}
		if !strings.HasPrefix(err.Error(), "clock:") {
			t.Errorf("Load with clock 4: error %q does not name the clock", err)
		}
	})
}

func TestLimitLifecycle(t *testing.T) {
	t.Parallel()
	d := loadTestClock(t)

	mapped := prefixes("::ffff:10.0.0.0/104", "192.168.1.7/24")
	l5 := Limit{
		Rate: 1000, Burst: 100, Unit: Bytes, Key: KeySrcPrefix, Prefix4: 24, Prefix6: 56, Action: Shadow,
		Match: Match{Direction: Egress, Protocol: TCP, DstPorts: ports(PortRange{80, 80}, PortRange{8000, 8010}), SrcCIDRs: mapped},
	}
	l2 := Limit{Rate: 10, Burst: 5, Key: KeyDstPort, Match: Match{Protocol: UDP, DstCIDRs: prefixes("2001:db8::/32")}}
	last := Limit{Rate: MaxRate, Burst: MaxRate, Match: Match{Protocol: ICMP}}
	mustSetLimit(t, d, 5, l5)
	mustSetLimit(t, d, 2, l2)
	mustSetLimit(t, d, MaxLimits-1, last)

	if got := d.IDs(); !slices.Equal(got, []uint32{2, 5, MaxLimits - 1}) {
		t.Errorf("IDs() = %v, want [2 5 %d]", got, MaxLimits-1)
	}
	if mapped[0] != netip.MustParsePrefix("::ffff:10.0.0.0/104") || mapped[1] != netip.MustParsePrefix("192.168.1.7/24") {
		t.Errorf("SetLimit changed the caller's CIDRs to %v", mapped)
	}
	got, err := d.Limit(5)
	if err != nil {
		t.Fatal(err)
	}
	want := l5
	want.Match.SrcCIDRs = prefixes("10.0.0.0/8", "192.168.1.0/24") // unmapped, masked
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Limit(5) = %+v\nwant %+v", got, want)
	}
	got.Match.DstPorts[0].First = 1 // the caller's copy
	if again, _ := d.Limit(5); again.Match.DstPorts[0].First != 80 {
		t.Errorf("changing the limit Limit returned changed the Datapath's: ports %v", again.Match.DstPorts)
	}
	for id, l := range map[uint32]Limit{2: l2, MaxLimits - 1: last} {
		if got, err := d.Limit(id); err != nil || !reflect.DeepEqual(got, l) {
			t.Errorf("Limit(%d) = %+v, %v; want %+v", id, got, err, l)
		}
	}

	// The entries in the map.
	e5, e2 := entryOf(t, d, 5), entryOf(t, d, 2)
	if e5.Gen == 0 || e2.Gen == 0 || e5.Gen == e2.Gen {
		t.Errorf("generations of limits 5 and 2: %d, %d; want distinct and non-zero", e5.Gen, e2.Gen)
	}
	p5 := e5.Params[e5.Active&1]
	wantP5 := bpf.RatelimitRlParams{Rate: 1000, Burst: 100, Chunk: 1, BaseNs: 1e9, BaseV: vOrigin}
	if e5.Seq != 1 || e5.Unit != bpf.RatelimitRlUnit(Bytes) || e5.KeyKind != bpf.RatelimitRlKeyKind(KeySrcPrefix) || e5.Action != bpf.RatelimitRlAction(Shadow) ||
		e5.Prefix4 != netmask4(24) || e5.Prefix6 != netmask6(56) || p5 != wantP5 {
		t.Errorf("entry of limit 5 = %+v, want seq 1, bytes, src-prefix /24 /56, shadow, params %+v", e5, wantP5)
	}
	if e := entryOf(t, d, MaxLimits-1); e.Params[e.Active&1].Chunk != chunk(MaxRate, MaxRate, 1) {
		t.Errorf("chunk of limit %d = %d, want %d", MaxLimits-1, e.Params[e.Active&1].Chunk, chunk(MaxRate, MaxRate, 1))
	}
	if e := entryOf(t, d, 3); e != (bpf.RatelimitRlLimit{}) {
		t.Errorf("entry of unset limit 3 = %+v, want zero", e)
	}

	// Errors callers branch on.
	if err := d.SetLimit(MaxLimits, l2); !errors.Is(err, ErrTableFull) {
		t.Errorf("SetLimit(%d) = %v, want ErrTableFull", MaxLimits, err)
	}
	if err := d.SetLimit(^uint32(0), l2); !errors.Is(err, ErrTableFull) {
		t.Errorf("SetLimit(max uint32) = %v, want ErrTableFull", err)
	}
	if err := d.DeleteLimit(3); !errors.Is(err, ErrUnknownLimit) {
		t.Errorf("DeleteLimit(3) of an unset id = %v, want ErrUnknownLimit", err)
	}
	if _, err := d.Stats(3); !errors.Is(err, ErrUnknownLimit) {
		t.Errorf("Stats(3) of an unset id = %v, want ErrUnknownLimit", err)
	}
	if _, err := d.Limit(3); !errors.Is(err, ErrUnknownLimit) {
		t.Errorf("Limit(3) of an unset id = %v, want ErrUnknownLimit", err)
	}
	if _, err := d.Buckets(3); !errors.Is(err, ErrUnknownLimit) {
		t.Errorf("Buckets(3) of an unset id = %v, want ErrUnknownLimit", err)
	}

	// An invalid limit writes nothing: not over an existing id, not on a new one.
	lastGen := d.state.cfg.LastGen
	bad := l2
	bad.Match.DstPorts = ports(PortRange{90, 80})
	if err := d.SetLimit(2, bad); err == nil || errors.Is(err, ErrTableFull) {
		t.Errorf("SetLimit(2, ports 90-80) = %v, want a validation error", err)
	}
	bad = l2
	bad.Burst = 0
	if err := d.SetLimit(9, bad); err == nil {
		t.Error("SetLimit(9, burst 0) = nil, want a validation error")
	}
	if got := d.IDs(); !slices.Equal(got, []uint32{2, 5, MaxLimits - 1}) {
		t.Errorf("IDs() after invalid SetLimits = %v, want [2 5 %d]", got, MaxLimits-1)
	}
	if got, _ := d.Limit(2); !reflect.DeepEqual(got, l2) {
		t.Errorf("Limit(2) after an invalid SetLimit = %+v, want %+v", got, l2)
	}
	if e := entryOf(t, d, 2); e != e2 {
		t.Errorf("entry of limit 2 after an invalid SetLimit = %+v, want %+v", e, e2)
	}
	if e := entryOf(t, d, 9); e.Gen != 0 {
		t.Errorf("entry of limit 9 after an invalid SetLimit = %+v, want free", e)
	}
	if d.state.cfg.LastGen != lastGen {
		t.Errorf("last_gen after invalid SetLimits = %d, want %d", d.state.cfg.LastGen, lastGen)
	}

	// Delete.
	if err := d.DeleteLimit(5); err != nil {
		t.Fatal(err)
	}
	if got := d.IDs(); !slices.Equal(got, []uint32{2, MaxLimits - 1}) {
		t.Errorf("IDs() after DeleteLimit(5) = %v, want [2 %d]", got, MaxLimits-1)
	}
	if err := d.DeleteLimit(5); !errors.Is(err, ErrUnknownLimit) {
		t.Errorf("second DeleteLimit(5) = %v, want ErrUnknownLimit", err)
	}
	if _, err := d.Stats(5); !errors.Is(err, ErrUnknownLimit) {
		t.Errorf("Stats(5) after delete = %v, want ErrUnknownLimit", err)
	}
	if e := entryOf(t, d, 5); e != (bpf.RatelimitRlLimit{}) {
		t.Errorf("entry of deleted limit 5 = %+v, want zero", e)
	}
	// A new limit on the freed id is a new generation.
	mustSetLimit(t, d, 5, l2)
	if e := entryOf(t, d, 5); e.Gen <= max(e5.Gen, e2.Gen) {
		t.Errorf("generation of limit 5 set again = %d, want above %d", e.Gen, max(e5.Gen, e2.Gen))
	}
	checkClassifier(t, d)
}

// TestFreshLimitResetsTokens: a limit deleted and set again on the same id,
// or given a new unit, starts over: counters (on delete), pool, and the
// tokens a CPU had leased for the old one.
func TestFreshLimitResetsTokens(t *testing.T) {
	t.Parallel()
	d := loadTestClock(t)
	pkt := udpPacket("10.0.0.1", "10.0.0.2", 53)
	match := Match{Protocol: UDP, DstPorts: ports(PortRange{53, 53})}
	passes := func(t *testing.T, n int) (passed int) {
		t.Helper()
		for range n {
			if mustRunPacket(t, d, pkt) == xdpPass {
				passed++
			}
		}
		return passed
	}

	t.Run("delete", func(t *testing.T) {
		defer testenv.PinCPU(t, firstCPU(t))() // the leased tokens are this CPU's
		// chunk min(100, 1000/8) = 100: the first packet leases 100 tokens.
		mustSetLimit(t, d, 1, Limit{Rate: 100_000, Burst: 1000, Match: match})
		mustPass(t, d, pkt, 10)
		if s := mustStatsOf(t, d, 1); s.AdmittedPackets != 10 {
			t.Fatalf("admitted %d, want 10", s.AdmittedPackets)
		}
		if err := d.DeleteLimit(1); err != nil {
			t.Fatal(err)
		}
		if v := mustRunPacket(t, d, pkt); v != xdpPass {
			t.Errorf("packet with no limit: verdict %d, want XDP_PASS", v)
		}
		mustSetLimit(t, d, 1, Limit{Rate: 1, Burst: 5, Match: match})
		if s := mustStatsOf(t, d, 1); s != (Stats{}) {
			t.Errorf("stats of limit 1 set again = %+v, want zero", s)
		}
		if n := passes(t, 20); n != 5 {
			t.Errorf("limit set again with burst 5 passed %d of 20 packets, want 5 (tokens of the deleted limit must not carry over)", n)
		}
		if s := mustStatsOf(t, d, 1); s.AdmittedPackets != 5 || s.DroppedPackets != 15 {
			t.Errorf("stats = %+v, want 5 admitted, 15 dropped", s)
		}
		if err := d.DeleteLimit(1); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("unit", func(t *testing.T) {
		defer testenv.PinCPU(t, firstCPU(t))()
		// Bytes, chunk 100: the first 42-byte packet leases 100, keeps 58.
		mustSetLimit(t, d, 2, Limit{Rate: 100_000, Burst: 10_000, Unit: Bytes, Match: match})
		if n := passes(t, 1); n != 1 {
			t.Fatal("first packet dropped")
		}
		mustSetLimit(t, d, 2, Limit{Rate: 1, Burst: 2, Unit: Packets, Match: match})
		if n := passes(t, 10); n != 2 {
			t.Errorf("limit changed to packets with burst 2 passed %d of 10, want 2 (bytes leased before must not count as packets)", n)
		}
	})
}

func bucketsOf(tb testing.TB, d *Datapath, id uint32) map[string]uint64 {
	tb.Helper()
	bs, err := d.Buckets(id)
	if err != nil {
		tb.Fatal(err)
	}
	out := make(map[string]uint64, len(bs))
	for _, b := range bs {
		var k string
		switch {
		case b.Addr.IsValid() && b.Prefix > 0:
			k = netip.PrefixFrom(b.Addr, b.Prefix).String()
		case b.Addr.IsValid():
			k = b.Addr.String()
		default:
			k = fmt.Sprint(b.Port)
		}
		out[k] = b.Tokens
	}
	return out
}

func checkBuckets(tb testing.TB, d *Datapath, id uint32, want map[string]uint64) {
	tb.Helper()
	if got := bucketsOf(tb, d, id); !reflect.DeepEqual(got, want) {
		tb.Errorf("buckets of limit %d = %v, want %v", id, got, want)
	}
}

func TestBuckets(t *testing.T) {
	t.Parallel()
	d := loadTestClock(t)
	udp := func(p uint16) Match { return Match{Protocol: UDP, DstPorts: ports(PortRange{p, p})} }
	// Rate 1000: chunk 1, so every admitted packet shows in the pool.
	mustSetLimit(t, d, 1, Limit{Rate: 1000, Burst: 100, Key: KeySrcIP, Match: udp(53)})
	mustSetLimit(t, d, 2, Limit{Rate: 1000, Burst: 100, Key: KeyDstPort,
		Match: Match{Protocol: UDP, DstPorts: ports(PortRange{5000, 5001})}})
	mustSetLimit(t, d, 3, Limit{Rate: 1000, Burst: 100, Key: KeySrcPrefix, Prefix4: 24, Prefix6: 64, Match: udp(6000)})
	mustSetLimit(t, d, 4, Limit{Rate: 1000, Burst: 100, Key: KeyDstIP, Match: udp(7000)})
	mustSetLimit(t, d, 5, Limit{Rate: 1000, Burst: 100, Match: udp(8000)})

	for _, p := range []struct {
		src, dst string
		port     uint16
		n        int
	}{
		{"10.0.0.1", "10.9.9.9", 53, 3},
		{"10.0.0.2", "10.9.9.9", 53, 2},
		{"2001:db8::1", "2001:db8::ff", 53, 1},
		{"10.0.0.1", "10.9.9.9", 5000, 2},
		{"10.0.0.1", "10.9.9.9", 5001, 1},
		{"10.1.2.3", "10.9.9.9", 6000, 1},
		{"10.1.2.200", "10.9.9.9", 6000, 1},
		{"10.1.3.1", "10.9.9.9", 6000, 1},
		{"2001:db8:0:1::5", "2001:db8::ff", 6000, 1},
		{"2001:db8:0:1::6", "2001:db8::ff", 6000, 1},
		{"2001:db8:0:2::6", "2001:db8::ff", 6000, 1},
		{"10.0.0.1", "192.0.2.1", 7000, 4},
		{"10.0.0.1", "192.0.2.1", 8000, 4},
	} {
		mustPass(t, d, udpPacket(p.src, p.dst, p.port), p.n)
	}

	checkBuckets(t, d, 1, map[string]uint64{"10.0.0.1": 97, "10.0.0.2": 98, "2001:db8::1": 99})
	checkBuckets(t, d, 2, map[string]uint64{"5000": 98, "5001": 99})
	checkBuckets(t, d, 3, map[string]uint64{"10.1.2.0/24": 98, "10.1.3.0/24": 99, "2001:db8:0:1::/64": 98, "2001:db8:0:2::/64": 99})
	checkBuckets(t, d, 4, map[string]uint64{"192.0.2.1": 96})
	checkBuckets(t, d, 5, map[string]uint64{}) // key-less: no keyed buckets
	if s := mustStatsOf(t, d, 1); s.NewKeys != 3 || s.AdmittedPackets != 6 || s.ReturnedKeys != 0 {
		t.Errorf("stats of limit 1 = %+v, want 3 new keys, 6 admitted", s)
	}
	if s := mustStatsOf(t, d, 3); s.NewKeys != 4 || s.AdmittedPackets != 6 {
		t.Errorf("stats of limit 3 = %+v, want 4 new keys, 6 admitted", s)
	}

	// Go's V(t) and the data path's agree: 2 ms at 1000/s is 2 tokens, and
	// a bucket holds no more than burst.
	mustSetClock(t, d, 1e9+2e6)
	checkBuckets(t, d, 1, map[string]uint64{"10.0.0.1": 99, "10.0.0.2": 100, "2001:db8::1": 100})
	mustPass(t, d, udpPacket("10.0.0.1", "10.9.9.9", 53), 1)
	checkBuckets(t, d, 1, map[string]uint64{"10.0.0.1": 98, "10.0.0.2": 100, "2001:db8::1": 100})

	// Deleting a keyed limit removes its buckets from the map.
	if err := d.DeleteLimit(1); err != nil {
		t.Fatal(err)
	}
	n := 0
	err := d.eachBucket(func(_ uint32, _ int, k *bpf.RatelimitRlBucketKey, _ uint64) {
		if k.Limit == 1 {
			t.Errorf("bucket %+v of deleted limit 1 still in the map", *k)
		}
		n++
	})
	if err != nil {
		t.Fatal(err)
	}
	if n != 2+4+1 {
		t.Errorf("%d buckets left in the map, want the 7 of limits 2, 3 and 4", n)
	}
}

// TestBucketStartsFull: a key seen for the first time gets a full bucket,
// whatever the burst the limit may have.
func TestBucketStartsFull(t *testing.T) {
	t.Parallel()
	d := loadTestClock(t)
	match := Match{Protocol: UDP, DstPorts: ports(PortRange{53, 53})}
	mustSetLimit(t, d, 1, Limit{Rate: 1000, Burst: 1000, Key: KeySrcIP, Match: match})
	mustPass(t, d, udpPacket("10.0.0.1", "10.9.9.9", 53), 1)
	checkBuckets(t, d, 1, map[string]uint64{"10.0.0.1": 999})

	t.Run("largest burst", func(t *testing.T) {
		burst := MaxRate * MaxBurstSeconds
		mustSetLimit(t, d, 2, Limit{Rate: MaxRate, Burst: burst, Key: KeySrcIP, Match: match})
		// The key's first packet draws its own cost, leasing no chunk;
		// the next one, on the same CPU, leases.
		defer testenv.PinCPU(t, firstCPU(t))()
		mustPass(t, d, udpPacket("10.0.0.1", "10.9.9.9", 53), 1)
		checkBuckets(t, d, 2, map[string]uint64{"10.0.0.1": burst - 1})
		mustPass(t, d, udpPacket("10.0.0.1", "10.9.9.9", 53), 1)
		checkBuckets(t, d, 2, map[string]uint64{"10.0.0.1": burst - 1 - chunk(MaxRate, burst, 1)})
	})
}

func TestChangeLimit(t *testing.T) {
	t.Parallel()
	// Exact counts: every packet on one CPU, whose cache holds what its
	// leases of 2 leave over.
	defer testenv.PinCPU(t, firstCPU(t))()
	d := loadTestClock(t)
	pkt := udpPacket("10.0.0.1", "10.9.9.9", 53)
	l := Limit{Rate: 1000, Burst: 100, Key: KeySrcIP, Match: Match{Protocol: UDP, DstPorts: ports(PortRange{53, 53})}}
	mustSetLimit(t, d, 1, l)
	mustPass(t, d, pkt, 10)
	checkBuckets(t, d, 1, map[string]uint64{"10.0.0.1": 90})
	e1 := entryOf(t, d, 1)

	// Rate: same generation, next seq, the other params slot; V continues.
	mustSetClock(t, d, 3e9) // 2 s later: the bucket is full again
	l.Rate = 2000
	mustSetLimit(t, d, 1, l)
	e2 := entryOf(t, d, 1)
	old := e1.Params[e1.Active&1]
	wantP := bpf.RatelimitRlParams{Rate: 2000, Burst: 100, Chunk: 2, BaseNs: 3e9, BaseV: vclock(&old, 3e9)}
	switch {
	case e2.Gen != e1.Gen:
		t.Errorf("rate change: gen %d -> %d, want it kept", e1.Gen, e2.Gen)
	case e2.Seq != e1.Seq+1:
		t.Errorf("rate change: seq %d -> %d, want +1", e1.Seq, e2.Seq)
	case e2.Active&1 == e1.Active&1:
		t.Errorf("rate change: active slot stayed %d", e2.Active)
	case e2.Params[e2.Active&1] != wantP:
		t.Errorf("rate change: params %+v, want %+v", e2.Params[e2.Active&1], wantP)
	case e2.Params[e1.Active&1] != old:
		t.Errorf("rate change: the old slot changed to %+v, want %+v", e2.Params[e1.Active&1], old)
	}
	if wantP.BaseV != vOrigin+2000 {
		t.Errorf("V after 2 s at 1000/s = %d, want %d", wantP.BaseV, vOrigin+2000)
	}
	if e := d.limits[1].entry; e != e2 {
		t.Errorf("the Datapath's copy of the entry %+v differs from the map's %+v", e, e2)
	}
	// The bucket keeps its tokens and refills at the new rate.
	mustPass(t, d, pkt, 30)
	checkBuckets(t, d, 1, map[string]uint64{"10.0.0.1": 70})
	mustSetClock(t, d, 3e9+5e6)
	checkBuckets(t, d, 1, map[string]uint64{"10.0.0.1": 80}) // 5 ms x 2000/s

	// Burst down: still in place, the bucket is clamped.
	l.Burst = 50
	mustSetLimit(t, d, 1, l)
	e3 := entryOf(t, d, 1)
	if e3.Gen != e1.Gen || e3.Seq != e2.Seq+1 || e3.Active&1 != e1.Active&1 {
		t.Errorf("burst change: entry gen %d seq %d active %d, want gen %d seq %d active %d",
			e3.Gen, e3.Seq, e3.Active, e1.Gen, e2.Seq+1, e1.Active&1)
	}
	checkBuckets(t, d, 1, map[string]uint64{"10.0.0.1": 50})

	// Action and match: in place too.
	l.Action = Shadow
	l.Match.DstPorts = ports(PortRange{53, 54})
	mustSetLimit(t, d, 1, l)
	if e := entryOf(t, d, 1); e.Gen != e1.Gen || e.Action != bpf.RatelimitRlAction(Shadow) {
		t.Errorf("action change: entry gen %d action %d, want gen %d action shadow", e.Gen, e.Action, e1.Gen)
	}
	checkBuckets(t, d, 1, map[string]uint64{"10.0.0.1": 50})

	// Unit and key: a new generation, and the old buckets are gone.
	for _, change := range []struct {
		name string
		f    func(*Limit)
	}{
		{"unit", func(l *Limit) { l.Unit = Bytes; l.Burst = 5000 }},
		{"key", func(l *Limit) { l.Key = KeyDstIP }},
		{"prefix", func(l *Limit) { l.Key, l.Prefix4, l.Prefix6 = KeySrcPrefix, 24, 64 }},
		{"prefix length", func(l *Limit) { l.Prefix4 = 16 }},
	} {
		mustPass(t, d, pkt, 1)
		before := entryOf(t, d, 1)
		if n := len(bucketsOf(t, d, 1)); n != 1 {
			t.Fatalf("%s change: %d buckets before, want 1", change.name, n)
		}
		change.f(&l)
		mustSetLimit(t, d, 1, l)
		after := entryOf(t, d, 1)
		if after.Gen == before.Gen || after.Seq != 1 {
			t.Errorf("%s change: gen %d -> %d, seq %d; want a new gen with seq 1", change.name, before.Gen, after.Gen, after.Seq)
		}
		err := d.eachBucket(func(_ uint32, _ int, k *bpf.RatelimitRlBucketKey, _ uint64) {
			if k.Limit == 1 && k.Gen == before.Gen {
				t.Errorf("%s change: bucket %+v of the old generation still in the map", change.name, *k)
			}
		})
		if err != nil {
			t.Fatal(err)
		}
		checkBuckets(t, d, 1, map[string]uint64{})
	}
	checkClassifier(t, d)
}

// TestRateRaiseCancelsWait: a CPU that found the pool short waits for a
// whole chunk to accrue at the old rate; a rate change (seq) ends that wait.
func TestRateRaiseCancelsWait(t *testing.T) {
	t.Parallel()
	d := loadTestClock(t)
	defer testenv.PinCPU(t, firstCPU(t))() // the wait is this CPU's

	pkt := udpPacket("10.0.0.1", "10.0.0.2", 53)
	l := Limit{Rate: 1, Burst: 1, Match: Match{Protocol: UDP, DstPorts: ports(PortRange{53, 53})}}
	mustSetLimit(t, d, 1, l)
	mustPass(t, d, pkt, 1)
	if v := mustRunPacket(t, d, pkt); v != xdpDrop {
		t.Fatalf("second packet with burst 1: verdict %d, want XDP_DROP", v)
	}
	// At 1/s the next token is 1 s away. At 1000/s it is 1 ms away.
	l.Rate = 1000
	mustSetLimit(t, d, 1, l)
	mustSetClock(t, d, 1e9+1e6)
	if v := mustRunPacket(t, d, pkt); v != xdpPass {
		t.Errorf("1 ms after raising the rate to 1000/s: verdict %d, want XDP_PASS", v)
	}
	if v := mustRunPacket(t, d, pkt); v != xdpDrop {
		t.Errorf("second packet in that ms: verdict %d, want XDP_DROP", v)
	}
}

// TestPrefixTableFull: more prefixes than the LPM trie holds is
// ErrTableFull, and the next change puts the maps back in line.
func TestPrefixTableFull(t *testing.T) {
	t.Parallel()
	d := loadTestClock(t)
	mustSetLimit(t, d, 1, Limit{Rate: 10, Burst: 10, Match: Match{SrcCIDRs: prefixes("192.0.2.0/24")}})
	var many []netip.Prefix
	for i := range 4097 { // rl_src4 holds 4096
		many = append(many, netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)}), 32))
	}
	err := d.SetLimit(2, Limit{Rate: 10, Burst: 10, Match: Match{SrcCIDRs: many}})
	if !errors.Is(err, ErrTableFull) {
		t.Fatalf("SetLimit with 4097 source prefixes = %v, want ErrTableFull", err)
	}
	t.Logf("SetLimit: %v; IDs after: %v", err, d.IDs())
	if err := d.DeleteLimit(2); err != nil && !errors.Is(err, ErrUnknownLimit) {
		t.Fatalf("DeleteLimit after a failed SetLimit: %v", err)
	}
	if got := d.IDs(); !slices.Equal(got, []uint32{1}) {
		t.Errorf("IDs() = %v, want [1]", got)
	}
	c := checkClassifier(t, d)
	if len(c.src) != 1 {
		t.Errorf("%d source prefixes left in the maps, want the 1 of limit 1", len(c.src))
	}
}

func TestPinning(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	opts := Options{PinDir: testenv.BPFFS(t), Clock: ClockTest, CPUs: 1, MaxBuckets: 1024}
	limits := map[uint32]Limit{
		1: {
			Rate: 1000, Burst: 200, Unit: Bytes, Key: KeySrcPrefix, Prefix4: 24, Prefix6: 48, Action: Shadow,
			Match: Match{
				Direction: Egress, Protocol: TCP,
				DstPorts: ports(PortRange{443, 443}, PortRange{80, 80}, PortRange{8000, 8100}),
				SrcCIDRs: prefixes("10.0.0.0/8", "10.1.0.0/16", "2001:db8::/32"),
			},
		},
		70: {
			Rate: 5, Burst: 5, Key: KeyDstPort,
			Match: Match{Protocol: UDP, DstPorts: ports(PortRange{53, 53}), DstCIDRs: prefixes("192.168.0.0/16", "fd00::/8")},
		},
	}
	pkt := udpPacket("10.0.0.1", "192.168.1.1", 53)

	d := loadTest(t, opts)
	mustSetClock(t, d, 1e9)
	for id, l := range limits {
		mustSetLimit(t, d, id, l)
	}
	mustPass(t, d, pkt, 2)
	entries := map[uint32]bpf.RatelimitRlLimit{1: entryOf(t, d, 1), 70: entryOf(t, d, 70)}
	buckets := bucketsOf(t, d, 70)
	if !reflect.DeepEqual(buckets, map[string]uint64{"53": 3}) {
		t.Errorf("buckets of limit 70 before reload = %v, want 53: 3", buckets)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}

	// Load again: the limits come back from the pinned maps.
	d = loadTest(t, opts)
	mustSetClock(t, d, 1e9)
	if got := d.IDs(); !slices.Equal(got, []uint32{1, 70}) {
		t.Fatalf("IDs() after reload = %v, want [1 70]", got)
	}
	for id, want := range limits {
		got, err := d.Limit(id)
		if err != nil {
			t.Fatal(err)
		}
		sameLimit(t, id, got, want)
		if e := entryOf(t, d, id); e != entries[id] {
			t.Errorf("entry of limit %d after reload = %+v, want %+v", id, e, entries[id])
		}
	}
	if got := bucketsOf(t, d, 70); !reflect.DeepEqual(got, buckets) {
		t.Errorf("buckets of limit 70 after reload = %v, want %v", got, buckets)
	}
	if s := mustStatsOf(t, d, 70); s.AdmittedPackets != 2 {
		t.Errorf("stats of limit 70 after reload = %+v, want the 2 admitted before", s)
	}
	// Enforcement went on with the pinned state: 3 tokens left.
	var passed int
	for range 5 {
		if mustRunPacket(t, d, pkt) == xdpPass {
			passed++
		}
	}
	if passed != 3 {
		t.Errorf("after reload %d of 5 packets passed, want the 3 tokens left", passed)
	}

	// Changes after the reload: a new limit gets a generation no pinned
	// limit has; a deleted one leaves no classifier entry behind.
	mustSetLimit(t, d, 3, Limit{Rate: 1, Burst: 1, Match: Match{Protocol: UDP, DstPorts: ports(PortRange{80, 90}),
		SrcCIDRs: prefixes("10.1.0.0/16")}})
	if g := entryOf(t, d, 3).Gen; g == entries[1].Gen || g == entries[70].Gen || g == 0 {
		t.Errorf("generation of a limit set after reload = %d, reuses one of %d, %d", g, entries[1].Gen, entries[70].Gen)
	}
	if err := d.DeleteLimit(1); err != nil {
		t.Fatal(err)
	}
	c := checkClassifier(t, d)
	in := func(m mask) bool { return hasBit(&m, 1) }
	if slices.ContainsFunc(c.cfg.Hook[:], in) || in(c.cfg.Conn) || in(c.cfg.SrcCidr) || in(c.cfg.DstCidr) || slices.ContainsFunc(c.protoAny[:], in) {
		t.Errorf("deleted limit 1 still in the classifier config %+v or protocol table %v", c.cfg, c.protoAny)
	}
	for i, m := range c.ports {
		if in(m) {
			t.Errorf("deleted limit 1 still in ports[class %d, port %d]", i/portSpace, i%portSpace)
		}
	}
	for p, m := range c.src {
		if in(m) {
			t.Errorf("deleted limit 1 still in source prefix %s", p)
		}
	}
	if m := c.src[netip.MustParsePrefix("10.1.0.0/16")]; m != maskOf(3) {
		t.Errorf("source prefix 10.1.0.0/16 = limits %v, want [3]", idsOf(m))
	}
	if m := c.ports[classUDP*portSpace+53]; m != maskOf(70) {
		t.Errorf("ports[udp, 53] = limits %v, want [70]", idsOf(m))
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}

	// A third Load sees the result.
	d = loadTest(t, opts)
	if got := d.IDs(); !slices.Equal(got, []uint32{3, 70}) {
		t.Errorf("IDs() after the second reload = %v, want [3 70]", got)
	}
	if got, err := d.Limit(3); err != nil || got.Match.SrcCIDRs[0] != netip.MustParsePrefix("10.1.0.0/16") {
		t.Errorf("Limit(3) after the second reload = %+v, %v", got, err)
	}
}

// firstCPU is the first CPU this process may run on.
func firstCPU(tb testing.TB) int {
	tb.Helper()
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		tb.Fatal(err)
	}
	for cpu := range 1024 {
		if set.IsSet(cpu) {
			return cpu
		}
	}
	tb.Fatal("no CPU in the affinity mask")
	return 0
}
