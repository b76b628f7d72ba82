package agent

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/attach"
	"github.com/rlagent/rlagent/maps"
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

// XDP attach modes (attach.Mode's words).
const (
	ModeNative  = string(attach.ModeNative)
	ModeGeneric = string(attach.ModeGeneric)
)

// linkResync is how often every hook is checked even without a netlink
// event: events can be lost (a full socket buffer), and a link can be
// detached without one (bpftool link detach).
const linkResync = 5 * time.Second

// InterfaceStatus is the attach state of one hook of one interface.
type InterfaceStatus struct {
	Name string `json:"name"`
	// Hook is the kernel hook: xdp, tc-ingress or tc-egress.
	Hook string `json:"hook,omitempty"`
	// Program is the data path's program there: the traffic it sees
	// (uplink-in, uplink-out, endpoint-in, endpoint-out; see maps.Hook).
	Program string `json:"program,omitempty"`
	// Netns is the network namespace of an endpoint's own interface
	// (endpointHook pod); empty for the agent's.
	Netns string `json:"netns,omitempty"`
	State string `json:"state"`
	// Mode is how the program is attached: native or generic (XDP), tcx or
	// clsact (TC).
	Mode  string `json:"mode,omitempty"`
	Error string `json:"error,omitempty"`
	// Qdisc is the uplink's fq where paced limits leave ("fq", or "fq
	// (rlagent)" for one the agent put there with manageQdisc), and
	// PaceIneffective why their departure times do nothing there.
	Qdisc           string `json:"qdisc,omitempty"`
	PaceIneffective string `json:"paceIneffective,omitempty"`
	// Since is when the hook entered this state.
	Since time.Time `json:"since"`
	// uplink: one of the config's interfaces, whose absence is a problem;
	// an endpoint's interface that goes away is a pod that went.
	uplink bool
}

func (s InterfaceStatus) String() string {
	var out string
	switch {
	case s.State == StateAttached && s.Mode != "":
		out = s.State + " (" + s.Mode + ")"
	case s.Error != "":
		out = s.State + ": " + s.Error
	default:
		out = s.State
	}
	switch {
	case s.PaceIneffective != "":
		out += "; pace ineffective: " + s.PaceIneffective
	case s.Qdisc != "":
		out += "; paced by " + s.Qdisc
	}
	return out
}

// where names the hook for logs and readiness: "xdp eth0", "tc-egress
// veth1a2b".
func (s InterfaceStatus) where() string {
	w := s.Name
	if s.Hook != "" {
		w = s.Hook + " " + w
	}
	if s.Netns != "" {
		w += " (netns " + s.Netns + ")"
	}
	return w
}

// placement is where one of the data path's programs runs: a hook of an
// interface, and the maps.Hook whose limits the program there enforces.
// The agent decides the placements; attach/ makes them so.
type placement struct {
	point  attach.Point
	hook   maps.Hook
	uplink bool // one of the config's interfaces
	// paced: a paced limit leaves through this hook (an uplink's TC
	// egress), whose interface's qdisc must then be fq, with fq's
	// parameters.
	paced bool
	fq    attach.FQ
}

func (p placement) key() string { return p.point.String() }

// program is the data path's program for p.
func (a *Agent) program(p placement) *ebpf.Program {
	if p.point.Kind == attach.XDP {
		return a.dp.Program()
	}
	return a.dp.TCProgram(p.hook)
}

// placements are the hooks the data path must run at for the limits given
// (those in the maps, and those about to be written) and the endpoint hooks
// the reconcile found for them: every configured interface gets the XDP
// program (or, with xdpFallback tc where another program holds XDP, the TC
// ingress one, see syncPlacement); its TC egress gets the uplink-out
// program when a limit needs it; each endpoint hook its program. Callers
// hold a.mu.
func (a *Agent) placements(limits []maps.Limit, endpoints []placement) []placement {
	uplinkOut := slices.ContainsFunc(limits, func(l maps.Limit) bool {
		return l.Match.Attach.Hook(l.Match.Direction) == maps.UplinkOut
	})
	paced, fq := pacing(limits)
	var out []placement
	for _, iface := range a.uplinks {
		out = append(out, placement{point: attach.Point{Iface: iface, Kind: attach.XDP}, hook: maps.UplinkIn, uplink: true})
		if uplinkOut {
			out = append(out, placement{point: attach.Point{Iface: iface, Kind: attach.TCEgress}, hook: maps.UplinkOut,
				uplink: true, paced: paced, fq: fq})
		}
	}
	seen := make(map[string]bool)
	for _, p := range endpoints {
		if !seen[p.key()] {
			seen[p.key()] = true
			out = append(out, p)
		}
	}
	return out
}

// pacing says whether any of limits paces (they leave through the uplinks'
// TC egress: maps.Limit.Validate), and what the uplinks' fq must hold for
// them: a horizon above the limits' own (theirs decides, and counts), and a
// flow limit that holds a horizon of the largest paced share, in packets
// (of 64 bytes for a bytes limit, the smallest frame).
func pacing(limits []maps.Limit) (bool, attach.FQ) {
	var (
		fq    attach.FQ
		paced bool
	)
	for _, l := range limits {
		if l.Action != maps.Pace {
			continue
		}
		paced = true
		fq.Horizon = max(fq.Horizon, 2*l.Horizon)
		pkts := l.Rate
		if l.Unit == maps.Bytes {
			pkts = l.Rate / 64
		}
		held := (pkts*uint64(l.Horizon.Microseconds()) + 999_999) / 1_000_000
		fq.FlowLimit = max(fq.FlowLimit, 100, uint32(min(held, 1<<20)))
	}
	return paced, fq
}

// appliedLimits are the limits in the maps. Callers hold a.mu.
func (a *Agent) appliedLimits() []maps.Limit {
	ids := a.dp.IDs()
	out := make([]maps.Limit, 0, len(ids))
	for _, id := range ids {
		l, err := a.dp.Limit(id)
		if err != nil {
			continue
		}
		out = append(out, l)
	}
	return out
}

// watchLinks keeps the hooks attached: on every netlink link, route or
// neighbour event and every linkResync it reconciles, which finds the
// endpoints' interfaces anew (a pod came or went) and re-attaches a hook
// whose interface was deleted and re-created (a veth re-created, a NIC
// reset, a driver reload) as soon as it is back.
func (a *Agent) watchLinks(ctx context.Context) {
	go a.att.Watch(ctx, a.wake)
	t := time.NewTicker(linkResync)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			a.wake()
		}
	}
}

// syncLinks makes the hooks of the placements run the data path, and with
// prune detaches the hooks of ours that no placement wants (an endpoint
// that went, an interface the config dropped, a hook no limit needs). It
// records the states. It returns the first error of a configured
// interface's XDP or TC hook (not a missing one's), for the start, which
// rejects a config whose interfaces cannot be attached. Callers hold a.mu.
func (a *Agent) syncLinks(want []placement, prune bool) error {
	a.syncLocal()
	hs := a.hookSync()
	res := hs.attach(want)
	for _, st := range res.states {
		a.setState(st)
	}
	if !prune {
		return res.first
	}
	// want is every placement now: the fq of ours goes where nothing
	// paces any more (a sync of some placements, such as a reload's new
	// interfaces, must not take it away from the others).
	if !slices.ContainsFunc(want, func(p placement) bool { return p.paced }) || !a.cfg.ManageQdisc {
		a.removeFQ()
	}
	hs.prune(res.keep)
	for key := range a.ifState {
		if !res.keep[key] {
			delete(a.ifState, key)
		}
	}
	a.recordInterfaces()
	a.finishMigration()
	return res.first
}

// hookSync is the sync of the agent's hooks, with the config in force.
// Callers hold a.mu.
func (a *Agent) hookSync() *hookSync {
	return &hookSync{hooks: a.hooks, program: a.program, fallbackTC: a.cfg.XDPFallback == v1alpha1.XDPFallbackTC,
		qdisc: a.syncQdisc, log: a.log, logOnce: a.logOnce}
}

// syncLocal writes what action reject may answer (maps.SetLocalAddresses,
// SetInterfaceMACs): the node's own addresses and its local endpoints', and
// the MAC address of each configured uplink (the only interfaces whose
// rejects are answered); and each local endpoint's addresses by its
// interface, which its egress limits match and key its packets by
// (maps.SetEndpointSources). Called before any hook is attached, so that an
// endpoint's egress program finds its addresses. A failure is logged, not
// returned: with nothing written, rejects are dropped unanswered
// (not_local), which never cuts the node off, and an endpoint's packets are
// charged as the unspecified address (counted as source mismatches).
// Callers hold a.mu.
func (a *Agent) syncLocal() {
	node, eps, err := a.att.LocalAddresses()
	if err != nil {
		a.logOnce("local addresses", "list the node's addresses for action reject", "error", err)
	}
	local := make(map[netip.Addr]maps.LocalKind, len(node)+len(eps))
	sources := make(map[int][]netip.Addr)
	for _, e := range eps {
		local[e.Addr] |= maps.LocalEndpoint
		sources[e.Ifindex] = append(sources[e.Ifindex], e.Addr)
	}
	for _, ad := range node {
		local[ad] |= maps.LocalNode
	}
	// A list that failed part way (an interrupted dump) adds what it has
	// and removes nothing: a node address it missed stays protected, an
	// endpoint's address it missed stays its own.
	write, writeSources := a.dp.SetLocalAddresses, a.dp.SetEndpointSources
	if err != nil {
		write, writeSources = a.dp.AddLocalAddresses, a.dp.AddEndpointSources
	}
	if err := write(local); err != nil {
		a.logOnce("local addresses write", "write the node's addresses for action reject and the protect rules", "error", err)
	}
	if err := writeSources(sources); err != nil {
		a.logOnce("endpoint sources write", "write the local endpoints' addresses for their egress limits", "error", err)
	}
	macs := make(map[uint32]net.HardwareAddr)
	for _, iface := range a.uplinks {
		idx, mac, err := a.att.InterfaceMAC(iface)
		if err != nil || len(mac) != 6 {
			continue // a missing interface: its state says so
		}
		macs[uint32(idx)] = mac
	}
	if err := a.dp.SetInterfaceMACs(macs); err != nil {
		a.logOnce("interface macs", "write the uplinks' MAC addresses for action reject", "error", err)
	}
}

// finishMigration ends a migration of the pin layout (maps.Migration) once
// every pinned hook runs one of this data path's programs: until then a
// hook still runs the earlier layout's program with its maps, and removing
// their pins would leave them unreadable. After it, the old maps go with
// their last user.
func (a *Agent) finishMigration() {
	mig := a.dp.Migrating()
	if mig == nil {
		return
	}
	ours := a.dp.ProgramIDs()
	pinned, err := a.hooks.Pinned()
	if err != nil {
		return
	}
	for _, pt := range pinned {
		res, err := a.hooks.Alive(pt)
		if err != nil {
			continue // a dead pin holds no program
		}
		if !slices.Contains(ours, res.Program) {
			return // the next sync moves it
		}
	}
	if err := a.dp.FinishMigration(); err != nil {
		a.log.Error("finish the pin layout's migration", "from", mig.From, "error", err)
		return
	}
	a.log.Info("pin layout migrated: every hook runs this data path, the earlier layout's pins are removed",
		"from", mig.From, "copied", len(mig.Copied), "rebuilt", mig.Rebuilt)
}

// syncQdisc checks, and with manageQdisc makes, that the qdisc of p's
// interface releases paced packets at their departure time: it returns
// the qdisc ("fq", or "fq (rlagent)" for one the agent put there), or why
// the paced limits are ineffective there.
func (a *Agent) syncQdisc(p placement) (qdisc, ineffective string) {
	var (
		st  attach.FQState
		err error
	)
	if a.cfg.ManageQdisc {
		st, err = attach.EnsureFQ(p.point.Iface, p.fq)
	} else {
		st, err = attach.CheckFQ(p.point.Iface)
	}
	switch {
	case err != nil:
		return "", err.Error()
	case st.Paces && st.Ours:
		return "fq (rlagent)", ""
	case st.Paces:
		return "fq", ""
	case !a.cfg.ManageQdisc:
		return "", st.Why + " (put fq there, or set manageQdisc: true)"
	}
	return "", st.Why
}

// paceIneffective says on which uplinks paced limits are ineffective, and
// why, or "". Callers hold a.mu.
func (a *Agent) paceIneffective() string {
	var out []string
	for _, st := range a.interfaces() {
		if st.PaceIneffective != "" {
			out = append(out, st.Name+": "+st.PaceIneffective)
		}
	}
	if len(out) == 0 {
		return ""
	}
	return "paced packets are not held to their departure time on " + strings.Join(out, "; ")
}

// removeFQ takes the fq qdiscs the agent put on the uplinks off again (no
// paced limit is left, or manageQdisc was turned off): the kernel puts its
// defaults back. Callers hold a.mu.
func (a *Agent) removeFQ() {
	for _, iface := range a.uplinks {
		removed, err := attach.RemoveFQ(iface)
		switch {
		case err != nil:
			a.logOnce("remove-fq "+iface, "fq qdisc of rlagent not removed", "interface", iface, "error", err)
		case removed:
			a.log.Info("removed rlagent's fq qdisc: no paced limit needs it", "interface", iface)
		}
	}
}

// logOnce logs a warning the first time key is seen. Callers hold a.mu.
func (a *Agent) logOnce(key, msg string, args ...any) {
	if a.logged == nil {
		a.logged = make(map[string]bool)
	}
	if a.logged[key] {
		return
	}
	a.logged[key] = true
	a.log.Warn(msg, args...)
}

// setState records a hook's state; a change is logged and written to
// the lock record. Callers hold a.mu.
func (a *Agent) setState(st InterfaceStatus) {
	if a.ifState == nil {
		a.ifState = make(map[string]InterfaceStatus)
	}
	key := attach.Point{Iface: st.Name, Netns: st.Netns, Kind: kindOf(st.Hook)}.String()
	old, ok := a.ifState[key]
	if ok && old.State == st.State && old.Mode == st.Mode && old.Error == st.Error &&
		old.Program == st.Program && old.Qdisc == st.Qdisc && old.PaceIneffective == st.PaceIneffective {
		return
	}
	if st.PaceIneffective != "" && st.PaceIneffective != old.PaceIneffective {
		a.log.Warn("paced limits are ineffective: their packets leave at once, and only their horizon drops",
			"interface", st.Name, "reason", st.PaceIneffective)
	}
	st.Since = time.Now().UTC()
	a.ifState[key] = st
	switch st.State {
	case StateAttached:
		a.log.Info("attached", "interface", st.Name, "hook", st.Hook, "program", st.Program, "mode", st.Mode,
			"netns", st.Netns)
	default:
		a.log.Warn("not attached: the traffic there passes unlimited", "interface", st.Name, "hook", st.Hook,
			"program", st.Program, "state", st.State, "error", st.Error)
	}
	a.recordInterfaces()
}

func kindOf(hook string) attach.Kind {
	for _, k := range []attach.Kind{attach.XDP, attach.TCIngress, attach.TCEgress} {
		if k.String() == hook {
			return k
		}
	}
	return 0
}

// recordInterfaces writes the states into the lock record, for status.
func (a *Agent) recordInterfaces() {
	st := a.interfaces()
	a.health.setInterfaces(st)
	if err := a.lock.setInterfaces(st); err != nil {
		a.log.Warn("interface states not recorded for rlagent status", "error", err)
	}
}

// interfaces are the hooks' states: the configured interfaces first, in
// config order, then the endpoints' by name. Callers hold a.mu.
func (a *Agent) interfaces() []InterfaceStatus {
	out := make([]InterfaceStatus, 0, len(a.ifState))
	for _, st := range a.ifState {
		out = append(out, st)
	}
	order := func(s InterfaceStatus) int {
		if i := slices.Index(a.uplinks, s.Name); i >= 0 && s.uplink {
			return i
		}
		return len(a.uplinks)
	}
	slices.SortFunc(out, func(x, y InterfaceStatus) int {
		if d := order(x) - order(y); d != 0 {
			return d
		}
		return strings.Compare(x.where(), y.where())
	})
	// A configured interface never attached yet (the first sync is under
	// way) is missing until it is.
	for _, iface := range a.uplinks {
		if !slices.ContainsFunc(out, func(s InterfaceStatus) bool { return s.Name == iface && s.uplink }) {
			out = append(out, InterfaceStatus{Name: iface, Hook: attach.XDP.String(), State: StateMissing,
				Error: "not attached yet", uplink: true})
		}
	}
	return out
}

// AgentStatus is what `rlagent status` shows of the agent: who holds the
// pin directory, and the hooks' attach state.
type AgentStatus struct {
	// Running: a process holds the pin directory's lock.
	Running bool `json:"running"`
	// Holder is the record of the agent that holds (or, not running, last
	// held) the pin directory; nil if none was left.
	Holder *Holder `json:"holder,omitempty"`
	// Interfaces are the agent's record, corrected by what the kernel says
	// of the pinned hooks: a hook whose interface was deleted is dead.
	Interfaces []InterfaceStatus `json:"interfaces"`
}

// ReadAgentStatus reads the agent's record and the pinned hooks in pinDir.
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
	pinned, err := attach.Pinned(pinDir)
	if err != nil {
		return st, err
	}
	point := func(s InterfaceStatus) attach.Point {
		k := kindOf(s.Hook)
		if k == 0 {
			k = attach.XDP // a record of an agent from before TC
		}
		return attach.Point{Iface: s.Name, Netns: s.Netns, Kind: k}
	}
	for _, pt := range pinned {
		if !slices.ContainsFunc(st.Interfaces, func(s InterfaceStatus) bool { return point(s) == pt }) {
			st.Interfaces = append(st.Interfaces, InterfaceStatus{Name: pt.Iface, Hook: pt.Kind.String(),
				Netns: pt.Netns, State: StateAttached})
		}
	}
	att := attach.New(attach.Options{PinDir: pinDir})
	for i := range st.Interfaces {
		s := &st.Interfaces[i]
		if s.State != StateAttached {
			continue
		}
		if _, err := att.Alive(point(*s)); err != nil {
			s.State, s.Mode, s.Error = StateDetached, "", err.Error()
		}
	}
	return st, nil
}
