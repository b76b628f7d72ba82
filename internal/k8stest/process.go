package k8stest

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"sync"
	"syscall"
	"time"
)

// process is one server the Env runs, with its output appended to a log file.
type process struct {
	name    string
	logPath string
	cmd     *exec.Cmd
	done    chan struct{} // closed when the process has exited
	waitErr error         // valid after done is closed
}

// startProcess starts path with args, appending its stdout and stderr to
// logPath. The log file is shared by restarts of the same server, so its tail
// is the latest run.
func startProcess(name, logPath, path string, args ...string) (*process, error) {
	logFile, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer logFile.Close() // the child has its own descriptor
	fmt.Fprintf(logFile, "=== %s: %s %q\n", time.Now().Format(time.RFC3339Nano), path, args)

	cmd := exec.Command(path, args...)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	// If the test binary dies without running its cleanups (a panic, -timeout,
	// SIGKILL), the kernel kills the servers too.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := spawn(cmd); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &process{name: name, logPath: logPath, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.waitErr = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// exited reports whether the process has exited, and how.
func (p *process) exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.waitErr
	default:
		return false, nil
	}
}

// stop sends SIGTERM and, if the process is still running after grace,
// SIGKILL; it returns once the process has exited. killed says that SIGTERM
// was not enough.
func (p *process) stop(grace time.Duration) (killed bool, err error) {
	if done, _ := p.exited(); done {
		return false, nil
	}
	pid := p.cmd.Process.Pid
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		if done, _ := p.exited(); done {
			return false, nil
		}
		return false, fmt.Errorf("stop %s (pid %d): %w", p.name, pid, err)
	}
	select {
	case <-p.done:
		return false, nil
	case <-time.After(grace):
	}
	if err := p.cmd.Process.Kill(); err != nil {
		if done, _ := p.exited(); !done {
			return false, fmt.Errorf("kill %s (pid %d): %w", p.name, pid, err)
		}
	}
	select {
	case <-p.done:
		return true, nil
	case <-time.After(10 * time.Second):
		return true, fmt.Errorf("%s (pid %d) did not exit after SIGKILL", p.name, pid)
	}
}

// Pdeathsig fires when the thread that forked the child exits, not the
// process, and the Go runtime does end threads (a goroutine that exits while
// locked to its thread takes the thread along). So every child is forked from
// one goroutine that is locked to its thread and never exits.
var (
	spawnOnce sync.Once
	spawnReqs chan spawnReq
)

type spawnReq struct {
	cmd *exec.Cmd
	err chan<- error
}

func spawn(cmd *exec.Cmd) error {
	spawnOnce.Do(func() {
		spawnReqs = make(chan spawnReq)
		go func() {
			runtime.LockOSThread()
			for r := range spawnReqs {
				r.err <- r.cmd.Start()
			}
		}()
	})
	errc := make(chan error, 1)
	spawnReqs <- spawnReq{cmd, errc}
	return <-errc
}
