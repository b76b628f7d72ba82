package attach

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// filterPrefix starts the name of every clsact filter rlagent adds: the
// name is how its filter is told from others on the hook (the kernel keeps
// it, and tc filter show prints it).
const filterPrefix = "rlagent-"

// attachTC: see Attach. tcx where the kernel has it, else clsact.
func (a *Attacher) attachTC(n *nsRef, dir string, p Point, nl netlink.Link, prog *ebpf.Program,
	id ebpf.ProgramID) (Attached, error) {
	if !a.forceClsact {
		res, err := a.attachTCX(n, dir, p, nl, prog, id)
		if err == nil {
			// A filter of ours left from the clsact path would see every
			// packet a second time (ours returns TCX_NEXT, and clsact
			// runs after tcx): it goes once the link is in place.
			if err := a.dropClsact(n, dir, p); err != nil {
				a.log.Warn("old clsact filter not removed: packets are seen twice", "point", p.String(), "error", err)
			}
			return res, nil
		}
		if !errors.Is(err, link.ErrNotSupported) {
			return Attached{}, err
		}
		a.noTCX.Do(func() {
			a.log.Info("the kernel has no tcx (6.6+): tc programs attach as clsact filters", "error", err)
		})
	}
	res, err := a.attachClsact(n, dir, p, nl, prog, id)
	if err != nil {
		return Attached{}, err
	}
	// The other way round: a tcx link of ours (ForceClsact after a tcx
	// attach) goes once the filter is in place.
	if err := detachLink(filepath.Join(dir, pinName(p.Kind, ModeTCX, p.Iface))); err != nil {
		a.log.Warn("old tcx link not removed: packets are seen twice", "point", p.String(), "error", err)
	}
	return res, nil
}

// attachTCX attaches prog with a tcx link at the head of the hook's chain,
// or adopts ours. The error wraps link.ErrNotSupported on kernels without
// tcx.
//
// Head: a packet must meet the limit before any program that could end the
// chain (TCX_PASS, TCX_DROP, a redirect) decides for it. Our programs
// return TCX_NEXT when they pass a packet, so the programs after ours still
// run, in their own order: attaching before the first one moves none of
// them, and an adoption (LINK_UPDATE) keeps ours where it is.
func (a *Attacher) attachTCX(n *nsRef, dir string, p Point, nl netlink.Link, prog *ebpf.Program,
	id ebpf.ProgramID) (Attached, error) {
	ifindex := nl.Attrs().Index
	path := filepath.Join(dir, pinName(p.Kind, ModeTCX, p.Iface))
	res := Attached{Point: p, Mode: ModeTCX, Program: id, Pin: path}
	alive := func(i *link.Info) bool {
		t := i.TCX()
		return t != nil && int(t.Ifindex) == ifindex && ebpf.AttachType(t.AttachType) == p.Kind.tcxAttach()
	}
	ch, lid, found, err := a.adopt(p, path, alive, prog, id)
	if err != nil {
		return Attached{}, fmt.Errorf("attach %s: %w", p, err)
	}
	if found {
		res.Change, res.Link = ch, lid
		return res, nil
	}
	var l link.Link
	err = n.do(func() (err error) {
		l, err = link.AttachTCX(link.TCXOptions{
			Interface: ifindex,
			Program:   prog,
			Attach:    p.Kind.tcxAttach(),
			Anchor:    link.Head(),
		})
		return err
	})
	if err != nil {
		return Attached{}, fmt.Errorf("attach %s: tcx: %w", p, err)
	}
	if res.Link, err = pinLink(l, path); err != nil {
		return Attached{}, fmt.Errorf("attach %s: %w", p, err)
	}
	res.Change = Created
	a.log.Info("attached tcx", "point", p.String(), "program", id)
	return res, nil
}

// clsactParent is the parent of a clsact hook's filters.
func clsactParent(k Kind) uint32 {
	if k == TCEgress {
		return netlink.HANDLE_MIN_EGRESS
	}
	return netlink.HANDLE_MIN_INGRESS
}

// attachClsact attaches prog as a direct-action bpf filter on the hook's
// clsact qdisc (added if the interface has none), or makes our filter
// there run prog: replaced in place, same priority and handle, which cls_bpf
// swaps atomically. The record of the filter is prog pinned at
// clsact_<hook>_<iface> (bpffs holds no plain files): it tells Pinned and
// Cleanup the hook is ours, and Alive which program should run there.
//
// A filter returning TC_ACT_UNSPEC (-1, the value of TCX_NEXT) lets the
// next filter run, as TCX_NEXT does on tcx. Ours goes first where it can
// (a priority below every other filter's), for the reason tcx's goes at
// the head.
func (a *Attacher) attachClsact(n *nsRef, dir string, p Point, nl netlink.Link, prog *ebpf.Program,
	id ebpf.ProgramID) (Attached, error) {
	path := filepath.Join(dir, pinName(p.Kind, ModeClsact, p.Iface))
	res := Attached{Point: p, Mode: ModeClsact, Program: id, Pin: path}
	if err := a.ensureClsact(n, p, nl); err != nil {
		return Attached{}, fmt.Errorf("attach %s: %w", p, err)
	}
	parent := clsactParent(p.Kind)
	ours, others, err := listFilters(n, nl, parent)
	if err != nil {
		return Attached{}, fmt.Errorf("attach %s: %w", p, err)
	}
	f := &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{
			LinkIndex: nl.Attrs().Index,
			Parent:    parent,
			Protocol:  unix.ETH_P_ALL,
		},
		Fd:           prog.FD(),
		Name:         filterName(prog),
		DirectAction: true,
	}
	if len(ours) > 0 {
		f.Handle, f.Priority = ours[0].Handle, ours[0].Priority
		if ours[0].Id == int(id) {
			res.Change = Kept
		} else {
			if err := n.nl.FilterReplace(f); err != nil {
				return Attached{}, fmt.Errorf("attach %s: replace filter: %w", p, err)
			}
			res.Change = Replaced
			a.log.Info("clsact filter adopted: its program replaced in place", "point", p.String(),
				"priority", f.Priority, "old_program", ours[0].Id, "program", id)
		}
		// One filter of ours per hook: an extra one would count every
		// packet twice. (None is made here; this undoes a crash between
		// an add and its record, with a second add after.)
		for _, extra := range ours[1:] {
			if err := n.nl.FilterDel(extra); err != nil && !errors.Is(err, unix.ENOENT) {
				return Attached{}, fmt.Errorf("attach %s: delete extra filter: %w", p, err)
			}
		}
	} else {
		prio, first := pickPriority(others)
		f.Priority, f.Handle = prio, 1
		// EXCL: never replace a filter that is not ours.
		if err := n.nl.FilterAdd(f); err != nil {
			return Attached{}, fmt.Errorf("attach %s: add filter: %w", p, err)
		}
		res.Change = Created
		if first {
			a.log.Info("attached clsact filter", "point", p.String(), "priority", prio, "program", id)
		} else {
			a.log.Warn("attached clsact filter after others at priority 1: they run first, and one that ends "+
				"the chain hides packets from the limit", "point", p.String(), "priority", prio, "program", id)
		}
	}
	runtime.KeepAlive(prog)
	if err := pinRecord(path, prog, id); err != nil {
		return Attached{}, fmt.Errorf("attach %s: record filter: %w", p, err)
	}
	return res, nil
}

// ensureClsact adds a clsact qdisc to the interface unless it has one. One
// that is there stays as it is: it may carry others' filters.
func (a *Attacher) ensureClsact(n *nsRef, p Point, nl netlink.Link) error {
	qs, err := n.nl.QdiscList(nl)
	if err != nil {
		return fmt.Errorf("list qdiscs: %w", err)
	}
	for _, q := range qs {
		if q.Attrs().Parent != netlink.HANDLE_CLSACT {
			continue
		}
		switch q.Type() {
		case "clsact":
			return nil
		case "ingress":
			// The older ingress qdisc takes the same place and its filters
			// run at the ingress hook, but it has no egress hook.
			if p.Kind == TCIngress {
				return nil
			}
			return errors.New("an ingress qdisc holds the place of clsact, and has no egress hook: " +
				"replace it with clsact (tc qdisc replace dev " + p.Iface + " clsact; its filters must be added again)")
		}
	}
	q := &netlink.Clsact{QdiscAttrs: netlink.QdiscAttrs{
		LinkIndex: nl.Attrs().Index,
		Handle:    netlink.MakeHandle(0xffff, 0),
		Parent:    netlink.HANDLE_CLSACT,
	}}
	// Add, not replace: if one appeared meanwhile, it is someone's.
	if err := n.nl.QdiscAdd(q); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("add clsact qdisc: %w", err)
	}
	a.log.Info("added a clsact qdisc", "point", p.String())
	return nil
}

// listFilters splits the filters of a clsact hook into ours (by name) and
// the others.
func listFilters(n *nsRef, nl netlink.Link, parent uint32) (ours []*netlink.BpfFilter, others []netlink.Filter, err error) {
	fs, err := n.nl.FilterList(nl, parent)
	if err != nil {
		return nil, nil, fmt.Errorf("list filters: %w", err)
	}
	for _, f := range fs {
		if b, ok := f.(*netlink.BpfFilter); ok && strings.HasPrefix(b.Name, filterPrefix) {
			ours = append(ours, b)
			continue
		}
		others = append(others, f)
	}
	return ours, others, nil
}

// pickPriority chooses the priority of a new filter among others: one
// below the lowest, so that ours runs first; if another filter has the
// lowest priority there is (1), the lowest free one, and first is false.
func pickPriority(others []netlink.Filter) (prio uint16, first bool) {
	used := make([]uint16, 0, len(others))
	for _, f := range others {
		used = append(used, f.Attrs().Priority)
	}
	if len(used) == 0 {
		return 1, true
	}
	lowest := slices.Min(used)
	if lowest > 1 {
		return lowest - 1, true
	}
	for prio = 2; slices.Contains(used, prio); prio++ {
	}
	return prio, false
}

// filterName names our filter after its program.
func filterName(prog *ebpf.Program) string {
	if info, err := prog.Info(); err == nil && info.Name != "" {
		return filterPrefix + info.Name
	}
	return filterPrefix + "prog"
}

// pinRecord pins prog at path as the record of a clsact filter, unless it
// is there already. A pin of the caller's program itself would move it
// (Pin renames an existing pin), hence a clone; and a new pin renamed over
// the old, so that the record is never missing.
func pinRecord(path string, prog *ebpf.Program, id ebpf.ProgramID) error {
	if old, err := ebpf.LoadPinnedProgram(path, nil); err == nil {
		same := false
		if oid, err := programID(old); err == nil && oid == id {
			same = true
		}
		old.Close()
		if same {
			return nil
		}
	}
	clone, err := prog.Clone()
	if err != nil {
		return err
	}
	defer clone.Close()
	tmp := filepath.Join(filepath.Dir(path), newPrefix+filepath.Base(path))
	os.Remove(tmp)
	if err := clone.Pin(tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// dropClsact deletes our filter from p's hook (n nil: the namespace cannot
// be reached, and only the record goes) and removes its record.
func (a *Attacher) dropClsact(n *nsRef, dir string, p Point) error {
	if n != nil {
		nl, err := n.link(p.Iface)
		switch {
		case errors.Is(err, ErrNoInterface):
			// The filter went with the interface.
		case err != nil:
			return err
		default:
			ours, _, err := listFilters(n, nl, clsactParent(p.Kind))
			if err != nil {
				return err
			}
			for _, f := range ours {
				if err := n.nl.FilterDel(f); err != nil && !errors.Is(err, unix.ENOENT) {
					return fmt.Errorf("delete filter: %w", err)
				}
				a.log.Info("detached clsact filter", "point", p.String(), "priority", f.Priority)
			}
		}
	}
	if dir == "" {
		return nil
	}
	if err := os.Remove(filepath.Join(dir, pinName(p.Kind, ModeClsact, p.Iface))); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove filter record: %w", err)
	}
	return nil
}

// clsactAlive checks our filter on p's hook against its record. nl is nil
// when the interface does not exist.
func (a *Attacher) clsactAlive(n *nsRef, dir string, p Point, nl netlink.Link) (Attached, string, error) {
	path := filepath.Join(dir, pinName(p.Kind, ModeClsact, p.Iface))
	if _, err := os.Lstat(path); errors.Is(err, fs.ErrNotExist) {
		return Attached{}, whyNothing, nil
	} else if err != nil {
		return Attached{}, "", err
	}
	if nl == nil {
		return Attached{}, "its interface was deleted, and its filter with it", nil
	}
	ours, _, err := listFilters(n, nl, clsactParent(p.Kind))
	if err != nil {
		return Attached{}, "", err
	}
	if len(ours) == 0 {
		return Attached{}, "its clsact filter was removed", nil
	}
	// The program is the filter's: if it is not the record's (an agent
	// died between replacing the filter and the record), the filter still
	// enforces, and the next Attach mends the record.
	return Attached{Point: p, Mode: ModeClsact, Program: ebpf.ProgramID(ours[0].Id), Pin: path}, "", nil
}
