package attach

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// A paced limit stamps each packet with its earliest departure time
// (skb->tstamp); only the fq qdisc holds a packet until then. Without fq
// the stamp does nothing: the packet leaves at once, and the limit passes
// everything within its horizon. The functions here check an interface's
// qdisc and, for an agent with manageQdisc, put fq there and take it away
// again. They work on interfaces of the calling thread's network namespace
// (the uplinks, in the agent's).

// fqMajor is the handle major of the fq qdiscs rlagent installs: the root
// one, and fqMajor+1+i for the child of mq's queue i. The handle is how
// Check, Ensure and Remove tell ours from an operator's.
const fqMajor = 0x524c // "RL"

// FQ is what an interface's fq must hold for the paced limits leaving
// through it.
type FQ struct {
	// Horizon: fq drops a packet stamped further ahead than this (fq's
	// default is 10 s). Above the limits' own horizons, so that theirs
	// decides and counts.
	Horizon time.Duration
	// FlowLimit is how many packets one flow may have queued (fq's
	// default is 100, which would drop a paced flow well below the
	// limit's horizon): a horizon of the paced share.
	FlowLimit uint32
}

// FQState is what an interface's qdisc does with departure times.
type FQState struct {
	// Paces: the root qdisc is fq, or mq whose every child is fq.
	Paces bool
	// Ours: that fq is rlagent's (installed by EnsureFQ).
	Ours bool
	// Why the interface does not pace, when it does not.
	Why string
}

// defaultQdiscs are the qdiscs the kernel puts on an interface by itself.
// EnsureFQ replaces only these: anything else an operator configured.
var defaultQdiscs = []string{"noqueue", "pfifo_fast", "fq_codel", "pfifo", "noop"}

// CheckFQ says whether iface's qdisc releases stamped packets at their
// time.
func CheckFQ(iface string) (FQState, error) {
	_, root, children, err := qdiscs(iface)
	if err != nil {
		return FQState{}, err
	}
	return fqState(root, children), nil
}

func fqState(root netlink.Qdisc, children []netlink.Qdisc) FQState {
	switch {
	case root == nil:
		return FQState{Why: "no root qdisc: paced packets leave at once"}
	case root.Type() == "fq":
		return FQState{Paces: true, Ours: major(root) == fqMajor}
	case root.Type() == "mq":
		if len(children) == 0 {
			return FQState{Why: "root qdisc mq has no children: paced packets leave at once"}
		}
		ours := true
		for _, c := range children {
			if c.Type() != "fq" {
				return FQState{Why: fmt.Sprintf("root qdisc mq has a %s child (queue %d), not fq: its paced packets leave at once",
					c.Type(), minorOf(c.Attrs().Parent))}
			}
			ours = ours && major(c) > fqMajor && major(c) <= fqMajor+1+uint16(len(children))
		}
		return FQState{Paces: true, Ours: ours}
	}
	return FQState{Why: fmt.Sprintf("root qdisc is %s, not fq: paced packets leave at once", root.Type())}
}

// EnsureFQ makes iface pace: where its qdisc is a kernel default it puts
// fq with want's parameters there (at the root, or on each queue of mq),
// and keeps an fq of ours at want; an fq an operator installed is left as
// it is, and so is any other qdisc an operator configured (the state then
// says why the interface does not pace).
func EnsureFQ(iface string, want FQ) (FQState, error) {
	l, root, children, err := qdiscs(iface)
	if err != nil {
		return FQState{}, err
	}
	st := fqState(root, children)
	if st.Paces && !st.Ours {
		return st, nil // an operator's fq
	}
	if st.Paces && fqHolds(root, children, want) {
		return st, nil // ours, as wanted: nothing to write
	}
	var parents []uint32
	switch {
	case root == nil:
		parents = []uint32{netlink.HANDLE_ROOT}
	case root.Type() == "mq":
		for _, c := range children {
			if c.Type() != "fq" && !slices.Contains(defaultQdiscs, c.Type()) {
				return FQState{Why: fmt.Sprintf("root qdisc mq has a %s child (queue %d), which someone configured: rlagent replaces only the kernel's defaults (%v) with fq",
					c.Type(), minorOf(c.Attrs().Parent), defaultQdiscs)}, nil
			}
			parents = append(parents, c.Attrs().Parent)
		}
	case root.Type() == "fq" || slices.Contains(defaultQdiscs, root.Type()):
		parents = []uint32{netlink.HANDLE_ROOT}
	default:
		return FQState{Why: fmt.Sprintf("root qdisc is %s, which someone configured: rlagent replaces only the kernel's defaults (%v) with fq",
			root.Type(), defaultQdiscs)}, nil
	}
	for i, parent := range parents {
		handle := netlink.MakeHandle(fqMajor, 0)
		if parent != netlink.HANDLE_ROOT {
			handle = netlink.MakeHandle(fqMajor+1+uint16(i), 0)
		}
		q := netlink.NewFq(netlink.QdiscAttrs{LinkIndex: l.Attrs().Index, Parent: parent, Handle: handle})
		q.Horizon = uint32(want.Horizon.Microseconds())
		q.FlowPacketLimit = want.FlowLimit
		q.PacketLimit = fqLimit(want)
		if err := netlink.QdiscReplace(q); err != nil {
			if errors.Is(err, unix.ENOENT) {
				err = fmt.Errorf("%w (the kernel has no fq: load the module sch_fq)", err)
			}
			return FQState{}, fmt.Errorf("put fq on %s: %w", iface, err)
		}
	}
	return FQState{Paces: true, Ours: true}, nil
}

// fqHolds reports whether the fq qdiscs (root, or mq's children) have
// want's parameters, as EnsureFQ sets them.
func fqHolds(root netlink.Qdisc, children []netlink.Qdisc, want FQ) bool {
	qs := children
	if root.Type() == "fq" {
		qs = []netlink.Qdisc{root}
	}
	for _, q := range qs {
		fq, ok := q.(*netlink.Fq)
		if !ok || fq.Horizon != uint32(want.Horizon.Microseconds()) || fq.FlowPacketLimit != want.FlowLimit ||
			fq.PacketLimit != fqLimit(want) {
			return false
		}
	}
	return true
}

// fqLimit is the fq's limit of packets in all: fq's default, or two flows'
// worth.
func fqLimit(want FQ) uint32 { return max(10000, 2*want.FlowLimit) }

// RemoveFQ takes an fq of ours off iface: the kernel then puts its
// default qdisc back (for mq, the root is deleted, and comes back with the
// default children). It reports whether there was one. An operator's
// qdisc is left alone.
func RemoveFQ(iface string) (bool, error) {
	_, root, children, err := qdiscs(iface)
	if errors.Is(err, ErrNoInterface) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if st := fqState(root, children); !st.Paces || !st.Ours {
		return false, nil
	}
	if err := netlink.QdiscDel(root); err != nil {
		return false, fmt.Errorf("remove rlagent's fq from %s: %w", iface, err)
	}
	return true, nil
}

// removeAllFQ takes rlagent's fq off every interface of this namespace.
func removeAllFQ() error {
	links, err := netlink.LinkList()
	if err != nil {
		return fmt.Errorf("list interfaces for their qdiscs: %w", err)
	}
	var errs []error
	for _, l := range links {
		if _, err := RemoveFQ(l.Attrs().Name); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// qdiscs lists iface's root qdisc (nil if none is listed) and, for mq, its
// children.
func qdiscs(iface string) (netlink.Link, netlink.Qdisc, []netlink.Qdisc, error) {
	l, err := netlink.LinkByName(iface)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil, nil, nil, fmt.Errorf("qdisc of %s: %w", iface, ErrNoInterface)
		}
		return nil, nil, nil, fmt.Errorf("qdisc of %s: %w", iface, err)
	}
	all, err := netlink.QdiscList(l)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("list qdiscs of %s: %w", iface, err)
	}
	var root netlink.Qdisc
	for _, q := range all {
		if q.Attrs().Parent == netlink.HANDLE_ROOT {
			root = q
		}
	}
	var children []netlink.Qdisc
	if root != nil && root.Type() == "mq" {
		for _, q := range all {
			if q != root && q.Attrs().Parent>>16 == uint32(major(root)) && q.Attrs().Parent != netlink.HANDLE_INGRESS {
				children = append(children, q)
			}
		}
		slices.SortFunc(children, func(a, b netlink.Qdisc) int { return int(a.Attrs().Parent) - int(b.Attrs().Parent) })
	}
	return l, root, children, nil
}

func major(q netlink.Qdisc) uint16 { return uint16(q.Attrs().Handle >> 16) }

func minorOf(h uint32) uint16 { return uint16(h) }
