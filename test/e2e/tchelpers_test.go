package e2e

import (
	"bufio"
	"bytes"
	"fmt"
	"math"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/rlagent/rlagent/agent"
	"github.com/rlagent/rlagent/internal/agenttest"
	"github.com/rlagent/rlagent/internal/bpftest"
	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
	"github.com/rlagent/rlagent/maps"
)

// Helpers of the fan-out, connections, XDP coexistence and redirect-peer
// tests: a topology with the agent in its node namespace (a rig), paced UDP
// streams measured at their receivers, the agent's counters over a window,
// a paced TCP stream, and the foreign BPF programs the tests load with
// cilium/ebpf's asm (an XDP program that counts and passes, a TC program
// that hands packets to a pod with bpf_redirect_peer).

// rigWindow is how long each rate is measured, once the burst is spent.
const rigWindow = 3 * time.Second

// rigTol is the tolerance of every measured rate: 5% of its share.
const rigTol = 0.05

// rig is a nettest topology with the agent in its node namespace, its
// uplink the config's one interface, a count of 2 (every share is half the
// global rate), metrics on the node's loopback.
type rig struct {
	t      *testing.T
	topo   *nettest.Topology
	dir    string
	pinDir string
	config string
	agent  *agenttest.Agent
}

func newRig(t *testing.T, cfg nettest.TopologyConfig) *rig {
	t.Helper()
	testenv.RequireRoot(t)
	r := &rig{t: t, topo: nettest.MustTopology(t, cfg), dir: t.TempDir()}
	r.pinDir = filepath.Join(r.dir, "bpf")
	r.config = filepath.Join(r.dir, "rlagent.yaml")
	return r
}

// rigCount is the static count of every rig: shares are half the global
// rates.
const rigCount = 2

// writeConfig writes the config: settings are top-level lines (such as
// "xdpFallback: tc\n"), limits the entries under limits:.
func (r *rig) writeConfig(settings, limits string) {
	r.t.Helper()
	writeAtomic(r.t, r.config, fmt.Sprintf(`interfaces: [%s]
pinDir: %s
metricsAddress: "%s"
count:
  static: %d
%slimits:
%s`, nettest.UplinkIf, r.pinDir, metricsAddr, rigCount, settings, limits))
}

// launch mounts the pin directory (its Cleanup runs `rlagent cleanup`, so
// call launch after starting anything the cleanup needs, such as a pod's
// namespace holder) and starts `rlagent run` in the node without waiting.
func (r *rig) launch(settings, limits string) *agenttest.Agent {
	r.t.Helper()
	agenttest.PinDir(r.t, rlagentBin, r.pinDir)
	r.writeConfig(settings, limits)
	r.agent = agenttest.StartAgent(r.t, r.topo.Node, rlagentBin, "--config", r.config, "--log-level", "debug")
	return r.agent
}

// start launches the agent and waits until it is ready: its hooks are
// attached, wherever they went (an XDP fallback logs no XDP attach, so
// agenttest's WaitAttached does not fit), and the first reconcile wrote
// the limits.
func (r *rig) start(settings, limits string) *agenttest.Agent {
	r.t.Helper()
	a := r.launch(settings, limits)
	timeout := testenv.Timeout(agenttest.AttachTimeout)
	if !a.WaitLog(timeout, "msg=ready") {
		r.t.Fatalf("rlagent run (pid %d) was not ready within %v; output:\n%s", a.PID(), timeout, a.Log())
	}
	return a
}

// hook is one line of the agent's interface table, as rlagent status shows
// it: "tc-egress vr-be endpoint-in".
func hookLine(s agent.InterfaceStatus) string { return s.Hook + " " + s.Name + " " + s.Program }

// waitHooks waits until rlagent's interface table (agent.ReadAgentStatus,
// what `rlagent status` prints) shows every hook in want attached, and
// returns the table.
func (r *rig) waitHooks(want ...string) []agent.InterfaceStatus {
	r.t.Helper()
	timeout := testenv.Timeout(5 * time.Second)
	deadline := time.Now().Add(timeout)
	for {
		st, err := r.hooks()
		missing := ""
		for _, w := range want {
			if err != nil || !slices.ContainsFunc(st, func(s agent.InterfaceStatus) bool {
				return s.State == agent.StateAttached && hookLine(s) == w
			}) {
				missing = w
				break
			}
		}
		if missing == "" {
			return st
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("no attached %q %v after the agent started: %+v (%v)", missing, timeout, st, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// hooks reads rlagent's interface table where `rlagent status` runs on a
// node: in the agent's network namespace, where a clsact filter's
// interface can be looked up (kernels before 6.6 have no tcx link to ask).
func (r *rig) hooks() ([]agent.InterfaceStatus, error) {
	var st agent.AgentStatus
	err := r.topo.Node.Do(func() (err error) {
		st, err = agent.ReadAgentStatus(r.pinDir)
		return err
	})
	return st.Interfaces, err
}

// rlagent runs rlagent with args in the node, where an operator runs it
// on a node: in the agent's network namespace (a clsact filter's interface
// is looked up there). It returns the output and fails the test on an
// error.
func (r *rig) rlagent(args ...string) string {
	r.t.Helper()
	var out bytes.Buffer
	cmd := exec.Command(rlagentBin, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := r.topo.Node.Start(cmd); err != nil {
		r.t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		r.t.Fatalf("rlagent %s: %v\n%s", strings.Join(args, " "), err, out.String())
	}
	return out.String()
}

// limit is the status of one limit, read now.
func (r *rig) limit(name string) agent.LimitStatus {
	r.t.Helper()
	return r.counters().limit(r.t, name)
}

// window reads the agent's counters at from and at to, then waits until
// after to (what was sent before to has arrived then).
//
// The counters at the window's ends are read in this process, straight
// from the pins with a read-only maps.Reader, and timed to the
// microsecond; `rlagent status` then adds the rest of each limit's status.
// The status command's own read could not be timed as well: under make
// vmtest's emulation it takes long and uneven, and a guess at its time was
// off by 170 ms in a 3 s window.
func (r *rig) window(from, to time.Time, after time.Duration) (counters, counters) {
	r.t.Helper()
	rd, err := maps.OpenPinned(r.pinDir)
	if err != nil {
		r.t.Fatal(err)
	}
	defer rd.Close()
	ids := r.counters()
	sleepUntil(from)
	c0 := r.exact(rd, ids)
	sleepUntil(to)
	c1 := r.exact(rd, ids)
	sleepUntil(to.Add(after))
	return c0, c1
}

// exact reads the counters of the limits in like now, through rd, and
// returns them in the status read next.
func (r *rig) exact(rd *maps.Reader, like counters) counters {
	r.t.Helper()
	totals := make(map[string]maps.Stats, len(like.limits))
	t0 := time.Now()
	for name, s := range like.limits {
		st, err := rd.Stats(s.ID)
		if err != nil {
			r.t.Fatalf("counters of %s: %v", name, err)
		}
		totals[name] = st
	}
	at := t0.Add(time.Since(t0) / 2)
	c := r.counters()
	c.at = at
	for name, st := range totals {
		s := c.limit(r.t, name)
		s.Totals = st
		c.limits[name] = s
	}
	return c
}

// counters is the agent's per-limit counters at one time, read with
// `rlagent status --output json`.
type counters struct {
	at     time.Time
	limits map[string]agent.LimitStatus
}

func (r *rig) counters() counters {
	r.t.Helper()
	st, at := agenttest.Status[[]agent.LimitStatus](r.t, rlagentBin, r.pinDir)
	c := counters{at: at, limits: make(map[string]agent.LimitStatus)}
	for _, s := range st {
		c.limits[s.Name] = s
	}
	return c
}

// limit is a limit's status in c; it fails the test if there is none.
func (c counters) limit(t *testing.T, name string) agent.LimitStatus {
	t.Helper()
	s, ok := c.limits[name]
	if !ok {
		t.Fatalf("rlagent status has no limit %q", name)
	}
	return s
}

// counterRate is a counter's rate between two readings, per second.
func counterRate(t *testing.T, from, to counters, name string, field func(maps.Stats) uint64) float64 {
	t.Helper()
	a, b := from.limit(t, name).Totals, to.limit(t, name).Totals
	return float64(field(b)-field(a)) / to.at.Sub(from.at).Seconds()
}

// The counters a test reads.
func admittedPackets(s maps.Stats) uint64 { return s.AdmittedPackets }
func droppedPackets(s maps.Stats) uint64  { return s.DroppedPackets }
func admittedBytes(s maps.Stats) uint64   { return s.AdmittedBytes }
func shadowBytes(s maps.Stats) uint64     { return s.ShadowBytes }
func shadowPackets(s maps.Stats) uint64   { return s.ShadowPackets }

// checkNear fails t unless got is want within tol (a fraction of want),
// and logs both.
func checkNear(t *testing.T, what string, got, want, tol float64, unit string) {
	t.Helper()
	t.Logf("%s: %.0f %s, want %.0f (%+.2f%%)", what, got, unit, want, pct(got, want))
	if math.Abs(got-want) > tol*want {
		t.Errorf("%s: %.0f %s, want %.0f +-%.0f%%", what, got, unit, want, tol*100)
	}
}

// stream is a paced UDP sender from one namespace and a receiver in
// another, on a port of its own.
type stream struct {
	name string
	send *nettest.Sender
	recv *nettest.Receiver
	// stop stops the sender and closes both sockets; it is idempotent.
	stop func()
}

// startStream starts a receiver on [::]:dst.Port() in to (it takes IPv4
// and IPv6) and a sender from from to dst at rate pkt/s with size-byte
// payloads, for at most span. Cleanup stops both.
func startStream(t *testing.T, name string, from *nettest.NS, dst netip.AddrPort, to *nettest.NS, rate float64,
	size int, span time.Duration) *stream {
	t.Helper()
	return startFlow(t, flow{name: name, from: from, to: dst, recv: to, port: dst.Port()}, rate, size, span)
}

// flow is one path: UDP from a namespace to an address and port, received
// in another namespace on a port of its own (another than the sender's
// with DNAT).
type flow struct {
	name string
	from *nettest.NS
	to   netip.AddrPort // what the sender addresses (a service address for DNAT)
	recv *nettest.NS    // where it is received
	port uint16         // the receiving socket's port
}

// startFlow starts a receiver on [::]:f.port in f.recv and a sender from
// f.from to f.to at rate pkt/s with size-byte payloads, for at most span.
// stop or Cleanup stops both.
func startFlow(t *testing.T, f flow, rate float64, size int, span time.Duration) *stream {
	t.Helper()
	conn, err := f.recv.ListenUDP("udp", netip.AddrPortFrom(netip.IPv6Unspecified(), f.port), 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	recv := nettest.StartReceiver(conn, nettest.ReceiverConfig{Span: span + time.Minute})
	t.Cleanup(func() { recv.Close() })
	out, err := f.from.DialUDP(f.to)
	if err != nil {
		t.Fatal(err)
	}
	send, err := nettest.StartSender(out, nettest.SenderConfig{Rate: rate, Count: int64(rate*span.Seconds()) + 10,
		Duration: span, Size: size})
	if err != nil {
		out.Close()
		t.Fatal(err)
	}
	s := &stream{name: f.name, send: send, recv: recv}
	s.stop = func() {
		send.Stop()
		out.Close()
		recv.Close()
	}
	t.Cleanup(s.stop)
	return s
}

// check checks that the stream's receiver got want pkt/s +-5% in [from,
// to) (by send time), out of an offer clearly above it, and returns what
// it got. Call it once the window has passed (and `late` after).
func (s *stream) check(t *testing.T, from, to time.Time, want float64) float64 {
	t.Helper()
	got, offered := s.recv.Got().Rate(from, to), s.send.Sent().Rate(from, to)
	// Against what a bucket of the share admits of what was sent: the
	// share while the sender keeps up (checkAdmitted).
	bucket := s.bucket(from, to, want)
	checkNear(t, s.name+": received", got, bucket, rigTol,
		fmt.Sprintf("pkt/s (offered %.0f; share %.0f, %+.2f%%)", offered, want, pct(got, want)))
	if offered < 1.3*want {
		t.Errorf("%s: the sender offered only %.0f pkt/s against a share of %.0f: the machine is too busy to measure",
			s.name, offered, want)
	}
	return got
}

// bucket is the rate a bucket of rate (burst a tenth of it) admits of what
// s sent in [from, to): see bucketAdmits.
func (s *stream) bucket(from, to time.Time, rate float64) float64 {
	return bucketAdmits(s.send.Sent(), rate, rate/10, from, to)
}

// checkAll checks that the receiver got everything offered in [from, to).
func (s *stream) checkAll(t *testing.T, from, to time.Time) {
	t.Helper()
	got, offered := s.recv.Got().Count(from, to), s.send.Sent().Count(from, to)
	t.Logf("%s: %d of %d offered packets arrived (%.0f pkt/s)", s.name, got, offered, s.recv.Got().Rate(from, to))
	if offered == 0 || got != offered {
		t.Errorf("%s: %d of %d offered packets arrived, want all", s.name, got, offered)
	}
}

// frameLen is the Ethernet frame of a UDP datagram of size payload bytes:
// what a bytes limit charges for it.
func frameLen(size int, ipv6 bool) int {
	if ipv6 {
		return 14 + 40 + 8 + size
	}
	return 14 + 20 + 8 + size
}

func family(ipv6 bool) string {
	if ipv6 {
		return "ipv6"
	}
	return "ipv4"
}

// tcpCounter reads one counter of the Tcp: line of a namespace's
// /proc/net/snmp (IPv4 and IPv6 together), such as RetransSegs.
func tcpCounter(t *testing.T, ns *nettest.NS, name string) uint64 {
	t.Helper()
	var v uint64
	err := ns.Do(func() error {
		f, err := os.Open("/proc/thread-self/net/snmp")
		if err != nil {
			return err
		}
		defer f.Close()
		var head []string
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			if len(fields) == 0 || fields[0] != "Tcp:" {
				continue
			}
			if head == nil {
				head = fields
				continue
			}
			for i := 1; i < len(fields) && i < len(head); i++ {
				if head[i] == name {
					v, err = strconv.ParseUint(fields[i], 10, 64)
					return err
				}
			}
		}
		return fmt.Errorf("no Tcp %s in /proc/net/snmp", name)
	})
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// metricLines are the samples of a metric in a /metrics body, one line
// each (name{labels} value).
func metricLines(body, name string) []string {
	var out []string
	for line := range strings.SplitSeq(body, "\n") {
		if strings.HasPrefix(line, name+"{") || strings.HasPrefix(line, name+" ") {
			out = append(out, line)
		}
	}
	return out
}

// xdpCounterName is the foreign XDP program's name as the kernel knows it:
// what a message that names the holder of the hook shows.
const xdpCounterName = "fgn_xdp_count"

// tcIngressProgs describes what runs at ifname's TC ingress in ns: the
// programs of its tcx hook ("tcx program ID"; kernels with tcx) and the bpf
// filters of its clsact qdisc ("clsact filter NAME"; any kernel).
func tcIngressProgs(t *testing.T, ns *nettest.NS, ifname string) []string {
	t.Helper()
	var out []string
	for _, id := range bpftest.TCXPrograms(t, ns, ifname, ebpf.AttachTCXIngress) {
		out = append(out, fmt.Sprintf("tcx program %d", id))
	}
	if slices.Contains(bpftest.Qdiscs(t, ns, ifname), "clsact") {
		for _, f := range bpftest.BPFFilters(t, ns, ifname, netlink.HANDLE_MIN_INGRESS) {
			out = append(out, "clsact filter "+f.Name)
		}
	}
	return out
}

// xdpLinkOf is the ID of the bpf_link that holds program prog on an XDP
// hook; it fails the test if there is none.
func xdpLinkOf(t *testing.T, prog ebpf.ProgramID) uint32 {
	t.Helper()
	it := new(link.Iterator)
	defer it.Close()
	for it.Next() {
		if info, err := it.Link.Info(); err == nil && info.XDP() != nil && info.Program == prog {
			return uint32(info.ID)
		}
	}
	if err := it.Err(); err != nil {
		t.Fatalf("list links: %v", err)
	}
	t.Fatalf("no bpf_link holds XDP program %d", prog)
	return 0
}
