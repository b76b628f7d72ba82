package e2e

import (
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rlagent/rlagent/internal/testenv"
)

// window is how long a rate is measured, once the share has applied and
// the burst is spent.
const window = 3 * time.Second

// settle is how long after a change the measuring starts: the new share
// has applied (the tests check it does within 1 s) and the burst is spent
// (a tenth of a second's share, spent in a tenth of a second at twice the
// share).
const settle = time.Second

// TestShareFollowsCount: the admitted rate is the node share (global rate /
// count) within 5% at counts 1, 2 and 4; a new count takes effect within 1 s;
// status reports what the receiver measured.
func TestShareFollowsCount(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t)
	e.writeCount(1)
	e.writeConfig(e.configYAML(globalRate, ""))
	e.startAgent()
	s := e.startSender(float64(2*globalRate), false)
	changed := time.Now()

	for i, count := range []int{1, 2, 4} {
		share := globalRate / uint64(count)
		if i > 0 {
			// Offer twice the new share: still at least the old one, so
			// the change shows in the traffic.
			s.SetRate(2 * float64(share))
			changed = time.Now()
			e.writeCount(count)
			latency, _ := e.waitShare(share, changed, 2*time.Second)
			t.Logf("count %d: status shows share %d pkt/s %v after the count file changed", count, share, latency.Round(time.Millisecond))
			if latency > time.Second {
				t.Errorf("count %d: the new share took %v to apply, want <= 1 s", count, latency)
			}
		}
		// In the traffic: from 1 s after the change, half a second at the
		// new share (+-10%), then the 3 s window (+-5%).
		e.checkAdmitted("count "+itoa(count)+" at change+1s", s, changed.Add(time.Second), 500*time.Millisecond, float64(share), 0.10)
		e.checkAdmitted("count "+itoa(count), s, changed.Add(settle), window, float64(share), 0.05)
		e.checkStatus("count "+itoa(count), count, share)
	}

	// Every packet the data path admitted reached the receiver, and no other:
	// the receiver measures the data path.
	s.Stop()
	time.Sleep(200 * time.Millisecond)
	l, _ := e.limit()
	udp, err := e.pair.B.UDPStats()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("totals: admitted %d, dropped %d; receiver %d; UDP in %d, receive buffer errors %d",
		l.Totals.AdmittedPackets, l.Totals.DroppedPackets, e.recv.Got().Total(), udp.InDatagrams, udp.RcvbufErrors)
	if got := uint64(e.recv.Got().Total()); got != l.Totals.AdmittedPackets || udp.RcvbufErrors != 0 {
		t.Errorf("the receiver got %d packets, the data path admitted %d (receive buffer errors %d)", got, l.Totals.AdmittedPackets, udp.RcvbufErrors)
	}
	if sent := uint64(s.Sent().Total()); l.Totals.AdmittedPackets+l.Totals.DroppedPackets != sent {
		t.Errorf("admitted %d + dropped %d != %d sent", l.Totals.AdmittedPackets, l.Totals.DroppedPackets, sent)
	}
}

// checkStatus checks that `rlagent status --output json` reports what the
// receiver measured: the admitted rate over the status interval (the time
// since the agent's last snapshot) within 10%, replicas and share exact.
func (e *env) checkStatus(what string, count int, share uint64) {
	e.t.Helper()
	l, at := e.limit()
	// The interval restarts every second; a short one holds few packets.
	for tries := 0; l.Interval < 0.6 && tries < 3; tries++ {
		time.Sleep(time.Duration((0.65 - l.Interval) * float64(time.Second)))
		l, at = e.limit()
	}
	time.Sleep(late)
	from := at.Add(-time.Duration(l.Interval * float64(time.Second)))
	measured := e.recv.Got().Rate(from, at)
	e.t.Logf("%s: status: replicas %d, share %d, admitted %.0f/s over %.2f s; the receiver measured %.0f/s (%+.2f%%)",
		what, l.Replicas, l.ShareRate, l.AdmittedPerSecond, l.Interval, measured, pct(l.AdmittedPerSecond, measured))
	if l.Replicas != uint32(count) || l.ShareRate != share || l.GlobalRate != globalRate || l.ShareBurst != globalRate/10/uint64(count) {
		e.t.Errorf("%s: status says replicas %d, share %d, burst %d, global %d; want %d, %d, %d, %d",
			what, l.Replicas, l.ShareRate, l.ShareBurst, l.GlobalRate, count, share, globalRate/10/uint64(count), globalRate)
	}
	if l.Interval <= 0 || math.Abs(l.AdmittedPerSecond-measured) > 0.10*measured {
		e.t.Errorf("%s: status says %.0f pkt/s admitted over %.2f s, the receiver measured %.0f", what, l.AdmittedPerSecond, l.Interval, measured)
	}
}

// TestLimitHoldsAfterSIGKILL: with the agent killed, the pinned data path
// keeps enforcing the share (over IPv6 here); status still reads it; cleanup
// then detaches it and traffic passes unlimited.
func TestLimitHoldsAfterSIGKILL(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t)
	a, s, share := e.halfShare(e.configYAML(globalRate, ""), true)

	a.Stop(syscall.SIGKILL, 5*time.Second)
	killed := time.Now()
	if ws, ok := a.State().Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("rlagent exited with %v, want killed by SIGKILL", a.State())
	}
	e.checkAdmitted("agent killed", s, killed.Add(200*time.Millisecond), window, share, 0.05)
	if l, _ := e.limit(); l.ShareRate != globalRate/2 || l.Replicas != 2 {
		t.Errorf("with the agent down, status says share %d, replicas %d; want %d, 2", l.ShareRate, l.Replicas, globalRate/2)
	}
	if !e.xdpAttached() {
		t.Errorf("no XDP program on %s after the agent was killed", e.pair.IfB)
	}

	// rlagent cleanup detaches and removes the pins.
	if out, err := e.rlagent("cleanup", "--pin-dir", e.pinDir); err != nil {
		t.Fatalf("rlagent cleanup: %v\n%s", err, out)
	}
	cleaned := time.Now()
	if e.xdpAttached() {
		t.Errorf("XDP still attached to %s after rlagent cleanup", e.pair.IfB)
	}
	if left := e.pins(); len(left) != 0 {
		t.Errorf("pins left after rlagent cleanup: %v", left)
	}
	e.checkUnlimited("after cleanup", s, cleaned.Add(100*time.Millisecond), time.Second)
}

// TestRestartAdoptsPins: a second agent adopts the pins of the first with no
// moment where packets pass unlimited, then applies a config change.
func TestRestartAdoptsPins(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t)
	e.writeCount(2)
	e.writeConfig(e.configYAML(globalRate, ""))
	first := e.startAgent()
	share, burst := float64(globalRate/2), float64(globalRate/10/2)
	s := e.startSender(2*share, false)
	time.Sleep(settle + 500*time.Millisecond)

	stopped := time.Now()
	first.Stop(syscall.SIGTERM, 5*time.Second)
	if !first.State().Success() {
		t.Errorf("rlagent exited with %v after SIGTERM, want 0", first.State())
	}
	time.Sleep(300 * time.Millisecond) // no agent at all for a while
	second := e.startAgent()
	adopted := time.Now()
	for _, want := range []string{"adopted pinned data path", "pinned link adopted"} {
		if !strings.Contains(second.Log(), want) {
			t.Errorf("the second agent did not log %q", want)
		}
	}
	t.Logf("restart: first agent stopped at +0, second attached at +%v", adopted.Sub(stopped).Round(time.Millisecond))

	// 100 ms bins from 1 s before the stop to 1.5 s after the adoption.
	from, to := stopped.Add(-time.Second), adopted.Add(1500*time.Millisecond)
	sleepUntil(to.Add(late))
	e.checkBins("restart", from, to, stopped, share, burst, false)
	e.checkAdmitted("across the restart", s, from, to.Sub(from), share, 0.05)

	// A config change after the restart: 1.5 times the global rate.
	newRate := globalRate * 3 / 2
	newShare := newRate / 2
	s.SetRate(float64(2 * newShare))
	changed := time.Now()
	e.writeConfig(e.configYAML(newRate, ""))
	latency, l := e.waitShare(newShare, changed, 3*time.Second)
	t.Logf("config change: status shows share %d %v after the file changed", newShare, latency.Round(time.Millisecond))
	if l.GlobalRate != newRate || l.Replicas != 2 {
		t.Errorf("after the config change status says global %d, replicas %d; want %d, 2", l.GlobalRate, l.Replicas, newRate)
	}
	e.checkAdmitted("new config after restart", s, changed.Add(latency+settle), window, float64(newShare), 0.05)
}

// TestRestartMigratesLayout: an agent started over pins of another layout
// (maxBuckets changed, as an upgrade that resizes or changes a map does)
// builds its maps beside the old ones, copies their state, moves the hook
// to its program atomically and then removes the old pins. The traffic is
// limited throughout, old program to new: no 100 ms bin above share +
// burst, none empty while load is offered, and the counters go on.
func TestRestartMigratesLayout(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t)
	e.writeCount(2)
	e.writeConfig("maxBuckets: 1024\n" + e.configYAML(globalRate, ""))
	first := e.startAgent()
	share, burst := float64(globalRate/2), float64(globalRate/10/2)
	s := e.startSender(2*share, false)
	time.Sleep(settle + 500*time.Millisecond)
	before, _ := e.limit()
	oldLayout := layoutDirs(t, e.pinDir)
	if len(oldLayout) != 1 {
		t.Fatalf("pin layouts before the upgrade: %v, want one", oldLayout)
	}

	stopped := time.Now()
	first.Stop(syscall.SIGTERM, 5*time.Second)
	e.writeConfig("maxBuckets: 4096\n" + e.configYAML(globalRate, ""))
	second := e.startAgent()
	adopted := time.Now()
	if !strings.Contains(second.Log(), "pin layout differs: migrating") {
		t.Errorf("the second agent did not log the migration's start")
	}
	if !second.WaitLog(testenv.Timeout(5*time.Second), "pin layout migrated") {
		t.Fatalf("the second agent did not finish the migration:\n%s", second.Log())
	}
	t.Logf("%s", second.LastLogLine("pin layout migrated"))
	newLayout := layoutDirs(t, e.pinDir)
	if len(newLayout) != 1 || newLayout[0] == oldLayout[0] {
		t.Errorf("pin layouts after the upgrade: %v, want one other than %v", newLayout, oldLayout)
	}

	from, to := stopped.Add(-time.Second), adopted.Add(1500*time.Millisecond)
	sleepUntil(to.Add(late))
	e.checkBins("upgrade", from, to, stopped, share, burst, true)
	e.checkAdmitted("across the upgrade", s, from, to.Sub(from), share, 0.05)
	after, _ := e.limit()
	t.Logf("counters: admitted %d, dropped %d before; %d, %d after", before.Totals.AdmittedPackets, before.Totals.DroppedPackets,
		after.Totals.AdmittedPackets, after.Totals.DroppedPackets)
	if after.Totals.AdmittedPackets <= before.Totals.AdmittedPackets || after.Totals.DroppedPackets <= before.Totals.DroppedPackets {
		t.Errorf("the counters did not go on across the upgrade: admitted %d -> %d, dropped %d -> %d",
			before.Totals.AdmittedPackets, after.Totals.AdmittedPackets, before.Totals.DroppedPackets, after.Totals.DroppedPackets)
	}
}

// checkBins checks the 100 ms bins of what the receiver got in [from, to):
// none above share x 0.1 s + burst (+10%), and, with noneEmpty, none empty
// (the sender offers more than the share throughout). Times are logged
// from ref.
func (e *env) checkBins(what string, from, to, ref time.Time, share, burst float64, noneEmpty bool) {
	e.t.Helper()
	bins := e.recv.Got().Series(from, to, 100*time.Millisecond)
	perBin := share / 10
	limit := (perBin + burst) * 1.1
	e.t.Logf("%s: admitted per 100 ms: %v (share %.0f per bin; min %d, max %d, bound %.0f)",
		what, bins, perBin, slices.Min(bins), slices.Max(bins), limit)
	for i, n := range bins {
		at := from.Add(time.Duration(i) * 100 * time.Millisecond).Sub(ref).Round(time.Millisecond)
		if float64(n) > limit {
			e.t.Errorf("%s: %d packets admitted in the 100 ms from %v, more than share x 0.1 s + burst + 10%% = %.0f", what, n, at, limit)
		}
		if noneEmpty && n == 0 {
			e.t.Errorf("%s: nothing admitted in the 100 ms from %v while load was offered", what, at)
		}
	}
}

// layoutDirs lists the pin layouts' directories in pinDir (maps-*).
func layoutDirs(t *testing.T, pinDir string) []string {
	t.Helper()
	entries, err := os.ReadDir(pinDir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if e.IsDir() && strings.HasPrefix(e.Name(), "maps-") {
			out = append(out, e.Name())
		}
	}
	return out
}

// TestInvalidConfigKeepsLimits: a config file that fails validation is
// rejected whole, with the field named in the log; the old limit stays.
func TestInvalidConfigKeepsLimits(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t)
	a, s, share := e.halfShare(e.configYAML(globalRate, ""), false)
	before, _ := e.limit()

	// A valid new rate next to an invalid action: none of it may apply.
	written := time.Now()
	e.writeConfig(e.configYAML(2*globalRate, "    action: block\n"))
	if !a.WaitLog(3*time.Second, "config rejected") {
		t.Fatalf("the agent did not reject the invalid config within 3 s")
	}
	line := a.LastLogLine("config rejected")
	t.Logf("rejected %v after the write: %s", time.Since(written).Round(time.Millisecond), line)
	if !strings.Contains(line, "limits[0].action") || !strings.Contains(line, "drop, shadow, pace") {
		t.Errorf("the rejection does not name limits[0].action and its valid values: %s", line)
	}
	e.checkAdmitted("after the invalid config", s, written.Add(settle), window, share, 0.05)
	after, _ := e.limit()
	if after.ShareRate != before.ShareRate || after.GlobalRate != before.GlobalRate || after.Replicas != before.Replicas || after.ShareBurst != before.ShareBurst {
		t.Errorf("status changed: before share %d global %d replicas %d, after share %d global %d replicas %d",
			before.ShareRate, before.GlobalRate, before.Replicas, after.ShareRate, after.GlobalRate, after.Replicas)
	}
	if !a.Running() {
		t.Fatalf("the agent exited after an invalid config")
	}

	// Fixed, the file applies.
	fixed := time.Now()
	e.writeConfig(e.configYAML(2*globalRate, ""))
	latency, _ := e.waitShare(globalRate, fixed, 3*time.Second)
	t.Logf("the fixed config applied %v after the write", latency.Round(time.Millisecond))
}

// TestLimitsSetPickedUpByAgent: `rlagent limits set` and `limits delete` on
// the config file of a running agent change what it enforces.
func TestLimitsSetPickedUpByAgent(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t)
	e.writeCount(2)
	e.writeConfig(e.configYAML(globalRate, ""))
	e.startAgent()
	newRate, share := globalRate/2, globalRate/4
	s := e.startSender(float64(2*share), false)
	time.Sleep(200 * time.Millisecond)

	changed := time.Now()
	if out, err := e.rlagent("limits", "set", limitName, "--config", e.config,
		"--rate", strconv.FormatUint(newRate, 10), "--protocol", "udp", "--dst-ports", itoa(port)); err != nil {
		t.Fatalf("rlagent limits set: %v\n%s", err, out)
	}
	latency, l := e.waitShare(share, changed, 3*time.Second)
	t.Logf("limits set: status shows share %d %v after the command", share, latency.Round(time.Millisecond))
	if l.GlobalRate != newRate {
		t.Errorf("status says global rate %d, want %d", l.GlobalRate, newRate)
	}
	e.checkAdmitted("after limits set", s, changed.Add(latency+settle), window, float64(share), 0.05)

	deleted := time.Now()
	if out, err := e.rlagent("limits", "delete", limitName, "--config", e.config); err != nil {
		t.Fatalf("rlagent limits delete: %v\n%s", err, out)
	}
	for {
		st, _ := e.status()
		if len(st) == 0 {
			t.Logf("limits delete: status shows no limit %v after the command", time.Since(deleted).Round(time.Millisecond))
			break
		}
		if time.Since(deleted) > 3*time.Second {
			t.Fatalf("status still shows %d limits 3 s after limits delete: %+v", len(st), st)
		}
		time.Sleep(20 * time.Millisecond)
	}
	e.checkUnlimited("after limits delete", s, time.Now().Add(100*time.Millisecond), time.Second)
	if _, err := os.Stat(filepath.Join(e.pinDir, "links")); err != nil {
		t.Errorf("the data path should stay attached with no limits: %v", err)
	}
}

func itoa(n int) string { return strconv.Itoa(n) }
