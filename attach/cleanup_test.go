package attach

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/internal/bpftest"
)

// Cleanup removes our XDP link, tcx link and clsact filter and every pin,
// and leaves the others' XDP program, tcx program, filter and the clsact
// qdisc as they were.
func TestCleanupKeepsOthers(t *testing.T) {
	p := pair(t, "10.220.10.0/24")
	pinDir := newAttacher(t, Options{}).pinDir
	a := New(Options{PinDir: pinDir, Log: testLogger(t)})
	legacy := New(Options{PinDir: pinDir, Log: testLogger(t), ForceClsact: true})

	// The others: XDP on veth-b, a tcx program on veth-b's egress, a clsact
	// qdisc with a filter on veth-b's ingress.
	fxdp := bpftest.NewCounter(t, ebpf.XDP, "foreign_xdp", bpftest.XDPPass)
	idxB := bpftest.IfIndex(t, p.B, "veth-b")
	err := p.B.Do(func() error {
		l, err := netlink.LinkByIndex(idxB)
		if err != nil {
			return err
		}
		return netlink.LinkSetXdpFd(l, fxdp.Prog.FD())
	})
	if err != nil {
		t.Fatal(err)
	}
	ftcx := bpftest.NewCounter(t, ebpf.SchedCLS, "foreign_tcx", bpftest.TCXNext)
	bpftest.AttachTCX(t, p.B, "veth-b", ebpf.AttachTCXEgress, ftcx.Prog)
	fcls := bpftest.NewCounter(t, ebpf.SchedCLS, "foreign_cls", bpftest.TCXNext)
	nlB, err := p.B.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nlB.Close()
	err = nlB.QdiscAdd(&netlink.Clsact{QdiscAttrs: netlink.QdiscAttrs{
		LinkIndex: idxB, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT}})
	if err != nil {
		t.Fatal(err)
	}
	err = nlB.FilterAdd(&netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{LinkIndex: idxB, Parent: netlink.HANDLE_MIN_INGRESS, Handle: 1,
			Priority: 5, Protocol: unix.ETH_P_ALL},
		Fd: fcls.Prog.FD(), Name: "foreign", DirectAction: true,
	})
	if err != nil {
		t.Fatal(err)
	}

	// Ours: XDP on veth-a, tcx on veth-b's egress, clsact on its ingress.
	mustAttach(t, a, Point{Iface: "veth-a", Netns: nsPath(p.A), Kind: XDP}, bpftest.NewCounter(t, ebpf.XDP, "test_xdp", bpftest.XDPPass).Prog)
	ours := bpftest.NewCounter(t, ebpf.SchedCLS, "test_tc", bpftest.TCXNext)
	mustAttach(t, a, Point{Iface: "veth-b", Netns: nsPath(p.B), Kind: TCEgress}, ours.Prog)
	res := mustAttach(t, legacy, Point{Iface: "veth-b", Netns: nsPath(p.B), Kind: TCIngress}, ours.Prog)
	if fs := bpftest.BPFFilters(t, p.B, "veth-b", netlink.HANDLE_MIN_INGRESS); len(fs) != 2 || fs[0].Id != int(ours.ID(t)) {
		t.Fatalf("veth-b ingress filters %+v, want ours first, then the foreign one", fs)
	}
	if res.Mode != ModeClsact {
		t.Fatalf("ingress attached as %s, want clsact", res.Mode)
	}
	if pinned, _ := Pinned(pinDir); len(pinned) != 3 {
		t.Fatalf("Pinned = %v, want 3 points", pinned)
	}

	if err := Cleanup(pinDir); err != nil {
		t.Fatal(err)
	}
	if got := bpftest.XDPProgram(t, p.A, "veth-a"); got != 0 {
		t.Errorf("our XDP program %d is still on veth-a", got)
	}
	if got := bpftest.XDPProgram(t, p.B, "veth-b"); got != fxdp.ID(t) {
		t.Errorf("veth-b's XDP hook runs %d, want the foreign %d", got, fxdp.ID(t))
	}
	if got := bpftest.TCXPrograms(t, p.B, "veth-b", ebpf.AttachTCXEgress); !slices.Equal(got, []ebpf.ProgramID{ftcx.ID(t)}) {
		t.Errorf("veth-b tcx egress runs %v, want only the foreign %d", got, ftcx.ID(t))
	}
	left := bpftest.BPFFilters(t, p.B, "veth-b", netlink.HANDLE_MIN_INGRESS)
	if len(left) != 1 || left[0].Name != "foreign" || left[0].Id != int(fcls.ID(t)) {
		t.Errorf("veth-b ingress filters %+v, want only the foreign one", left)
	}
	if !slices.Contains(bpftest.Qdiscs(t, p.B, "veth-b"), "clsact") {
		t.Errorf("Cleanup removed the clsact qdisc (it holds another filter)")
	}
	if _, err := os.Stat(filepath.Join(pinDir, "links")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("links/ is still there: %v", err)
	}
	if pinned, err := Pinned(pinDir); err != nil || len(pinned) != 0 {
		t.Errorf("after Cleanup Pinned = %v, %v", pinned, err)
	}
}
