package nettest

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// NS is a network namespace held open by a file descriptor.
type NS struct {
	// Name is for messages only; the namespace itself has no name.
	Name string
	h    netns.NsHandle
}

// NewNS creates a network namespace with its loopback interface up. The
// calling goroutine's thread is not moved into it.
func NewNS(name string) (*NS, error) {
	h, err := onLockedThread(func() (netns.NsHandle, error) {
		orig, err := netns.Get()
		if err != nil {
			return netns.None(), err
		}
		defer orig.Close()
		h, err := netns.New() // unshare(CLONE_NEWNET): this thread is now in h
		if err != nil {
			return netns.None(), err
		}
		if err := netns.Set(orig); err != nil {
			h.Close()
			return netns.None(), errThreadLost{err}
		}
		return h, nil
	})
	if err != nil {
		return nil, fmt.Errorf("create network namespace %s: %w", name, err)
	}
	ns := &NS{Name: name, h: h}
	nl, err := ns.Netlink()
	if err != nil {
		ns.Close()
		return nil, err
	}
	defer nl.Close()
	lo, err := nl.LinkByName("lo")
	if err == nil {
		err = nl.LinkSetUp(lo)
	}
	if err != nil {
		ns.Close()
		return nil, fmt.Errorf("network namespace %s: set lo up: %w", name, err)
	}
	return ns, nil
}

// OpenNS opens the network namespace at path (/proc/PID/ns/net, a pod's):
// one the caller did not create, which Close leaves in place.
func OpenNS(name, path string) (*NS, error) {
	h, err := netns.GetFromPath(path)
	if err != nil {
		return nil, fmt.Errorf("open network namespace %s at %s: %w", name, path, err)
	}
	return &NS{Name: name, h: h}, nil
}

// Close releases the handle. The namespace goes away once nothing else
// (a socket, a process) uses it. Close is idempotent.
func (ns *NS) Close() error {
	if ns == nil || !ns.h.IsOpen() {
		return nil
	}
	err := ns.h.Close()
	ns.h = netns.None()
	return err
}

// Handle is the namespace's file descriptor, owned by ns.
func (ns *NS) Handle() netns.NsHandle { return ns.h }

// Netlink returns a route netlink handle inside the namespace. Only
// NETLINK_ROUTE is opened: a minimal kernel may lack the other families
// netlink.NewHandleAt would try (XFRM), and then fails with "protocol not
// supported". The caller closes it.
func (ns *NS) Netlink() (*netlink.Handle, error) {
	h, err := netlink.NewHandleAt(ns.h, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink in %s: %w", ns.Name, err)
	}
	return h, nil
}

// Do runs fn on an OS thread that is inside the namespace, and waits for
// it. Sockets fn opens stay in the namespace after Do returns. Goroutines fn
// starts do not run in the namespace.
func (ns *NS) Do(fn func() error) error {
	_, err := onLockedThread(func() (struct{}, error) {
		orig, err := netns.Get()
		if err != nil {
			return struct{}{}, fmt.Errorf("enter %s: %w", ns.Name, err)
		}
		defer orig.Close()
		if err := netns.Set(ns.h); err != nil {
			return struct{}{}, fmt.Errorf("enter %s: %w", ns.Name, err)
		}
		ferr := fn()
		if err := netns.Set(orig); err != nil {
			return struct{}{}, errThreadLost{errors.Join(ferr, err)}
		}
		return struct{}{}, ferr
	})
	return err
}

// errThreadLost marks a thread left in the wrong namespace: it must not go
// back to the Go scheduler.
type errThreadLost struct{ err error }

func (e errThreadLost) Error() string { return "restore network namespace: " + e.err.Error() }
func (e errThreadLost) Unwrap() error { return e.err }

// onLockedThread runs fn on a fresh goroutine locked to its thread. If fn
// reports errThreadLost the thread stays locked, and the runtime ends it
// with the goroutine instead of reusing it in a foreign namespace.
func onLockedThread[T any](fn func() (T, error)) (T, error) {
	type result struct {
		v   T
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		v, err := fn()
		var lost errThreadLost
		if !errors.As(err, &lost) {
			runtime.UnlockOSThread()
		}
		ch <- result{v, err}
	}()
	r := <-ch
	return r.v, r.err
}

// execEnv carries the launcher request from Start to MaybeExec: the
// namespace is the child's file descriptor 3. mountEnv asks the launcher
// for the mount steps of `ip netns exec` too (StartIPNetnsExec); its value
// names the sysfs it mounts.
const (
	execEnv  = "RLAGENT_NETTEST_NETNS_EXEC"
	mountEnv = "RLAGENT_NETTEST_NETNS_MOUNTS"
)

// Start starts cmd in the namespace. cmd is built as usual with
// exec.Command (its Path, Args, Env, Dir, Stdout and Stderr are kept); Start
// turns it into a re-execution of the current binary, which must call
// MaybeExec before anything else, and starts it. The process that runs is
// cmd's program itself, with cmd.Process.Pid as its PID.
//
// The process gets its own process group (a Ctrl-C on the terminal reaches
// only the caller, which decides how to stop it) and is killed if the caller
// dies.
func (ns *NS) Start(cmd *exec.Cmd) error { return ns.start(cmd, false) }

// StartIPNetnsExec starts cmd as Start does, with what `ip netns exec`
// gives a program besides its network namespace (iproute2's
// netns_switch): a mount namespace of its own, whose / is a recursive slave
// of the caller's, with a fresh sysfs on /sys, so that the caller's mounts
// under /sys (its bpffs at /sys/fs/bpf) are not there. The launcher takes
// these steps in the child, before it becomes cmd's program: no thread of
// the caller ever leaves its own mount namespace (a thread that did would
// hold the new namespace, and every mount made in it, for as long as the
// caller runs if the runtime could not end that thread, as it cannot end
// the main one).
func (ns *NS) StartIPNetnsExec(cmd *exec.Cmd) error { return ns.start(cmd, true) }

func (ns *NS) start(cmd *exec.Cmd, mounts bool) error {
	if cmd.Err != nil {
		return cmd.Err
	}
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("start %s in %s: %w", cmd.Path, ns.Name, err)
	}
	fd, err := unix.Dup(int(ns.h))
	if err != nil {
		return fmt.Errorf("start %s in %s: %w", cmd.Path, ns.Name, err)
	}
	f := os.NewFile(uintptr(fd), "netns:"+ns.Name)
	defer f.Close() // the child has its own copy once started

	args := append([]string{self, cmd.Path}, cmd.Args[1:]...)
	cmd.Path, cmd.Args = self, args
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	cmd.Env = append(cmd.Env, execEnv+"=1")
	if mounts {
		cmd.Env = append(cmd.Env, mountEnv+"="+ns.Name)
	}
	cmd.ExtraFiles = []*os.File{f} // fd 3 in the child
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setpgid = true
	// The parent-death signal is sent when the thread that forked ends, not
	// the process. Go ends a thread only when a goroutine exits while locked
	// to it, so do not call Start from a goroutine that does that.
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s in %s: %w", args[1], ns.Name, err)
	}
	return nil
}

// MaybeExec does nothing unless the process was started by NS.Start. Then
// it enters the namespace and replaces the process with the requested
// program; it returns only to exit with status 127 on failure. Call it first
// in TestMain or main.
func MaybeExec() {
	if os.Getenv(holdEnv) == "1" && os.Getenv(execEnv) == "" {
		hold()
	}
	if os.Getenv(execEnv) == "" {
		return
	}
	runtime.LockOSThread() // setns changes this thread; execve keeps it
	fail := func(err error) {
		fmt.Fprintf(os.Stderr, "nettest launcher: %v\n", err)
		os.Exit(127)
	}
	if len(os.Args) < 2 {
		fail(errors.New("no program to run"))
	}
	if err := netns.Set(netns.NsHandle(3)); err != nil {
		fail(fmt.Errorf("enter network namespace: %w", err))
	}
	unix.CloseOnExec(3)
	if name, ok := os.LookupEnv(mountEnv); ok {
		if err := ipNetnsExecMounts(name); err != nil {
			fail(err)
		}
	}
	env := slices.DeleteFunc(os.Environ(), func(kv string) bool {
		return strings.HasPrefix(kv, execEnv+"=") || strings.HasPrefix(kv, mountEnv+"=")
	})
	err := syscall.Exec(os.Args[1], os.Args[1:], env)
	fail(fmt.Errorf("exec %s: %w", os.Args[1], err))
}

// ipNetnsExecMounts takes the mount steps of `ip netns exec` on the calling
// thread, which the launcher then replaces with the program: unshare the
// mount namespace, make / a recursive slave (the host's mounts still reach
// it, its own do not reach the host), and replace /sys with a sysfs of the
// new network namespace, named name.
func ipNetnsExecMounts(name string) error {
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("unshare mount namespace: %w", err)
	}
	if err := unix.Mount("", "/", "none", unix.MS_SLAVE|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("make / a slave: %w", err)
	}
	if err := unix.Unmount("/sys", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach /sys: %w", err)
	}
	if err := unix.Mount(name, "/sys", "sysfs", 0, ""); err != nil {
		return fmt.Errorf("mount sysfs: %w", err)
	}
	return nil
}

// link opens a netlink handle in ns and finds ifname in it. The caller
// closes the handle.
func (ns *NS) link(ifname string) (*netlink.Handle, netlink.Link, error) {
	nl, err := ns.Netlink()
	if err != nil {
		return nil, nil, err
	}
	l, err := nl.LinkByName(ifname)
	if err != nil {
		nl.Close()
		return nil, nil, fmt.Errorf("%s in %s: %w", ifname, ns.Name, err)
	}
	return nl, l, nil
}

// holdEnv makes the test binary, started by Hold, a holder of the
// namespace it was started in (MaybeExec then calls hold).
const holdEnv = "RLAGENT_NETTEST_NETNS_HOLD"

// holdSpan bounds a holder's life, should its parent leave it behind.
const holdSpan = 10 * time.Minute

// hold waits until standard input closes (the test is done with the
// holder, or gone) or holdSpan has passed, and exits.
func hold() {
	done := make(chan struct{})
	go func() {
		io.Copy(io.Discard, os.Stdin)
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(holdSpan):
	}
	os.Exit(0)
}

// Hold starts a process that does nothing but sit in ns, the way a pod's
// pause container holds the pod's network namespace, so that ns has a
// /proc/PID/ns/net (the fixture's namespaces are otherwise held only by the
// test's descriptors, which a program looking for pods does not find). The
// process is the test binary itself (a VM has no sleep binary): call
// MaybeExec first in TestMain. Hold returns the process's PID once it is in
// ns; Cleanup ends it, so call Hold before anything whose cleanup needs
// the namespace found.
func (ns *NS) Hold(tb testing.TB) int {
	tb.Helper()
	self, err := os.Executable()
	if err != nil {
		tb.Fatal(err)
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), holdEnv+"=1")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		tb.Fatal(err)
	}
	if err := ns.Start(cmd); err != nil {
		tb.Fatal(err)
	}
	exited := make(chan struct{})
	go func() {
		cmd.Wait()
		close(exited)
	}()
	tb.Cleanup(func() {
		stdin.Close()
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
			cmd.Process.Kill()
			<-exited
		}
	})
	// The launcher enters ns, then execs: wait until the process is in it.
	want, err := inode(fmt.Sprintf("/proc/self/fd/%d", int(ns.h)))
	if err != nil {
		tb.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		if got, err := inode(fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid)); err == nil && got == want {
			return cmd.Process.Pid
		}
		select {
		case <-exited:
			tb.Fatalf("the holder of %s (pid %d) exited: %v", ns.Name, cmd.Process.Pid, cmd.ProcessState)
		default:
		}
		if time.Now().After(deadline) {
			tb.Fatalf("the holder (pid %d) never entered %s", cmd.Process.Pid, ns.Name)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// inode is the inode of the file at path: a namespace's identity.
func inode(path string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, err
	}
	return st.Ino, nil
}
