package agent

import (
	"errors"
	"log/slog"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/attach"
)

// hookSet is the attacher as the hook sync sees it: *attach.Attacher is
// one; tests use an in-memory one that passes the same contract
// (hooks_test.go).
type hookSet interface {
	// Attach makes prog run at a hook and pins it (idempotent); an
	// interface that is not there is attach.ErrNoInterface, an XDP hook
	// another program holds an *attach.XDPBusyError.
	Attach(p attach.Point, prog *ebpf.Program) (attach.Attached, error)
	// Detach removes what Attach put at a hook (nothing there: no error).
	Detach(p attach.Point) error
	// Alive says whether what Attach put at a hook still runs there
	// (attach.ErrNotAttached when not).
	Alive(p attach.Point) (attach.Attached, error)
	// Pinned lists the hooks attached and not detached.
	Pinned() ([]attach.Point, error)
	// SetNativeXDPOnly makes an XDP attach the driver cannot run natively
	// fail with attach.ErrNoNativeXDP (xdpFallback tc: TC ingress runs
	// it instead) rather than fall back to generic XDP.
	SetNativeXDPOnly(bool)
}

// hookSync makes placements so: the data path's programs at the hooks that
// need them, and, pruning, nothing of ours at the hooks that need none.
type hookSync struct {
	hooks   hookSet
	program func(placement) *ebpf.Program
	// fallbackTC: where another program holds an uplink's XDP hook, or its
	// driver has no native XDP, its ingress limits run at its TC ingress
	// hook (xdpFallback tc).
	fallbackTC bool
	// qdisc checks a paced placement's qdisc (see Agent.syncQdisc).
	qdisc   func(placement) (qdisc, ineffective string)
	log     *slog.Logger
	logOnce func(key, msg string, args ...any)
}

// hookResult is what a sync did.
type hookResult struct {
	// states are the hooks' states, in the order of the placements; an
	// endpoint's hook whose interface is gone (its pod went) has none.
	states []InterfaceStatus
	// keep are the hooks (attach.Point.String()) the placements hold, the
	// XDP hooks another program holds included.
	keep map[string]bool
	// first is the first error of an uplink's hook, for the start, which
	// rejects a config whose interfaces cannot be attached.
	first error
}

// attach attaches every placement's program.
func (h *hookSync) attach(want []placement) hookResult {
	res := hookResult{keep: make(map[string]bool, len(want))}
	for _, p := range want {
		st, used, err := h.place(p)
		res.keep[used.key()] = true
		if used != p {
			res.keep[p.key()] = true // the XDP hook another program holds is not ours to detach
		}
		if err != nil && p.uplink && res.first == nil {
			res.first = err
		}
		if err != nil && !p.uplink && errors.Is(err, attach.ErrNoInterface) {
			// An endpoint's interface that is gone: its pod went. The
			// next reconcile drops it (the route or neighbour event that
			// came with it has woken one).
			continue
		}
		res.states = append(res.states, st)
	}
	return res
}

// prune detaches every hook of ours that keep does not hold.
func (h *hookSync) prune(keep map[string]bool) {
	pinned, err := h.hooks.Pinned()
	if err != nil {
		h.log.Warn("list pinned hooks", "error", err)
	}
	for _, pt := range pinned {
		if keep[pt.String()] {
			continue
		}
		if err := h.hooks.Detach(pt); err != nil {
			h.log.Error("detach a hook no limit needs", "point", pt.String(), "error", err)
			continue
		}
		h.log.Info("detached", "point", pt.String())
	}
}

// place attaches p's program at p. Where another program holds an
// uplink's XDP hook, xdpFallback tc puts the uplink-in program on the
// interface's TC ingress instead: used is where it went.
func (h *hookSync) place(p placement) (st InterfaceStatus, used placement, err error) {
	used = p
	h.hooks.SetNativeXDPOnly(h.fallbackTC)
	res, err := h.hooks.Attach(p.point, h.program(p))
	var busy *attach.XDPBusyError
	fallback := ""
	switch {
	case !h.fallbackTC:
	case errors.As(err, &busy):
		fallback = "xdpFallback"
		h.logOnce("xdp-busy "+p.point.Iface, "another program holds the XDP hook: enforcing the uplink's ingress limits from its TC ingress hook (xdpFallback tc)",
			"interface", p.point.Iface, "holder", busy.Name, "holder_id", busy.Program)
	case errors.Is(err, attach.ErrNoNativeXDP):
		fallback = "xdpFallback: no native XDP"
		h.logOnce("xdp-native "+p.point.Iface, "the interface's driver has no native XDP: enforcing the uplink's ingress limits from its TC ingress hook (xdpFallback tc)",
			"interface", p.point.Iface, "error", err)
	}
	if fallback != "" {
		used = placement{point: attach.Point{Iface: p.point.Iface, Kind: attach.TCIngress}, hook: p.hook, uplink: p.uplink}
		res, err = h.hooks.Attach(used.point, h.program(used))
	}
	st = InterfaceStatus{Name: used.point.Iface, Hook: used.point.Kind.String(), Program: used.hook.String(),
		Netns: used.point.Netns, uplink: used.uplink}
	switch {
	case err == nil:
		st.State, st.Mode = StateAttached, string(res.Mode)
		if used != p {
			st.Mode += ", " + fallback
		}
		if p.paced {
			st.Qdisc, st.PaceIneffective = h.qdisc(p)
		}
	case errors.Is(err, attach.ErrNoInterface):
		st.State, st.Error = StateMissing, err.Error()
	default:
		// An *attach.XDPBusyError says what to do already.
		st.State, st.Error = StateFailed, err.Error()
	}
	return st, used, err
}
