package agent

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// One agent per pin directory. Two agents on one directory each believe the
// pins are theirs: the second rewrote the first's limits from its own config
// and the first never put them back. So an agent holds an exclusive lock on
// the pin directory for its whole life, and a second one exits naming the
// holder.
//
// Where the lock lives. The pin directory is on a bpffs, which holds pinned
// objects, directories and symlinks but no regular files, and in Kubernetes
// it is the only host path the agent mounts (hostPath /sys/fs/bpf/rlagent):
// a lock file next to it or under /run would need another volume, and one
// on the container's own filesystem would not be seen by the other agent.
// flock(2) works on any open file, a directory included, and the lock
// belongs to the inode, which every mount of the same bpffs shares. So:
//
//   - the lock is flock(LOCK_EX|LOCK_NB) on the pin directory itself, held
//     through an open descriptor until the process exits (the kernel
//     releases it however the process ends, SIGKILL included);
//   - the holder's record (PID, host and pod name, start time, and the
//     interfaces' attach state for `rlagent status`) is the target of a
//     symlink in the directory, lockRecord, which bpffs can hold. It is
//     replaced atomically (a new symlink renamed over the old), so a reader
//     never sees half a record. It stays when the agent exits: it is only a
//     record, the lock is what counts, and the next holder overwrites it.
//
// bpffs refuses names with a dot (they are kept for its own files such as
// maps.debug), hence "lock-new", not "lock.new".
const (
	lockRecord    = "lock"
	lockRecordNew = "lock-new"
	// maxRecord bounds the record: a symlink target is at most PATH_MAX
	// (4096 bytes) including the terminating NUL.
	maxRecord = 4000
)

// lockWait is how long an agent retries a held lock before giving up: a
// restart (the old process still closing) must not fail.
const lockWait = time.Second

// Holder is the record of the agent that holds a pin directory.
type Holder struct {
	PID   int       `json:"pid"`
	Host  string    `json:"host"`
	Pod   string    `json:"pod,omitempty"`
	Since time.Time `json:"since"`
	// Interfaces are the configured interfaces and their attach state, as
	// the agent last saw them.
	Interfaces []InterfaceStatus `json:"interfaces,omitempty"`
}

func (h Holder) String() string {
	s := fmt.Sprintf("pid %d on host %s", h.PID, h.Host)
	if h.Pod != "" {
		s += fmt.Sprintf(" (pod %s)", h.Pod)
	}
	if !h.Since.IsZero() {
		s += ", since " + h.Since.Format(time.RFC3339)
	}
	return s
}

// ErrPinDirLocked is returned when another agent holds the pin directory.
var ErrPinDirLocked = errors.New("pin directory in use by another rlagent")

// pinLock is a held lock on a pin directory.
type pinLock struct {
	dir    string
	f      *os.File
	holder Holder
}

// lockPinDir takes the pin directory's lock and writes this agent's record.
func lockPinDir(dir string) (*pinLock, error) {
	// O_NOFOLLOW: the directory itself, never one a symlink planted at its
	// path points to (preparePinDir checked every component before).
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("lock pin directory %s: %w", dir, err)
	}
	f := os.NewFile(uintptr(fd), dir)
	deadline := time.Now().Add(lockWait)
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.EWOULDBLOCK) || time.Now().After(deadline) {
			f.Close()
			if errors.Is(err, unix.EWOULDBLOCK) {
				return nil, lockedError(dir)
			}
			return nil, fmt.Errorf("lock pin directory %s: %w", dir, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	host, _ := os.Hostname()
	l := &pinLock{dir: dir, f: f, holder: Holder{PID: os.Getpid(), Host: host, Pod: os.Getenv("POD_NAME"), Since: time.Now().UTC()}}
	if err := l.write(); err != nil {
		l.release()
		return nil, err
	}
	return l, nil
}

// lockedError names the holder, as its record says.
func lockedError(dir string) error {
	h, err := readHolder(dir)
	who := "an agent that left no record"
	if err == nil {
		who = h.String()
	}
	return fmt.Errorf("%w: %s is locked by %s; one agent per pin directory: stop that agent, or give this one "+
		"another pinDir", ErrPinDirLocked, dir, who)
}

// setInterfaces records the interfaces' attach state.
func (l *pinLock) setInterfaces(st []InterfaceStatus) error {
	if l == nil {
		return nil
	}
	l.holder.Interfaces = st
	return l.write()
}

// write replaces the record.
func (l *pinLock) write() error {
	b, err := json.Marshal(l.holder)
	if err != nil {
		return err
	}
	if len(b) > maxRecord {
		// Long error texts first: the states matter more.
		h := l.holder
		h.Interfaces = append([]InterfaceStatus(nil), h.Interfaces...)
		for i := range h.Interfaces {
			h.Interfaces[i].Error = truncate(h.Interfaces[i].Error, 80)
		}
		if b, err = json.Marshal(h); err != nil {
			return err
		}
		if len(b) > maxRecord {
			h.Interfaces = nil
			b, _ = json.Marshal(h)
		}
	}
	tmp := filepath.Join(l.dir, lockRecordNew)
	os.Remove(tmp)
	if err := os.Symlink(string(b), tmp); err != nil {
		return fmt.Errorf("write lock record in %s: %w", l.dir, err)
	}
	if err := os.Rename(tmp, filepath.Join(l.dir, lockRecord)); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write lock record in %s: %w", l.dir, err)
	}
	return nil
}

// release drops the lock. The record stays: with the agent down, `rlagent
// status` still shows who ran last and the interfaces it attached (checked
// against the kernel), and the next holder overwrites it.
func (l *pinLock) release() {
	if l == nil || l.f == nil {
		return
	}
	l.f.Close() // drops the flock
	l.f = nil
}

// removeLockRecord removes the last holder's record from dir (Cleanup).
func removeLockRecord(dir string) {
	os.Remove(filepath.Join(dir, lockRecordNew))
	os.Remove(filepath.Join(dir, lockRecord))
}

// readHolder reads the record in dir.
func readHolder(dir string) (Holder, error) {
	var h Holder
	s, err := os.Readlink(filepath.Join(dir, lockRecord))
	if err != nil {
		return h, err
	}
	if err := json.Unmarshal([]byte(s), &h); err != nil {
		return h, fmt.Errorf("lock record in %s: %w", dir, err)
	}
	return h, nil
}

// locked reports whether some process holds a flock on dir, from
// /proc/locks: taking the lock to find out would make an agent that starts
// at that moment fail. /proc/locks lists the locks of the processes in the
// reader's PID namespace only; from another one (a container's agent seen
// from the host is fine, the reverse is not) it reports false.
func locked(dir string) (bool, error) {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return false, err
	}
	// "1: FLOCK  ADVISORY  WRITE 1234 00:27:40424 0 EOF": the device in
	// hex major:minor, then the inode.
	want := fmt.Sprintf("%02x:%02x:%d", unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino)
	f, err := os.Open("/proc/locks")
	if err != nil {
		return false, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 6 && fields[1] == "FLOCK" && fields[5] == want {
			return true, nil
		}
	}
	return false, sc.Err()
}

// truncate shortens s to at most n bytes, marking the cut.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n-3] + "..."
}
