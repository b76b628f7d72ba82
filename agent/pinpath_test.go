package agent

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rlagent/rlagent/internal/testenv"
)

// TestPinPathRedirectRefused: a symlink planted at the pin directory or at
// one of its parents, and a parent owned by another user (who could plant
// one), are refused with an error that names the component, by the
// agent's start (preparePinDir, lockPinDir) and by rlagent cleanup; nothing
// is created, locked or removed through them.
func TestPinPathRedirectRefused(t *testing.T) {
	testenv.RequireRoot(t)
	base := filepath.Dir(testenv.BPFFS(t)) // a bpffs directory of the test's own
	mkdir := func(path string) {
		t.Helper()
		if err := os.MkdirAll(path, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	// victim is a directory the attacker wants pinned into or removed; a
	// subdirectory stands for its contents.
	victim := filepath.Join(base, "victim")
	mkdir(filepath.Join(victim, "rlagent", "contents"))

	linkAtDir := filepath.Join(base, "linked")
	if err := os.Symlink(filepath.Join(victim, "rlagent"), linkAtDir); err != nil {
		t.Fatal(err)
	}
	linkAbove := filepath.Join(base, "above")
	if err := os.Symlink(victim, linkAbove); err != nil {
		t.Fatal(err)
	}
	foreign := filepath.Join(base, "user")
	mkdir(filepath.Join(foreign, "rlagent", "contents"))
	if err := os.Chown(foreign, 65534, 65534); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct{ name, dir, want string }{
		{"symlink at the pin dir", linkAtDir, linkAtDir + " is a symbolic link"},
		{"symlink at a parent", filepath.Join(linkAbove, "rlagent"), linkAbove + " is a symbolic link"},
		{"symlink at a parent, dir not there yet", filepath.Join(linkAbove, "new", "rlagent"), linkAbove + " is a symbolic link"},
		{"parent owned by another user", filepath.Join(foreign, "rlagent"), foreign + " is owned by uid 65534, not root"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := preparePinDir(tc.dir, true); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("preparePinDir: %v; want an error saying %q", err, tc.want)
			}
			if err := Cleanup(tc.dir); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Cleanup: %v; want an error saying %q", err, tc.want)
			}
		})
	}
	if l, err := lockPinDir(linkAtDir); err == nil {
		l.release()
		t.Errorf("lockPinDir took a lock through the symlink %s", linkAtDir)
	}
	// Nothing was created or removed through them.
	for _, p := range []string{filepath.Join(victim, "rlagent", "contents"), filepath.Join(foreign, "rlagent", "contents")} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("%s: %v; want it left alone", p, err)
		}
	}
	if _, err := os.Lstat(filepath.Join(victim, "new")); err == nil {
		t.Errorf("%s was created through the symlink", filepath.Join(victim, "new"))
	}
	// The real path next to them is accepted.
	if _, err := preparePinDir(filepath.Join(base, "rlagent"), true); err != nil {
		t.Errorf("preparePinDir of a plain path: %v", err)
	}
}
