// Command vmtest boots Debian kernels in qemu (software emulation) and runs
// static Go test binaries inside them, one VM per kernel, the suites one
// after another in each. It prints the console with a [series] prefix,
// then one summary line per kernel, and exits 0 only if every suite on
// every kernel passed.
//
//	vmtest -kernel 6.1 -kernel 6.12 -rlagent bin/vmtest/rlagent \
//	    -suite 'bin/vmtest/bpf.test -test.v' -suite 'bin/vmtest/e2e.test -test.v'
//
// As `go test -exec` (the test binary and its arguments come last):
//
//	CGO_ENABLED=0 go test -exec "$PWD/bin/vmtest/vmtest -kernel 6.1" ./bpf/
//
// Kernels, their package lists and a built /init are cached (-cache); qemu
// is installed with apt-get when missing and the runner is root.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/rlagent/rlagent/test/vmtests"
)

type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, " ") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

type options struct {
	kernels, suites, env, modules listFlag
	rlagent, cache, init, flavor  string
	mirror, summary               string
	timeout                       time.Duration
	memMB, cpus                   int
	prefix                        bool
}

// defaultEnv is the suites' environment unless -env sets a variable again:
// skips of privileged tests fail (the VM has root and every feature the
// suites need), and the end-to-end traffic is scaled down to what a VM in
// software emulation sends and receives reliably (a tenth of the default).
var defaultEnv = []string{"RLAGENT_REQUIRE_ROOT_TESTS=1", "RLAGENT_E2E_GLOBAL_RATE=800"}

func main() {
	var o options
	flag.Var(&o.kernels, "kernel", "kernel series to boot, repeatable (one of "+strings.Join(vmtests.Series(), ", ")+")")
	flag.Var(&o.suites, "suite", "a static test binary and its arguments, split at spaces; repeatable, run in order")
	flag.Var(&o.env, "env", "KEY=VALUE for the suites' environment, repeatable (defaults: "+strings.Join(defaultEnv, " ")+")")
	flag.Var(&o.modules, "module", "kernel module to load with its dependencies, repeatable (default veth)")
	flag.StringVar(&o.rlagent, "rlagent", "", "a static rlagent binary: copied to /rlagent, and RLAGENT_BIN=/rlagent")
	flag.StringVar(&o.cache, "cache", "", "cache directory (default $RLAGENT_VM_CACHE, else test/vmtests/.cache in the module, else ~/.cache/rlagent/vm)")
	flag.StringVar(&o.init, "init", "", "a static build of ./test/vmtests/cmd/vminit (default: built with go build into the cache)")
	flag.StringVar(&o.flavor, "flavor", "cloud-amd64", "Debian kernel flavor: cloud-amd64 or amd64")
	flag.StringVar(&o.mirror, "mirror", "http://deb.debian.org", "Debian mirror")
	flag.DurationVar(&o.timeout, "timeout", 12*time.Minute, "bound on each VM, boot to power-off; qemu is killed after it")
	flag.IntVar(&o.memMB, "mem", 1536, "VM memory in MiB")
	flag.IntVar(&o.cpus, "smp", 2, "VM CPUs")
	flag.BoolVar(&o.prefix, "prefix", true, "prefix console lines with [series]")
	flag.StringVar(&o.summary, "summary", "", "also append the summary to this file")
	flag.Usage = func() {
		fmt.Fprintf(os.Stderr, "usage: vmtest -kernel SERIES... [flags] [-suite 'BIN ARGS']... [BIN ARGS...]\n\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if rest := flag.Args(); len(rest) > 0 {
		// go test -exec: the test binary and its arguments.
		o.suites = append(o.suites, strings.Join(rest, " "))
	}
	if len(o.kernels) == 0 || len(o.suites) == 0 {
		flag.Usage()
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ok, err := run(ctx, &o)
	if err != nil {
		fmt.Fprintf(os.Stderr, "vmtest: %v\n", err)
		os.Exit(1)
	}
	if !ok {
		os.Exit(1)
	}
}

// result is one kernel's outcome, for the summary.
type result struct {
	series  string
	kernel  *vmtests.Kernel
	report  *vmtests.Report
	err     error
	elapsed time.Duration
	// reboots is how many times the kernel was booted again because it
	// did not reach /init.
	reboots int
}

// bootAttempts is how many times a kernel is booted before a VM that never
// reaches /init counts as a failure. Under software emulation a guest
// kernel now and then dies early in boot (an int3 oops while it patches its
// own text, with several vCPUs on multi-threaded TCG), before anything of
// ours ran: booting again tells that apart from a kernel that cannot run
// the suites.
const bootAttempts = 3

func run(ctx context.Context, o *options) (bool, error) {
	if len(o.modules) == 0 {
		o.modules = listFlag{"veth"}
	}
	root := moduleRoot()
	if o.cache == "" {
		o.cache = defaultCache(root)
	}
	if err := os.MkdirAll(o.cache, 0o755); err != nil {
		return false, err
	}
	files, man, err := payload(o)
	if err != nil {
		return false, err
	}
	if o.init == "" {
		if o.init, err = buildInit(ctx, root, o.cache); err != nil {
			return false, err
		}
	}
	if err := vmtests.CheckStatic(o.init); err != nil {
		return false, err
	}
	qemu, err := vmtests.EnsureQemu(ctx, os.Stderr)
	if err != nil {
		return false, err
	}
	f := &vmtests.Fetcher{Cache: o.cache, Flavor: o.flavor, Mirror: o.mirror, MaxListAge: 24 * time.Hour, Log: os.Stderr}
	// Fetch every kernel before booting any: a missing one fails fast.
	kernels := make([]*vmtests.Kernel, len(o.kernels))
	for i, s := range o.kernels {
		if kernels[i], err = f.Kernel(ctx, s); err != nil {
			return false, err
		}
	}
	var results []result
	for _, k := range kernels {
		r := runKernel(ctx, o, qemu, k, files, man)
		results = append(results, r)
		if ctx.Err() != nil {
			break
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "vmtest: summary (qemu %s, %d CPUs, %d MiB; suites %s)\n", accel(), o.cpus, o.memMB, suiteNames(man))
	ok := len(results) == len(kernels)
	for _, r := range results {
		b.WriteString(summary(r) + "\n")
		for _, rr := range r.report.Reruns {
			verdict := "passed"
			if rr.Status != 0 {
				verdict = fmt.Sprintf("failed again (exit %d)", rr.Status)
			}
			fmt.Fprintf(&b, "vmtest: %-5s %s: ran %s again: %s\n", r.series, rr.Suite, strings.Join(rr.Tests, ", "), verdict)
		}
		for _, f := range r.report.Failures {
			fmt.Fprintf(&b, "vmtest: %-5s --- FAIL: %s\n", r.series, f.Test)
			for _, l := range f.Lines {
				fmt.Fprintf(&b, "vmtest: %-5s     %s\n", r.series, l)
			}
		}
		if r.err != nil || !r.report.Passed() {
			ok = false
		}
	}
	fmt.Print(b.String())
	if o.summary != "" {
		// make vmtest boots one VM per run and prints every run's summary
		// again at the end, where a CI log's tail shows it.
		f, err := os.OpenFile(o.summary, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
		if err != nil {
			return ok, err
		}
		_, err = f.WriteString(b.String())
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return ok, err
		}
	}
	return ok, nil
}

// payload is what every VM gets: the suites, rlagent, and the manifest
// without the modules (those depend on the kernel).
func payload(o *options) ([]vmtests.File, vmtests.Manifest, error) {
	var files []vmtests.File
	man := vmtests.Manifest{Env: mergeEnv(defaultEnv, o.env)}
	used := map[string]bool{}
	for _, s := range o.suites {
		fields := strings.Fields(s)
		if len(fields) == 0 {
			return nil, man, errors.New("-suite: empty")
		}
		bin := fields[0]
		if err := vmtests.CheckStatic(bin); err != nil {
			return nil, man, err
		}
		name := vmtests.SuiteName(bin)
		for i := 2; used[name]; i++ {
			name = fmt.Sprintf("%s.%d", vmtests.SuiteName(bin), i)
		}
		used[name] = true
		dst := "/suites/" + name
		files = append(files, vmtests.File{Src: bin, Dst: dst, Mode: 0o755})
		man.Suites = append(man.Suites, vmtests.Suite{Name: name, Path: dst, Args: fields[1:]})
	}
	if o.rlagent != "" {
		if err := vmtests.CheckStatic(o.rlagent); err != nil {
			return nil, man, err
		}
		files = append(files, vmtests.File{Src: o.rlagent, Dst: "/rlagent", Mode: 0o755})
		man.Env = mergeEnv(man.Env, []string{"RLAGENT_BIN=/rlagent"})
	}
	return files, man, nil
}

func runKernel(ctx context.Context, o *options, qemu string, k *vmtests.Kernel, files []vmtests.File, man vmtests.Manifest) (r result) {
	start := time.Now()
	r = result{series: k.Series, kernel: k, report: &vmtests.Report{}}
	defer func() { r.elapsed = time.Since(start) }()
	mods, err := k.ModuleFiles(o.modules)
	if err != nil {
		r.err = err
		return r
	}
	files = slices.Clip(files) // append below must not write into the caller's array
	for _, m := range mods {
		dst := "/modules/" + filepath.Base(m)
		files = append(files, vmtests.File{Src: m, Dst: dst, Mode: 0o644})
		man.Modules = append(man.Modules, dst)
	}
	initrd := filepath.Join(o.cache, "initrd-"+k.Release+".cpio")
	defer os.Remove(initrd)
	if err := vmtests.WriteInitramfs(initrd, o.init, files, man); err != nil {
		r.err = fmt.Errorf("initramfs: %w", err)
		return r
	}
	prefix := ""
	if o.prefix {
		prefix = "[" + k.Series + "] "
	}
	fmt.Fprintf(os.Stderr, "vmtest: booting %s (%s) for at most %v\n", k.Release, k.Package, o.timeout)
	vm := &vmtests.VM{Qemu: qemu, Kernel: k.Vmlinuz, Initrd: initrd, MemMB: o.memMB, CPUs: o.cpus, Timeout: o.timeout, Out: os.Stdout, Prefix: prefix}
	for attempt := 1; ; attempt++ {
		r.report, r.err = vm.Run(ctx)
		// A VM that hung past its timeout is not booted again: that would
		// double the run.
		if r.report.Kernel != "" || attempt == bootAttempts || ctx.Err() != nil || errors.Is(r.err, vmtests.ErrTimeout) {
			return r
		}
		r.reboots++
		fmt.Fprintf(os.Stderr, "vmtest: %s did not reach /init (attempt %d of %d: an early boot failure under emulation); booting it again\n",
			k.Release, attempt, bootAttempts)
	}
}

// summary is one kernel's line: series, kernel, verdict, wall time, then
// the boot and every suite.
func summary(r result) string {
	verdict := "PASS"
	if r.err != nil || !r.report.Passed() {
		verdict = "FAIL"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "vmtest: %-5s %-28s %s %6.1fs", r.series, r.kernel.Release, verdict, r.elapsed.Seconds())
	if r.report.Kernel != "" {
		fmt.Fprintf(&b, "  boot %.1fs", r.report.Boot.Seconds())
	}
	if r.reboots > 0 {
		fmt.Fprintf(&b, " (booted %d times)", r.reboots+1)
	}
	for _, s := range r.report.Suites {
		st := "ok"
		if s.Status != 0 {
			st = fmt.Sprintf("FAIL(exit %d)", s.Status)
		}
		fmt.Fprintf(&b, "  %s %s %.1fs", s.Name, st, s.Duration.Seconds())
	}
	switch {
	case r.err != nil:
		fmt.Fprintf(&b, "  (%v)", r.err)
	case !r.report.Done:
		b.WriteString("  (no done line from /init: the VM stopped early)")
	case r.report.Status != 0 && allSuitesOK(r.report):
		b.WriteString("  (/init failed to set the VM up: see its output)")
	}
	return b.String()
}

func allSuitesOK(r *vmtests.Report) bool {
	for _, s := range r.Suites {
		if s.Status != 0 {
			return false
		}
	}
	return true
}

func suiteNames(m vmtests.Manifest) string {
	var n []string
	for _, s := range m.Suites {
		n = append(n, s.Name)
	}
	return strings.Join(n, " ")
}

func accel() string {
	if a := os.Getenv(vmtests.AccelEnv); a != "" {
		return a + " (" + vmtests.AccelEnv + ")"
	}
	return "tcg"
}

// mergeEnv appends add to base, a later KEY= replacing an earlier one.
func mergeEnv(base, add []string) []string {
	out := append([]string(nil), base...)
	for _, kv := range add {
		k, _, _ := strings.Cut(kv, "=")
		i := -1
		for j, o := range out {
			if ok, _, _ := strings.Cut(o, "="); ok == k {
				i = j
			}
		}
		if i >= 0 {
			out[i] = kv
		} else {
			out = append(out, kv)
		}
	}
	return out
}

// moduleRoot is the directory of rlagent's go.mod at or above the working
// directory, or "" outside the module.
func moduleRoot() string {
	dir, err := os.Getwd()
	if err != nil {
		return ""
	}
	for {
		b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && strings.Contains(string(b), "module github.com/rlagent/rlagent\n") {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return ""
		}
		dir = parent
	}
}

func defaultCache(root string) string {
	if c := os.Getenv("RLAGENT_VM_CACHE"); c != "" {
		return c
	}
	if root != "" {
		return filepath.Join(root, "test", "vmtests", ".cache")
	}
	if c, err := os.UserCacheDir(); err == nil {
		return filepath.Join(c, "rlagent", "vm")
	}
	return filepath.Join(os.TempDir(), "rlagent-vm")
}

// buildInit builds the static /init from the module's source into the cache.
func buildInit(ctx context.Context, root, cache string) (string, error) {
	if root == "" {
		return "", errors.New("no /init: run inside the rlagent module (the runner builds ./test/vmtests/cmd/vminit) or pass -init")
	}
	out := filepath.Join(cache, "vminit")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, "./test/vmtests/cmd/vminit")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH=amd64")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./test/vmtests/cmd/vminit: %w\n%s", err, b)
	}
	return out, nil
}
