package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/attach"
	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
	"github.com/rlagent/rlagent/maps"
)

// memHooks is a hookSet in memory: the hook sync's tables run on it
// without root. It passes the contract *attach.Attacher passes
// (TestHookSetContract).
type memHooks struct {
	// ifaces are the interfaces there are, by netns path ("" the
	// caller's); a hook of another one is attach.ErrNoInterface.
	ifaces map[string][]string
	// busy are the interfaces whose XDP hook another program holds (a
	// case the contract does not cover: attach's own tests do).
	busy map[string]bool
	// generic are the interfaces whose driver has no native XDP (a VLAN,
	// a bridge): generic XDP, or attach.ErrNoNativeXDP when nativeOnly.
	generic    map[string]bool
	nativeOnly bool
	attached   map[attach.Point]attach.Attached
}

func newMemHooks(ifaces ...string) *memHooks {
	return &memHooks{ifaces: map[string][]string{"": ifaces}, busy: map[string]bool{}, generic: map[string]bool{},
		attached: map[attach.Point]attach.Attached{}}
}

func (h *memHooks) SetNativeXDPOnly(v bool) { h.nativeOnly = v }

func (h *memHooks) Attach(p attach.Point, prog *ebpf.Program) (attach.Attached, error) {
	if !slices.Contains(h.ifaces[p.Netns], p.Iface) {
		return attach.Attached{}, fmt.Errorf("attach %s: %w", p, attach.ErrNoInterface)
	}
	if p.Kind == attach.XDP && h.busy[p.Iface] {
		return attach.Attached{}, &attach.XDPBusyError{Point: p, Program: 99, Name: "foreign"}
	}
	var id ebpf.ProgramID
	if prog != nil {
		info, err := prog.Info()
		if err != nil {
			return attach.Attached{}, err
		}
		id, _ = info.ID()
	}
	res := attach.Attached{Point: p, Mode: attach.ModeTCX, Program: id, Change: attach.Created}
	if p.Kind == attach.XDP {
		res.Mode = attach.ModeNative
		if h.generic[p.Iface] {
			if h.nativeOnly {
				return attach.Attached{}, fmt.Errorf("attach %s: %w: operation not supported", p, attach.ErrNoNativeXDP)
			}
			res.Mode = attach.ModeGeneric
		}
	}
	if cur, ok := h.attached[p]; ok {
		res.Change = attach.Replaced
		if cur.Program == id {
			res.Change = attach.Kept
		}
	}
	kept := res
	kept.Change = 0 // as Alive reports it
	h.attached[p] = kept
	return res, nil
}

func (h *memHooks) Detach(p attach.Point) error {
	delete(h.attached, p)
	return nil
}

func (h *memHooks) Alive(p attach.Point) (attach.Attached, error) {
	res, ok := h.attached[p]
	if !ok || !slices.Contains(h.ifaces[p.Netns], p.Iface) {
		return attach.Attached{}, fmt.Errorf("%s: %w: nothing pinned", p, attach.ErrNotAttached)
	}
	return res, nil
}

func (h *memHooks) Pinned() ([]attach.Point, error) {
	out := make([]attach.Point, 0, len(h.attached))
	for p := range h.attached {
		out = append(out, p)
	}
	slices.SortFunc(out, func(a, b attach.Point) int {
		return strings.Compare(a.Netns+"\x00"+a.Iface+"\x00"+a.Kind.String(), b.Netns+"\x00"+b.Iface+"\x00"+b.Kind.String())
	})
	return out, nil
}

// The contract the hook sync relies on, for the in-memory hooks and for
// the attacher itself (as root, on a veth of a namespace of the test's).
func TestHookSetContract(t *testing.T) {
	t.Run("memory", func(t *testing.T) {
		h := newMemHooks()
		h.ifaces["/run/netns/x"] = []string{"veth-a"}
		hookContract(t, h, "/run/netns/x", nil, nil)
	})
	t.Run("attacher", func(t *testing.T) {
		testenv.RequireRoot(t)
		dp, err := maps.Load(maps.Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { dp.Close() })
		p := nettest.MustPair(t, nettest.PairConfig{Subnet4: netip.MustParsePrefix("10.203.0.0/24")})
		a := attach.New(attach.Options{PinDir: testenv.BPFFS(t)})
		netns := fmt.Sprintf("/proc/self/fd/%d", int(p.A.Handle()))
		hookContract(t, a, netns, dp.Program(), dp.TCProgram(maps.UplinkOut))
		// What the contract left is the test's to clean up.
		t.Cleanup(func() {
			pts, _ := a.Pinned()
			for _, pt := range pts {
				a.Detach(pt)
			}
		})
	})
}

// hookContract runs on a hookSet whose namespace netns has an interface
// veth-a (and no nope0); xdp and tc are the programs to attach (nil for
// the in-memory one).
func hookContract(t *testing.T, h hookSet, netns string, xdp, tc *ebpf.Program) {
	x := attach.Point{Iface: "veth-a", Netns: netns, Kind: attach.XDP}
	e := attach.Point{Iface: "veth-a", Netns: netns, Kind: attach.TCEgress}
	if pts, err := h.Pinned(); err != nil || len(pts) != 0 {
		t.Fatalf("pinned at the start: %v, %v", pts, err)
	}
	if _, err := h.Alive(x); !errors.Is(err, attach.ErrNotAttached) {
		t.Errorf("alive before any attach: %v, want ErrNotAttached", err)
	}
	r1, err := h.Attach(x, xdp)
	if err != nil {
		t.Fatalf("attach %s: %v", x, err)
	}
	if _, err := h.Attach(x, xdp); err != nil {
		t.Errorf("attach %s again: %v", x, err)
	}
	if _, err := h.Attach(e, tc); err != nil {
		t.Fatalf("attach %s: %v", e, err)
	}
	if r, err := h.Alive(x); err != nil || r.Program != r1.Program || r.Point != x {
		t.Errorf("alive %s: %+v, %v; want the program attached (%d)", x, r, err, r1.Program)
	}
	if pts, err := h.Pinned(); err != nil || !slices.Equal(pts, []attach.Point{e, x}) && !slices.Equal(pts, []attach.Point{x, e}) {
		t.Errorf("pinned: %v, %v; want %s and %s", pts, err, x, e)
	}
	missing := attach.Point{Iface: "nope0", Netns: netns, Kind: attach.TCIngress}
	if _, err := h.Attach(missing, tc); !errors.Is(err, attach.ErrNoInterface) {
		t.Errorf("attach to an interface that is not there: %v, want ErrNoInterface", err)
	}
	if err := h.Detach(x); err != nil {
		t.Fatalf("detach %s: %v", x, err)
	}
	if _, err := h.Alive(x); !errors.Is(err, attach.ErrNotAttached) {
		t.Errorf("alive after detach: %v, want ErrNotAttached", err)
	}
	if err := h.Detach(x); err != nil {
		t.Errorf("detach twice: %v", err)
	}
	if err := h.Detach(missing); err != nil {
		t.Errorf("detach what was never attached: %v", err)
	}
	if pts, err := h.Pinned(); err != nil || !slices.Equal(pts, []attach.Point{e}) {
		t.Errorf("pinned after detaching %s: %v, %v; want %s alone", x, pts, err, e)
	}
}

// testHookSync is a hook sync on memHooks with these interfaces.
func testHookSync(fallback bool, ifaces ...string) (*hookSync, *memHooks, *logBuffer) {
	h := newMemHooks(ifaces...)
	logs := &logBuffer{}
	log := slog.New(slog.NewTextHandler(logs, nil))
	logged := map[string]bool{}
	return &hookSync{
		hooks: h, program: func(placement) *ebpf.Program { return nil }, fallbackTC: fallback,
		qdisc: func(placement) (string, string) { return "fq", "" }, log: log,
		logOnce: func(key, msg string, args ...any) {
			if !logged[key] {
				logged[key] = true
				log.Warn(msg, args...)
			}
		},
	}, h, logs
}

func uplinkXDP(iface string) placement {
	return placement{point: attach.Point{Iface: iface, Kind: attach.XDP}, hook: maps.UplinkIn, uplink: true}
}

func endpointOut(iface string) placement {
	return placement{point: attach.Point{Iface: iface, Kind: attach.TCEgress}, hook: maps.Endpoints.Hook(maps.Ingress)}
}

// The hook sync attaches each placement, reports each hook's state, fails
// the start only for an uplink, drops a gone endpoint's hook without a
// state, falls back to TC where another program holds XDP, and prunes
// what no placement holds.
func TestHookSync(t *testing.T) {
	hs, h, logs := testHookSync(false, "eth0", "veth1")
	res := hs.attach([]placement{uplinkXDP("eth0"), endpointOut("veth1"), endpointOut("veth-gone")})
	if res.first != nil {
		t.Errorf("first error %v, want none: a gone endpoint is no start failure", res.first)
	}
	if len(res.states) != 2 || res.states[0].State != StateAttached || res.states[1].Name != "veth1" || res.states[1].State != StateAttached {
		t.Errorf("states %+v, want eth0's and veth1's, attached", res.states)
	}
	if !res.keep["xdp eth0"] || !res.keep["tc-egress veth1"] || len(h.attached) != 2 {
		t.Errorf("keep %v, attached %v", res.keep, h.attached)
	}

	// An uplink that is not there fails the start, and says so.
	res = hs.attach([]placement{uplinkXDP("eth9")})
	if !errors.Is(res.first, attach.ErrNoInterface) || len(res.states) != 1 || res.states[0].State != StateMissing {
		t.Errorf("a missing uplink: first %v, states %+v", res.first, res.states)
	}

	// Pruning detaches what no placement holds, and nothing else.
	hs.prune(hs.attach([]placement{uplinkXDP("eth0")}).keep)
	if pts, _ := h.Pinned(); len(pts) != 1 || pts[0].Iface != "eth0" {
		t.Errorf("pinned after pruning %v, want eth0's XDP hook alone", pts)
	}
	if logs.count(`msg=detached`, "tc-egress veth1") != 1 {
		t.Errorf("the detach is not logged:\n%s", logs.buf.String())
	}

	// XDP held by another program: failed, or with xdpFallback tc at TC
	// ingress, and the XDP hook (not ours) is kept out of the prune.
	h.busy["eth0"] = true
	delete(h.attached, attach.Point{Iface: "eth0", Kind: attach.XDP})
	res = hs.attach([]placement{uplinkXDP("eth0")})
	var busy *attach.XDPBusyError
	if !errors.As(res.first, &busy) || res.states[0].State != StateFailed {
		t.Errorf("XDP busy without fallback: first %v, states %+v", res.first, res.states)
	}
	hs.fallbackTC = true
	res = hs.attach([]placement{uplinkXDP("eth0")})
	st := res.states[0]
	if res.first != nil || st.Hook != "tc-ingress" || st.State != StateAttached || !strings.Contains(st.Mode, "xdpFallback") ||
		!res.keep["xdp eth0"] || !res.keep["tc-ingress eth0"] {
		t.Errorf("XDP busy with fallback: first %v, state %+v, keep %v", res.first, st, res.keep)
	}
	hs.attach([]placement{uplinkXDP("eth0")})
	if n := logs.count("xdpFallback tc"); n != 1 {
		t.Errorf("%d fallback log lines, want 1", n)
	}

	// A paced placement's qdisc is checked and reported.
	paced := placement{point: attach.Point{Iface: "eth0", Kind: attach.TCEgress}, hook: maps.UplinkOut, uplink: true, paced: true}
	if st := hs.attach([]placement{paced}).states[0]; st.Qdisc != "fq" {
		t.Errorf("paced placement: qdisc %q, want the check's fq", st.Qdisc)
	}

	// A driver without native XDP (a VLAN, a bridge): generic XDP, or
	// with xdpFallback tc its TC ingress, each saying so.
	hs, h, logs = testHookSync(false, "vlan0")
	h.generic["vlan0"] = true
	if st := hs.attach([]placement{uplinkXDP("vlan0")}).states[0]; st.Hook != "xdp" || st.Mode != string(attach.ModeGeneric) ||
		st.State != StateAttached {
		t.Errorf("no native XDP without fallback: state %+v, want XDP in generic mode", st)
	}
	hs.prune(nil)
	hs.fallbackTC = true
	res = hs.attach([]placement{uplinkXDP("vlan0")})
	if st := res.states[0]; res.first != nil || st.Hook != "tc-ingress" || st.State != StateAttached ||
		st.Mode != "tcx, xdpFallback: no native XDP" || !res.keep["tc-ingress vlan0"] {
		t.Errorf("no native XDP with fallback: first %v, state %+v, keep %v", res.first, st, res.keep)
	}
	if n := logs.count("no native XDP"); n != 1 {
		t.Errorf("%d no-native log lines, want 1:\n%s", n, logs.buf.String())
	}
}
