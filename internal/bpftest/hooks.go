package bpftest

import (
	"errors"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/internal/nettest"
)

// linkOf looks ifname up in ns.
func linkOf(tb testing.TB, ns *nettest.NS, ifname string) (*netlink.Handle, netlink.Link) {
	tb.Helper()
	nl, err := ns.Netlink()
	if err != nil {
		tb.Fatal(err)
	}
	l, err := nl.LinkByName(ifname)
	if err != nil {
		nl.Close()
		tb.Fatalf("%s in %s: %v", ifname, ns.Name, err)
	}
	return nl, l
}

// IfIndex is the index of ifname in ns.
func IfIndex(tb testing.TB, ns *nettest.NS, ifname string) int {
	tb.Helper()
	nl, l := linkOf(tb, ns, ifname)
	nl.Close()
	return l.Attrs().Index
}

// XDPProgram is the ID of the program on ifname's XDP hook in ns (0:
// none).
func XDPProgram(tb testing.TB, ns *nettest.NS, ifname string) ebpf.ProgramID {
	tb.Helper()
	nl, l := linkOf(tb, ns, ifname)
	nl.Close()
	if x := l.Attrs().Xdp; x != nil && x.Attached {
		return ebpf.ProgramID(x.ProgId)
	}
	return 0
}

// TCXPrograms lists the programs on ifname's tcx hook at in ns, in the
// order they run. On a kernel without tcx the list is empty.
func TCXPrograms(tb testing.TB, ns *nettest.NS, ifname string, at ebpf.AttachType) []ebpf.ProgramID {
	tb.Helper()
	idx := IfIndex(tb, ns, ifname)
	var ids []ebpf.ProgramID
	err := ns.Do(func() error {
		res, err := link.QueryPrograms(link.QueryOptions{Target: idx, Attach: at})
		if err != nil {
			return err
		}
		for _, p := range res.Programs {
			ids = append(ids, p.ID)
		}
		return nil
	})
	if err != nil && !errors.Is(err, ebpf.ErrNotSupported) && !errors.Is(err, unix.EINVAL) {
		tb.Fatalf("query the tcx programs of %s in %s: %v", ifname, ns.Name, err)
	}
	return ids
}

// BPFFilters lists the bpf filters of ifname's clsact hook parent
// (netlink.HANDLE_MIN_INGRESS or HANDLE_MIN_EGRESS) in ns.
func BPFFilters(tb testing.TB, ns *nettest.NS, ifname string, parent uint32) []*netlink.BpfFilter {
	tb.Helper()
	nl, l := linkOf(tb, ns, ifname)
	defer nl.Close()
	fs, err := nl.FilterList(l, parent)
	if err != nil {
		tb.Fatalf("list the filters of %s in %s: %v", ifname, ns.Name, err)
	}
	var out []*netlink.BpfFilter
	for _, f := range fs {
		if b, ok := f.(*netlink.BpfFilter); ok {
			out = append(out, b)
		}
	}
	return out
}

// Qdiscs lists the kinds of ifname's qdiscs in ns ("clsact", "noqueue"...).
func Qdiscs(tb testing.TB, ns *nettest.NS, ifname string) []string {
	tb.Helper()
	nl, l := linkOf(tb, ns, ifname)
	defer nl.Close()
	qs, err := nl.QdiscList(l)
	if err != nil {
		tb.Fatal(err)
	}
	var out []string
	for _, q := range qs {
		out = append(out, q.Type())
	}
	return out
}

// AttachXDPNetlink attaches prog to ifname's XDP hook in ns through
// netlink (IFLA_XDP, as `ip link set dev IF xdp obj ...` and libxdp do),
// never replacing a program that is there. The hook keeps prog after its
// descriptor is closed; Cleanup takes it off if it is still there.
func AttachXDPNetlink(tb testing.TB, ns *nettest.NS, ifname string, prog *ebpf.Program) {
	tb.Helper()
	// netlink's package functions work in the calling thread's namespace.
	err := ns.Do(func() error {
		l, err := netlink.LinkByName(ifname)
		if err != nil {
			return err
		}
		return netlink.LinkSetXdpFdWithFlags(l, prog.FD(), unix.XDP_FLAGS_UPDATE_IF_NOEXIST)
	})
	if err != nil {
		tb.Fatalf("attach program %s to the XDP hook of %s in %s through netlink: %v", prog, ifname, ns.Name, err)
	}
	id := ProgramID(tb, prog)
	tb.Cleanup(func() {
		ns.Do(func() error {
			l, err := netlink.LinkByName(ifname)
			if err == nil && l.Attrs().Xdp != nil && l.Attrs().Xdp.ProgId == uint32(id) {
				err = netlink.LinkSetXdpFd(l, -1)
			}
			return err
		})
	})
}

// AttachXDPLink attaches prog to ifname's XDP hook in ns with a bpf_link
// (as Cilium does). Cleanup closes the link, which detaches it.
func AttachXDPLink(tb testing.TB, ns *nettest.NS, ifname string, prog *ebpf.Program) link.Link {
	tb.Helper()
	idx := IfIndex(tb, ns, ifname)
	var l link.Link
	err := ns.Do(func() (err error) {
		// The kernel resolves the index in the calling thread's namespace.
		l, err = link.AttachXDP(link.XDPOptions{Program: prog, Interface: idx})
		return err
	})
	if err != nil {
		tb.Fatalf("attach program %s to the XDP hook of %s in %s with a bpf_link: %v", prog, ifname, ns.Name, err)
	}
	tb.Cleanup(func() { l.Close() })
	return l
}

// AttachTCX attaches prog at the tail of ifname's tcx hook at in ns, as
// another agent would. Cleanup detaches it.
func AttachTCX(tb testing.TB, ns *nettest.NS, ifname string, at ebpf.AttachType, prog *ebpf.Program) link.Link {
	tb.Helper()
	l, err := attachTCX(ns, IfIndex(tb, ns, ifname), at, prog)
	if err != nil {
		tb.Fatalf("attach program %s to the tcx hook %s of %s in %s: %v", prog, at, ifname, ns.Name, err)
	}
	tb.Cleanup(func() { l.Close() })
	return l
}

func attachTCX(ns *nettest.NS, idx int, at ebpf.AttachType, prog *ebpf.Program) (l link.Link, err error) {
	err = ns.Do(func() (err error) {
		l, err = link.AttachTCX(link.TCXOptions{Interface: idx, Program: prog, Attach: at, Anchor: link.Tail()})
		return err
	})
	return l, err
}

// AddClsactFilter adds prog as a direct-action bpf filter named name with
// priority prio at parent (netlink.HANDLE_MIN_INGRESS or
// HANDLE_MIN_EGRESS) of ifname's clsact qdisc in ns, adding the qdisc if
// there is none. Cleanup removes the filter (the qdisc stays, as another
// tool's would).
func AddClsactFilter(tb testing.TB, ns *nettest.NS, ifname string, parent uint32, prio uint16, name string,
	prog *ebpf.Program) {
	tb.Helper()
	nl, l := linkOf(tb, ns, ifname)
	defer nl.Close()
	idx := l.Attrs().Index
	q := &netlink.Clsact{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: idx, Handle: netlink.MakeHandle(0xffff, 0),
		Parent: netlink.HANDLE_CLSACT}}
	if err := nl.QdiscAdd(q); err != nil && !errors.Is(err, unix.EEXIST) {
		tb.Fatalf("add a clsact qdisc to %s in %s: %v", ifname, ns.Name, err)
	}
	f := &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{LinkIndex: idx, Parent: parent, Handle: netlink.MakeHandle(0, 1),
			Priority: prio, Protocol: unix.ETH_P_ALL},
		Fd: prog.FD(), Name: name, DirectAction: true,
	}
	if err := nl.FilterAdd(f); err != nil {
		tb.Fatalf("add bpf filter %s to the clsact qdisc of %s in %s: %v", name, ifname, ns.Name, err)
	}
	tb.Cleanup(func() {
		if nl, err := ns.Netlink(); err == nil {
			nl.FilterDel(f)
			nl.Close()
		}
	})
}

// AttachTCIngress attaches prog to ifname's TC ingress in ns: at the tail
// of its tcx hook, or, on a kernel without tcx (before 6.6), as a
// direct-action filter of a clsact qdisc. Cleanup detaches it.
func AttachTCIngress(tb testing.TB, ns *nettest.NS, ifname string, prog *ebpf.Program) {
	tb.Helper()
	l, err := attachTCX(ns, IfIndex(tb, ns, ifname), ebpf.AttachTCXIngress, prog)
	if err == nil {
		tb.Cleanup(func() { l.Close() })
		return
	}
	if !errors.Is(err, link.ErrNotSupported) {
		tb.Fatalf("attach program %s to the tcx ingress of %s in %s: %v", prog, ifname, ns.Name, err)
	}
	AddClsactFilter(tb, ns, ifname, netlink.HANDLE_MIN_INGRESS, 1, "test-"+ifname, prog)
}
