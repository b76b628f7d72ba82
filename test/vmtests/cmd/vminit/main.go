//go:build linux

// Command vminit is the /init of the initramfs that test/vmtests boots: it
// mounts the file systems the tests use, loads the kernel modules the
// manifest lists, brings lo up, runs each test binary of the manifest with
// the console as its output, reports on the console in the lines
// vmtests.Report parses, and powers the VM off.
//
// It must be linked statically (CGO_ENABLED=0): the initramfs has no libc.
package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/test/vmtests"
)

func main() {
	status := run()
	fmt.Println(vmtests.DoneLine(status))
	unix.Sync()
	// With qemu -no-reboot, powering off ends qemu with status 0.
	err := unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
	fmt.Fprintf(os.Stderr, "vminit: power off: %v\n", err)
	// Returning from PID 1 panics the kernel; with panic=-1 qemu exits too.
	os.Exit(1)
}

// run sets the VM up and runs the suites; 0 when all of it succeeded.
func run() int {
	status := 0
	fail := func(err error) {
		fmt.Fprintf(os.Stderr, "vminit: %v\n", err)
		status = 1
	}
	for _, m := range []struct{ fstype, target string }{
		{"proc", "/proc"},
		{"sysfs", "/sys"},
		{"devtmpfs", "/dev"},
		{"bpf", "/sys/fs/bpf"},
		{"debugfs", "/sys/kernel/debug"},
		{"tracefs", "/sys/kernel/tracing"},
		{"tmpfs", "/tmp"},
		{"tmpfs", "/run"},
	} {
		if err := mount(m.fstype, m.target); err != nil {
			fail(err)
		}
	}
	var uts unix.Utsname
	unix.Uname(&uts)
	fmt.Println(vmtests.BootLine(unix.ByteSliceToString(uts.Release[:]), uptime()))

	b, err := os.ReadFile(vmtests.ManifestPath)
	if err != nil {
		fail(err)
		return status
	}
	var man vmtests.Manifest
	if err := json.Unmarshal(b, &man); err != nil {
		fail(fmt.Errorf("%s: %w", vmtests.ManifestPath, err))
		return status
	}
	for _, mod := range man.Modules {
		if err := loadModule(mod); err != nil {
			fail(err)
		}
	}
	if err := linkUp("lo"); err != nil {
		fail(err)
	}
	env := append([]string{"PATH=/usr/bin:/bin:/", "HOME=/tmp", "TMPDIR=/tmp"}, man.Env...)
	for _, s := range man.Suites {
		start := time.Now()
		var rep vmtests.Report
		st, err := runSuite(s, env, &rep)
		if err != nil {
			fmt.Fprintf(os.Stderr, "vminit: %s: %v\n", s.Name, err)
		}
		// Under software emulation on a busy host a guest can be starved
		// for long enough that a rate measured in it misses its bound. A
		// suite's failed tests run again, at most vmtests.Reruns times,
		// each time those that failed the time before; the summary names
		// them either way, and a test that fails every time fails the
		// suite.
		tests := vmtests.RerunTests(rep.Failures)
		for n := 1; st == 1 && tests != nil && n <= vmtests.Reruns; n++ {
			fmt.Fprintf(os.Stderr, "vminit: %s: %s failed; running them again (%d of %d)\n", s.Name,
				strings.Join(tests, ", "), n, vmtests.Reruns)
			again := s
			again.Args = append(slices.Clip(s.Args), "-test.run", vmtests.RunPattern(tests))
			var rerun vmtests.Report
			if st, err = runSuite(again, env, &rerun); err != nil {
				fmt.Fprintf(os.Stderr, "vminit: %s (rerun): %v\n", s.Name, err)
			}
			fmt.Println(vmtests.RerunLine(s.Name, tests, st))
			tests = vmtests.RerunTests(rerun.Failures)
		}
		fmt.Println(vmtests.SuiteLine(s.Name, st, time.Since(start)))
		if st != 0 {
			status = 1
		}
	}
	return status
}

func mount(fstype, target string) error {
	if err := os.MkdirAll(target, 0o755); err != nil {
		return err
	}
	if err := unix.Mount(fstype, target, fstype, 0, ""); err != nil {
		return fmt.Errorf("mount %s on %s: %w", fstype, target, err)
	}
	return nil
}

// loadModule loads a module file. A compressed one (.ko.xz, .ko.zst: Debian
// compresses its modules since 6.12) is decompressed by the kernel
// (MODULE_INIT_COMPRESSED_FILE, with CONFIG_MODULE_DECOMPRESS).
func loadModule(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	flags := 0
	if !strings.HasSuffix(path, ".ko") {
		flags = unix.MODULE_INIT_COMPRESSED_FILE
	}
	if err := unix.FinitModule(int(f.Fd()), "", flags); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("load module %s: %w", filepath.Base(path), err)
	}
	return nil
}

func linkUp(name string) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("set %s up: %w", name, err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("set %s up: %w", name, err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("set %s up: %w", name, err)
	}
	return nil
}

// runSuite runs one test binary in /tmp and returns its exit status
// (128+signal when a signal ended it). Its standard output goes to the
// console and, line by line, into rep when rep is not nil. As PID 1 it
// also reaps the orphans the suite leaves (processes it started and did
// not wait for) while it waits.
func runSuite(s vmtests.Suite, env []string, rep *vmtests.Report) (int, error) {
	stdout := os.Stdout
	if rep != nil {
		r, w, err := os.Pipe()
		if err != nil {
			return 127, err
		}
		defer r.Close()
		stdout = w
		copied := make(chan struct{})
		var got vmtests.Report
		go func() {
			defer close(copied)
			sc := bufio.NewScanner(r)
			sc.Buffer(make([]byte, 64<<10), 1<<20)
			for sc.Scan() {
				fmt.Println(sc.Text())
				got.Parse(vmtests.CleanConsole(sc.Text()))
			}
			io.Copy(os.Stdout, r) // a line too long for the scanner
		}()
		// Wait for the output only once the suite has exited, and not
		// for ever: a process it left holding the pipe would hold /init.
		defer func() {
			select {
			case <-copied:
				*rep = got
			case <-time.After(10 * time.Second):
				fmt.Fprintf(os.Stderr, "vminit: %s: its output did not end 10 s after it exited\n", s.Name)
			}
		}()
	}
	p, err := os.StartProcess(s.Path, append([]string{s.Path}, s.Args...), &os.ProcAttr{
		Dir:   "/tmp",
		Env:   env,
		Files: []*os.File{os.Stdin, stdout, os.Stderr},
	})
	if stdout != os.Stdout {
		// The child holds its own copy; the pipe ends when it and every
		// process it started that kept it have exited.
		stdout.Close()
	}
	if err != nil {
		return 127, err
	}
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, 0, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return 127, fmt.Errorf("wait for pid %d: %w", p.Pid, err)
		}
		if pid != p.Pid {
			continue
		}
		if ws.Signaled() {
			return 128 + int(ws.Signal()), nil
		}
		return ws.ExitStatus(), nil
	}
}

// uptime is the time since the kernel started, from /proc/uptime.
func uptime() time.Duration {
	b, err := os.ReadFile("/proc/uptime")
	if err != nil {
		return 0
	}
	f, _, _ := strings.Cut(string(b), " ")
	s, _ := strconv.ParseFloat(f, 64)
	return time.Duration(s * float64(time.Second))
}
