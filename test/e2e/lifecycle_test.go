package e2e

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/internal/agenttest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// The agent's lifecycle: one agent per pin directory, pins that outlive
// it, interfaces that come and go, health that tells the truth, and a
// reload that applies whole or not at all.

// metricsAddr is where the tests that read /metrics and /readyz have the
// agent listen: the loopback of its own network namespace, so any port is
// free.
const metricsAddr = "127.0.0.1:9478"

// withMetrics turns a config's metrics on at metricsAddr.
func withMetrics(yaml string) string {
	return strings.Replace(yaml, `metricsAddress: "off"`, `metricsAddress: "`+metricsAddr+`"`, 1)
}

// get GETs a path of the agent's metrics listener.
func (e *env) get(path string) (int, string) {
	e.t.Helper()
	return agenttest.HTTPGet(e.t, e.pair.B, "http://"+metricsAddr+path)
}

// metric returns the value of the sample whose line starts with series
// (name and labels as exposed, e.g. `rlagent_ready` or
// `rlagent_interface_attached{hook="xdp",interface="x",mode="native",program="uplink-in"}`), and whether
// there is one.
func metric(body, series string) (float64, bool) {
	for line := range strings.SplitSeq(body, "\n") {
		if rest, ok := strings.CutPrefix(line, series+" "); ok {
			v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
			return v, err == nil
		}
	}
	return 0, false
}

// refused waits for an agent that must refuse to start, and returns its
// output; it fails the test if the agent still runs after timeout or exits
// with another code than 1.
func refused(t *testing.T, a *agenttest.Agent, timeout time.Duration) string {
	t.Helper()
	timeout = testenv.Timeout(timeout)
	st := a.WaitExit(timeout)
	if st == nil {
		t.Fatalf("the agent (pid %d) still runs %v after start, want it refused; output:\n%s", a.PID(), timeout, a.Log())
	}
	if st.ExitCode() != 1 {
		t.Errorf("the agent exited with %v, want exit code 1", st)
	}
	return a.Log()
}

// TestSecondAgentOnPinDirRefused: a second agent on the pin directory of a
// running one exits at once, naming the first one's PID and host; the first
// keeps its limits (the second's config would have changed them).
func TestSecondAgentOnPinDirRefused(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t)
	first, s, share := e.halfShare(e.configYAML(globalRate, ""), false)

	// The second one's own config: four times the rate.
	other := filepath.Join(e.dir, "other.yaml")
	writeAtomic(t, other, e.configYAML(4*globalRate, ""))
	started := time.Now()
	second := agenttest.StartAgent(t, e.pair.B, rlagentBin, "--config", other)
	out := refused(t, second, 10*time.Second)
	host, _ := os.Hostname()
	t.Logf("the second agent exited %v after start: %s", time.Since(started).Round(time.Millisecond), strings.TrimSpace(out))
	for _, want := range []string{fmt.Sprintf("locked by pid %d on host %s", first.PID(), host), e.pinDir} {
		if !strings.Contains(out, want) {
			t.Errorf("the refusal does not say %q", want)
		}
	}
	if !first.Running() {
		t.Fatalf("the first agent exited")
	}
	if l, _ := e.limit(); l.GlobalRate != globalRate || l.ShareRate != globalRate/2 {
		t.Errorf("after the second agent: status says global %d, share %d; want %d, %d", l.GlobalRate, l.ShareRate, globalRate, globalRate/2)
	}
	e.checkAdmitted("the first agent's limit after the second one's attempt", s, time.Now(), window, share, 0.05)
}

// TestPinDirNotOwnedByRootRefused: an existing pin directory that another
// user owns is refused, naming the owner.
func TestPinDirNotOwnedByRootRefused(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t)
	e.writeCount(1)
	e.writeConfig(e.configYAML(globalRate, ""))
	if err := os.Chown(e.pinDir, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	a := agenttest.StartAgent(t, e.pair.B, rlagentBin, "--config", e.config)
	out := refused(t, a, 10*time.Second)
	t.Logf("refused: %s", strings.TrimSpace(out))
	if !strings.Contains(out, e.pinDir+" is owned by uid 65534, not root") {
		t.Errorf("the refusal does not name the directory and its owner")
	}
	if e.xdpAttached() {
		t.Errorf("XDP attached to %s although the agent refused to start", e.pair.IfB)
	}
}

// TestPinDirNotOnBPFFSRefused: an existing pin directory that is not on a
// BPF filesystem is refused, and nothing is mounted over it.
func TestPinDirNotOnBPFFSRefused(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t)
	plain := filepath.Join(e.dir, "plain")
	if err := os.Mkdir(plain, 0o700); err != nil {
		t.Fatal(err)
	}
	// Registered before the agent starts, so that it runs after the agent
	// stops: what an agent that does mount over it (the old one) leaves.
	t.Cleanup(func() {
		if onBPFFS(plain) {
			exec.Command(rlagentBin, "cleanup", "--pin-dir", plain).Run()
			unix.Unmount(plain, unix.MNT_DETACH)
		}
	})
	e.writeCount(1)
	e.writeConfig(strings.Replace(e.configYAML(globalRate, ""), "pinDir: "+e.pinDir, "pinDir: "+plain, 1))
	a := agenttest.StartAgent(t, e.pair.B, rlagentBin, "--config", e.config)
	out := refused(t, a, 10*time.Second)
	t.Logf("refused: %s", strings.TrimSpace(out))
	if !strings.Contains(out, plain+" exists and is not on a BPF filesystem") {
		t.Errorf("the refusal does not say the directory is not on a BPF filesystem")
	}
	if onBPFFS(plain) {
		t.Errorf("a bpffs was mounted over %s", plain)
	}
}

func onBPFFS(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && st.Type == unix.BPF_FS_MAGIC
}

// deleteVeth deletes the veth pair (deleting one end deletes both).
func (e *env) deleteVeth() {
	e.t.Helper()
	nl, err := e.pair.A.Netlink()
	if err != nil {
		e.t.Fatal(err)
	}
	defer nl.Close()
	l, err := nl.LinkByName(e.pair.IfA)
	if err == nil {
		err = nl.LinkDel(l)
	}
	if err != nil {
		e.t.Fatalf("delete %s: %v", e.pair.IfA, err)
	}
}

// createVeth creates the pair again under the same names, with the same
// addresses and permanent neighbor entries: new interfaces (new indexes,
// new MACs) where the old ones were. It returns when B's end exists.
func (e *env) createVeth() time.Time {
	e.t.Helper()
	p := e.pair
	nlA, err := p.A.Netlink()
	if err != nil {
		e.t.Fatal(err)
	}
	defer nlA.Close()
	nlB, err := p.B.Netlink()
	if err != nil {
		e.t.Fatal(err)
	}
	defer nlB.Close()
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: p.IfA}, PeerName: p.IfB, PeerNamespace: netlink.NsFd(int(p.B.Handle()))}
	if err := nlA.LinkAdd(veth); err != nil {
		e.t.Fatalf("re-create the veth pair: %v", err)
	}
	created := time.Now()
	type end struct {
		nl       *netlink.Handle
		name     string
		a4, a6   netip.Addr
		peer4    netip.Addr
		peer6    netip.Addr
		link     netlink.Link
		peerLink netlink.Link
	}
	ends := []*end{{nl: nlA, name: p.IfA, a4: p.A4, a6: p.A6, peer4: p.B4, peer6: p.B6}, {nl: nlB, name: p.IfB, a4: p.B4, a6: p.B6, peer4: p.A4, peer6: p.A6}}
	for _, x := range ends {
		if x.link, err = x.nl.LinkByName(x.name); err != nil {
			e.t.Fatal(err)
		}
	}
	ends[0].peerLink, ends[1].peerLink = ends[1].link, ends[0].link
	for _, x := range ends {
		for _, a := range []netip.Addr{x.a4, x.a6} {
			addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(map[bool]int{true: 24, false: 64}[a.Is4()], a.BitLen())}}
			if a.Is6() {
				addr.Flags = unix.IFA_F_NODAD
			}
			if err := x.nl.AddrAdd(x.link, addr); err != nil {
				e.t.Fatalf("%s: add %s: %v", x.name, a, err)
			}
		}
		if err := x.nl.LinkSetUp(x.link); err != nil {
			e.t.Fatal(err)
		}
		for _, a := range []netip.Addr{x.peer4, x.peer6} {
			family := unix.AF_INET6
			if a.Is4() {
				family = unix.AF_INET
			}
			if err := x.nl.NeighSet(&netlink.Neigh{LinkIndex: x.link.Attrs().Index, Family: family, State: netlink.NUD_PERMANENT,
				IP: a.AsSlice(), HardwareAddr: x.peerLink.Attrs().HardwareAddr}); err != nil {
				e.t.Fatalf("%s: neighbor %s: %v", x.name, a, err)
			}
		}
	}
	return created
}

// waitXDP polls B's interface until its XDP program is attached (or not,
// want false), for up to timeout, and returns when that was seen.
func (e *env) waitXDP(want bool, timeout time.Duration) (time.Time, bool) {
	e.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		nl, err := e.pair.B.Netlink()
		if err != nil {
			e.t.Fatal(err)
		}
		l, err := nl.LinkByName(e.pair.IfB)
		nl.Close()
		now := time.Now()
		if err == nil && (l.Attrs().Xdp != nil && l.Attrs().Xdp.Attached) == want {
			return now, true
		}
		if now.After(deadline) {
			return now, false
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// statusInterfaceLine runs `rlagent status` (table output) and returns the
// line of the interface table for B's interface; "" if there is none.
func (e *env) statusInterfaceLine() string {
	e.t.Helper()
	out, err := e.rlagent("status", "--pin-dir", e.pinDir)
	if err != nil {
		e.t.Errorf("rlagent status: %v\n%s", err, out)
		return ""
	}
	for line := range strings.SplitSeq(out, "\n") {
		if f := strings.Fields(line); len(f) > 1 && f[0] == e.pair.IfB {
			return line
		}
	}
	return ""
}

// TestInterfaceRecreatedReattached: the agent's interface is deleted and
// re-created (a new veth pair under the same names); the agent attaches to
// the new interface within 1 s and the limit holds again, measured with
// real packets.
func TestInterfaceRecreatedReattached(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t)
	_, s, share := e.halfShare(e.configYAML(globalRate, ""), false)
	e.checkAdmitted("before", s, time.Now(), time.Second, share, 0.05)

	for round := 1; round <= 3; round++ {
		e.deleteVeth()
		time.Sleep(300 * time.Millisecond) // the interface is away for a while
		if line := e.statusInterfaceLine(); !strings.Contains(line, "missing") {
			t.Errorf("round %d: with the interface deleted, rlagent status says %q, want it missing", round, line)
		}
		created := e.createVeth()
		attached, ok := e.waitXDP(true, 3*time.Second)
		took := attached.Sub(created)
		t.Logf("round %d: XDP on the new %s %v after it was created", round, e.pair.IfB, took.Round(time.Millisecond))
		if !ok {
			// Go on: the traffic shows what that means.
			t.Errorf("round %d: no XDP program on the re-created %s 3 s after it was created", round, e.pair.IfB)
		} else if took > time.Second {
			t.Errorf("round %d: re-attached after %v, want within 1 s", round, took)
		}
		if line := e.statusInterfaceLine(); !strings.Contains(line, "attached") || !strings.Contains(line, "native") {
			t.Errorf("round %d: after re-attaching, rlagent status says %q, want it attached (native)", round, line)
		}
		// The limit holds on the new interface.
		e.checkAdmitted(fmt.Sprintf("round %d: after re-attaching", round), s, attached.Add(settle), window, share, 0.05)
		if t.Failed() {
			return
		}
	}
}

// TestReadinessTellsTheTruth: /healthz and /readyz answer 503, naming the
// interface, while the agent's interface is gone (metrics say attached 0),
// and 200 again once it is back; a count file that cannot be read makes the
// count stale, which /readyz notes but which does not make the agent unready.
func TestReadinessTellsTheTruth(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t)
	e.writeCount(2)
	e.writeConfig(withMetrics(e.configYAML(globalRate, "")))
	a := e.startAgent()
	// startAgent returns on the attach; the listener comes up after it.
	if !a.WaitLog(5*time.Second, "msg=ready") {
		t.Fatalf("the agent did not log ready within 5 s")
	}
	series := fmt.Sprintf(`rlagent_interface_attached{hook="xdp",interface=%q,mode="native",program="uplink-in"}`, e.pair.IfB)

	for _, path := range []string{"/healthz", "/readyz"} {
		if code, body := e.get(path); code != 200 || !strings.HasPrefix(body, "ok") {
			t.Errorf("%s with everything attached: %d %q", path, code, body)
		}
	}
	if code, body := e.get("/livez"); code != 200 {
		t.Errorf("/livez: %d %q", code, body)
	}
	if _, body := e.get("/metrics"); !has(body, series, 1) || !has(body, "rlagent_ready", 1) {
		t.Errorf("metrics with everything attached lack %s 1 or rlagent_ready 1", series)
	}

	e.deleteVeth()
	deleted := time.Now()
	var code int
	var body string
	for {
		code, body = e.get("/healthz")
		if code != 200 || time.Since(deleted) > 2*time.Second {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("interface deleted: /healthz %d after %v:\n%s", code, time.Since(deleted).Round(time.Millisecond), body)
	if code != 503 || !strings.Contains(body, "interface xdp "+e.pair.IfB+": missing") {
		t.Errorf("with the interface deleted: /healthz %d, want 503 naming the interface:\n%s", code, body)
	}
	if time.Since(deleted) > time.Second {
		t.Errorf("/healthz took %v to see the interface gone, want within 1 s", time.Since(deleted))
	}
	if code, _ := e.get("/readyz"); code != 503 {
		t.Errorf("/readyz %d with the interface deleted, want 503", code)
	}
	if code, _ := e.get("/livez"); code != 200 {
		t.Errorf("/livez %d with the interface deleted, want 200 (the agent is alive)", code)
	}
	_, metrics := e.get("/metrics")
	if !has(metrics, fmt.Sprintf(`rlagent_interface_attached{hook="xdp",interface=%q,mode="",program="uplink-in"}`, e.pair.IfB), 0) || !has(metrics, "rlagent_ready", 0) {
		t.Errorf("metrics with the interface deleted do not say attached 0, ready 0:\n%s", grep(metrics, "rlagent_interface_attached", "rlagent_ready"))
	}

	created := e.createVeth()
	for {
		code, body = e.get("/readyz")
		if code == 200 || time.Since(created) > 2*time.Second {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("interface re-created: /readyz %d after %v", code, time.Since(created).Round(time.Millisecond))
	if code != 200 {
		t.Errorf("/readyz %d 2 s after the interface came back, want 200:\n%s", code, body)
	}

	// The count file turns unreadable: stale, reported, still ready.
	if err := os.Remove(e.count); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(e.count, 0o700); err != nil { // a directory: unreadable as a count
		t.Fatal(err)
	}
	stale := time.Now()
	for {
		code, body = e.get("/readyz")
		if strings.Contains(body, "note:") || time.Since(stale) > 5*time.Second {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("count file unreadable: /readyz %d after %v:\n%s", code, time.Since(stale).Round(time.Millisecond), body)
	if code != 200 || !strings.Contains(body, "note: limit "+limitName+": count source unreadable, the last good count (2) stands") {
		t.Errorf("with a stale count: /readyz %d, want 200 with a note on the stale count:\n%s", code, body)
	}
	_, metrics = e.get("/metrics")
	if !has(metrics, fmt.Sprintf(`rlagent_limit_observation_stale{limit=%q,scope="file"}`, limitName), 1) || !has(metrics, "rlagent_ready", 1) {
		t.Errorf("metrics with a stale count do not say stale 1, ready 1:\n%s", grep(metrics, "rlagent_limit_observation_stale", "rlagent_ready"))
	}
	if l, _ := e.limit(); !l.Stale || l.Replicas != 2 {
		t.Errorf("status with a stale count: stale %v, replicas %d; want true, 2", l.Stale, l.Replicas)
	}
}

func has(metrics, series string, want float64) bool {
	v, ok := metric(metrics, series)
	return ok && v == want
}

// grep returns the lines of s that start with one of prefixes.
func grep(s string, prefixes ...string) string {
	var out []string
	for line := range strings.SplitSeq(s, "\n") {
		if slices.ContainsFunc(prefixes, func(p string) bool { return strings.HasPrefix(line, p) }) {
			out = append(out, line)
		}
	}
	return strings.Join(out, "\n")
}

// TestReloadWithMissingInterfaceRejectedWhole: a new config whose new
// interface does not exist is rejected whole: its new rate is not applied,
// the old limit keeps being enforced, the rejection is logged and counted.
func TestReloadWithMissingInterfaceRejectedWhole(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t)
	a, s, share := e.halfShare(withMetrics(e.configYAML(globalRate, "")), false)

	const missing = "rlnosuch0"
	written := time.Now()
	bad := strings.Replace(e.configYAML(2*globalRate, ""), "interfaces: ["+e.pair.IfB+"]", "interfaces: ["+e.pair.IfB+", "+missing+"]", 1)
	e.writeConfig(withMetrics(bad))
	if !a.WaitLog(3*time.Second, "config rejected") {
		t.Fatalf("the agent did not reject the config within 3 s")
	}
	line := a.LastLogLine("config rejected")
	t.Logf("rejected %v after the write: %s", time.Since(written).Round(time.Millisecond), line)
	if !strings.Contains(line, missing) {
		t.Errorf("the rejection does not name %s", missing)
	}
	if l, _ := e.limit(); l.GlobalRate != globalRate || l.ShareRate != globalRate/2 {
		t.Errorf("after the rejected config, status says global %d, share %d; want %d, %d (the old config)",
			l.GlobalRate, l.ShareRate, globalRate, globalRate/2)
	}
	e.checkAdmitted("after the rejected config", s, written.Add(200*time.Millisecond), window, share, 0.05)
	_, metrics := e.get("/metrics")
	if !has(metrics, "rlagent_config_reload_errors_total", 1) || !has(metrics, "rlagent_config_reloads_total", 0) {
		t.Errorf("metrics do not count one rejection and no reload:\n%s", grep(metrics, "rlagent_config_reload"))
	}
	if code, body := e.get("/readyz"); code != 200 {
		t.Errorf("/readyz %d after a rejected reload (the old config is in force), want 200:\n%s", code, body)
	}
	if !e.xdpAttached() || !a.Running() {
		t.Fatalf("after the rejected config: XDP attached %v, agent running %v", e.xdpAttached(), a.Running())
	}
}

// TestIPNetnsExecPins: started as a user starts a program in a network
// namespace (`ip netns exec`, which gives it a private mount namespace and
// a fresh /sys without the host's bpffs), the agent refuses a pin directory
// under /sys/fs/bpf, where it would have to mount a bpffs that dies with it,
// and says how to run it. With --ephemeral-pins it runs, and indeed its
// data path goes when it is killed. With the pins on a bpffs mounted
// outside /sys (which `ip netns exec` leaves in place), it runs without the
// flag and a SIGKILL leaves the limit enforced, with no unlimited moment.
func TestIPNetnsExecPins(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t)
	e.writeCount(2)
	underSys := fmt.Sprintf("/sys/fs/bpf/rlagent-e2e-%d", os.Getpid())
	sysConfig := filepath.Join(e.dir, "sys.yaml")
	writeAtomic(t, sysConfig, strings.Replace(e.configYAML(globalRate, ""), "pinDir: "+e.pinDir, "pinDir: "+underSys, 1))
	share := float64(globalRate / 2)

	t.Run("refused", func(t *testing.T) {
		a, via := agenttest.StartAgentIPNetnsExec(t, e.pair.B, rlagentBin, "--config", sysConfig)
		out := refused(t, a, 10*time.Second)
		t.Logf("via %s: %s", via, strings.TrimSpace(out))
		for _, want := range []string{underSys, "would not outlive it", "mount namespace", "--ephemeral-pins", "/sys/fs/bpf"} {
			if !strings.Contains(out, want) {
				t.Errorf("the refusal does not say %q", want)
			}
		}
		if e.xdpAttached() {
			t.Errorf("XDP attached although the agent refused to start")
		}
	})

	t.Run("ephemeral", func(t *testing.T) {
		a, via := agenttest.StartAgentIPNetnsExec(t, e.pair.B, rlagentBin, "--config", sysConfig, "--ephemeral-pins")
		a.WaitAttached(agenttest.AttachTimeout)
		t.Logf("via %s: the agent runs with --ephemeral-pins", via)
		s := e.startSender(2*share, false)
		time.Sleep(settle)
		e.checkAdmitted("ephemeral pins, agent running", s, time.Now(), time.Second, share, 0.05)
		a.Stop(syscall.SIGKILL, 5*time.Second)
		killed := time.Now()
		// What the refusal prevents: the pins and the link die with the
		// agent's mount namespace, and the traffic passes unlimited
		// (3-9 ms later in a 6.1 VM). The namespace dies with the agent
		// only if no thread of this test holds it: nettest's launcher
		// unshares it in the agent's process (NS.StartIPNetnsExec; a
		// thread of this process that did it once stayed behind in it,
		// and the link with it, for the rest of a VM's suite).
		gone, ok := e.waitXDP(false, ephemeralLinkWait())
		t.Logf("SIGKILL: the XDP program went %v later (the bpffs died with the agent's mount namespace)", gone.Sub(killed).Round(time.Millisecond))
		if !ok {
			t.Fatalf("XDP still attached %v after the ephemeral agent was killed", ephemeralLinkWait())
		}
		e.checkUnlimited("ephemeral pins, agent killed", s, gone.Add(100*time.Millisecond), time.Second)
		s.Stop()
	})

	t.Run("host bpffs outside /sys", func(t *testing.T) {
		// The killed ephemeral agent's link must be gone first: the
		// agent never replaces another program's XDP.
		if _, ok := e.waitXDP(false, ephemeralLinkWait()); !ok {
			t.Fatalf("the ephemeral agent's XDP program is still attached %v after its kill", ephemeralLinkWait())
		}
		e.writeConfig(e.configYAML(globalRate, "")) // pinDir: the test's bpffs, on a temporary directory
		a, via := agenttest.StartAgentIPNetnsExec(t, e.pair.B, rlagentBin, "--config", e.config)
		a.WaitAttached(agenttest.AttachTimeout)
		t.Logf("via %s: the agent runs with its pins on %s", via, e.pinDir)
		s := e.startSender(2*share, false)
		time.Sleep(settle + 500*time.Millisecond) // the burst spent before the bins below
		a.Stop(syscall.SIGKILL, 5*time.Second)
		killed := time.Now()
		if !e.xdpAttached() {
			t.Errorf("no XDP program after the agent was killed")
		}
		// 100 ms bins from 1 s before the kill to 2 s after: none above the
		// share's tenth plus the burst.
		from, to := killed.Add(-time.Second), killed.Add(2*time.Second)
		sleepUntil(to.Add(late))
		bins := e.recv.Got().Series(from, to, 100*time.Millisecond)
		bound := (share/10 + float64(globalRate/10/2)) * 1.1
		t.Logf("admitted per 100 ms around the SIGKILL: %v (bound %.0f)", bins, bound)
		for i, n := range bins {
			if float64(n) > bound {
				t.Errorf("%d packets admitted in the 100 ms from %v after the kill, more than %.0f",
					n, from.Add(time.Duration(i)*100*time.Millisecond).Sub(killed).Round(time.Millisecond), bound)
			}
		}
		e.checkAdmitted("host bpffs, agent killed", s, killed.Add(200*time.Millisecond), 2*time.Second, share, 0.05)
	})
}

// ephemeralLinkWait is how long the kernel may take to free the XDP link
// of a killed agent whose pins were in its own mount namespace, an RCU
// grace period and a work item after its bpffs: 3 s, and 20 s under make
// vmtest's emulation (see TestIPNetnsExecPins).
func ephemeralLinkWait() time.Duration {
	if os.Getenv(testenv.VMTestEnv) == "1" {
		return 20 * time.Second
	}
	return 3 * time.Second
}
