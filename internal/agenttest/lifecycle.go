package agenttest

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/internal/nettest"
)

// WaitExit waits up to timeout for the agent to exit and returns its exit
// state, or nil if it still runs.
func (a *Agent) WaitExit(timeout time.Duration) *os.ProcessState {
	select {
	case <-a.exited:
		return a.state
	case <-time.After(timeout):
		return nil
	}
}

// HTTPGet GETs url from inside ns (where the agent's metrics and health
// endpoints listen, on the namespace's own loopback) and returns the status
// code and the body. It fails tb if the request fails.
func HTTPGet(tb testing.TB, ns *nettest.NS, url string) (int, string) {
	tb.Helper()
	tr := &http.Transport{
		DisableKeepAlives: true,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			var c net.Conn
			err := ns.Do(func() error {
				var err error
				c, err = (&net.Dialer{Timeout: 2 * time.Second}).DialContext(ctx, network, addr)
				return err
			})
			return c, err
		},
	}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 3 * time.Second}).Get(url)
	if err != nil {
		tb.Fatalf("GET %s in %s: %v", url, ns.Name, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		tb.Fatalf("GET %s in %s: %v", url, ns.Name, err)
	}
	return resp.StatusCode, string(b)
}

var netnsSeq atomic.Int64

// StartAgentIPNetnsExec starts `bin run args...` the way a user runs a
// program in a network namespace: `ip netns exec NAME bin run args...`,
// with ns named NAME for the test's duration (a bind mount of it under
// /run/netns, as `ip netns add` makes; Cleanup removes it). That gives the
// agent what `ip netns exec` gives any program: ns as its network
// namespace, and a mount namespace of its own, a slave of the host's, with
// a fresh sysfs on /sys, where the host's bpffs at /sys/fs/bpf is not.
//
// Without the ip command (a minimal VM), nettest's launcher takes the same
// steps in the agent's process before it becomes the agent
// (NS.StartIPNetnsExec): the test binary must call nettest.MaybeExec first
// in TestMain. via says which way it went.
func StartAgentIPNetnsExec(tb testing.TB, ns *nettest.NS, bin string, args ...string) (a *Agent, via string) {
	tb.Helper()
	argv := append([]string{bin, "run"}, args...)
	if ip, err := exec.LookPath("ip"); err == nil {
		name := fmt.Sprintf("rlagent-test-%d-%d", os.Getpid(), netnsSeq.Add(1))
		nameNS(tb, ns, name)
		cmd := exec.Command(ip, append([]string{"netns", "exec", name}, argv...)...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		return startCmd(tb, cmd, cmd.Start, args), "ip netns exec"
	}
	cmd := exec.Command(bin, argv[1:]...)
	return startCmd(tb, cmd, func() error { return ns.StartIPNetnsExec(cmd) }, args), "nettest's launcher (no ip command)"
}

// nameNS gives ns a name under /run/netns for `ip netns exec`.
func nameNS(tb testing.TB, ns *nettest.NS, name string) {
	tb.Helper()
	if err := os.MkdirAll("/run/netns", 0o755); err != nil {
		tb.Fatal(err)
	}
	path := filepath.Join("/run/netns", name)
	if err := os.WriteFile(path, nil, 0o444); err != nil {
		tb.Fatal(err)
	}
	src := fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), int(ns.Handle()))
	if err := unix.Mount(src, path, "none", unix.MS_BIND, ""); err != nil {
		os.Remove(path)
		tb.Fatalf("name network namespace %s: bind %s: %v", name, src, err)
	}
	tb.Cleanup(func() {
		if err := unix.Unmount(path, unix.MNT_DETACH); err != nil {
			tb.Errorf("unmount %s: %v", path, err)
		}
		os.Remove(path)
	})
}

// startCmd starts cmd with start and makes it an Agent, as StartAgent does.
func startCmd(tb testing.TB, cmd *exec.Cmd, start func() error, args []string) *Agent {
	tb.Helper()
	a := &Agent{tb: tb, cmd: cmd, exited: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = &a.out, &a.out
	if err := start(); err != nil {
		tb.Fatalf("start %s: %v", strings.Join(cmd.Args, " "), err)
	}
	go func() {
		cmd.Wait()
		a.state = cmd.ProcessState
		close(a.exited)
	}()
	tb.Cleanup(func() {
		if a.Running() {
			a.Stop(syscall.SIGTERM, 5*time.Second)
		}
		if tb.Failed() {
			tb.Logf("rlagent run %s (pid %d) output:\n%s", strings.Join(args, " "), a.PID(), a.Log())
		}
	})
	return a
}
