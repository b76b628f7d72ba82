package k8s

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// BenchmarkIdleAgentCPU reports the CPU an agent uses in a cluster when
// nothing changes (target: ~0): one agent, one RateLimit, informers synced,
// then 10 s of quiet. It asks the API server nothing while its watches work;
// the snapshot loop reads the counters every second, and that is all it
// does.
func BenchmarkIdleAgentCPU(b *testing.B) {
	testenv.RequireRoot(b)
	env := k8stest.Shared(b)
	installCRD(b, env)
	ns := env.Namespace(b)
	c := startCluster(b, env, ns, 1)
	const name = "idle"
	deleteInCleanup(b, env, name)
	c.rlagent("limits", "set", name, "--rate", "1000", "--scope", "nodes", "--protocol", "udp", "--dst-ports", fmt.Sprint(svcPort))
	time.Sleep(3 * time.Second) // settle: sync, reconcile, first status writes
	pid := c.nodes[0].agent.PID()
	for range b.N {
		start, err := cpuTicks(pid)
		if err != nil {
			b.Fatal(err)
		}
		const quiet = 10 * time.Second
		time.Sleep(quiet)
		end, err := cpuTicks(pid)
		if err != nil {
			b.Fatal(err)
		}
		// /proc/PID/stat counts in clock ticks of 1/100 s (USER_HZ).
		cpu := time.Duration(end-start) * 10 * time.Millisecond
		b.ReportMetric(100*cpu.Seconds()/quiet.Seconds(), "cpu-%")
	}
}

// cpuTicks is a process's user + system time in clock ticks.
func cpuTicks(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The fields after the parenthesised command name; utime and stime are
	// the 14th and 15th of the whole line.
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: %q", pid, s)
	}
	u, err := strconv.ParseUint(f[11], 10, 64)
	if err != nil {
		return 0, err
	}
	st, err := strconv.ParseUint(f[12], 10, 64)
	return u + st, err
}
