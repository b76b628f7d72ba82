package agenttest

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// attachedLines are the log lines of `rlagent run` that say the data path is
// attached (or adopted from the pins).
var attachedLines = []string{"attached XDP", "pinned link adopted", "native XDP not available"}

// Agent is one `rlagent run` process that the test started.
type Agent struct {
	tb     testing.TB
	cmd    *exec.Cmd
	out    syncBuffer
	exited chan struct{}
	state  *os.ProcessState
}

// StartAgent starts `bin run args...` in ns (through the test binary as a
// launcher: the test's TestMain must call nettest.MaybeExec first) and
// returns without waiting; WaitAttached waits. tb's Cleanup stops the
// process, by its PID: SIGTERM, then SIGKILL after 5 s; if tb failed, it
// prints the agent's output.
func StartAgent(tb testing.TB, ns *nettest.NS, bin string, args ...string) *Agent {
	tb.Helper()
	cmd := exec.Command(bin, append([]string{"run"}, args...)...)
	return startCmd(tb, cmd, func() error { return ns.Start(cmd) }, args)
}

// AttachTimeout is how long a test waits for an agent to attach. An agent
// attaches in well under a second on a warm machine, but its first BPF
// loads can stall for seconds on a freshly booted CI machine: one verifier
// run took more than 10 s there, and returned at once when a signal made
// it start over.
const AttachTimeout = 30 * time.Second

// WaitAttached waits until the agent logs that it attached (or adopted) the
// data path and then that it is ready (its first reconcile wrote the
// limits: the hooks are attached before the limits reach them), and fails
// tb if it does not within timeout or exits first.
//
// In make vmtest's VMs (software emulation) the timeout is longer
// (testenv.Timeout).
func (a *Agent) WaitAttached(timeout time.Duration) {
	a.tb.Helper()
	timeout = testenv.Timeout(timeout)
	deadline := time.Now().Add(timeout)
	if !a.WaitLog(timeout, attachedLines...) {
		a.tb.Fatalf("rlagent run (pid %d) did not attach within %v; output and goroutines:\n%s", a.PID(), timeout, a.dump())
	}
	if !a.WaitLog(time.Until(deadline), "msg=ready") {
		a.tb.Fatalf("rlagent run (pid %d) attached but was not ready within %v; output:\n%s", a.PID(), timeout, a.Log())
	}
}

// dump says where a hung agent waits: its threads' kernel stacks, then its
// output after a SIGQUIT, which makes a Go program print its goroutines and
// exit.
func (a *Agent) dump() string {
	if !a.Running() {
		return a.Log()
	}
	var b strings.Builder
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*", a.PID()))
	for _, task := range tasks {
		stat, _ := os.ReadFile(filepath.Join(task, "stat"))
		stack, _ := os.ReadFile(filepath.Join(task, "stack"))
		fmt.Fprintf(&b, "thread %s: %s\n%s", filepath.Base(task), bytes.TrimSpace(stat), stack)
	}
	a.cmd.Process.Signal(syscall.SIGQUIT)
	select {
	case <-a.exited:
	case <-time.After(5 * time.Second):
	}
	return b.String() + a.Log()
}

// PID is the agent's process ID.
func (a *Agent) PID() int { return a.cmd.Process.Pid }

// Log is everything the agent wrote so far (stdout and stderr).
func (a *Agent) Log() string { return a.out.String() }

// LastLogLine is the last line of the agent's output that contains substr,
// or "".
func (a *Agent) LastLogLine(substr string) string {
	var line string
	for l := range strings.SplitSeq(a.Log(), "\n") {
		if strings.Contains(l, substr) {
			line = l
		}
	}
	return line
}

// State is the exit state, once the agent has exited (nil before).
func (a *Agent) State() *os.ProcessState {
	select {
	case <-a.exited:
		return a.state
	default:
		return nil
	}
}

// Running reports whether the agent has not exited yet.
func (a *Agent) Running() bool {
	select {
	case <-a.exited:
		return false
	default:
		return true
	}
}

// Stop sends sig to the agent (by its PID) and waits for it to exit; if it
// still runs after timeout, it fails the test and SIGKILLs it.
func (a *Agent) Stop(sig syscall.Signal, timeout time.Duration) {
	a.tb.Helper()
	if err := a.cmd.Process.Signal(sig); err != nil && a.Running() {
		a.tb.Errorf("signal %v to rlagent (pid %d): %v", sig, a.PID(), err)
	}
	select {
	case <-a.exited:
		return
	case <-time.After(timeout):
	}
	a.tb.Errorf("rlagent (pid %d) still runs %s after %v: killing it", a.PID(), timeout, sig)
	a.cmd.Process.Kill()
	<-a.exited
}

// WaitLog waits until the agent's output holds one of substrs. It gives up
// after timeout, or when the agent exits.
func (a *Agent) WaitLog(timeout time.Duration, substrs ...string) bool {
	deadline := time.Now().Add(timeout)
	for {
		out := a.Log()
		for _, s := range substrs {
			if strings.Contains(out, s) {
				return true
			}
		}
		if time.Now().After(deadline) || !a.Running() {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
