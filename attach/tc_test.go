package attach

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/rlagent/rlagent/internal/bpftest"
)

// tcx on a veth's ingress and on the other end's egress sees every packet
// sent; attaching again with the same program changes nothing; Alive and
// Pinned report both points.
func TestTCXCountsPackets(t *testing.T) {
	p := pair(t, "10.220.1.0/24")
	a := newAttacher(t, Options{})
	in := Point{Iface: "veth-b", Netns: nsPath(p.B), Kind: TCIngress}
	eg := Point{Iface: "veth-a", Netns: nsPath(p.A), Kind: TCEgress}
	cin := bpftest.NewCounter(t, ebpf.SchedCLS, "test_in", bpftest.TCXNext)
	ceg := bpftest.NewCounter(t, ebpf.SchedCLS, "test_eg", bpftest.TCXNext)
	for _, tc := range []struct {
		p Point
		c *bpftest.Counter
	}{{in, cin}, {eg, ceg}} {
		res := mustAttach(t, a, tc.p, tc.c.Prog)
		if res.Mode != ModeTCX || res.Change != Created || res.Program != tc.c.ID(t) || res.Link == 0 {
			t.Fatalf("Attach(%s) = %+v, want a new tcx link running program %d", tc.p, res, tc.c.ID(t))
		}
		again := mustAttach(t, a, tc.p, tc.c.Prog)
		if again.Change != Kept || again.Link != res.Link {
			t.Errorf("second Attach(%s) = %+v, want link %d kept", tc.p, again, res.Link)
		}
		if alive := mustAlive(t, a, tc.p); alive.Mode != ModeTCX || alive.Program != tc.c.ID(t) || alive.Link != res.Link {
			t.Errorf("Alive(%s) = %+v, want link %d with program %d", tc.p, alive, res.Link, tc.c.ID(t))
		}
	}
	if got := bpftest.TCXPrograms(t, p.B, "veth-b", ebpf.AttachTCXIngress); !slices.Equal(got, []ebpf.ProgramID{cin.ID(t)}) {
		t.Errorf("veth-b tcx ingress runs %v, want [%d]", got, cin.ID(t))
	}

	const n = 200
	dst := netip.AddrPortFrom(p.B4, 7001)
	listen(t, p.B, dst)
	sendUDP(t, p.A, dst, n)
	if got := cin.Wait(t, n); got != n {
		t.Errorf("ingress of veth-b counted %d IPv4 packets, want %d", got, n)
	}
	if got := ceg.Wait(t, n); got != n {
		t.Errorf("egress of veth-a counted %d IPv4 packets, want %d", got, n)
	}

	pinned, err := Pinned(a.pinDir)
	if err != nil {
		t.Fatal(err)
	}
	want := []Point{eg, in}
	slices.SortFunc(want, func(x, y Point) int { return strings.Compare(x.Netns, y.Netns) })
	if !slices.Equal(pinned, want) {
		t.Errorf("Pinned = %v, want %v", pinned, want)
	}
}

// The clsact path (kernels 6.1-6.5) counts packets on both hooks; attaching
// again replaces the program of our one filter in place, same priority and
// handle, and never adds a second filter.
func TestClsactCountsAndReplacesInPlace(t *testing.T) {
	p := pair(t, "10.220.2.0/24")
	a := newAttacher(t, Options{ForceClsact: true})
	in := Point{Iface: "veth-b", Netns: nsPath(p.B), Kind: TCIngress}
	eg := Point{Iface: "veth-a", Netns: nsPath(p.A), Kind: TCEgress}
	c1 := bpftest.NewCounter(t, ebpf.SchedCLS, "test_in1", bpftest.TCXNext)
	ceg := bpftest.NewCounter(t, ebpf.SchedCLS, "test_eg", bpftest.TCXNext)

	res := mustAttach(t, a, in, c1.Prog)
	if res.Mode != ModeClsact || res.Change != Created || res.Program != c1.ID(t) {
		t.Fatalf("Attach(%s) = %+v, want a new clsact filter running %d", in, res, c1.ID(t))
	}
	if res := mustAttach(t, a, eg, ceg.Prog); res.Mode != ModeClsact {
		t.Fatalf("Attach(%s) = %+v, want clsact", eg, res)
	}
	if !slices.Contains(bpftest.Qdiscs(t, p.B, "veth-b"), "clsact") {
		t.Errorf("veth-b has qdiscs %v, want a clsact", bpftest.Qdiscs(t, p.B, "veth-b"))
	}
	if got := bpftest.TCXPrograms(t, p.B, "veth-b", ebpf.AttachTCXIngress); len(got) != 0 {
		t.Errorf("ForceClsact left tcx programs %v on veth-b", got)
	}
	before := bpftest.BPFFilters(t, p.B, "veth-b", netlink.HANDLE_MIN_INGRESS)
	if len(before) != 1 || !strings.HasPrefix(before[0].Name, filterPrefix) || before[0].Id != int(c1.ID(t)) ||
		!before[0].DirectAction {
		t.Fatalf("veth-b ingress filters %+v, want one direct-action %s* filter running %d", before, filterPrefix, c1.ID(t))
	}

	const n = 100
	dst := netip.AddrPortFrom(p.B4, 7002)
	listen(t, p.B, dst)
	sendUDP(t, p.A, dst, n)
	if got := c1.Wait(t, n); got != n {
		t.Errorf("clsact ingress counted %d, want %d", got, n)
	}
	if got := ceg.Wait(t, n); got != n {
		t.Errorf("clsact egress counted %d, want %d", got, n)
	}

	if res := mustAttach(t, a, in, c1.Prog); res.Change != Kept {
		t.Errorf("Attach with the same program: %v, want kept", res.Change)
	}
	c2 := bpftest.NewCounter(t, ebpf.SchedCLS, "test_in2", bpftest.TCXNext)
	if res := mustAttach(t, a, in, c2.Prog); res.Change != Replaced || res.Program != c2.ID(t) {
		t.Fatalf("Attach with a new program = %+v, want replaced, running %d", res, c2.ID(t))
	}
	after := bpftest.BPFFilters(t, p.B, "veth-b", netlink.HANDLE_MIN_INGRESS)
	if len(after) != 1 {
		t.Fatalf("after re-attach veth-b has %d ingress filters (%+v), want 1", len(after), after)
	}
	if after[0].Priority != before[0].Priority || after[0].Handle != before[0].Handle || after[0].Id != int(c2.ID(t)) {
		t.Errorf("after re-attach the filter is prio %d handle %x program %d, want prio %d handle %x program %d",
			after[0].Priority, after[0].Handle, after[0].Id, before[0].Priority, before[0].Handle, c2.ID(t))
	}
	if alive := mustAlive(t, a, in); alive.Mode != ModeClsact || alive.Program != c2.ID(t) {
		t.Errorf("Alive = %+v, want clsact running %d", alive, c2.ID(t))
	}
	sendUDP(t, p.A, dst, n)
	if got := c2.Wait(t, n); got != n {
		t.Errorf("the new program counted %d, want %d", got, n)
	}
	if got := c1.N(t); got != n {
		t.Errorf("the old program counted %d after it was replaced, want it to stay at %d", got, n)
	}

	// Detach takes our filter, leaves the qdisc.
	if err := a.Detach(in); err != nil {
		t.Fatal(err)
	}
	if got := bpftest.BPFFilters(t, p.B, "veth-b", netlink.HANDLE_MIN_INGRESS); len(got) != 0 {
		t.Errorf("after Detach: filters %+v", got)
	}
	if !slices.Contains(bpftest.Qdiscs(t, p.B, "veth-b"), "clsact") {
		t.Errorf("Detach removed the clsact qdisc")
	}
	notAlive(t, a, in, "nothing pinned")
}

// Our tcx program goes to the head of the chain without moving the
// programs already there, stays there when its program is replaced, and
// (returning TCX_NEXT) lets them see every packet.
func TestTCXKeepsOthersOrder(t *testing.T) {
	p := pair(t, "10.220.3.0/24")
	a := newAttacher(t, Options{})
	fa := bpftest.NewCounter(t, ebpf.SchedCLS, "foreign_a", bpftest.TCXNext)
	fb := bpftest.NewCounter(t, ebpf.SchedCLS, "foreign_b", bpftest.TCXNext)
	bpftest.AttachTCX(t, p.B, "veth-b", ebpf.AttachTCXIngress, fa.Prog)
	bpftest.AttachTCX(t, p.B, "veth-b", ebpf.AttachTCXIngress, fb.Prog)
	order := func() []ebpf.ProgramID { return bpftest.TCXPrograms(t, p.B, "veth-b", ebpf.AttachTCXIngress) }
	if got, want := order(), []ebpf.ProgramID{fa.ID(t), fb.ID(t)}; !slices.Equal(got, want) {
		t.Fatalf("foreign programs run as %v, want %v", got, want)
	}

	in := Point{Iface: "veth-b", Netns: nsPath(p.B), Kind: TCIngress}
	ours := bpftest.NewCounter(t, ebpf.SchedCLS, "test_ours", bpftest.TCXNext)
	mustAttach(t, a, in, ours.Prog)
	if got, want := order(), []ebpf.ProgramID{ours.ID(t), fa.ID(t), fb.ID(t)}; !slices.Equal(got, want) {
		t.Fatalf("after Attach the hook runs %v, want %v (ours first, the others in their order)", got, want)
	}

	const n = 100
	dst := netip.AddrPortFrom(p.B4, 7003)
	listen(t, p.B, dst)
	sendUDP(t, p.A, dst, n)
	for name, c := range map[string]*bpftest.Counter{"ours": ours, "foreign_a": fa, "foreign_b": fb} {
		if got := c.Wait(t, n); got != n {
			t.Errorf("%s counted %d, want %d: every program after ours must see every packet", name, got, n)
		}
	}

	ours2 := bpftest.NewCounter(t, ebpf.SchedCLS, "test_ours2", bpftest.TCXNext)
	if res := mustAttach(t, a, in, ours2.Prog); res.Change != Replaced {
		t.Fatalf("Attach of a new program: %v, want replaced", res.Change)
	}
	if got, want := order(), []ebpf.ProgramID{ours2.ID(t), fa.ID(t), fb.ID(t)}; !slices.Equal(got, want) {
		t.Fatalf("after replacing our program the hook runs %v, want %v", got, want)
	}

	if err := a.Detach(in); err != nil {
		t.Fatal(err)
	}
	if got, want := order(), []ebpf.ProgramID{fa.ID(t), fb.ID(t)}; !slices.Equal(got, want) {
		t.Fatalf("after Detach the hook runs %v, want %v", got, want)
	}
}

// A pin whose interface was deleted is dead: Alive says so (and leaves it),
// and Attach replaces it with a new link once the interface is back.
func TestDeadPinReplaced(t *testing.T) {
	p := pair(t, "10.220.4.0/24")
	a := newAttacher(t, Options{})
	in := Point{Iface: "veth-b", Netns: nsPath(p.B), Kind: TCIngress}
	c := bpftest.NewCounter(t, ebpf.SchedCLS, "test_dead", bpftest.TCXNext)
	first := mustAttach(t, a, in, c.Prog)

	nlB, err := p.B.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nlB.Close()
	l, err := nlB.LinkByName("veth-b")
	if err != nil {
		t.Fatal(err)
	}
	if err := nlB.LinkDel(l); err != nil {
		t.Fatal(err)
	}
	notAlive(t, a, in, "deleted")
	if pinned, _ := Pinned(a.pinDir); !slices.Contains(pinned, in) {
		t.Fatalf("Alive removed the dead pin: Pinned = %v", pinned)
	}
	if _, err := a.Attach(in, c.Prog); !errors.Is(err, ErrNoInterface) {
		t.Fatalf("Attach without the interface: %v, want ErrNoInterface", err)
	}

	// The interface again, another veth of the same name.
	if err := nlB.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "veth-b"}, PeerName: "veth-x"}); err != nil {
		t.Fatal(err)
	}
	second := mustAttach(t, a, in, c.Prog)
	if second.Change != Created || second.Link == first.Link {
		t.Fatalf("Attach after the interface came back = %+v, want a new link (the old one was %d)", second, first.Link)
	}
	if alive := mustAlive(t, a, in); alive.Link != second.Link {
		t.Errorf("Alive = %+v, want link %d", alive, second.Link)
	}
}

// An interface with the older ingress qdisc (which takes clsact's place):
// our ingress filter joins it and counts; an egress one cannot, and the
// error says what to do. The qdisc stays an ingress qdisc.
func TestClsactOnIngressQdisc(t *testing.T) {
	p := pair(t, "10.220.12.0/24")
	nl, err := p.B.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	idx := bpftest.IfIndex(t, p.B, "veth-b")
	err = nl.QdiscAdd(&netlink.Ingress{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: idx,
		Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_INGRESS}})
	if err != nil {
		t.Fatal(err)
	}
	a := newAttacher(t, Options{ForceClsact: true})
	c := bpftest.NewCounter(t, ebpf.SchedCLS, "test_ingq", bpftest.TCXNext)
	mustAttach(t, a, Point{Iface: "veth-b", Netns: nsPath(p.B), Kind: TCIngress}, c.Prog)
	const n = 50
	dst := netip.AddrPortFrom(p.B4, 7006)
	listen(t, p.B, dst)
	sendUDP(t, p.A, dst, n)
	if got := c.Wait(t, n); got != n {
		t.Errorf("the filter on the ingress qdisc counted %d, want %d", got, n)
	}
	_, err = a.Attach(Point{Iface: "veth-b", Netns: nsPath(p.B), Kind: TCEgress}, c.Prog)
	if err == nil || !strings.Contains(err.Error(), "replace it with clsact") {
		t.Errorf("egress on an ingress qdisc: %v, want an error saying to replace it with clsact", err)
	}
	if q := bpftest.Qdiscs(t, p.B, "veth-b"); !slices.Contains(q, "ingress") || slices.Contains(q, "clsact") {
		t.Errorf("qdiscs %v, want the ingress qdisc kept", q)
	}
}
