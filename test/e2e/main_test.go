package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/rlagent/rlagent/internal/nettest"
)

// rlagentBin is the binary under test.
var rlagentBin string

func TestMain(m *testing.M) {
	nettest.MaybeExec() // the launcher of the agent in its namespace: never returns there
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if v := os.Getenv("RLAGENT_E2E_GLOBAL_RATE"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil || n == 0 || n%40 != 0 {
			fmt.Fprintf(os.Stderr, "e2e: RLAGENT_E2E_GLOBAL_RATE=%q: want a multiple of 40 pkt/s\n", v)
			return 2
		}
		globalRate = n
	}
	if bin := os.Getenv("RLAGENT_BIN"); bin != "" {
		abs, err := filepath.Abs(bin)
		if err == nil {
			_, err = os.Stat(abs)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "e2e: RLAGENT_BIN: %v\n", err)
			return 1
		}
		rlagentBin = abs
		return m.Run()
	}
	dir, err := os.MkdirTemp("", "rlagent-e2e-bin-")
	if err != nil {
		fmt.Fprintf(os.Stderr, "e2e: %v\n", err)
		return 1
	}
	defer os.RemoveAll(dir)
	rlagentBin = filepath.Join(dir, "rlagent")
	if err := build(rlagentBin); err != nil {
		fmt.Fprintf(os.Stderr, "e2e: build rlagent (set RLAGENT_BIN to test a prebuilt binary): %v\n", err)
		return 1
	}
	return m.Run()
}

// build builds ./cmd/rlagent of this module into out.
func build(out string) error {
	gomod, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return fmt.Errorf("go env GOMOD: %w", err)
	}
	mod := strings.TrimSpace(string(gomod))
	if mod == "" || mod == os.DevNull {
		return fmt.Errorf("go env GOMOD: not in a module")
	}
	root := filepath.Dir(mod)
	cmd := exec.Command("go", "build", "-o", out, "./cmd/rlagent")
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build ./cmd/rlagent: %w\n%s", err, b)
	}
	return nil
}
