package attach

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// errDeadLink is what the kernel answers for a link whose hook is gone
// (LINK_UPDATE, LINK_DETACH after the interface was deleted).
var errDeadLink = unix.ENOLINK

// attachXDP: see Attach. nl is the interface as just read.
func (a *Attacher) attachXDP(n *nsRef, dir string, p Point, nl netlink.Link, prog *ebpf.Program,
	id ebpf.ProgramID) (Attached, error) {
	ifindex := nl.Attrs().Index
	path := filepath.Join(dir, pinName(XDP, "", p.Iface))
	res := Attached{Point: p, Program: id, Pin: path}
	alive := func(i *link.Info) bool { return i.XDP() != nil && int(i.XDP().Ifindex) == ifindex }
	ch, lid, found, err := a.adopt(p, path, alive, prog, id)
	if err != nil {
		return Attached{}, fmt.Errorf("attach %s: %w", p, err)
	}
	if found {
		res.Change, res.Link, res.Mode = ch, lid, xdpMode(nl)
		return res, nil
	}

	// Nothing of ours: the hook must be free. A program attached through
	// netlink would be replaced by a netlink attach; a link attach fails
	// with EBUSY on it, but then the user learns nothing of who holds it.
	if err := busy(p, nl); err != nil {
		return Attached{}, err
	}
	var l link.Link
	mode := ModeNative
	err = n.do(func() error {
		var native error
		l, native = link.AttachXDP(link.XDPOptions{Program: prog, Interface: ifindex, Flags: link.XDPDriverMode})
		if native == nil {
			return nil
		}
		if errors.Is(native, unix.EBUSY) || errors.Is(native, unix.EEXIST) {
			return native // taken meanwhile: generic would not help
		}
		if a.nativeOnly.Load() {
			return fmt.Errorf("%w: %v", ErrNoNativeXDP, native)
		}
		mode = ModeGeneric
		var generic error
		l, generic = link.AttachXDP(link.XDPOptions{Program: prog, Interface: ifindex, Flags: link.XDPGenericMode})
		if generic != nil {
			return fmt.Errorf("native: %v; generic: %w", native, generic)
		}
		a.log.Warn("native XDP not available, attached in generic mode (slower, after the stack allocates an skb)",
			"point", p.String(), "native_error", native)
		return nil
	})
	if err != nil {
		if errors.Is(err, unix.EBUSY) || errors.Is(err, unix.EEXIST) {
			if now, lerr := n.link(p.Iface); lerr == nil {
				if berr := busy(p, now); berr != nil {
					return Attached{}, berr
				}
			}
		}
		return Attached{}, fmt.Errorf("attach %s: %w", p, err)
	}
	if res.Link, err = pinLink(l, path); err != nil {
		return Attached{}, fmt.Errorf("attach %s: %w", p, err)
	}
	res.Change, res.Mode = Created, mode
	a.log.Info("attached XDP", "point", p.String(), "mode", string(mode), "program", id)
	return res, nil
}

// busy returns an *XDPBusyError if a program holds nl's XDP hook.
func busy(p Point, nl netlink.Link) error {
	x := nl.Attrs().Xdp
	if x == nil || !x.Attached {
		return nil
	}
	e := &XDPBusyError{Point: p, Program: ebpf.ProgramID(x.ProgId), Mode: string(xdpMode(nl))}
	if e.Program != 0 {
		if prog, err := ebpf.NewProgramFromID(e.Program); err == nil {
			if info, err := prog.Info(); err == nil {
				e.Name = info.Name
			}
			prog.Close()
		}
		// Which link holds it, if one does: then only its owner (or
		// bpftool link detach) can remove it.
		it := new(link.Iterator)
		for it.Next() {
			if info, err := it.Link.Info(); err == nil && info.XDP() != nil && info.Program == e.Program {
				e.Link = info.ID
				break
			}
		}
		it.Close()
	}
	return e
}

// xdpMode is how the kernel runs the XDP program of l.
func xdpMode(l netlink.Link) Mode {
	if l == nil {
		return "" // an interface the caller cannot see
	}
	x := l.Attrs().Xdp
	if x == nil {
		return ""
	}
	// IFLA_XDP_ATTACHED: XDP_ATTACHED_DRV, _SKB, _HW, _MULTI (if_link.h).
	switch x.AttachMode {
	case 1:
		return ModeNative
	case 2:
		return ModeGeneric
	case 3:
		return "offload"
	case 4:
		return "multi"
	}
	return ""
}
