package vmtests

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// QemuPackage is the Debian package of qemu-system-x86_64.
const QemuPackage = "qemu-system-x86"

// AccelEnv opts in to another qemu accelerator than TCG, e.g.
// RLAGENT_VM_ACCEL=kvm on a host where KVM boots a guest. Never decided by
// the presence of /dev/kvm: on the CI machines it exists and its ioctls
// succeed, yet qemu aborts or hangs with it (a nested hypervisor).
const AccelEnv = "RLAGENT_VM_ACCEL"

// EnsureQemu returns the path of qemu-system-x86_64, installing the Debian
// package with apt-get when it is missing and the runner is root.
func EnsureQemu(ctx context.Context, log io.Writer) (string, error) {
	const bin = "qemu-system-x86_64"
	if p, err := exec.LookPath(bin); err == nil {
		return p, nil
	}
	if _, err := exec.LookPath("apt-get"); err != nil || os.Geteuid() != 0 {
		return "", fmt.Errorf("%s not found: install the package %s (Debian/Ubuntu: apt-get install %s), or run as root on Debian to have it installed", bin, QemuPackage, QemuPackage)
	}
	install := func() error {
		fmt.Fprintf(log, "vmtest: %s not found: apt-get install %s\n", bin, QemuPackage)
		cmd := exec.CommandContext(ctx, "apt-get", "install", "-y", "-q", "--no-install-recommends", QemuPackage)
		cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
		cmd.Stdout, cmd.Stderr = log, log
		return cmd.Run()
	}
	err := install()
	if err != nil {
		// Stale package lists are the usual cause: update once and retry.
		cmd := exec.CommandContext(ctx, "apt-get", "-q", "update")
		cmd.Stdout, cmd.Stderr = log, log
		if uerr := cmd.Run(); uerr == nil {
			err = install()
		}
	}
	if err != nil {
		return "", fmt.Errorf("%s not found and apt-get install %s failed: %w", bin, QemuPackage, err)
	}
	return exec.LookPath(bin)
}

// VM is one boot of a kernel with an initramfs.
type VM struct {
	Qemu    string
	Kernel  string // vmlinuz
	Initrd  string
	MemMB   int
	CPUs    int
	Timeout time.Duration // the whole boot; qemu is killed when it passes
	Out     io.Writer     // the console, line by line, each line after Prefix
	Prefix  string
}

// Args is qemu's command line. TCG unless AccelEnv says otherwise.
func (vm *VM) Args() []string {
	accel, cpu := "tcg,thread=multi", "max"
	if a := os.Getenv(AccelEnv); a != "" && a != "tcg" {
		accel, cpu = a, "host"
	}
	return []string{
		"-accel", accel, "-cpu", cpu,
		"-smp", strconv.Itoa(vm.CPUs), "-m", strconv.Itoa(vm.MemMB),
		"-M", "q35", "-nographic", "-no-reboot", "-nodefaults", "-display", "none",
		"-serial", "stdio",
		"-kernel", vm.Kernel, "-initrd", vm.Initrd,
		// panic=-1 with -no-reboot: a panic (or /init exiting) ends qemu.
		"-append", "console=ttyS0 panic=-1 oops=panic mitigations=off quiet rdinit=/init",
	}
}

// ErrTimeout is returned when the VM ran past its timeout.
var ErrTimeout = errors.New("timed out")

// Run boots the VM, streams its console to Out and returns what /init
// reported. The error is non-nil when qemu could not run, failed, or was
// killed at the timeout; the report may then be partial.
func (vm *VM) Run(ctx context.Context) (*Report, error) {
	ctx, cancel := context.WithTimeoutCause(ctx, vm.Timeout, ErrTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, vm.Qemu, vm.Args()...)
	// Kill qemu itself, by its PID, on timeout or interrupt; WaitDelay
	// bounds the wait for the console pipe after that.
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGKILL) }
	cmd.WaitDelay = 5 * time.Second
	cmd.Stdin = nil // /dev/null: qemu must not put a terminal in raw mode
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw

	report := &Report{}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := CleanConsole(sc.Text())
			fmt.Fprintf(vm.Out, "%s%s\n", vm.Prefix, line)
			if _, err := report.Parse(line); err != nil {
				fmt.Fprintf(vm.Out, "%svmtest: %v\n", vm.Prefix, err)
			}
		}
		io.Copy(io.Discard, pr) // a line over 1 MiB: keep qemu from blocking
	}()
	err := cmd.Run()
	pw.Close()
	wg.Wait()
	if ctx.Err() != nil {
		if c := context.Cause(ctx); errors.Is(c, ErrTimeout) {
			return report, fmt.Errorf("qemu killed after %v: %w", vm.Timeout, ErrTimeout)
		}
		return report, fmt.Errorf("qemu killed: %w", context.Cause(ctx))
	}
	if err != nil {
		return report, fmt.Errorf("qemu: %w", err)
	}
	return report, nil
}

// CleanConsole removes what a terminal would interpret from a console line:
// the escape sequences SeaBIOS prints to clear the screen (ESC c,
// ESC [ ... letter), and carriage returns.
func CleanConsole(line string) string {
	if !strings.ContainsAny(line, "\x1b\r") {
		return line
	}
	var b strings.Builder
	for i := 0; i < len(line); i++ {
		switch c := line[i]; {
		case c == '\r':
		case c == 0x1b && i+1 < len(line) && line[i+1] == '[':
			// A control sequence: parameters, then a final byte in @..~.
			i += 2
			for i < len(line) && (line[i] < 0x40 || line[i] > 0x7e) {
				i++
			}
		case c == 0x1b:
			i++ // a two-byte sequence such as ESC c (reset)
		default:
			b.WriteByte(c)
		}
	}
	return b.String()
}
