package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
)

// Interface attach states.
const (
	// StateAttached: the data path is attached; Mode says how.
	StateAttached = "attached"
	// StateMissing: no interface of that name in the agent's network
	// namespace (deleted, renamed, moved, not yet created). The agent
	// attaches as soon as it appears.
	StateMissing = "missing"
	// StateFailed: the interface is there but attaching failed (Error).
	StateFailed = "failed"
	// StateDetached (status only, with the agent down): the pinned link is
	// dead, its interface was deleted.
	StateDetached = "detached"
)

// XDP attach modes.
const (
	ModeNative  = "native"
	ModeGeneric = "generic"
)

// linkResync is how often every interface is checked even without a
// netlink event: events can be lost (a full socket buffer), and a link can
// be detached without one (bpftool link detach).
const linkResync = 5 * time.Second

// InterfaceStatus is the attach state of one configured interface.
type InterfaceStatus struct {
	Name  string `json:"name"`
	State string `json:"state"`
	// Mode is native or generic while attached.
	Mode  string `json:"mode,omitempty"`
	Error string `json:"error,omitempty"`
	// Since is when the interface entered this state.
	Since time.Time `json:"since"`
}

func (s InterfaceStatus) String() string {
	switch {
	case s.State == StateAttached && s.Mode != "":
		return s.State + " (" + s.Mode + ")"
	case s.Error != "":
		return s.State + ": " + s.Error
	}
	return s.State
}

// watchLinks keeps the configured interfaces attached: it re-checks them on
// every netlink link event and every linkResync, and re-attaches an
// interface that was deleted and re-created (a veth re-created, a NIC
// reset, a driver reload) as soon as it is back.
func (a *Agent) watchLinks(ctx context.Context) {
	due := make(chan struct{}, 1)
	poke := func() {
		select {
		case due <- struct{}{}:
		default:
		}
	}
	go a.subscribeLinks(ctx, poke)
	t := time.NewTicker(linkResync)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-due:
		case <-t.C:
		}
		a.mu.Lock()
		// The agent closes its links after ctx ends: never attach after.
		if ctx.Err() == nil {
			a.syncLinks()
		}
		a.mu.Unlock()
	}
}

// subscribeLinks calls poke on every link event in the agent's network
// namespace, and once after each (re)subscription, since events may have
// been missed while there was none. A subscription that fails (ENOBUFS when
// events come faster than they are read) is replaced.
func (a *Agent) subscribeLinks(ctx context.Context, poke func()) {
	for ctx.Err() == nil {
		updates := make(chan netlink.LinkUpdate, 64)
		done := make(chan struct{})
		err := netlink.LinkSubscribeWithOptions(updates, done, netlink.LinkSubscribeOptions{
			ErrorCallback: func(err error) {
				a.log.Warn("netlink link events: resubscribing", "error", err)
			},
		})
		if err != nil {
			close(done)
			a.log.Error("subscribe to netlink link events; checking interfaces every "+linkResync.String()+" only",
				"error", err)
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Second):
			}
			continue
		}
		poke()
	read:
		for {
			select {
			case <-ctx.Done():
				break read
			case _, ok := <-updates:
				if !ok {
					break read // the subscription ended on an error
				}
				// Any event may concern a configured interface (by name
				// now, or by the index it had): checking them all costs a
				// lookup per interface.
				poke()
			}
		}
		close(done)
		for range updates {
			// The reader closes updates once the socket is closed; until
			// then it may block on a send.
		}
	}
}

// syncLinks checks every configured interface against the kernel,
// attaches where the link is missing or dead, and records the states.
// Callers hold a.mu.
func (a *Agent) syncLinks() {
	for _, iface := range a.cfg.Interfaces {
		st, _ := a.syncLink(iface)
		a.setState(st)
	}
	a.dropStates()
}

// setState records an interface's state; a change is logged and written to
// the lock record. Callers hold a.mu.
func (a *Agent) setState(st InterfaceStatus) {
	if a.ifState == nil {
		a.ifState = make(map[string]InterfaceStatus)
	}
	iface := st.Name
	if old, ok := a.ifState[iface]; ok && old.State == st.State && old.Mode == st.Mode && old.Error == st.Error {
		return
	}
	st.Since = time.Now().UTC()
	a.ifState[iface] = st
	switch st.State {
	case StateAttached:
		a.log.Info("interface attached", "interface", iface, "mode", st.Mode)
	default:
		a.log.Warn("interface not attached: its traffic passes unlimited", "interface", iface,
			"state", st.State, "error", st.Error)
	}
	a.recordInterfaces()
}

// dropStates forgets the interfaces no longer configured. Callers hold a.mu.
func (a *Agent) dropStates() {
	changed := false
	for iface := range a.ifState {
		if !slices.Contains(a.cfg.Interfaces, iface) {
			delete(a.ifState, iface)
			changed = true
		}
	}
	if changed {
		a.recordInterfaces()
	}
}

// syncLink checks one interface and attaches it if its link is missing or
// dead. The error, when not attached, is the state's reason. Callers hold
// a.mu.
func (a *Agent) syncLink(iface string) (InterfaceStatus, error) {
	fail := func(state string, err error) (InterfaceStatus, error) {
		return InterfaceStatus{Name: iface, State: state, Error: err.Error()}, err
	}
	nl, err := netlink.LinkByName(iface)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			// Its link, if any, died with it.
			a.closeLink(iface)
			return fail(StateMissing, fmt.Errorf("attach xdp to %s: no such interface", iface))
		}
		return fail(StateFailed, fmt.Errorf("attach xdp to %s: %w", iface, err))
	}
	if l := a.links[iface]; l != nil {
		info, err := l.Info()
		if err == nil && info.XDP() != nil && int(info.XDP().Ifindex) == nl.Attrs().Index {
			return InterfaceStatus{Name: iface, State: StateAttached, Mode: xdpMode(nl)}, nil
		}
		// Dead (its interface was deleted, and the one there now is
		// another) or detached by someone: attach anew.
		a.log.Warn("XDP link lost, attaching again", "interface", iface, "ifindex", nl.Attrs().Index)
		a.closeLink(iface)
	}
	l, mode, err := attachXDP(a.dp.Program(), iface, a.cfg.PinDir, a.log)
	if err != nil {
		return fail(StateFailed, err)
	}
	if a.links == nil {
		a.links = make(map[string]link.Link)
	}
	a.links[iface] = l
	return InterfaceStatus{Name: iface, State: StateAttached, Mode: mode}, nil
}

func (a *Agent) closeLink(iface string) {
	if l := a.links[iface]; l != nil {
		l.Close()
		delete(a.links, iface)
	}
}

// recordInterfaces writes the states into the lock record, for status.
func (a *Agent) recordInterfaces() {
	st := a.interfaces()
	a.health.setInterfaces(st)
	if err := a.lock.setInterfaces(st); err != nil {
		a.log.Warn("interface states not recorded for rlagent status", "error", err)
	}
}

// interfaces are the configured interfaces' states, in config order.
// Callers hold a.mu.
func (a *Agent) interfaces() []InterfaceStatus {
	out := make([]InterfaceStatus, 0, len(a.cfg.Interfaces))
	for _, iface := range a.cfg.Interfaces {
		st, ok := a.ifState[iface]
		if !ok {
			st = InterfaceStatus{Name: iface, State: StateMissing, Error: "not attached yet"}
		}
		out = append(out, st)
	}
	return out
}

// xdpMode is how the kernel runs the XDP program of l.
func xdpMode(l netlink.Link) string {
	x := l.Attrs().Xdp
	if x == nil {
		return ""
	}
	switch x.AttachMode {
	case 1: // XDP_ATTACHED_DRV
		return ModeNative
	case 2: // XDP_ATTACHED_SKB
		return ModeGeneric
	case 3:
		return "offload"
	case 4:
		return "multi"
	}
	return ""
}

// AgentStatus is what `rlagent status` shows of the agent: who holds the
// pin directory, and the interfaces' attach state.
type AgentStatus struct {
	// Running: a process holds the pin directory's lock.
	Running bool `json:"running"`
	// Holder is the record of the agent that holds (or, not running, last
	// held) the pin directory; nil if none was left.
	Holder *Holder `json:"holder,omitempty"`
	// Interfaces are the agent's record, corrected by what the kernel says
	// of the pinned links: a link whose interface was deleted is dead.
	Interfaces []InterfaceStatus `json:"interfaces"`
}

// ReadAgentStatus reads the agent's record and the pinned links in pinDir.
// It writes nothing and works while the agent is down.
func ReadAgentStatus(pinDir string) (AgentStatus, error) {
	var st AgentStatus
	if _, err := os.Stat(pinDir); err != nil {
		return st, err
	}
	running, err := locked(pinDir)
	if err != nil {
		return st, fmt.Errorf("read %s: %w", pinDir, err)
	}
	st.Running = running
	if h, err := readHolder(pinDir); err == nil {
		st.Holder = &h
		st.Interfaces = h.Interfaces
	}
	pinned, err := pinnedLinks(pinDir)
	if err != nil {
		return st, err
	}
	for _, iface := range pinned {
		if !slices.ContainsFunc(st.Interfaces, func(s InterfaceStatus) bool { return s.Name == iface }) {
			st.Interfaces = append(st.Interfaces, InterfaceStatus{Name: iface, State: StateAttached})
		}
	}
	for i := range st.Interfaces {
		s := &st.Interfaces[i]
		if s.State != StateAttached {
			continue
		}
		if alive, err := pinnedLinkAlive(pinDir, s.Name); err != nil {
			s.State, s.Mode, s.Error = StateDetached, "", err.Error()
		} else if !alive {
			s.State, s.Mode, s.Error = StateDetached, "", "the interface was deleted; its XDP link is dead"
		}
	}
	return st, nil
}

// pinnedLinkAlive reports whether the pinned XDP link of iface is still
// attached to a device. The kernel clears a link's ifindex when its device
// goes away.
func pinnedLinkAlive(pinDir, iface string) (bool, error) {
	l, err := link.LoadPinnedLink(linkPin(pinDir, iface), nil)
	if errors.Is(err, os.ErrNotExist) {
		return false, errors.New("no pinned XDP link")
	}
	if err != nil {
		return false, err
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		return false, err
	}
	return info.XDP() != nil && info.XDP().Ifindex != 0, nil
}
