package e2e

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/agent"
	"github.com/rlagent/rlagent/internal/agenttest"
	"github.com/rlagent/rlagent/internal/bpftest"
	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// XDP is exclusive: one program per interface. When another program holds
// the uplink's XDP hook, rlagent never replaces it. The holder here is a
// tiny program that counts IPv4 frames and passes them, attached the two
// ways other tools do: through netlink (ip link, libxdp's dispatcher) and
// with a bpf_link (Cilium).

// xdpHolders are the two ways a foreign program holds the hook, and what
// the agent must tell the user to do about each.
var xdpHolders = []struct {
	name   string
	attach func(*testing.T, *bpftest.Counter, *nettest.NS)
	// remedy is the command the agent's message names.
	remedy func(linkID uint32) string
}{
	{"netlink", func(t *testing.T, c *bpftest.Counter, ns *nettest.NS) {
		bpftest.AttachXDPNetlink(t, ns, nettest.UplinkIf, c.Prog)
	},
		func(uint32) string { return "ip link set dev " + nettest.UplinkIf + " xdp off" }},
	{"bpf_link", func(t *testing.T, c *bpftest.Counter, ns *nettest.NS) {
		bpftest.AttachXDPLink(t, ns, nettest.UplinkIf, c.Prog)
	},
		func(id uint32) string { return fmt.Sprintf("bpftool link detach id %d", id) }},
}

// newHeldRig builds a rig with the uplink's XDP hook held by a foreign
// counter, attached by hold, and returns both.
func newHeldRig(t *testing.T, hold func(*testing.T, *bpftest.Counter, *nettest.NS)) (*rig, *bpftest.Counter) {
	t.Helper()
	r := newRig(t, nettest.TopologyConfig{Uplink: true})
	foreign := bpftest.NewCounter(t, ebpf.XDP, xdpCounterName, bpftest.XDPPass)
	hold(t, foreign, r.topo.Node)
	if got, id := bpftest.XDPProgram(t, r.topo.Node, nettest.UplinkIf), foreign.ID(t); got != id {
		t.Fatalf("the uplink's XDP hook runs program %d, want the foreign %d", got, id)
	}
	return r, foreign
}

// coexistLimit is the uplink ingress limit of these tests: udp/53 at rate
// (global).
func coexistLimit(rate uint64) string {
	return fmt.Sprintf(`  - name: dns
    rate: %d
    match:
      protocol: udp
      dstPorts: ["%d"]
`, rate, port)
}

// TestXDPHeldRefusesToStart: with xdpFallback none (the default), `rlagent
// run` does not start; its error names the program that holds the hook
// (ID, name, and the bpf_link if one holds it) and says what to do (remove
// it, with the command, or set xdpFallback: tc). The foreign program stays
// on the hook and keeps running, and the agent left nothing on the TC hook.
func TestXDPHeldRefusesToStart(t *testing.T) {
	for _, h := range xdpHolders {
		t.Run(h.name, func(t *testing.T) {
			r, foreign := newHeldRig(t, h.attach)
			id := foreign.ID(t)
			linkID := uint32(0)
			if h.name == "bpf_link" {
				linkID = xdpLinkOf(t, id)
			}

			a := r.launch("", coexistLimit(globalRate))
			out := refused(t, a, 10*time.Second)
			msg := lastLine(out, "rlagent:")
			t.Logf("rlagent run refused to start: %s", msg)
			for _, want := range []string{
				fmt.Sprintf("program %d %q", id, xdpCounterName),
				h.remedy(linkID),
				"xdpFallback: tc",
				"never replaces another program's XDP",
			} {
				if !strings.Contains(msg, want) {
					t.Errorf("the error does not say %q: %s", want, msg)
				}
			}
			if got := bpftest.XDPProgram(t, r.topo.Node, nettest.UplinkIf); got != id {
				t.Errorf("after the refused start the uplink's XDP hook runs program %d, want the foreign %d", got, id)
			}
			if progs := tcIngressProgs(t, r.topo.Node, nettest.UplinkIf); len(progs) != 0 {
				t.Errorf("the refused agent left %v on the uplink's TC ingress", progs)
			}
			// The foreign program still sees every frame (a socket takes
			// them, so that no ICMP error fails the sender).
			sink, err := r.topo.Node.ListenUDP("udp4", netip.AddrPortFrom(r.topo.NodeUp4, port), 0)
			if err != nil {
				t.Fatal(err)
			}
			defer sink.Close()
			before := foreign.N(t)
			if err := r.topo.Remote.SendUDP(netip.AddrPortFrom(r.topo.NodeUp4, port), 100, []byte("rlagent e2e")); err != nil {
				t.Fatal(err)
			}
			if got := foreign.Wait(t, before+100) - before; got != 100 {
				t.Errorf("the foreign XDP program counted %d of 100 frames after the refused start", got)
			}
		})
	}
}

// TestXDPHeldFallbackTC: with xdpFallback tc the agent starts where another
// program holds the uplink's XDP hook, and enforces the uplink's ingress
// limit from the uplink's TC ingress hook (tcx) within 5% of the share.
// Status and metrics say the hook is tc-ingress (an XDP fallback); the
// foreign XDP program stays and sees every frame before the TC program
// drops the excess. When the agent is gone and its pins are cleaned up,
// the foreign program is still there.
func TestXDPHeldFallbackTC(t *testing.T) {
	for _, h := range xdpHolders {
		t.Run(h.name, func(t *testing.T) {
			r, foreign := newHeldRig(t, h.attach)
			id := foreign.ID(t)

			a := r.start("xdpFallback: tc\n", coexistLimit(globalRate))
			ifs := r.waitHooks("tc-ingress " + nettest.UplinkIf + " uplink-in")
			for _, s := range ifs {
				t.Logf("status: %s %s %s: %s", s.Hook, s.Name, s.Program, s)
				if s.Name != nettest.UplinkIf {
					continue
				}
				if s.Hook == "xdp" && s.State == agent.StateAttached {
					t.Errorf("status says the agent holds the uplink's XDP hook: %+v", s)
				}
				if s.Hook == "tc-ingress" && !strings.Contains(s.Mode, "xdpFallback") {
					t.Errorf("status shows the uplink's tc-ingress hook in mode %q, want it marked as the xdpFallback", s.Mode)
				}
			}
			if line := a.LastLogLine("another program holds the XDP hook"); !strings.Contains(line, xdpCounterName) {
				t.Errorf("the agent's log does not name the holder %q when it falls back: %q", xdpCounterName, line)
			}
			_, body := agenttest.HTTPGet(t, r.topo.Node, "http://"+metricsAddr+"/metrics")
			attached := metricLines(body, "rlagent_interface_attached")
			t.Logf("metrics: %s", strings.Join(attached, "; "))
			var tcIn bool
			for _, l := range attached {
				up := strings.HasSuffix(l, " 1")
				switch {
				case strings.Contains(l, `hook="tc-ingress"`) && strings.Contains(l, `program="uplink-in"`) && up:
					tcIn = true
				case strings.Contains(l, `hook="xdp"`) && up:
					t.Errorf("metrics say the agent is attached at XDP: %s", l)
				}
			}
			if !tcIn {
				t.Errorf("metrics show no rlagent_interface_attached{hook=\"tc-ingress\",program=\"uplink-in\"} 1")
			}
			// What `rlagent status` prints.
			table := r.rlagent("status", "--pin-dir", r.pinDir)
			if row := lastLine(table, nettest.UplinkIf+" "); !strings.Contains(row, "tc-ingress") ||
				!strings.Contains(row, "uplink-in") || !strings.Contains(row, "xdpFallback") {
				t.Errorf("rlagent status shows the uplink as %q, want its tc-ingress hook attached as the xdpFallback:\n%s", row, table)
			}
			if got := bpftest.XDPProgram(t, r.topo.Node, nettest.UplinkIf); got != id {
				t.Fatalf("with the agent running the uplink's XDP hook runs program %d, want the foreign %d", got, id)
			}
			if progs := tcIngressProgs(t, r.topo.Node, nettest.UplinkIf); len(progs) != 1 {
				t.Errorf("the uplink's TC ingress runs %v, want the agent's program alone", progs)
			}

			// The limit holds at TC, after the foreign XDP program saw
			// every frame.
			share := float64(globalRate / rigCount)
			count0 := foreign.N(t)
			s := startStream(t, "remote -> node udp/53 (uplink ingress at tc)", r.topo.Remote,
				netip.AddrPortFrom(r.topo.NodeUp4, port), r.topo.Node, 2*share, 0, settle+rigWindow+2*time.Second)
			from := s.send.Sent().Start().Add(settle)
			to := from.Add(rigWindow)
			c0, c1 := r.window(from, to, late)
			s.check(t, from, to, share)
			checkNear(t, "dns: admitted (status)", counterRate(t, c0, c1, "dns", admittedPackets), s.bucket(from, to, share), rigTol, "pkt/s")
			s.send.Stop()
			sent := uint64(s.send.Sent().Total())
			seen := foreign.Wait(t, count0+sent) - count0
			t.Logf("the foreign XDP program saw %d of the %d frames sent; the receiver got %d", seen, sent, s.recv.Got().Total())
			if seen != sent {
				t.Errorf("the foreign XDP program saw %d frames, the remote sent %d: it must see every one", seen, sent)
			}

			// Without the agent and its pins, the foreign program is
			// still the hook's.
			a.Stop(syscall.SIGTERM, 5*time.Second)
			r.rlagent("cleanup", "--pin-dir", r.pinDir)
			if got := bpftest.XDPProgram(t, r.topo.Node, nettest.UplinkIf); got != id {
				t.Errorf("after rlagent cleanup the uplink's XDP hook runs program %d, want the foreign %d", got, id)
			}
			if progs := tcIngressProgs(t, r.topo.Node, nettest.UplinkIf); len(progs) != 0 {
				t.Errorf("after rlagent cleanup the uplink's TC ingress still runs %v", progs)
			}
		})
	}
}

// lastLine is the last line of out that starts with prefix, or "".
func lastLine(out, prefix string) string {
	var last string
	for l := range strings.SplitSeq(out, "\n") {
		if strings.HasPrefix(l, prefix) {
			last = l
		}
	}
	return last
}

// TestXDPFallbackReloadToNoneRejected: a reload that sets xdpFallback none
// while another program holds the uplink's XDP hook cannot attach the
// uplink's ingress limits anywhere: XDP is taken and TC is no longer
// allowed. Like a reload that adds such an interface, it is rejected whole
// and the previous config stays in force: the TC fallback keeps enforcing
// the old share (the new config's doubled rate does not apply), and status
// still shows the tc-ingress hook.
func TestXDPFallbackReloadToNoneRejected(t *testing.T) {
	r, _ := newHeldRig(t, xdpHolders[0].attach)
	a := r.start("xdpFallback: tc\n", coexistLimit(globalRate))
	r.waitHooks("tc-ingress " + nettest.UplinkIf + " uplink-in")
	share := float64(globalRate / rigCount)
	s := startStream(t, "remote -> node udp/53 after the reload", r.topo.Remote, netip.AddrPortFrom(r.topo.NodeUp4, port),
		r.topo.Node, 2*share, 0, 2*settle+rigWindow+2*time.Second)
	time.Sleep(settle)

	written := time.Now()
	r.writeConfig("xdpFallback: none\n", coexistLimit(2*globalRate))
	if !a.WaitLog(testenv.Timeout(3*time.Second), "config rejected") {
		t.Errorf("the agent did not reject a reload that leaves the uplink's ingress limits nowhere to run "+
			"(XDP held by %s, xdpFallback none)", xdpCounterName)
	} else {
		line := a.LastLogLine("config rejected")
		t.Logf("rejected %v after the write: %s", time.Since(written).Round(time.Millisecond), line)
		if !strings.Contains(line, xdpCounterName) || !strings.Contains(line, "xdpFallback: tc") {
			t.Errorf("the rejection does not name the holder %q and say what to do: %s", xdpCounterName, line)
		}
	}
	if st, err := r.hooks(); err != nil || !slices.ContainsFunc(st, func(s agent.InterfaceStatus) bool {
		return hookLine(s) == "tc-ingress "+nettest.UplinkIf+" uplink-in" && s.State == agent.StateAttached
	}) {
		t.Errorf("after the reload status shows %+v (%v), want the uplink's tc-ingress hook still attached", st, err)
	}
	if progs := tcIngressProgs(t, r.topo.Node, nettest.UplinkIf); len(progs) != 1 {
		t.Errorf("after the reload the uplink's TC ingress runs %v, want the agent's program", progs)
	}
	if l := r.counters().limit(t, "dns"); l.ShareRate != uint64(share) {
		t.Errorf("after the reload the share is %d, want the previous config's %.0f", l.ShareRate, share)
	}
	from := written.Add(settle)
	to := from.Add(rigWindow)
	sleepUntil(to.Add(late))
	s.check(t, from, to, share)
}
