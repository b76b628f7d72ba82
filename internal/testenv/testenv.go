// Package testenv decides whether a test that needs privileges or a kernel
// feature skips or fails.
//
// Every machine and CI job that runs rlagent's tests is root, so a skipped
// privileged test usually hides a broken environment rather than a missing
// permission. Setting RLAGENT_REQUIRE_ROOT_TESTS=1 (CI does, through .ci/run)
// turns those skips into failures; without it a non-root developer still gets
// a green `go test ./...` with the privileged tests reported as skipped.
//
// Only tests import this package.
package testenv

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// RequireRootEnv is the environment variable that, set to "1", forbids skipping.
const RequireRootEnv = "RLAGENT_REQUIRE_ROOT_TESTS"

// geteuid is a variable so that tests can pretend to be root or not.
var geteuid = os.Geteuid

// skipForbidden reports whether RLAGENT_REQUIRE_ROOT_TESTS=1.
func skipForbidden() bool {
	return os.Getenv(RequireRootEnv) == "1"
}

// RequireRoot skips tb unless the test runs as root (BPF_PROG_TEST_RUN, map
// creation and attaching need CAP_BPF and CAP_NET_ADMIN). With
// RLAGENT_REQUIRE_ROOT_TESTS=1 it fails tb instead of skipping it.
func RequireRoot(tb testing.TB) {
	tb.Helper()
	if geteuid() == 0 {
		return
	}
	if skipForbidden() {
		tb.Fatalf("test needs root (CAP_BPF, CAP_NET_ADMIN) and %s=1 forbids skipping", RequireRootEnv)
		return
	}
	tb.Skip("needs root: loading and running BPF programs needs CAP_BPF and CAP_NET_ADMIN (run as root; " +
		RequireRootEnv + "=1 turns this skip into a failure)")
}

// SkipOrFail skips tb with the formatted reason, or fails it with that reason
// when RLAGENT_REQUIRE_ROOT_TESTS=1. Use it where a test would skip because
// the environment lacks something, such as "kernel lacks BPF atomics".
func SkipOrFail(tb testing.TB, format string, args ...any) {
	tb.Helper()
	reason := fmt.Sprintf(format, args...)
	if skipForbidden() {
		tb.Fatalf("%s (%s=1 forbids skipping)", reason, RequireRootEnv)
		return
	}
	tb.Skip(reason)
}

// VMTestEnv is set to 1 in the VMs of make vmtest (test/vmtests).
const VMTestEnv = "RLAGENT_VMTEST"

// vmSlowdown is how much longer the agent takes to start in make vmtest's
// VMs, in software emulation, than on a host: the verifier takes there
// about 10 s for the data path's six programs, a third of a second on the
// host.
const vmSlowdown = 6

// Timeout is d on a host and vmSlowdown times d in make vmtest's VMs: the
// time to wait for what loads or verifies BPF programs (an agent's start,
// its refusal to start, a reload).
func Timeout(d time.Duration) time.Duration {
	if os.Getenv(VMTestEnv) == "1" {
		return vmSlowdown * d
	}
	return d
}

// HostOnly skips tb inside make vmtest's VMs, whose minimal userland lacks
// what the test needs (why: "the nft binary", "the bridge module"); the
// host's make test runs it. It is a skip in the VM even with
// RLAGENT_REQUIRE_ROOT_TESTS=1: the README's kernel table lists these tests
// as host-only.
func HostOnly(tb testing.TB, why string) {
	tb.Helper()
	if os.Getenv(VMTestEnv) == "1" {
		tb.Skip("host only (make test): the VM lacks " + why)
	}
}

// HostRefuses skips tb on a host whose kernel refuses feature, a thing
// the test needs, to any program: a policy of the machine (a sandbox's),
// not a kernel that lacks the feature, shown by refusal, the error of a
// probe that asks for the feature in its least form. It skips even with
// RLAGENT_REQUIRE_ROOT_TESTS=1, as HostOnly does in the VMs, because make
// vmtest runs the test again in its VMs, whose kernels answer for
// themselves: there the same refusal fails the test under
// RLAGENT_REQUIRE_ROOT_TESTS=1, so CI still proves it.
func HostRefuses(tb testing.TB, feature string, refusal error) {
	tb.Helper()
	if os.Getenv(VMTestEnv) == "1" {
		SkipOrFail(tb, "the kernel refuses %s: %v", feature, refusal)
		return
	}
	tb.Skipf("this host's kernel refuses %s to any program (%v): a policy of the machine; "+
		"make vmtest runs this test in its VMs, where it may not skip", feature, refusal)
}

// BPFFS returns a path, not yet created, on a BPF filesystem private to the
// test: a fresh directory under /sys/fs/bpf when that is a bpffs, otherwise
// a bpffs mounted on a temporary directory. Both go away in Cleanup.
func BPFFS(tb testing.TB) string {
	tb.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs("/sys/fs/bpf", &st); err == nil && st.Type == unix.BPF_FS_MAGIC {
		dir, err := os.MkdirTemp("/sys/fs/bpf", "rlagent-test-")
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { os.RemoveAll(dir) })
		return filepath.Join(dir, "rlagent")
	}
	dir := tb.TempDir()
	if err := unix.Mount("bpffs", dir, "bpf", 0, "mode=0700"); err != nil {
		tb.Fatalf("/sys/fs/bpf is not a bpffs and mounting one on %s failed: %v", dir, err)
	}
	tb.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			tb.Errorf("unmount %s: %v", dir, err)
		}
	})
	return filepath.Join(dir, "rlagent")
}

// PinCPU locks the calling goroutine to its OS thread and the thread to
// cpu, so that BPF_PROG_TEST_RUN runs the program there. The returned
// function restores the affinity and unlocks the thread.
func PinCPU(tb testing.TB, cpu int) func() {
	tb.Helper()
	runtime.LockOSThread()
	var old, set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &old); err != nil {
		runtime.UnlockOSThread()
		tb.Fatal(err)
	}
	set.Set(cpu)
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		runtime.UnlockOSThread()
		tb.Fatalf("pin to CPU %d: %v", cpu, err)
	}
	return func() {
		unix.SchedSetaffinity(0, &old)
		runtime.UnlockOSThread()
	}
}
