package agenttest

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Pins is a private BPF filesystem for one agent's pins.
type Pins struct {
	// Dir is the mount point, the agent's pinDir.
	Dir string
	// preloaded are the files a new bpffs holds before anything is pinned
	// (maps.debug and progs.debug, with CONFIG_BPF_PRELOAD).
	preloaded []string
	tb        testing.TB
}

// PinDir mounts a BPF filesystem on dir (created here, mode 0700), private
// to the test: the agent (same mount namespace) and the test both see it.
// tb's Cleanup detaches a data path the test left attached the user's way
// (`bin cleanup`) and unmounts it, which removes whatever pins are left.
// Register it before the agent starts, so that the agent stops first.
func PinDir(tb testing.TB, bin, dir string) *Pins {
	tb.Helper()
	p := &Pins{Dir: dir, tb: tb}
	if err := os.Mkdir(dir, 0o700); err != nil {
		tb.Fatal(err)
	}
	if err := unix.Mount("bpffs", dir, "bpf", 0, "mode=0700"); err != nil {
		tb.Fatalf("mount bpffs at %s: %v", dir, err)
	}
	p.preloaded = p.List()
	tb.Cleanup(func() {
		if _, err := os.Stat(filepath.Join(dir, "links")); err == nil {
			if out, err := exec.Command(bin, "cleanup", "--pin-dir", dir).CombinedOutput(); err != nil {
				tb.Errorf("rlagent cleanup: %v\n%s", err, out)
			}
		}
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			tb.Errorf("unmount %s: %v", dir, err)
		}
	})
	return p
}

// List lists the pin directory's entries, less the preloaded ones.
func (p *Pins) List() []string {
	p.tb.Helper()
	ents, err := os.ReadDir(p.Dir)
	if err != nil {
		p.tb.Fatal(err)
	}
	var names []string
	for _, d := range ents {
		if !slices.Contains(p.preloaded, d.Name()) {
			names = append(names, d.Name())
		}
	}
	return names
}

// Status runs `bin status --pin-dir pinDir --output json` and returns what
// it printed decoded into a T (the caller's []agent.LimitStatus: the
// harness reads the JSON as a user's script would, and imports nothing of
// the agent), and when it ran (the middle of the command's run). It fails
// tb if the command fails.
func Status[T any](tb testing.TB, bin, pinDir string) (T, time.Time) {
	tb.Helper()
	t0 := time.Now()
	out, err := exec.Command(bin, "status", "--pin-dir", pinDir, "--output", "json").Output()
	at := t0.Add(time.Since(t0) / 2)
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			tb.Fatalf("rlagent status: %v\n%s", err, ee.Stderr)
		}
		tb.Fatalf("rlagent status: %v", err)
	}
	var st T
	if err := json.Unmarshal(out, &st); err != nil {
		tb.Fatalf("rlagent status --output json: %v\n%s", err, out)
	}
	return st, at
}
