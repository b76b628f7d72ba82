package agent

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// ensureBPFFS makes dir a directory on a BPF filesystem, mounting one if
// none is there: at /sys/fs/bpf when dir is below it (where a system without
// systemd may lack the mount), otherwise at dir itself.
func ensureBPFFS(dir string) error {
	dir = filepath.Clean(dir)
	existing := dir
	for {
		if _, err := os.Stat(existing); err == nil {
			break
		} else if !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("pin directory %s: %w", dir, err)
		}
		parent := filepath.Dir(existing)
		if parent == existing {
			break
		}
		existing = parent
	}
	if onBPFFS(existing) {
		return os.MkdirAll(dir, 0o700)
	}
	mountAt := dir
	if existing == "/sys/fs/bpf" {
		mountAt = existing
	}
	if err := os.MkdirAll(mountAt, 0o700); err != nil {
		return fmt.Errorf("pin directory %s: %w", dir, err)
	}
	if err := unix.Mount("bpffs", mountAt, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount bpffs at %s: %w", mountAt, err)
	}
	return os.MkdirAll(dir, 0o700)
}

func onBPFFS(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && st.Type == unix.BPF_FS_MAGIC
}
