package e2e

import (
	"fmt"
	"math"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/rlagent/rlagent/agent"
	"github.com/rlagent/rlagent/internal/agenttest"
	"github.com/rlagent/rlagent/internal/nettest"
)

// globalRate is the limit every privileged test starts with, in pkt/s over
// all replicas: counts 1, 2 and 4 give shares of 8000, 4000 and 2000, and the
// sender offers twice the share. $RLAGENT_E2E_GLOBAL_RATE sets another (a
// multiple of 40, so that every share and burst divides exactly), for a
// machine that cannot send 16,000 pkt/s, such as a VM in software emulation.
var globalRate uint64 = 8000

// The limit: udp/53 in one bucket.
const (
	limitName = "dns"
	port      = 53
	// senderSpan bounds every sender of a test in time; senderMax in count.
	senderSpan = 60 * time.Second
	senderMax  = 2_000_000
)

// env is one test's world: two namespaces joined by veth (the client in A,
// the agent's interface in B), a private bpffs for the pins, a config file
// and a count file, and a receiver on B's udp/53 counting what the data path
// admitted.
type env struct {
	t      testing.TB
	pair   *nettest.Pair
	dir    string
	pinDir string
	pinFS  *agenttest.Pins
	config string
	count  string
	recv   *nettest.Receiver
}

func newEnv(t testing.TB) *env {
	t.Helper()
	e := &env{t: t, dir: t.TempDir()}
	e.pinDir = filepath.Join(e.dir, "bpf")
	e.config = filepath.Join(e.dir, "rlagent.yaml")
	e.count = filepath.Join(e.dir, "replicas")
	e.pair = nettest.MustPair(t, nettest.PairConfig{NameA: "client", NameB: "agent", IfA: "veth-client", IfB: "veth-agent"})

	// A private bpffs that the agent (same mount namespace) and the test
	// both see. Unmounting it removes whatever pins are left.
	e.pinFS = agenttest.PinDir(t, rlagentBin, e.pinDir)

	// One dual-stack socket receives IPv4 and IPv6.
	conn, err := e.pair.B.ListenUDP("udp", netip.AddrPortFrom(netip.IPv6Unspecified(), port), 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	e.recv = nettest.StartReceiver(conn, nettest.ReceiverConfig{Span: 2 * time.Minute})
	t.Cleanup(func() { e.recv.Close() })
	return e
}

// configYAML is a config with the one limit at rate (global pkt/s), and
// extra lines for it.
func (e *env) configYAML(rate uint64, extra string) string {
	return fmt.Sprintf(`interfaces: [%s]
pinDir: %s
metricsAddress: "off"
count:
  file: %s
limits:
  - name: %s
    rate: %d
    match:
      protocol: udp
      dstPorts: ["%d"]
%s`, e.pair.IfB, e.pinDir, e.count, limitName, rate, port, extra)
}

func (e *env) writeConfig(yaml string) { e.t.Helper(); writeAtomic(e.t, e.config, yaml) }

func (e *env) writeCount(n int) { e.t.Helper(); writeAtomic(e.t, e.count, fmt.Sprintf("%d\n", n)) }

// writeAtomic replaces path by rename, so the agent never reads half a file.
func writeAtomic(t testing.TB, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// startSender starts a paced sender from A to B's udp/53 over IPv4 or IPv6.
// It stops by itself after senderSpan or senderMax packets, and in cleanup.
func (e *env) startSender(rate float64, ipv6 bool) *nettest.Sender {
	e.t.Helper()
	dst := e.pair.B4
	if ipv6 {
		dst = e.pair.B6
	}
	conn, err := e.pair.A.DialUDP(netip.AddrPortFrom(dst, port))
	if err != nil {
		e.t.Fatal(err)
	}
	s, err := nettest.StartSender(conn, nettest.SenderConfig{Rate: rate, Count: senderMax, Duration: senderSpan})
	if err != nil {
		conn.Close()
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() {
		s.Stop()
		conn.Close()
	})
	return s
}

// startAgent runs `rlagent run` in B and waits until it has attached (or
// adopted) the data path. Cleanup stops it: SIGTERM, then SIGKILL after 5 s.
// halfShare sets the usual scene: a count of 2 (the share is half the
// global rate), the agent started on config, and a sender at twice the
// share, settled. It returns the agent, the sender and the share.
func (e *env) halfShare(config string, ipv6 bool) (*agenttest.Agent, *nettest.Sender, float64) {
	e.t.Helper()
	e.writeCount(2)
	e.writeConfig(config)
	a := e.startAgent()
	share := float64(globalRate / 2)
	s := e.startSender(2*share, ipv6)
	time.Sleep(settle)
	return a, s, share
}

func (e *env) startAgent() *agenttest.Agent {
	e.t.Helper()
	a := agenttest.StartAgent(e.t, e.pair.B, rlagentBin, "--config", e.config, "--log-level", "debug")
	a.WaitAttached(agenttest.AttachTimeout)
	return a
}

// rlagent runs the binary under test in the host namespace.
func (e *env) rlagent(args ...string) (string, error) {
	out, err := exec.Command(rlagentBin, args...).CombinedOutput()
	return string(out), err
}

// status runs `rlagent status --output json` and returns the limits, and
// when it ran (the middle of the command's run).
func (e *env) status() ([]agent.LimitStatus, time.Time) {
	e.t.Helper()
	return agenttest.Status[[]agent.LimitStatus](e.t, rlagentBin, e.pinDir)
}

// limit is the status of the test's limit.
func (e *env) limit() (agent.LimitStatus, time.Time) {
	e.t.Helper()
	st, at := e.status()
	for _, s := range st {
		if s.Name == limitName {
			return s, at
		}
	}
	e.t.Fatalf("rlagent status has no limit %q: %+v", limitName, st)
	return agent.LimitStatus{}, at
}

// waitShare polls status until the limit's share is want, for up to
// timeout, and returns how long that took from since.
func (e *env) waitShare(want uint64, since time.Time, timeout time.Duration) (time.Duration, agent.LimitStatus) {
	e.t.Helper()
	for {
		s, at := e.limit()
		if s.ShareRate == want {
			return at.Sub(since), s
		}
		if time.Since(since) > timeout {
			e.t.Fatalf("share still %d pkt/s (replicas %d, global %d) %s after the change; want %d",
				s.ShareRate, s.Replicas, s.GlobalRate, timeout, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func sleepUntil(t time.Time) { time.Sleep(time.Until(t)) }

// late is how long after a window's end the test waits before counting it:
// the last admitted packets are still on their way to the receiver.
const late = 100 * time.Millisecond

// checkAdmitted waits for the window [from, from+d) to pass and checks that
// the receiver's rate in it is want within +-tol (a fraction). The sender
// must have offered clearly more than want, or the window proves nothing.
func (e *env) checkAdmitted(what string, s *nettest.Sender, from time.Time, d time.Duration, want, tol float64) float64 {
	e.t.Helper()
	to := from.Add(d)
	sleepUntil(to.Add(late))
	got := e.recv.Got().Rate(from, to)
	offered := s.Sent().Rate(from, to)
	// What a bucket of the share admits of what the sender really sent:
	// the share itself while the sender keeps up; less where it stalled
	// for longer than the burst lasts, whose tokens went to waste.
	bucket := bucketAdmits(s.Sent(), want, want/10, from, to)
	e.t.Logf("%s: admitted %.0f pkt/s over %s, share %.0f (%+.2f%%), offered %.0f, a bucket of the share admits %.0f of it",
		what, got, d, want, pct(got, want), offered, bucket)
	if offered < want*1.3 {
		e.t.Errorf("%s: the sender offered only %.0f pkt/s against a share of %.0f: the machine is too busy to measure", what, offered, want)
	}
	if math.Abs(got-bucket) > tol*want {
		e.t.Errorf("%s: admitted %.0f pkt/s, want %.0f +-%.0f%% of the share %.0f (a bucket of it, on what was sent)",
			what, got, bucket, tol*100, want)
	}
	return got
}

// bucketAdmits is the rate (pkt/s) a token bucket of rate and burst (the
// agent's default: a tenth of a second's rate) admits over [from, to), cut
// at the bins' boundaries, of the packets counted in sent. The bucket starts
// full a second before from, as a limit's does: the tests offer at least
// 1.3 times the rate, which empties it within a burst's time unless the
// sender stalls.
func bucketAdmits(sent *nettest.Bins, rate, burst float64, from, to time.Time) float64 {
	const lead = time.Second
	w := sent.Width()
	before := len(sent.Series(from.Add(-lead), from, w))
	return bucketRate(sent.Series(from.Add(-lead), to, w), before, w, rate, burst)
}

// bucketRate runs a token bucket of rate and burst, full at first, over
// bins of width w, and returns the rate it admits over the bins from before
// on.
func bucketRate(bins []int64, before int, w time.Duration, rate, burst float64) float64 {
	if len(bins) <= before {
		return 0
	}
	tokens, admitted := burst, 0.0
	for i, n := range bins {
		// A bin's packets arrive while its tokens accrue: they may take
		// the bucket's burst and the bin's accrual; what is left over the
		// burst is lost.
		tokens += rate * w.Seconds()
		a := min(float64(n), tokens)
		tokens = min(burst, tokens-a)
		if i >= before {
			admitted += a
		}
	}
	return admitted / (time.Duration(len(bins)-before) * w).Seconds()
}

// checkUnlimited checks that everything offered over [from, from+d) arrived.
func (e *env) checkUnlimited(what string, s *nettest.Sender, from time.Time, d time.Duration) {
	e.t.Helper()
	to := from.Add(d)
	sleepUntil(to.Add(late))
	got, offered := e.recv.Got().Count(from, to), s.Sent().Count(from, to)
	e.t.Logf("%s: %d of %d offered packets arrived", what, got, offered)
	if offered == 0 || got != offered {
		e.t.Errorf("%s: %d of %d offered packets arrived, want all (nothing limits them)", what, got, offered)
	}
}

// pins lists the pin directory's entries, less the preloaded ones.
func (e *env) pins() []string { return e.pinFS.List() }

func pct(got, want float64) float64 { return (got - want) / want * 100 }

// xdpAttached reports whether B's veth has an XDP program.
func (e *env) xdpAttached() bool {
	e.t.Helper()
	nl, err := e.pair.B.Netlink()
	if err != nil {
		e.t.Fatal(err)
	}
	defer nl.Close()
	l, err := nl.LinkByName(e.pair.IfB)
	if err != nil {
		e.t.Fatal(err)
	}
	x := l.Attrs().Xdp
	return x != nil && x.Attached
}

// TestBucketRate: the rig's reference for what a limit admits of what was
// sent. No root: it runs on numbers.
func TestBucketRate(t *testing.T) {
	const w = 10 * time.Millisecond
	steady := func(n int, per int64) []int64 {
		bins := make([]int64, n)
		for i := range bins {
			bins[i] = per
		}
		return bins
	}
	stalled := steady(150, 80) // a second of lead, then 500 ms, at twice 4,000 pkt/s
	for i := 120; i < 135; i++ {
		stalled[i] = 0 // 150 ms sent nothing: 600 tokens accrue, 400 are kept
	}
	for _, c := range []struct {
		name   string
		bins   []int64
		before int
		want   float64
	}{
		{"twice the rate", steady(150, 80), 100, 4000},
		{"under the rate", steady(150, 20), 100, 2000},
		// 50 bins of 40 tokens less the 200 the stall let go to waste.
		{"a stall longer than the burst", stalled, 100, (50*40 - 200) / 0.5},
		// The full bucket is spent within the lead.
		{"the burst spent before the window", steady(150, 80), 10, 4000},
		{"nothing after the lead", steady(100, 80), 100, 0},
	} {
		if got := bucketRate(c.bins, c.before, w, 4000, 400); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("%s: %.3f pkt/s, want %.3f", c.name, got, c.want)
		}
	}
}
