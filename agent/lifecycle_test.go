package agent

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/internal/testenv"
)

// TestPreparePinDirRefuses: an existing pin directory that is not a
// directory, not on a bpffs, not owned by root or writable by others is
// refused, and nothing is mounted over it; a missing one below a bpffs is
// created 0700.
func TestPreparePinDirRefuses(t *testing.T) {
	testenv.RequireRoot(t)
	plain := filepath.Join(t.TempDir(), "pins")
	if err := os.Mkdir(plain, 0o700); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	bpffsDir := func(uid int, mode os.FileMode) string {
		dir := testenv.BPFFS(t)
		if err := os.Mkdir(dir, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(dir, mode); err != nil { // past the umask
			t.Fatal(err)
		}
		if err := os.Chown(dir, uid, uid); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	for _, tc := range []struct {
		name, dir, want string
	}{
		{"plain directory", plain, "exists and is not on a BPF filesystem"},
		{"a file", file, "not a directory"},
		{"owned by another user", bpffsDir(65534, 0o700), "is owned by uid 65534, not root"},
		{"writable by others", bpffsDir(0, 0o777), "writable by group or others"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := preparePinDir(tc.dir, false)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("preparePinDir(%s): %v, want an error saying %q", tc.dir, err, tc.want)
			}
			t.Logf("refused: %v", err)
			if tc.dir == plain && onBPFFS(plain) {
				unix.Unmount(plain, unix.MNT_DETACH)
				t.Errorf("a bpffs was mounted over %s", plain)
			}
		})
	}
	t.Run("created below a bpffs", func(t *testing.T) {
		dir := filepath.Join(testenv.BPFFS(t), "sub")
		if _, err := preparePinDir(dir, false); err != nil {
			t.Fatal(err)
		}
		fi, err := os.Stat(dir)
		if err != nil || fi.Mode().Perm() != 0o700 || !onBPFFS(dir) {
			t.Fatalf("after preparePinDir: %v, %v", fi, err)
		}
		// And accepted as it is the second time.
		if _, err := preparePinDir(dir, false); err != nil {
			t.Fatal(err)
		}
	})
}

// inPrivateMountNS runs fn on a thread in a new mount namespace of its own,
// a slave of the host's as under `ip netns exec`. Afterwards the thread
// goes back to the process's mount namespace, so that the new one and its
// mounts go, and is thrown away (it stays locked: since the unshare, its
// filesystem context is its own). Going back matters: the runtime wedges
// the main thread rather than ending it, and a main thread left in the new
// namespace would hold it for the process's life.
func inPrivateMountNS(t *testing.T, fn func()) {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the runtime ends the thread
		orig, err := unix.Open("/proc/thread-self/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			done <- fmt.Errorf("open mount namespace: %w", err)
			return
		}
		defer unix.Close(orig)
		if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
			done <- fmt.Errorf("unshare mount namespace: %w", err)
			return
		}
		var ferr error
		defer func() {
			if err := unix.Setns(orig, unix.CLONE_NEWNS); err != nil {
				ferr = errors.Join(ferr, fmt.Errorf("return to the mount namespace: %w", err))
			}
			done <- ferr
		}()
		if err := unix.Mount("", "/", "", unix.MS_SLAVE|unix.MS_REC, ""); err != nil {
			ferr = fmt.Errorf("make / a slave: %w", err)
			return
		}
		fn()
	}()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestPinsThatDieWithTheAgentAreRefused: a bpffs the agent would mount in
// a mount namespace other than the host's, or an existing one that the host
// does not have, is refused with a message that says how to run; with
// ephemeral pins it is accepted.
func TestPinsThatDieWithTheAgentAreRefused(t *testing.T) {
	testenv.RequireRoot(t)
	if ok, why := mountOutlivesAgent(); !ok {
		t.Fatalf("in the test's own mount namespace: %s", why)
	}
	private := t.TempDir()
	var outlives bool
	var why string
	var onHostErr, ephemeralErr, createErr error
	inPrivateMountNS(t, func() {
		outlives, why = mountOutlivesAgent()
		if err := unix.Mount("bpffs", private, "bpf", 0, "mode=0700"); err != nil {
			onHostErr = err
			return
		}
		dir := filepath.Join(private, "rlagent")
		_, createErr = preparePinDir(dir, false)
		_, ephemeralErr = preparePinDir(dir, true)
		onHostErr = checkOnHost(private)
	})
	if outlives || !strings.Contains(why, "mount namespace") {
		t.Errorf("in a private mount namespace: outlives %v (%s), want false naming the mount namespace", outlives, why)
	}
	for _, err := range []error{createErr, onHostErr} {
		if err == nil || !strings.Contains(err.Error(), "the host's mount namespace does not have") ||
			!strings.Contains(err.Error(), "--ephemeral-pins") {
			t.Errorf("a private bpffs: %v, want a refusal saying why and how to run", err)
		}
	}
	if ephemeralErr != nil {
		t.Errorf("with ephemeral pins: %v", ephemeralErr)
	}
	if onBPFFS(private) {
		t.Errorf("the private bpffs shows in the host's namespace")
	}
}

// TestPinLockOneHolder: a second lock on a pin directory fails naming the
// holder's PID and host; once released, the lock is free and the record
// tells status who held it.
func TestPinLockOneHolder(t *testing.T) {
	testenv.RequireRoot(t)
	dir := testenv.BPFFS(t)
	if _, err := preparePinDir(dir, false); err != nil {
		t.Fatal(err)
	}
	t.Setenv("POD_NAME", "rlagent-test-pod")
	first, err := lockPinDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer first.release()
	if err := first.setInterfaces([]InterfaceStatus{{Name: "eth0", State: StateAttached, Mode: ModeNative}}); err != nil {
		t.Fatal(err)
	}
	host, _ := os.Hostname()
	t0 := time.Now()
	second, err := lockPinDir(dir)
	if err == nil {
		second.release()
		t.Fatal("a second lock on the pin directory succeeded")
	}
	t.Logf("second lock after %v: %v", time.Since(t0).Round(time.Millisecond), err)
	for _, want := range []string{fmt.Sprintf("pid %d", os.Getpid()), "host " + host, "pod rlagent-test-pod"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not name the holder (%q): %v", want, err)
		}
	}
	if !errors.Is(err, ErrPinDirLocked) {
		t.Errorf("the error is not ErrPinDirLocked: %v", err)
	}
	st, err := ReadAgentStatus(dir)
	if err != nil {
		t.Fatal(err)
	}
	// The record says attached; the kernel has no such link pinned, and
	// the kernel wins.
	if !st.Running || st.Holder == nil || st.Holder.PID != os.Getpid() || len(st.Interfaces) != 1 ||
		st.Interfaces[0].Name != "eth0" || st.Interfaces[0].State != StateDetached {
		t.Errorf("status while held: %+v", st)
	}

	first.release()
	// The record stays, for status with the agent down.
	if st, err := ReadAgentStatus(dir); err != nil || st.Running || st.Holder == nil || st.Holder.PID != os.Getpid() {
		t.Errorf("status after release: %+v, %v", st, err)
	}
	third, err := lockPinDir(dir)
	if err != nil {
		t.Fatalf("the lock after release: %v", err)
	}
	third.release()
}

// TestReadyzTellsWhy: /readyz answers 503 with the reasons while an
// interface is not attached or the last reconcile failed, and 200 with a
// note while a count is stale.
func TestReadyzTellsWhy(t *testing.T) {
	src := &fakeSource{}
	src.set(2)
	a := newTestAgent(t, twoLimits, src)
	a.reconcileErrors = prometheus.NewCounter(prometheus.CounterOpts{Name: "rlagent_reconcile_errors_total"})
	get := func() (int, string) {
		t.Helper()
		rec := httptest.NewRecorder()
		a.health.serveReady(rec, httptest.NewRequest("GET", "/readyz", nil))
		b, _ := io.ReadAll(rec.Result().Body)
		return rec.Code, string(b)
	}
	check := func(what string, code int, substrs ...string) {
		t.Helper()
		got, body := get()
		if got != code {
			t.Errorf("%s: /readyz %d, want %d:\n%s", what, got, code, body)
		}
		for _, s := range substrs {
			if !strings.Contains(body, s) {
				t.Errorf("%s: /readyz body lacks %q:\n%s", what, s, body)
			}
		}
	}

	a.health.setInterfaces([]InterfaceStatus{{Name: "lo", State: StateAttached, Mode: ModeGeneric}})
	if err := a.reconcileRecorded(); err != nil {
		t.Fatal(err)
	}
	check("attached and reconciled", http.StatusOK, "ok")

	// A count source that fails: the last count stands, the agent stays
	// ready, and says so.
	src.mu.Lock()
	src.all.Err = errors.New("count file: permission denied")
	src.mu.Unlock()
	a.reportStale()
	check("stale count", http.StatusOK, "ok", "note: limit dns: count source unreadable", "permission denied")
	src.set(2)
	a.reportStale()
	if _, body := get(); strings.Contains(body, "note:") {
		t.Errorf("the stale note outlived the staleness:\n%s", body)
	}

	a.health.setInterfaces([]InterfaceStatus{{Name: "lo", State: StateMissing, Error: "attach xdp to lo: no such interface"}})
	check("interface missing", http.StatusServiceUnavailable, "interface lo: missing: attach xdp to lo: no such interface")
	a.health.setInterfaces([]InterfaceStatus{{Name: "lo", State: StateAttached, Mode: ModeGeneric}})

	// Maps that cannot be written: the reconcile fails as a whole.
	a.dp.Close()
	src.set(3)
	if err := a.reconcileRecorded(); err == nil {
		t.Fatal("a reconcile on closed maps succeeded")
	}
	check("reconcile failed", http.StatusServiceUnavailable, "last reconcile failed")
	if n := counterValue(t, a.reconcileErrors); n != 1 {
		t.Errorf("rlagent_reconcile_errors_total %v, want 1", n)
	}
}

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	mfs, err := reg.Gather()
	if err != nil || len(mfs) != 1 {
		t.Fatalf("gather: %v", err)
	}
	return mfs[0].GetMetric()[0].GetCounter().GetValue()
}
