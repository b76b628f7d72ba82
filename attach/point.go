package attach

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// Kind is a hook on an interface.
type Kind uint8

const (
	// XDP is the interface's XDP hook (receive path, before the stack).
	// It holds one program: rlagent never takes it from another one.
	XDP Kind = iota + 1
	// TCIngress is the interface's tc ingress hook (tcx, or a clsact filter).
	TCIngress
	// TCEgress is the interface's tc egress hook (tcx, or a clsact filter).
	TCEgress
)

func (k Kind) String() string {
	if names := [...]string{XDP: "xdp", TCIngress: "tc-ingress", TCEgress: "tc-egress"}; int(k) < len(names) && names[k] != "" {
		return names[k]
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// tcxAttach is the tcx attach type of a tc hook.
func (k Kind) tcxAttach() ebpf.AttachType {
	if k == TCEgress {
		return ebpf.AttachTCXEgress
	}
	return ebpf.AttachTCXIngress
}

// Point is where a program runs: a hook of an interface in a network
// namespace. It is a value: two Points that are equal name the same hook.
type Point struct {
	// Iface is the interface's name in its namespace. (Required)
	Iface string
	// Netns is the path of a network namespace file (/var/run/netns/cni-...,
	// /proc/PID/ns/net); "" is the caller's own namespace, the one the
	// calling thread is in. (Optional)
	Netns string
	// Kind is the hook. (Required)
	Kind Kind
}

func (p Point) String() string {
	s := p.Kind.String() + " " + p.Iface
	if p.Netns != "" {
		s += " (netns " + p.Netns + ")"
	}
	return s
}

func (p Point) validate() error {
	if p.Iface == "" {
		return fmt.Errorf("attach %s: no interface name", p)
	}
	switch p.Kind {
	case XDP, TCIngress, TCEgress:
		return nil
	}
	return fmt.Errorf("attach %s: unknown hook %s: want xdp, tc-ingress or tc-egress", p, p.Kind)
}

// Mode says how a program is attached.
type Mode string

// Attach modes. The XDP ones keep the words the agent's status has always
// used.
const (
	// ModeNative: XDP in the driver's receive path.
	ModeNative Mode = "native"
	// ModeGeneric: XDP emulated after the stack allocated an skb (slower;
	// for drivers without XDP support).
	ModeGeneric Mode = "generic"
	// ModeTCX: a tcx link (kernel 6.6+), at the head of the hook's chain.
	ModeTCX Mode = "tcx"
	// ModeClsact: a direct-action bpf filter on a clsact qdisc (kernels
	// without tcx, 6.1-6.5).
	ModeClsact Mode = "clsact"
)

// Change is what Attach did.
type Change uint8

const (
	// Created: the program was attached anew (nothing of ours was on the
	// hook, or what was there was dead).
	Created Change = iota + 1
	// Replaced: an attachment of ours (maybe pinned by an earlier agent)
	// now runs the new program. The swap is atomic: every packet met either
	// the old program or the new one.
	Replaced
	// Kept: the hook already ran this program; nothing changed.
	Kept
)

func (c Change) String() string {
	if names := [...]string{Created: "created", Replaced: "replaced", Kept: "kept"}; int(c) < len(names) && names[c] != "" {
		return names[c]
	}
	return fmt.Sprintf("change(%d)", uint8(c))
}

// Attached describes a program running at a Point.
type Attached struct {
	Point Point
	Mode  Mode
	// Program is the ID of the program the hook runs.
	Program ebpf.ProgramID
	// Link is the ID of the XDP or tcx link; 0 for a clsact filter.
	Link link.ID
	// Change is what Attach did; Alive leaves it 0.
	Change Change
	// Pin is the bpffs path of the link (XDP, tcx) or of the record of the
	// filter (clsact: the program, pinned).
	Pin string
}

// Sentinel errors, compared with errors.Is.
var (
	// ErrXDPBusy: another program holds the XDP hook. The error is an
	// *XDPBusyError that names it.
	ErrXDPBusy = errors.New("another program holds the XDP hook")
	// ErrNoInterface: there is no interface of that name in the Point's
	// namespace (not yet created, deleted, renamed or moved).
	ErrNoInterface = errors.New("no such interface")
	// ErrNotAttached: Alive found nothing of ours running at the Point; the
	// error says why (nothing pinned, interface deleted, filter removed,
	// namespace gone).
	ErrNotAttached = errors.New("not attached")
	// ErrNoNativeXDP: the interface's driver runs no XDP program natively
	// (a VLAN, a bridge, a bond of drivers without it), and the Attacher
	// was told not to fall back to generic XDP (SetNativeXDPOnly).
	ErrNoNativeXDP = errors.New("no native XDP on this interface")
)

// XDPBusyError is returned when another program holds the XDP hook. XDP
// holds one program per interface and mode, and a bpf_link attachment
// cannot be replaced by anyone but its owner, so replacing the holder would
// silently remove someone else's data path: rlagent refuses instead.
type XDPBusyError struct {
	Point Point
	// Program is the holder's ID (0 when several modes each hold one).
	Program ebpf.ProgramID
	// Name is the holder's name as the kernel knows it (up to 15 chars).
	Name string
	// Mode is how it is attached: native, generic, offload or multi.
	Mode string
	// Link is the ID of the bpf_link that holds it; 0 when it was attached
	// through netlink (ip link set ... xdp).
	Link link.ID
}

func (e *XDPBusyError) Error() string {
	holder := fmt.Sprintf("program %d %q", e.Program, e.Name)
	if e.Program == 0 {
		holder = "several programs"
	}
	remove := fmt.Sprintf("ip link set dev %s xdp off", e.Point.Iface)
	if e.Link != 0 {
		holder += fmt.Sprintf(" through bpf_link %d", e.Link)
		remove = fmt.Sprintf("bpftool link detach id %d, or stop its owner", e.Link)
	}
	return fmt.Sprintf("attach %s: %s (%s mode) holds the XDP hook, and rlagent never replaces another "+
		"program's XDP: remove it (%s) or set xdpFallback: tc to enforce ingress from tc instead",
		e.Point, holder, e.Mode, remove)
}

func (e *XDPBusyError) Unwrap() error { return ErrXDPBusy }
