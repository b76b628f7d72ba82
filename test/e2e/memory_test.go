package e2e

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

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
