package bpf_test

import (
	"encoding/binary"
	"errors"
	"slices"
	"sync"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"

	"github.com/rlagent/rlagent/bpf"
	"github.com/rlagent/rlagent/internal/testenv"
	"github.com/rlagent/rlagent/maps"
)

// The programs of the data path, as the tests run them: the XDP program and
// one TC program per hook. The tables written for the XDP program (verdicts
// xdpPass and xdpDrop) run through the TC programs too: prog.run maps a TC
// verdict to the XDP one, and prog.at puts a table's limits at the
// program's hook.

// Verdicts of the TC programs, as BPF_PROG_TEST_RUN returns them (the
// program's int as a u32).
const (
	tcNext = 0xffffffff // TCX_NEXT (-1, TC_ACT_UNSPEC): pass, the next program runs
	tcShot = 2          // TC_ACT_SHOT: drop
)

// prog is one program of the data path.
type prog struct {
	name string
	hook maps.Hook // the limits it enforces
	tc   bool      // a TC program, run on an skb
}

var (
	xdpProg = prog{"xdp_ratelimit", maps.UplinkIn, false}
	tcProgs = []prog{
		{"tc_uplink_in", maps.UplinkIn, true},
		{"tc_uplink_out", maps.UplinkOut, true},
		{"tc_endpoint_in", maps.EndpointIn, true},
		{"tc_endpoint_out", maps.EndpointOut, true},
	}
	allProgs = append([]prog{xdpProg}, tcProgs...)
	// tcEgress is a TC program of the egress direction, for tests that
	// run one TC program besides the XDP one.
	tcEgress = tcProgs[1]
)

// hookDatapath loads the whole data path (TC programs too) with the test
// clock, unpinned. testDatapath loads the XDP programs only, which the
// verifier takes a fifth of the time for.
//
// With -short (make vmtest passes it: under software emulation the
// verifier takes seconds a program) one data path serves every test of the
// binary, emptied between them (sharedDatapath).
func hookDatapath(tb testing.TB) *maps.Datapath {
	tb.Helper()
	if testing.Short() {
		return sharedDatapath(tb)
	}
	d := newDatapath(tb, maps.Options{Clock: maps.ClockTest})
	setClock(tb, d, 1e9, 0)
	return d
}

// shared is the data path hookDatapath hands out with -short: loaded once,
// never closed (the test binary's exit frees it).
var shared *maps.Datapath

// sharedDatapath empties shared as a new one would be: no limits (deleting
// one drops its buckets and counters), no protect rules, no local or
// endpoint addresses, endpointSourceCheck count, an empty fragment
// table, no tombstones, the clock at 1 s. The global counters go on counting: the tests
// read them as differences (globals, minus).
func sharedDatapath(tb testing.TB) *maps.Datapath {
	tb.Helper()
	testenv.RequireRoot(tb)
	if shared == nil {
		d, err := maps.Load(maps.Options{Clock: maps.ClockTest})
		if err != nil {
			tb.Fatalf("load data path: %v", err)
		}
		shared = d
	}
	for _, id := range shared.IDs() {
		if err := shared.DeleteLimit(id); err != nil {
			tb.Fatalf("empty the shared data path: delete limit %d: %v", id, err)
		}
	}
	if err := shared.SetProtected(nil); err != nil {
		tb.Fatalf("empty the shared data path: %v", err)
	}
	if err := errors.Join(shared.SetLocalAddresses(nil), shared.SetInterfaceMACs(nil),
		shared.SetEndpointSources(nil), shared.SetSourceCheck(maps.SourceCount)); err != nil {
		tb.Fatalf("empty the shared data path: %v", err)
	}
	clearMap(tb, fragTable(tb, shared))
	// The tombstones of earlier tests were noted on a clock that this one
	// sets back to 1 s: they would all seem to owe.
	clearTombstones(tb, shared)
	setClock(tb, shared, 1e9, 0)
	return shared
}

// fresh sets limit id of d to l with new, full buckets, the test clock to
// 1 s, stopped, and empties the fragment table: a case of a table starts as
// on a new Datapath (testDatapath).
func fresh(tb testing.TB, d *maps.Datapath, id uint32, l maps.Limit) {
	tb.Helper()
	setClock(tb, d, 1e9, 0)
	if slices.Contains(d.IDs(), id) {
		if err := d.DeleteLimit(id); err != nil {
			tb.Fatalf("delete limit %d: %v", id, err)
		}
	}
	mustSet(tb, d, id, l)
	clearMap(tb, fragTable(tb, d))
}

// forEachProg runs f as a subtest for each of progs.
func forEachProg(t *testing.T, progs []prog, f func(t *testing.T, p prog)) {
	t.Helper()
	for _, p := range progs {
		t.Run(p.name, func(t *testing.T) { f(t, p) })
	}
}

// of is p in d.
func (p prog) of(tb testing.TB, d *maps.Datapath) *ebpf.Program {
	tb.Helper()
	if !p.tc {
		return d.Program()
	}
	pr := d.TCProgram(p.hook)
	if pr == nil {
		tb.Fatalf("no TC program for hook %v (loaded with XDPOnly?)", p.hook)
	}
	return pr
}

// at is l for a test of p: the tables are written for the XDP program, so a
// limit at its hook (uplink-in, the zero Match) moves to p's hook, and one
// at another hook to another hook than p's (the hooks rotate by p's).
func (p prog) at(l maps.Limit) maps.Limit {
	h := maps.Hook((int(l.Match.Attach.Hook(l.Match.Direction)) + int(p.hook)) % maps.NumHooks)
	l.Match.Attach, l.Match.Direction = h.Attach(), h.Direction()
	return l
}

// atAll is at of every limit of ls.
func (p prog) atAll(ls map[uint32]maps.Limit) map[uint32]maps.Limit {
	out := make(map[uint32]maps.Limit, len(ls))
	for id, l := range ls {
		out[id] = p.at(l)
	}
	return out
}

// runnable reports whether test_run runs p on frame b at all: it refuses
// (EINVAL) a buffer shorter than an Ethernet header, and for an skb one
// whose ethertype is IPv4 or IPv6 and that is too short for that fixed IP
// header (measured on 6.18: 34 and 54 bytes), as the receive path would
// drop it before TC.
func (p prog) runnable(b []byte) bool {
	if len(b) < 14 {
		return false
	}
	if !p.tc {
		return true
	}
	switch binary.BigEndian.Uint16(b[12:]) {
	case ethIPv4:
		return len(b) >= 14+20
	case ethIPv6:
		return len(b) >= 14+40
	}
	return true
}

// verdict maps what p returned to xdpPass or xdpDrop, and fails tb on any
// other value.
func (p prog) verdict(tb testing.TB, ret uint32) uint32 {
	tb.Helper()
	switch {
	case !p.tc && (ret == xdpPass || ret == xdpDrop):
		return ret
	case p.tc && ret == tcNext:
		return xdpPass
	case p.tc && ret == tcShot:
		return xdpDrop
	}
	tb.Fatalf("%s returned %#x: neither its pass nor its drop", p.name, ret)
	return 0
}

// run runs p once on pkt and returns xdpPass or xdpDrop.
func (p prog) run(tb testing.TB, d *maps.Datapath, pkt []byte) uint32 {
	tb.Helper()
	return p.verdict(tb, mustRun(tb, p.of(tb, d), pkt))
}

// runSkb runs TC program p once on pkt with the __sk_buff ctx (skbCtx) and
// returns xdpPass or xdpDrop.
func (p prog) runSkb(tb testing.TB, d *maps.Datapath, pkt, ctx []byte) uint32 {
	tb.Helper()
	ret, err := p.of(tb, d).Run(&ebpf.RunOptions{Data: pkt, Context: ctx})
	if err != nil {
		tb.Fatalf("run %s: %v", p.name, err)
	}
	return p.verdict(tb, ret)
}

// repeat runs p n times on pkt, in test_run calls of up to 2^20.
func (p prog) repeat(tb testing.TB, d *maps.Datapath, pkt []byte, n uint32) {
	tb.Helper()
	for n > 0 {
		k := min(n, 1<<20)
		mustRepeat(tb, p.of(tb, d), pkt, k)
		n -= k
	}
}

// passes sends pkt n times through p and counts the passes.
func (p prog) passes(tb testing.TB, d *maps.Datapath, pkt []byte, n int) int {
	tb.Helper()
	pass := 0
	for range n {
		if p.run(tb, d, pkt) == xdpPass {
			pass++
		}
	}
	return pass
}

// The context of a TC program under BPF_PROG_TEST_RUN is a struct
// __sk_buff, of which the kernel takes mark, priority, ifindex, cb, tstamp,
// wire_len, gso_segs, gso_size and hwtstamp. bpf2go cannot generate a Go
// type for it (it has pointer members: "type *btf.Pointer: not supported"),
// so skbCtx writes the fields by name at the offsets the data path's own BTF
// gives, and TestSkbContextLayout checks those against the kernel's.

type skbField struct{ off, size uint32 }

var skbLayout = sync.OnceValues(func() (map[string]skbField, error) {
	spec, err := bpf.LoadRatelimit()
	if err != nil {
		return nil, err
	}
	return structLayout(spec.Types, "__sk_buff")
})

// structLayout is the offset and size of each member of struct name.
func structLayout(types *btf.Spec, name string) (map[string]skbField, error) {
	var s *btf.Struct
	if err := types.TypeByName(name, &s); err != nil {
		return nil, err
	}
	out := map[string]skbField{"": {size: s.Size}} // "" holds the struct's size
	for _, m := range s.Members {
		if m.Name == "" || m.BitfieldSize != 0 {
			continue // the unions of pointers: nothing a test sets
		}
		size, err := btf.Sizeof(m.Type)
		if err != nil {
			return nil, err
		}
		out[m.Name] = skbField{uint32(m.Offset.Bytes()), uint32(size)}
	}
	return out, nil
}

// skbCtx is a struct __sk_buff with the given 32-bit fields set.
func skbCtx(tb testing.TB, fields map[string]uint32) []byte {
	tb.Helper()
	layout, err := skbLayout()
	if err != nil {
		tb.Fatalf("__sk_buff in the data path's BTF: %v", err)
	}
	b := make([]byte, layout[""].size)
	for name, v := range fields {
		f, ok := layout[name]
		if !ok || f.size != 4 {
			tb.Fatalf("__sk_buff has no 32-bit field %q", name)
		}
		binary.NativeEndian.PutUint32(b[f.off:], v)
	}
	return b
}

// The fields skbCtx sets are where the running kernel has them, and the
// struct is no larger than the kernel's (test_run refuses a larger context
// unless its tail is zero, and misreads a shifted one).
func TestSkbContextLayout(t *testing.T) {
	ours, err := skbLayout()
	if err != nil {
		t.Fatal(err)
	}
	kspec, err := btf.LoadKernelSpec()
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skip("the kernel has no BTF")
	}
	if err != nil {
		t.Fatal(err)
	}
	kernel, err := structLayout(kspec, "__sk_buff")
	if err != nil {
		t.Fatal(err)
	}
	if ours[""].size > kernel[""].size {
		t.Errorf("__sk_buff is %d bytes here, %d in the kernel", ours[""].size, kernel[""].size)
	}
	for _, name := range []string{"len", "mark", "priority", "ifindex", "wire_len", "gso_segs", "gso_size"} {
		o, ok := ours[name]
		if !ok {
			t.Errorf("no field %s in the data path's __sk_buff", name)
			continue
		}
		if k := kernel[name]; k != o {
			t.Errorf("__sk_buff.%s at %+v here, %+v in the kernel", name, o, k)
		}
	}
}

// Each hook's limits are enforced by its own program only: a limit at one
// hook is charged nothing by the programs of the others, so no packet is
// charged twice for one limit. The XDP program and tc_uplink_in enforce the
// same hook (XDP where it can attach, TC where it cannot). Before (issue 9)
// the data path had one direction mask per direction and no TC program.
func TestHooks(t *testing.T) {
	d := hookDatapath(t)
	// Limit id h is at hook h, rate 0: it drops and counts what it sees.
	for h := range maps.NumHooks {
		hook := maps.Hook(h)
		mustSet(t, d, uint32(h), empty(maps.Match{Attach: hook.Attach(), Direction: hook.Direction()}))
	}
	for _, b := range [][]byte{udp4p.bytes(), tcp6p.bytes(), with(udp4p, func(p *pkt) { p.vlans = []uint16{7} }).bytes()} {
		forEachProg(t, allProgs, func(t *testing.T, p prog) {
			before := snapshot(t, d)
			if got := p.run(t, d, b); got != xdpDrop {
				t.Errorf("verdict %d, want drop", got)
			}
			checkDropped(t, before, snapshot(t, d), []uint32{uint32(p.hook)}, len(b), gNone)
		})
	}
}

// A limit set again at another attach point moves there: the old hook's
// program stops charging it and the new one's starts, with the tokens it
// had (the agent moves a limit to the uplink when an endpoint has no
// interface). While the classifier changes the limit is at neither hook,
// never at both (maps.TestInterimConfig checks that config).
func TestMoveLimit(t *testing.T) {
	defer pinCPU(t, 0)()
	d := hookDatapath(t)
	up := perSecond(1, 10)
	ep := up
	ep.Match.Attach = maps.Endpoints
	mustSet(t, d, 0, up)
	b := udp4p.bytes()
	if got := xdpProg.passes(t, d, b, 6); got != 6 {
		t.Fatalf("at the uplink: %d of 6 passed, want 6", got)
	}
	epIn := prog{"tc_endpoint_in", maps.EndpointIn, true}
	if got := epIn.passes(t, d, b, 20); got != 20 {
		t.Fatalf("tc_endpoint_in charged a limit at the uplink: %d of 20 passed", got)
	}
	mustSet(t, d, 0, ep)
	if got := xdpProg.passes(t, d, b, 20); got != 20 {
		t.Errorf("after the move the XDP program still charges the limit: %d of 20 passed", got)
	}
	if got := epIn.passes(t, d, b, 20); got != 4 {
		t.Errorf("after the move tc_endpoint_in passed %d of 20, want the 4 tokens left", got)
	}
	if st := mustStats(t, d, 0); st.AdmittedPackets != 10 || st.DroppedPackets != 16 {
		t.Errorf("limit counted %d admitted, %d dropped; want 10 and 16", st.AdmittedPackets, st.DroppedPackets)
	}
}

// The direction a program passes to the protect rules is its hook's: a
// rule's local port is the destination port of traffic coming in (at
// uplink-in and endpoint-in: traffic INTO the endpoint, though the host
// sees it leave through the veth's egress) and the source port of traffic
// going out; its peer is the source or the destination. Every hook has a
// rate-0 limit, so a packet the rule does not protect is dropped. A rule
// exempts the node's own traffic only: at the uplinks' hooks (both
// addresses are the node's here), never at an endpoint's
// (TestProtectNodeOnly).
func TestHookDirection(t *testing.T) {
	d := hookDatapath(t)
	nodeAddresses(t, d, src4, dst4)
	for h := range maps.NumHooks {
		hook := maps.Hook(h)
		mustSet(t, d, uint32(h), empty(maps.Match{Attach: hook.Attach(), Direction: hook.Direction()}))
	}
	if err := d.SetProtected([]maps.ProtectRule{
		{Protocol: maps.TCP, LocalPorts: ports(22, 22)},
		{Peers: prefixes("192.0.2.9/32")},
	}); err != nil {
		t.Fatal(err)
	}
	toSSH := with(tcp4p, func(p *pkt) { p.sport, p.dport = 40000, 22 }).bytes()   // local port 22 coming in
	fromSSH := with(tcp4p, func(p *pkt) { p.sport, p.dport = 22, 40000 }).bytes() // local port 22 going out
	fromPeer := with(udp4p, func(p *pkt) { p.src = "192.0.2.9" }).bytes()
	toPeer := with(udp4p, func(p *pkt) { p.dst = "192.0.2.9" }).bytes()
	forEachProg(t, allProgs, func(t *testing.T, p prog) {
		in := p.hook.Direction() == maps.Ingress
		up := p.hook.Attach() == maps.Uplink
		for _, c := range []struct {
			name      string
			b         []byte
			protected bool
		}{
			{"to local port 22", toSSH, up && in},
			{"from local port 22", fromSSH, up && !in},
			{"from the peer", fromPeer, up && in},
			{"to the peer", toPeer, up && !in},
		} {
			want := uint32(xdpDrop)
			if c.protected {
				want = xdpPass
			}
			if got := p.run(t, d, c.b); got != want {
				t.Errorf("%s: verdict %d, want %d (protected: %v)", c.name, got, want, c.protected)
			}
		}
	})
}
