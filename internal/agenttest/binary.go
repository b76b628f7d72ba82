package agenttest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// BinEnv names the environment variable that points the tests at a prebuilt
// rlagent binary (test/vmtests sets it: the VM has no Go toolchain).
const BinEnv = "RLAGENT_BIN"

// Binary returns the rlagent binary under test: $RLAGENT_BIN when set, or
// ./cmd/rlagent of this module built into a temporary directory, which
// cleanup removes. Call it from TestMain.
func Binary() (path string, cleanup func(), err error) {
	if bin := os.Getenv(BinEnv); bin != "" {
		abs, err := filepath.Abs(bin)
		if err == nil {
			_, err = os.Stat(abs)
		}
		if err != nil {
			return "", nil, fmt.Errorf("%s: %w", BinEnv, err)
		}
		return abs, func() {}, nil
	}
	dir, err := os.MkdirTemp("", "rlagent-test-bin-")
	if err != nil {
		return "", nil, err
	}
	path = filepath.Join(dir, "rlagent")
	if err := Build(path); err != nil {
		os.RemoveAll(dir)
		return "", nil, fmt.Errorf("build rlagent (set %s to test a prebuilt binary): %w", BinEnv, err)
	}
	return path, func() { os.RemoveAll(dir) }, nil
}

// Build builds ./cmd/rlagent of this module into out. The module root is
// found with `go env GOMOD` in the current directory, which is the package
// directory under go test.
func Build(out string) error {
	gomod, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return fmt.Errorf("go env GOMOD: %w", err)
	}
	mod := strings.TrimSpace(string(gomod))
	if mod == "" || mod == os.DevNull {
		return fmt.Errorf("go env GOMOD: not in a module")
	}
	cmd := exec.Command("go", "build", "-o", out, "./cmd/rlagent")
	cmd.Dir = filepath.Dir(mod)
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build ./cmd/rlagent: %w\n%s", err, b)
	}
	return nil
}
