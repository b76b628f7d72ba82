package agent

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// bpffsRoot is where the host's BPF filesystem is mounted by convention.
const bpffsRoot = "/sys/fs/bpf"

// initPIDNS is the inode of the initial PID namespace (PROC_PID_INIT_INO,
// fixed since Linux 3.8): only there is PID 1 the host's init, whose mount
// namespace is the one that outlives every process.
const initPIDNS = "pid:[4026531836]"

// howToRun is the advice every refusal of an ephemeral pin directory gives.
const howToRun = "run the agent in the host's mount namespace with the host's bpffs (" + bpffsRoot +
	"; to enter only a network namespace use `nsenter --net=/run/netns/NAME`, or under `ip netns exec` set pinDir " +
	"to a directory on a bpffs mounted outside /sys, which `ip netns exec` leaves in place); in Kubernetes mount " +
	"the hostPath " + bpffsRoot + "/rlagent; or pass --ephemeral-pins to accept that enforcement stops with the agent"

// preparePinDir makes dir a directory on a BPF filesystem whose pins
// outlive the agent, and refuses what would not be one:
//
//   - An existing dir must be a directory on a bpffs, owned by root (or by
//     the agent's own user) and not writable by group or others: the agent
//     adopts whatever maps and links it finds there, so a directory another
//     user controls could hand it forged pins. rlagent never mounts over an
//     existing directory: that would hide its contents and, if it held an
//     earlier agent's pins, detach nothing but orphan them.
//   - A bpffs the agent would mount itself (dir missing, no bpffs above it)
//     must be mounted in the host's mount namespace. Mounted in a private one
//     (`ip netns exec`, `unshare -m`, a container without the host's
//     /sys/fs/bpf), it dies with the namespace when the agent exits, and the
//     pins and the XDP links die with it: the node then passes traffic
//     unlimited until another agent attaches anew.
//   - An existing bpffs that the host's mount namespace does not have
//     either, for the same reason.
//
// ephemeral skips the last two checks: the caller accepts that enforcement
// ends with the agent (a test, a demo). It returns what it did, for the log.
func preparePinDir(dir string, ephemeral bool) (did string, err error) {
	dir = filepath.Clean(dir)
	if err := checkPinPath(dir); err != nil {
		return "", err
	}
	defer func() {
		// Again once the directories are made: a symlink planted while
		// they were is caught before anything is pinned through it.
		if err == nil {
			if err = checkPinPath(dir); err != nil {
				did = ""
			}
		}
	}()
	fi, err := os.Stat(dir)
	switch {
	case err == nil:
		if err := checkPinDir(dir, fi); err != nil {
			return "", err
		}
		if !ephemeral {
			if err := checkOnHost(dir); err != nil {
				return "", err
			}
		}
		return "", nil
	case !errors.Is(err, fs.ErrNotExist):
		return "", fmt.Errorf("pin directory %s: %w", dir, err)
	}

	existing := dir
	for {
		parent := filepath.Dir(existing)
		if parent == existing {
			break
		}
		existing = parent
		if _, err := os.Stat(existing); err == nil {
			break
		} else if !errors.Is(err, fs.ErrNotExist) {
			return "", fmt.Errorf("pin directory %s: %w", dir, err)
		}
	}
	if onBPFFS(existing) {
		if !ephemeral {
			if err := checkOnHost(existing); err != nil {
				return "", err
			}
		}
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return "", fmt.Errorf("pin directory %s: %w", dir, err)
		}
		return "created " + dir, nil
	}

	// No bpffs: mount one. At /sys/fs/bpf when dir is below it (the
	// kernel's mount point for it, which a system without systemd may leave
	// empty), otherwise at dir itself, which does not exist yet: nothing is
	// hidden by the mount.
	mountAt := dir
	if existing == bpffsRoot {
		mountAt = existing
	}
	if !ephemeral {
		if ok, why := mountOutlivesAgent(); !ok {
			return "", fmt.Errorf("pin directory %s: no BPF filesystem at %s, and one the agent mounted there would not "+
				"outlive it: %s; the pins and the XDP links would go with it, leaving the node unlimited until "+
				"another agent attached: %s", dir, existing, why, howToRun)
		}
	}
	if err := os.MkdirAll(mountAt, 0o700); err != nil {
		return "", fmt.Errorf("pin directory %s: %w", dir, err)
	}
	if err := unix.Mount("bpffs", mountAt, "bpf", 0, "mode=0700"); err != nil {
		return "", fmt.Errorf("mount bpffs at %s: %w", mountAt, err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("pin directory %s: %w", dir, err)
	}
	return "mounted a BPF filesystem at " + mountAt, nil
}

// checkPinPath refuses a pin directory path that someone other than root
// (or the agent's own user) could redirect: every component of dir that
// exists, dir included, must be a directory that is not a symbolic link and
// is owned by root or the agent's user. The agent creates, adopts and (with
// rlagent cleanup) removes pins at dir; a symlink there or above, which any
// owner of a parent directory can plant, would make it pin into, adopt from
// or remove whatever the link points to. Components that do not exist yet
// are the agent's to create (preparePinDir checks again after).
func checkPinPath(dir string) error {
	dir, err := filepath.Abs(dir) // cleaned
	if err != nil {
		return fmt.Errorf("pin directory %s: %w", dir, err)
	}
	euid := uint32(os.Geteuid())
	path := "/"
	for _, name := range append([]string{""}, strings.Split(strings.TrimPrefix(dir, "/"), "/")...) {
		path = filepath.Join(path, name)
		fi, err := os.Lstat(path)
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("pin directory %s: %w", dir, err)
		}
		if fi.Mode()&fs.ModeSymlink != 0 {
			to, _ := os.Readlink(path)
			return fmt.Errorf("pin directory %s: %s is a symbolic link (to %s): the agent creates, adopts and removes "+
				"pins at the path itself, never through a link someone could plant; set pinDir to the real path", dir, path, to)
		}
		if !fi.IsDir() {
			return fmt.Errorf("pin directory %s: %s is not a directory", dir, path)
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return fmt.Errorf("pin directory %s: %s: no owner information", dir, path)
		}
		if st.Uid != 0 && st.Uid != euid {
			return fmt.Errorf("pin directory %s: %s is owned by uid %d, not root: its owner could replace what is below "+
				"it (a symlink to elsewhere) and make the agent pin into, adopt from or remove another directory; "+
				"chown root %s, or choose a pinDir whose parents root owns", dir, path, st.Uid, path)
		}
	}
	return nil
}

// checkPinDir checks an existing pin directory: a directory, on a bpffs,
// owned by root or the agent's user, not writable by group or others.
func checkPinDir(dir string, fi fs.FileInfo) error {
	if !fi.IsDir() {
		return fmt.Errorf("pin directory %s: not a directory", dir)
	}
	if !onBPFFS(dir) {
		return fmt.Errorf("pin directory %s exists and is not on a BPF filesystem; rlagent does not mount over an "+
			"existing directory: choose a pinDir on a bpffs (such as %s/rlagent), or mount one there yourself "+
			"(mount -t bpf bpffs %s)", dir, bpffsRoot, dir)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fmt.Errorf("pin directory %s: no owner information", dir)
	}
	if euid := uint32(os.Geteuid()); st.Uid != 0 && st.Uid != euid {
		return fmt.Errorf("pin directory %s is owned by uid %d, not root: the agent adopts the maps and links it finds "+
			"there, so it must not be a directory another user controls: if its pins are to be trusted, "+
			"chown root %s; otherwise remove it or choose another pinDir", dir, st.Uid, dir)
	}
	if fi.Mode().Perm()&0o022 != 0 {
		return fmt.Errorf("pin directory %s has mode %v, writable by group or others: the agent adopts the maps and "+
			"links it finds there; chmod go-w it (a bpffs mounted without -o mode=0700 is writable by all: mount it "+
			"with that option, or give the agent a directory below it, which it creates 0700)", dir, fi.Mode().Perm())
	}
	return nil
}

// checkOnHost refuses a bpffs that the host's mount namespace does not
// have: it dies with the agent's mount namespace. Outside the initial PID
// namespace (a container) the host's mounts cannot be seen; a bpffs that is
// already there is then taken for what it should be, the host's (a hostPath
// volume).
func checkOnHost(path string) error {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return fmt.Errorf("pin directory %s: %w", path, err)
	}
	onHost, err := hostHasMount(st.Dev)
	if err != nil || onHost {
		return nil // cannot tell (a container): trust it
	}
	return fmt.Errorf("pin directory %s is on a BPF filesystem that the host's mount namespace does not have (a "+
		"private mount): it dies with this mount namespace, and the pins and the XDP links with it, leaving the node "+
		"unlimited until another agent attached: %s", path, howToRun)
}

// hostHasMount reports whether a bpffs with device number dev is mounted
// in the host's mount namespace (PID 1's). It fails outside the initial
// PID namespace, where PID 1 is not the host's init.
func hostHasMount(dev uint64) (bool, error) {
	if ns, err := os.Readlink("/proc/thread-self/ns/pid"); err != nil || ns != initPIDNS {
		return false, errors.New("not in the host's PID namespace")
	}
	mounts, err := readMountinfo("/proc/1/mountinfo")
	if err != nil {
		return false, err
	}
	want := fmt.Sprintf("%d:%d", unix.Major(dev), unix.Minor(dev))
	for _, m := range mounts {
		if m.fstype == "bpf" && m.dev == want {
			return true, nil
		}
	}
	return false, nil
}

// mountOutlivesAgent reports whether a filesystem this process mounts
// stays mounted after it exits, and if not, why: only a mount in the host's
// mount namespace does. In another one (`ip netns exec` and `unshare -m`
// create one, and so does every container) the mount goes when the
// namespace's last process does, which may well be the agent. It reads
// the calling thread's namespaces (/proc/thread-self), where mount(2) acts.
func mountOutlivesAgent() (bool, string) {
	if ns, err := os.Readlink("/proc/thread-self/ns/pid"); err != nil || ns != initPIDNS {
		return false, "the agent runs in a PID namespace of its own (a container), whose mount namespace ends with it"
	}
	self, err1 := os.Readlink("/proc/thread-self/ns/mnt")
	host, err2 := os.Readlink("/proc/1/ns/mnt")
	if err1 == nil && err2 == nil {
		if self != host {
			return false, fmt.Sprintf("the agent runs in a mount namespace (%s) other than the host's (%s), as under "+
				"`ip netns exec` or `unshare -m`", self, host)
		}
		return true, ""
	}
	// PID 1's namespace links need ptrace access to PID 1, which some
	// sandboxes deny; its mountinfo is readable by anyone. Every mount has
	// an ID unique in the system, and a new mount namespace copies the
	// mounts under new IDs: the same root mount ID is the same namespace.
	selfRoot, err1 := rootMountID("/proc/thread-self/mountinfo")
	hostRoot, err2 := rootMountID("/proc/1/mountinfo")
	if err := errors.Join(err1, err2); err != nil {
		return false, fmt.Sprintf("cannot tell whether the agent runs in the host's mount namespace: %v", err)
	}
	if selfRoot != hostRoot {
		return false, "the agent runs in a mount namespace other than the host's (its root mount differs from PID 1's), " +
			"as under `ip netns exec` or `unshare -m`"
	}
	return true, ""
}

// mountEntry is one line of /proc/PID/mountinfo, the fields used here.
type mountEntry struct {
	id, dev, point, fstype string
}

// readMountinfo parses a mountinfo file (proc(5)): "ID PARENT MAJ:MIN ROOT
// POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTIONS".
func readMountinfo(path string) ([]mountEntry, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []mountEntry
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		sep := -1
		for i, f := range fields {
			if f == "-" {
				sep = i
				break
			}
		}
		if len(fields) < 5 || sep < 0 || sep+1 >= len(fields) {
			continue
		}
		out = append(out, mountEntry{id: fields[0], dev: fields[2], point: fields[4], fstype: fields[sep+1]})
	}
	return out, sc.Err()
}

// rootMountID is the ID of the mount at "/" in a mountinfo file (the last
// one, if several are stacked).
func rootMountID(path string) (string, error) {
	mounts, err := readMountinfo(path)
	if err != nil {
		return "", err
	}
	id := ""
	for _, m := range mounts {
		if m.point == "/" {
			id = m.id
		}
	}
	if id == "" {
		return "", fmt.Errorf("%s: no root mount", path)
	}
	return id, nil
}

func onBPFFS(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && st.Type == unix.BPF_FS_MAGIC
}
