package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"testing"
	"time"
)

// The tests run the command as a user does: this test binary, started again
// with mainEnv set, runs main instead of the tests, so that exit codes and
// the split between stdout and stderr are the real ones.
const mainEnv = "RLAGENT_TEST_RUN_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(mainEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// result is what one run of rlagent did.
type result struct {
	stdout, stderr string
	code           int
}

// runDeadline bounds every run: a command that hangs (on a FIFO, say) is
// killed, and its exit code (-1) fails the test instead of hanging it.
const runDeadline = 60 * time.Second

// rlagent runs the command with args and returns its output and exit code.
func rlagent(t *testing.T, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), runDeadline)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], args...)
	cmd.Env = append(os.Environ(), mainEnv+"=1", "KUBERNETES_SERVICE_HOST=")
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err := cmd.Run()
	r := result{stdout: o.String(), stderr: e.String()}
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		r.code = ee.ExitCode()
	case err != nil:
		t.Fatalf("run rlagent %q: %v", args, err)
	}
	return r
}
