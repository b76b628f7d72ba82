package e2e

import (
	"bufio"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rlagent/rlagent/agent"
	"github.com/rlagent/rlagent/internal/agenttest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// BenchmarkAgentRSS reports the resident memory of `rlagent run` with 100
// limits configured (target: 50 MiB), after it attached and reconciled and
// after a few seconds of metrics scrapes and snapshots. Memory, not speed: one
// iteration is the whole measurement.
func BenchmarkAgentRSS(b *testing.B) {
	testenv.RequireRoot(b)
	for range b.N {
		e := newEnv(b)
		var cfg strings.Builder
		fmt.Fprintf(&cfg, "interfaces: [%s]\npinDir: %s\nmetricsAddress: \"off\"\ncount:\n  file: %s\nlimits:\n", e.pair.IfB, e.pinDir, e.count)
		for i := range 100 {
			fmt.Fprintf(&cfg, "  - name: l%d\n    rate: %d\n    match: {protocol: udp, dstPorts: [\"%d\"]}\n", i, 1000+i, 2000+i)
			if i%10 == 0 {
				cfg.WriteString("    key: src-ip\n")
			}
		}
		e.writeCount(1)
		e.writeConfig(cfg.String())
		a := e.startAgent()
		// Let it reconcile, snapshot and re-divide a few times.
		for n := 2; n <= 4; n++ {
			time.Sleep(time.Second)
			e.writeCount(n)
		}
		time.Sleep(time.Second)
		if out, err := e.rlagent("status", "--pin-dir", e.pinDir, "-o", "json"); err != nil || !strings.Contains(out, `"name": "l99"`) {
			b.Fatalf("status does not show the 100 limits: %v\n%.500s", err, out)
		}
		rss, err := vmRSS(a.PID())
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(float64(rss)/(1<<20), "MiB-rss")
		a.Stop(syscall.SIGTERM, 5*time.Second)
	}
}

// vmRSS reads a process's resident set size, in bytes.
func vmRSS(pid int) (int64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("no VmRSS in /proc/%d/status", pid)
}

// BenchmarkAgentKeys (issue 28) is `rlagent run` holding 1,000,000 live
// keyed buckets and 64 limits: its resident memory and the CPU it uses
// over windows of keysWindow (60 s) with one metrics scrape every 15 s
// and no `rlagent status --watch`, the median of 3 windows (MiB-rss,
// cpu-pct: percent of one core). Printed, not asserted: targets 64 MiB and
// 2%, docs/benchmarks.md.
//
// The buckets are made by real frames: one UDP frame from each of
// 1,000,000 sources (10.128.0.0/12), sent into the agent's interface from
// a packet socket in the client's namespace, under a keyed limit whose
// rate they never reach, in a table of 2^21 buckets (maxBuckets): at that
// load its 4-way sets hold all but a few in a thousand (a set that five
// of them hash to keeps four), so the benchmark asks for 99% of them
// (held-keys). RLAGENT_BENCH_KEYS_WINDOW shortens the windows for a quick
// look.
func BenchmarkAgentKeys(b *testing.B) {
	testenv.RequireRoot(b)
	const keys = 1_000_000
	window := 60 * time.Second
	if w, err := time.ParseDuration(os.Getenv("RLAGENT_BENCH_KEYS_WINDOW")); err == nil && w > 0 {
		window = w
	}
	for range b.N {
		e := newEnv(b)
		var cfg strings.Builder
		fmt.Fprintf(&cfg, "interfaces: [%s]\npinDir: %s\nmetricsAddress: %q\nmaxBuckets: %d\ncount:\n  file: %s\nlimits:\n",
			e.pair.IfB, e.pinDir, metricsAddr, 1<<21, e.count)
		for i := range 64 {
			fmt.Fprintf(&cfg, "  - name: l%d\n    rate: %d\n    match: {protocol: udp, dstPorts: [\"%d\"]}\n", i, 1_000_000_000+i, 2000+i)
			if i%8 == 0 {
				cfg.WriteString("    key: src-ip\n")
			}
		}
		e.writeCount(1)
		e.writeConfig(cfg.String())
		a := e.startAgent()

		// One frame from each source to l0's port, until l0 holds a
		// bucket for each (a frame the veth ring had no room for is sent
		// again in the next pass).
		pc, err := e.pair.A.OpenPacket(e.pair.IfA)
		if err != nil {
			b.Fatal(err)
		}
		from, err := e.pair.A.MAC(e.pair.IfA)
		if err != nil {
			b.Fatal(err)
		}
		to, err := e.pair.B.MAC(e.pair.IfB)
		if err != nil {
			b.Fatal(err)
		}
		base := netip.MustParseAddr("10.128.0.0").As4()
		// At least this many sources hold a bucket (see above).
		const want = keys * 99 / 100
		held := 0
		for pass := 0; pass < 3 && held < want; pass++ {
			for i := range uint32(keys) {
				src := base
				src[1] |= byte(i >> 16)
				src[2], src[3] = byte(i>>8), byte(i)
				if err := pc.Send(udpFrame(b, from, to, netip.AddrFrom4(src), e.pair.B4, 2000)); err != nil {
					b.Fatal(err)
				}
			}
			held = keysOf(b, e, "l0")
		}
		pc.Close()
		if held < want {
			b.Fatalf("l0 holds %d buckets after 3 passes of %d sources, want at least %d", held, keys, want)
		}

		var rss, cpu []float64
		for range 3 {
			c0, t0 := cpuTicks(b, a.PID()), time.Now()
			for at := time.Duration(0); at < window; at += 15 * time.Second {
				time.Sleep(time.Until(t0.Add(at)))
				if code, _ := agenttest.HTTPGet(b, e.pair.B, "http://"+metricsAddr+"/metrics"); code != http.StatusOK {
					b.Fatalf("scrape: status %d", code)
				}
			}
			time.Sleep(time.Until(t0.Add(window)))
			c1, t1 := cpuTicks(b, a.PID()), time.Now()
			cpu = append(cpu, float64(c1-c0)/clockTicks/t1.Sub(t0).Seconds()*100)
			r, err := vmRSS(a.PID())
			if err != nil {
				b.Fatal(err)
			}
			rss = append(rss, float64(r)/(1<<20))
		}
		if k := keysOf(b, e, "l0"); k < held {
			b.Fatalf("l0 holds %d buckets after the windows, %d before them: want none lost", k, held)
		}
		mid := func(v []float64) float64 { s := slices.Clone(v); slices.Sort(s); return s[len(s)/2] }
		b.Logf("%d buckets; RSS %.1f MiB, CPU %.2f%% of a core (windows of %v: %.1f, %.2f%%; %.1f, %.2f%%; %.1f, %.2f%%)",
			held, mid(rss), mid(cpu), window, rss[0], cpu[0], rss[1], cpu[1], rss[2], cpu[2])
		b.ReportMetric(float64(held), "held-keys")
		b.ReportMetric(mid(rss), "MiB-rss")
		b.ReportMetric(mid(cpu), "cpu-pct")
		a.Stop(syscall.SIGTERM, 5*time.Second)
	}
}

// clockTicks is USER_HZ, the unit of /proc/PID/stat's CPU times.
const clockTicks = 100

// cpuTicks is a process's user and system CPU time, in clock ticks.
func cpuTicks(tb testing.TB, pid int) uint64 {
	tb.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		tb.Fatal(err)
	}
	// The command may hold spaces and parentheses: fields count from the
	// last ')'. utime and stime are fields 14 and 15 of the line, 12 and
	// 13 after "pid (comm)".
	_, rest, ok := strings.Cut(string(b)[strings.LastIndexByte(string(b), ')'):], ") ")
	f := strings.Fields(rest)
	if !ok || len(f) < 13 {
		tb.Fatalf("/proc/%d/stat: %q", pid, b)
	}
	u, err1 := strconv.ParseUint(f[11], 10, 64)
	s, err2 := strconv.ParseUint(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		tb.Fatalf("/proc/%d/stat: %q", pid, b)
	}
	return u + s
}

// keysOf is how many buckets limit name holds, from rlagent status.
func keysOf(tb testing.TB, e *env, name string) int {
	tb.Helper()
	limits, _ := agenttest.Status[[]agent.LimitStatus](tb, rlagentBin, e.pinDir)
	for _, l := range limits {
		if l.Name == name {
			return int(l.Keys)
		}
	}
	tb.Fatalf("rlagent status shows no limit %s", name)
	return 0
}
