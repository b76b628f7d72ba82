//go:build unix

package v1alpha1

// Editing the config file in place: a lock and an atomic replace, with
// the file's owner kept. Unix only, as the agent and its CLI are; the rest
// of the package (the spec, decoding, validation) builds everywhere, for
// the limiter library.

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// LockConfig takes an exclusive lock on the config file at path, for a
// read-modify-write that no other editor (rlagent limits set and delete, in
// any process) may interleave with: without it, of two edits that read the
// same file the second's write drops the first's change. It returns the
// function that releases the lock.
//
// The lock is flock on the config file itself, not on a lock file beside
// it: nothing is left behind in the config's directory, and there is no
// second path someone could plant (a symlink) for the editor to create.
// Since an edit replaces the file by rename, the inode locked can stop
// being the file at path while the lock is waited for: the lock is then
// released and taken again on the new file, until the one locked is the one
// at path. The lock is advisory: it orders the editors, and the agent, which
// only reads, never waits for it.
func LockConfig(path string) (unlock func(), err error) {
	for {
		f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOCTTY|syscall.O_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("lock config: %w", err)
		}
		if err := flock(f, syscall.LOCK_EX); err != nil {
			f.Close()
			return nil, fmt.Errorf("lock config %s: %w", path, err)
		}
		locked, err1 := f.Stat()
		now, err2 := os.Stat(path)
		if err := errors.Join(err1, err2); err != nil {
			f.Close()
			return nil, fmt.Errorf("lock config %s: %w", path, err)
		}
		if os.SameFile(locked, now) {
			return func() { f.Close() }, nil // closing releases the lock
		}
		f.Close() // replaced while we waited: lock the new file
	}
}

// flock is syscall.Flock on f, again when a signal interrupts the wait.
func flock(f *os.File, how int) error {
	for {
		err := syscall.Flock(int(f.Fd()), how)
		if !errors.Is(err, syscall.EINTR) {
			return err
		}
	}
}

// WriteConfigAtomic replaces the config file at path with c if c is valid.
// It marshals c and checks that the result loads with ParseConfig (the code
// the agent runs), then writes it to a temporary file in the same directory,
// syncs it and renames it over path: a reader sees the old file or the new
// one, never a part. The file keeps its permission bits (a new file gets
// 0644) and its owner and group (a failure to keep them fails the write);
// if path is a symbolic link, the file it points to is replaced. On any
// error the old file is left as it was and no temporary file remains. An
// editor that read the file first holds LockConfig across the read and the
// write.
//
// c is written as it is: a config from DecodeConfig keeps its defaults
// implicit.
func WriteConfigAtomic(path string, c *Config) (err error) {
	data, err := c.Marshal()
	if err != nil {
		return fmt.Errorf("write config %s: %w", path, err)
	}
	if _, err := ParseConfig(data); err != nil {
		return wrap("write config "+path, err)
	}
	target, mode := path, fs.FileMode(0o644)
	uid, gid := -1, -1 // a new file: the creator's
	resolved, err := filepath.EvalSymlinks(path)
	switch {
	case err == nil:
		target = resolved
		fi, err := os.Stat(target)
		if err != nil {
			return fmt.Errorf("write config: %w", err)
		}
		mode = fi.Mode().Perm()
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			uid, gid = int(st.Uid), int(st.Gid)
		}
	case !errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("write config: %w", err)
	}
	dir := filepath.Dir(target)
	f, err := os.CreateTemp(dir, "."+filepath.Base(target)+".tmp-*")
	if err != nil {
		return fmt.Errorf("write config: %w", err)
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
			err = fmt.Errorf("write config %s: %w", path, err)
		}
	}()
	if uid >= 0 {
		if err := keepOwner(f, uid, gid); err != nil {
			return err
		}
	}
	// After the chown, which clears the set-id bits.
	if err := f.Chmod(mode); err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(f.Name(), target); err != nil {
		return err
	}
	// The rename is durable once the directory is synced. The new file is in
	// place whatever happens here, so a failure is not reported.
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
	return nil
}

// keepOwner gives the new file f the old file's owner and group, where they
// differ from its own (the creator's, and the directory's group with
// setgid).
func keepOwner(f *os.File, uid, gid int) error {
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || (int(st.Uid) == uid && int(st.Gid) == gid) {
		return nil
	}
	if err := f.Chown(uid, gid); err != nil {
		return fmt.Errorf("keep the file's owner %d and group %d: %w", uid, gid, err)
	}
	return nil
}
