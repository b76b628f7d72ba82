package testenv

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

// recorder is a testing.TB that records Skip and Fatal calls instead of
// stopping the test. Methods it does not override panic (the embedded TB is
// nil), which catches any unexpected use.
type recorder struct {
	testing.TB
	skipped, fatal string // the messages, "" when not called
}

func (r *recorder) Helper() {}

func (r *recorder) Skip(args ...any) { r.skipped = fmt.Sprint(args...) }

func (r *recorder) Skipf(format string, args ...any) { r.skipped = fmt.Sprintf(format, args...) }

func (r *recorder) Fatal(args ...any) { r.fatal = fmt.Sprint(args...) }

func (r *recorder) Fatalf(format string, args ...any) { r.fatal = fmt.Sprintf(format, args...) }

func TestSkipOrFail(t *testing.T) {
	tests := []struct {
		env       string
		wantSkip  bool
		wantFatal bool
	}{
		{env: "", wantSkip: true},
		{env: "0", wantSkip: true},
		{env: "1", wantFatal: true},
	}
	for _, tt := range tests {
		t.Run("env="+tt.env, func(t *testing.T) {
			t.Setenv(RequireRootEnv, tt.env)
			var r recorder
			SkipOrFail(&r, "kernel lacks %s", "BPF atomics")
			checkOutcome(t, &r, tt.wantSkip, tt.wantFatal, "kernel lacks BPF atomics")
		})
	}
}

func TestRequireRoot(t *testing.T) {
	tests := []struct {
		name      string
		euid      int
		env       string
		wantSkip  bool
		wantFatal bool
	}{
		{name: "root", euid: 0, env: "1"},
		{name: "root without env", euid: 0, env: ""},
		{name: "user", euid: 1000, env: "", wantSkip: true},
		{name: "user with env", euid: 1000, env: "1", wantFatal: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv(RequireRootEnv, tt.env)
			saved := geteuid
			t.Cleanup(func() { geteuid = saved })
			geteuid = func() int { return tt.euid }

			var r recorder
			RequireRoot(&r)
			checkOutcome(t, &r, tt.wantSkip, tt.wantFatal, "needs root")
		})
	}
}

// TestHostRefuses: a host that refuses a feature skips the test even when
// skips are forbidden (make vmtest runs it again); a VM that refuses it
// fails the test then.
func TestHostRefuses(t *testing.T) {
	tests := []struct {
		name      string
		vm, env   string
		wantSkip  bool
		wantFatal bool
	}{
		{name: "host", vm: "", env: "", wantSkip: true},
		{name: "host with env", vm: "", env: "1", wantSkip: true},
		{name: "vm", vm: "1", env: "", wantSkip: true},
		{name: "vm with env", vm: "1", env: "1", wantFatal: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv(RequireRootEnv, tt.env)
			t.Setenv(VMTestEnv, tt.vm)
			var r recorder
			HostRefuses(&r, "live frames", errors.New("operation not permitted"))
			checkOutcome(t, &r, tt.wantSkip, tt.wantFatal, "refuses live frames")
			if tt.vm == "" && !strings.Contains(r.skipped, "make vmtest") {
				t.Errorf("a host's skip %q does not say where the test runs", r.skipped)
			}
		})
	}
}

func checkOutcome(t *testing.T, r *recorder, wantSkip, wantFatal bool, wantMsg string) {
	t.Helper()
	if got := r.skipped != ""; got != wantSkip {
		t.Errorf("skipped = %v (%q), want %v", got, r.skipped, wantSkip)
	}
	if got := r.fatal != ""; got != wantFatal {
		t.Errorf("failed = %v (%q), want %v", got, r.fatal, wantFatal)
	}
	if msg := r.skipped + r.fatal; (wantSkip || wantFatal) && !strings.Contains(msg, wantMsg) {
		t.Errorf("message %q does not contain %q", msg, wantMsg)
	}
	if wantFatal && !strings.Contains(r.fatal, RequireRootEnv+"=1") {
		t.Errorf("failure %q does not name %s=1", r.fatal, RequireRootEnv)
	}
}
