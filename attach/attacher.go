package attach

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// Options configure an Attacher.
type Options struct {
	// PinDir is the agent's pin directory on a bpffs; the links and records
	// go under PinDir/links. (Required)
	PinDir string
	// Log receives what changed on a hook. (Optional; default: discard)
	Log *slog.Logger
	// ForceClsact attaches tc hooks through clsact even where tcx works, so
	// that tests exercise the path of kernels 6.1-6.5. (Optional; default
	// false)
	ForceClsact bool
	// NetnsDirs are the directories searched, before /proc/*/ns/net, for
	// the file of a veth peer's network namespace. (Optional; default
	// /var/run/netns and /run/netns, where ip netns and CNI plugins bind
	// them)
	NetnsDirs []string
	// SkipPeerNetns leaves the pod side's namespace and name out of the
	// Endpoints found (Peer.Netns, Peer.Iface): finding them searches
	// /proc, which a caller that never attaches inside pods (endpointHook
	// host) need not pay for at every look-up. (Optional; default false)
	SkipPeerNetns bool
}

// Attacher attaches programs to Points and finds the Points where
// endpoints' traffic passes. It keeps no handles: every attachment is
// pinned, and the pins are the state (see the package doc). Its methods are
// safe for concurrent use; Attach and Detach run one at a time.
type Attacher struct {
	pinDir      string
	log         *slog.Logger
	forceClsact bool
	netnsDirs   []string
	skipPeerNS  bool

	// mu serialises Attach and Detach: two of them on one hook would race
	// between reading its pin and writing it.
	mu sync.Mutex
	// noTCX logs once that the kernel has no tcx.
	noTCX sync.Once
	// nativeOnly: an XDP attach that cannot run natively fails with
	// ErrNoNativeXDP instead of falling back to generic mode.
	nativeOnly atomic.Bool
}

// SetNativeXDPOnly says whether an XDP attach the driver cannot run
// natively fails with ErrNoNativeXDP (true: the caller puts the program
// elsewhere, at TC ingress) or falls back to generic XDP (false, the
// default). An attachment that exists is kept as it is.
func (a *Attacher) SetNativeXDPOnly(v bool) { a.nativeOnly.Store(v) }

// New returns an Attacher. It touches nothing: a reader (rlagent status)
// may create one to call Alive.
func New(o Options) *Attacher {
	a := &Attacher{pinDir: o.PinDir, log: o.Log, forceClsact: o.ForceClsact, netnsDirs: o.NetnsDirs, skipPeerNS: o.SkipPeerNetns}
	if a.log == nil {
		a.log = slog.New(slog.DiscardHandler)
	}
	if a.netnsDirs == nil {
		a.netnsDirs = []string{"/var/run/netns", "/run/netns"}
	}
	return a
}

// Attach makes prog (XDP for an XDP Point, SchedCLS for a tc one) run at p
// and pins the attachment; it is idempotent. An attachment of ours already
// on the hook (pinned by this agent or an earlier one) is kept if it runs
// prog, and otherwise made to run prog in one atomic swap, so that the hook
// is never without a program. A pin whose hook is gone (the interface was
// deleted) is replaced.
//
// XDP is attached in native mode, or generic where the driver has none; if
// another program holds the hook the error is an *XDPBusyError (ErrXDPBusy)
// and that program stays. A tc hook gets a tcx link at the head of its
// chain, or, where the kernel has no tcx (before 6.6), a direct-action
// filter on a clsact qdisc.
//
// Errors wrap ErrNoInterface when p's interface does not exist, and
// fs.ErrNotExist when p.Netns does not.
func (a *Attacher) Attach(p Point, prog *ebpf.Program) (Attached, error) {
	if err := p.validate(); err != nil {
		return Attached{}, err
	}
	if a.pinDir == "" {
		return Attached{}, fmt.Errorf("attach %s: no pin directory", p)
	}
	want := ebpf.SchedCLS
	if p.Kind == XDP {
		want = ebpf.XDP
	}
	if prog == nil || prog.Type() != want {
		return Attached{}, fmt.Errorf("attach %s: want a %s program", p, want)
	}
	id, err := programID(prog)
	if err != nil {
		return Attached{}, fmt.Errorf("attach %s: %w", p, err)
	}

	a.mu.Lock()
	defer a.mu.Unlock()
	n, err := openNS(p.Netns)
	if err != nil {
		return Attached{}, fmt.Errorf("attach %s: %w", p, err)
	}
	defer n.Close()
	nl, err := n.link(p.Iface)
	if err != nil {
		return Attached{}, fmt.Errorf("attach %s: %w", p, err)
	}
	dir, err := makeNsDir(a.pinDir, n)
	if err != nil {
		return Attached{}, fmt.Errorf("attach %s: %w", p, err)
	}
	var res Attached
	if p.Kind == XDP {
		res, err = a.attachXDP(n, dir, p, nl, prog, id)
	} else {
		res, err = a.attachTC(n, dir, p, nl, prog, id)
	}
	if err != nil {
		removeNsDirIfEmpty(dir)
		return Attached{}, err
	}
	return res, nil
}

// adopt looks at the link pinned at path. If it is on the hook (alive says
// so from its info) it is made to run prog: kept as it is, or its program
// swapped atomically. A link that is not (its interface was deleted) is
// unpinned. found is false then, and when nothing was pinned.
func (a *Attacher) adopt(p Point, path string, alive func(*link.Info) bool, prog *ebpf.Program,
	id ebpf.ProgramID) (ch Change, lid link.ID, found bool, err error) {
	l, err := link.LoadPinnedLink(path, nil)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, 0, false, nil
	}
	if err != nil {
		return 0, 0, false, fmt.Errorf("load pinned link %s: %w", path, err)
	}
	defer l.Close()
	info, err := l.Info()
	if err == nil && alive(info) {
		if info.Program == id {
			return Kept, info.ID, true, nil
		}
		err := l.Update(prog)
		if err == nil {
			a.log.Info("pinned link adopted: its program replaced atomically", "point", p.String(),
				"pin", path, "old_program", info.Program, "program", id)
			return Replaced, info.ID, true, nil
		}
		if !errors.Is(err, errDeadLink) {
			return 0, 0, false, fmt.Errorf("update pinned link %s: %w", path, err)
		}
		// Its interface went away between the two calls.
	}
	a.log.Warn("pinned link is dead (its interface was deleted or re-created): attaching anew",
		"point", p.String(), "pin", path)
	if err := l.Unpin(); err != nil {
		return 0, 0, false, fmt.Errorf("unpin dead link %s: %w", path, err)
	}
	return 0, 0, false, nil
}

// pinLink pins a new link; on failure the link is closed, which detaches
// it: an attachment nobody can find again must not stay.
func pinLink(l link.Link, path string) (link.ID, error) {
	if err := l.Pin(path); err != nil {
		l.Close()
		return 0, fmt.Errorf("pin link: %w", err)
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		return 0, nil // pinned and attached; the ID is only informative
	}
	return info.ID, nil
}

// detachLink detaches the link pinned at path, if any, and removes the pin.
// Detaching (rather than only unpinning) takes it off the hook even while
// another process holds it open.
func detachLink(path string) error {
	l, err := link.LoadPinnedLink(path, nil)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		// Not a link we can load: remove the name all the same.
		if rerr := os.Remove(path); rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
			return fmt.Errorf("remove pin %s: %w", path, errors.Join(err, rerr))
		}
		return nil
	}
	defer l.Close()
	// A dead link has nothing to detach from; old kernels without
	// LINK_DETACH still detach when the last reference (the pin, ours)
	// goes.
	if err := l.Detach(); err != nil && !errors.Is(err, ebpf.ErrNotSupported) && !errors.Is(err, errDeadLink) {
		return fmt.Errorf("detach link %s: %w", path, err)
	}
	if err := l.Unpin(); err != nil {
		return fmt.Errorf("unpin link %s: %w", path, err)
	}
	return nil
}

// Detach removes what Attach put at p: the link or our filter and the
// pins. It does nothing where nothing of ours is, and never touches
// another program, filter or qdisc (a clsact qdisc it added stays: other
// filters may have joined it, and an empty one costs nothing).
func (a *Attacher) Detach(p Point) error {
	if err := p.validate(); err != nil {
		return err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	dir, ino, havePins := pointDir(a.pinDir, p)
	// The namespace, to delete our filter there: only if it is the one
	// the pins belong to.
	n, _ := openNS(p.Netns)
	defer n.Close()
	if n != nil && havePins && n.ino != ino {
		n.Close()
		n = nil
	}
	var errs []error
	if havePins && p.Kind == XDP {
		errs = append(errs, detachLink(filepath.Join(dir, pinName(XDP, "", p.Iface))))
	}
	if p.Kind != XDP {
		if havePins {
			errs = append(errs, detachLink(filepath.Join(dir, pinName(p.Kind, ModeTCX, p.Iface))))
		}
		errs = append(errs, a.dropClsact(n, dir, p))
	}
	if havePins {
		removeNsDirIfEmpty(dir)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("detach %s: %w", p, err)
	}
	return nil
}

// Alive checks, reading only, that what Attach put at p still runs there:
// the pinned link is on p's interface (not dead with a deleted one), or
// our filter is on the hook. The error wraps ErrNotAttached with the reason
// when it is not, and is something else when the kernel could not be asked.
func (a *Attacher) Alive(p Point) (Attached, error) {
	if err := p.validate(); err != nil {
		return Attached{}, err
	}
	notAttached := func(why string) (Attached, error) {
		return Attached{}, fmt.Errorf("%s: %w: %s", p, ErrNotAttached, why)
	}
	dir, ino, ok := pointDir(a.pinDir, p)
	if !ok {
		return notAttached("nothing pinned")
	}
	n, err := openNS(p.Netns)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, errNotNetns) {
			return notAttached("its network namespace is gone")
		}
		return Attached{}, fmt.Errorf("check %s: %w", p, err)
	}
	defer n.Close()
	if n.ino != ino {
		return notAttached("its network namespace is gone (the path names another one now)")
	}
	// nl is nil when the caller cannot see the interface (another
	// namespace than the agent's): the link's own interface index decides.
	nl, err := n.link(p.Iface)
	if err != nil && !errors.Is(err, ErrNoInterface) {
		return Attached{}, fmt.Errorf("check %s: %w", p, err)
	}

	if p.Kind == XDP {
		path := filepath.Join(dir, pinName(XDP, "", p.Iface))
		res, why, err := linkAlive(path, func(i *link.Info) (uint32, bool) {
			if x := i.XDP(); x != nil {
				return x.Ifindex, true
			}
			return 0, false
		})
		if err != nil {
			return Attached{}, fmt.Errorf("check %s: %w", p, err)
		}
		if why != "" {
			return notAttached(why)
		}
		res.Point, res.Mode = p, xdpMode(nl)
		return res, nil
	}

	path := filepath.Join(dir, pinName(p.Kind, ModeTCX, p.Iface))
	res, why, err := linkAlive(path, func(i *link.Info) (uint32, bool) {
		if t := i.TCX(); t != nil && ebpf.AttachType(t.AttachType) == p.Kind.tcxAttach() {
			return t.Ifindex, true
		}
		return 0, false
	})
	if err != nil {
		return Attached{}, fmt.Errorf("check %s: %w", p, err)
	}
	if why == "" {
		res.Point, res.Mode = p, ModeTCX
		return res, nil
	}
	if why != whyNothing {
		return notAttached(why)
	}
	res, why, err = a.clsactAlive(n, dir, p, nl)
	if err != nil {
		return Attached{}, fmt.Errorf("check %s: %w", p, err)
	}
	if why != "" {
		return notAttached(why)
	}
	return res, nil
}

const whyNothing = "nothing pinned"

// linkAlive checks that the link pinned at path is on a device; ifindexOf
// reads the link's interface index, and says
// whether the link is of the expected kind. why is the reason it is not
// alive.
func linkAlive(path string, ifindexOf func(*link.Info) (uint32, bool)) (res Attached, why string, err error) {
	l, err := link.LoadPinnedLink(path, nil)
	if errors.Is(err, fs.ErrNotExist) {
		return Attached{}, whyNothing, nil
	}
	if err != nil {
		return Attached{}, "", err
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		return Attached{}, "", err
	}
	got, ok := ifindexOf(info)
	switch {
	case !ok:
		return Attached{}, "the pin is not a link of this hook", nil
	case got == 0:
		// The kernel clears a link's interface when the device goes, so
		// a link that names one is on a live device. The caller's lookup
		// by name (ifindex) is not asked: a reader such as rlagent status
		// may run in another network namespace than the agent, where the
		// name is unknown or another interface's.
		return Attached{}, "its interface was deleted; the pinned link is dead", nil
	}

	return Attached{Program: info.Program, Link: info.ID, Pin: path}, "", nil
}

// Cleanup detaches everything pinned in pinDir (XDP and tcx links, our
// clsact filters, in every namespace that has pins), removes the pins and
// the links directory, and takes the fq qdiscs rlagent put on interfaces
// of this namespace off (RemoveFQ). Other programs, filters and qdiscs
// stay. Pins
// of another namespace whose recorded path no longer leads to it are
// removed without touching that namespace: its filters went with it, or
// cannot be reached.
func Cleanup(pinDir string) error {
	a := New(Options{PinDir: pinDir})
	a.mu.Lock()
	defer a.mu.Unlock()
	var errs []error
	n, err := openNS("")
	if err != nil {
		return fmt.Errorf("cleanup %s: %w", pinDir, err)
	}
	errs = append(errs, a.cleanDir(n, linksDir(pinDir)))
	n.Close()
	errs = append(errs, removeAllFQ())
	dirs, err := netnsDirs(pinDir)
	if err != nil {
		return fmt.Errorf("cleanup %s: %w", pinDir, err)
	}
	for _, d := range dirs {
		var n *nsRef
		if path, err := readNetnsRecord(d.dir); err == nil {
			if n, _ = openNS(path); n != nil && n.ino != d.ino {
				n.Close()
				n = nil
			}
		}
		errs = append(errs, a.cleanDir(n, d.dir))
		n.Close()
		removeNsDirIfEmpty(d.dir)
		os.Remove(d.dir) // no record either
	}
	if err := os.Remove(linksDir(pinDir)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		var left []string
		if ents, rerr := os.ReadDir(linksDir(pinDir)); rerr == nil {
			for _, e := range ents {
				left = append(left, e.Name())
			}
		}
		errs = append(errs, fmt.Errorf("%s holds entries rlagent did not make, left as they are: %v: %w",
			linksDir(pinDir), left, err))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("cleanup %s: %w", pinDir, err)
	}
	return nil
}

// cleanDir detaches and removes the pins in one directory; n is its
// namespace, nil if it cannot be reached.
func (a *Attacher) cleanDir(n *nsRef, dir string) error {
	pins, err := pinsIn(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range pins {
		if e.mode == ModeClsact {
			errs = append(errs, a.dropClsact(n, dir, Point{Iface: e.iface, Kind: e.kind}))
		} else {
			errs = append(errs, detachLink(e.path))
		}
	}
	// Records being replaced when an agent died.
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), newPrefix) {
			os.Remove(filepath.Join(dir, e.Name()))
		}
	}
	return errors.Join(errs...)
}

// programID is the kernel's ID of prog.
func programID(prog *ebpf.Program) (ebpf.ProgramID, error) {
	info, err := prog.Info()
	if err != nil {
		return 0, fmt.Errorf("program info: %w", err)
	}
	id, ok := info.ID()
	if !ok {
		return 0, errors.New("program info: the kernel gives no program ID")
	}
	return id, nil
}
