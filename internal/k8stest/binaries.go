package k8stest

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// KubernetesVersion is the release of kube-apiserver the tests run against. It
// must match the k8s.io/kubernetes requirement in test/k8s/tools/go.mod, and
// it keys the binary cache.
const KubernetesVersion = "v1.34.3"

// CacheEnv names the environment variable that overrides the cache root.
const CacheEnv = "RLAGENT_K8S_CACHE"

// Names of the binaries in the cache directory.
const (
	apiserverBinary = "kube-apiserver"
	etcdBinary      = "etcd"
)

// binary is a main package built from test/k8s/tools: its name in the
// cache, its import path, and the name go build gives it (etcd's import
// path ends in /v3, so its binary is named after "server").
type binary struct{ name, pkg, buildName string }

var (
	serverBinaries = []binary{
		{apiserverBinary, "k8s.io/kubernetes/cmd/kube-apiserver", apiserverBinary},
		{etcdBinary, "go.etcd.io/etcd/server/v3", "server"},
	}
	// What a node adds (StartNode): the controllers that run DaemonSets and
	// service accounts, the scheduler, the kubelet, kube-proxy, and kubectl
	// to apply deploy/ as a user would.
	nodeBinaries = []binary{
		{"kube-controller-manager", "k8s.io/kubernetes/cmd/kube-controller-manager", "kube-controller-manager"},
		{"kube-scheduler", "k8s.io/kubernetes/cmd/kube-scheduler", "kube-scheduler"},
		{"kubelet", "k8s.io/kubernetes/cmd/kubelet", "kubelet"},
		{"kube-proxy", "k8s.io/kubernetes/cmd/kube-proxy", "kube-proxy"},
		{"kubectl", "k8s.io/kubernetes/cmd/kubectl", "kubectl"},
	}
)

// toolsDir is the tools module, relative to the rlagent module root.
const toolsDir = "test/k8s/tools"

// CacheDir returns the directory that holds the binaries for
// KubernetesVersion: $RLAGENT_K8S_CACHE/<version> when that is set, otherwise
// $XDG_CACHE_HOME/rlagent/k8s/<version>, or ~/.cache/rlagent/k8s/<version>.
// It lives outside the repository so that every clone on the machine shares it.
func CacheDir() (string, error) {
	if root := os.Getenv(CacheEnv); root != "" {
		return filepath.Join(root, KubernetesVersion), nil
	}
	base, err := os.UserCacheDir() // $XDG_CACHE_HOME, else $HOME/.cache
	if err != nil {
		return "", fmt.Errorf("find cache directory (set %s): %w", CacheEnv, err)
	}
	return filepath.Join(base, "rlagent", "k8s", KubernetesVersion), nil
}

// EnsureBinaries returns the paths of kube-apiserver and etcd for
// KubernetesVersion, building them into CacheDir when either is missing. log
// receives progress lines (a cold build takes minutes); it may be nil.
//
// The build needs the rlagent source tree: the module root is found with
// `go env GOMOD` in the current directory, which is the package directory
// under `go test`. Cached binaries are returned without it.
func EnsureBinaries(ctx context.Context, log func(string, ...any)) (apiserver, etcd string, err error) {
	paths, err := ensure(ctx, log, serverBinaries, "~8 min, ~850 CPU-s")
	if err != nil {
		return "", "", err
	}
	return paths[apiserverBinary], paths[etcdBinary], nil
}

// EnsureNodeBinaries is EnsureBinaries for what StartNode adds: it returns
// the paths of kube-controller-manager, kube-scheduler, kubelet, kube-proxy
// and kubectl by name.
func EnsureNodeBinaries(ctx context.Context, log func(string, ...any)) (map[string]string, error) {
	return ensure(ctx, log, nodeBinaries, "~5 min more with the servers' build cache warm")
}

// ensure returns the cached paths of bins, building them first when any is
// missing.
func ensure(ctx context.Context, log func(string, ...any), bins []binary, cold string) (map[string]string, error) {
	if log == nil {
		log = func(string, ...any) {}
	}
	dir, err := CacheDir()
	if err != nil {
		return nil, err
	}
	paths := make(map[string]string, len(bins))
	var all []string
	for _, b := range bins {
		paths[b.name] = filepath.Join(dir, b.name)
		all = append(all, paths[b.name])
	}
	if cached(all...) {
		return paths, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create binary cache: %w", err)
	}
	unlock, err := lock(ctx, filepath.Join(dir, ".lock"), log)
	if err != nil {
		return nil, err
	}
	defer unlock()
	// Whoever held the lock before us may have built them.
	if cached(all...) {
		return paths, nil
	}
	if err := build(ctx, dir, log, bins, cold); err != nil {
		return nil, fmt.Errorf("build %s %s: %w", names(bins), KubernetesVersion, err)
	}
	return paths, nil
}

func names(bins []binary) string {
	var n []string
	for _, b := range bins {
		n = append(n, b.name)
	}
	return strings.Join(n, ", ")
}

// cached reports whether both binaries are in place. They are only ever
// renamed into the cache complete, so existing means usable.
func cached(paths ...string) bool {
	for _, p := range paths {
		fi, err := os.Stat(p)
		if err != nil || !fi.Mode().IsRegular() || fi.Mode().Perm()&0o100 == 0 {
			return false
		}
	}
	return true
}

// lock takes an exclusive flock on path, waiting for ctx. The kernel drops it
// when the process dies, so a killed build never leaves a stale lock.
func lock(ctx context.Context, path string, log func(string, ...any)) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open build lock: %w", err)
	}
	start := time.Now()
	lastLog := time.Time{}
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		if time.Since(lastLog) >= 30*time.Second {
			log("k8stest: another process is building kube-apiserver and etcd (lock %s held), waiting (%s so far)",
				path, time.Since(start).Round(time.Second))
			lastLog = time.Now()
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("wait for build lock %s: %w", path, ctx.Err())
		case <-time.After(500 * time.Millisecond):
		}
	}
	return func() {
		unix.Flock(int(f.Fd()), unix.LOCK_UN)
		f.Close()
	}, nil
}

// build runs go build in the tools module into a temporary directory inside
// dir and renames the results into place, so that a concurrent reader or an
// interrupted build never sees a partial binary.
func build(ctx context.Context, dir string, log func(string, ...any), bins []binary, cold string) error {
	tools, err := findTools(ctx)
	if err != nil {
		return err
	}
	tmp, err := os.MkdirTemp(dir, ".build-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)

	ldflags := strings.Join([]string{
		"-s", "-w",
		// Without these the server reports v0.0.0-master+$Format:%H$ and
		// clients that parse the version fail.
		"-X", "k8s.io/component-base/version.gitVersion=" + KubernetesVersion,
		"-X", "k8s.io/component-base/version.gitMajor=" + major(KubernetesVersion),
		"-X", "k8s.io/component-base/version.gitMinor=" + minor(KubernetesVersion),
	}, " ")
	// -v prints each package as it is compiled (cached ones are not), which is
	// the only progress go build offers.
	args := []string{"build", "-v", "-ldflags", ldflags, "-o", tmp + "/"}
	for _, b := range bins {
		args = append(args, b.pkg)
	}
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = tools
	cmd.Env = append(os.Environ(), "GOWORK=off")
	logPath := filepath.Join(dir, "build.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer logFile.Close()
	var compiled atomic.Int64
	cmd.Stdout = logFile
	cmd.Stderr = io.MultiWriter(logFile, &packageCounter{n: &compiled})

	log("k8stest: building %s %s in %s into %s "+
		"(cold: %s, ~2 GB RAM on 2 cores; warm: seconds); output in %s",
		names(bins), KubernetesVersion, tools, dir, cold, logPath)
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	tick := time.NewTicker(30 * time.Second)
	defer tick.Stop()
	for waiting := true; waiting; {
		select {
		case err = <-done:
			waiting = false
		case <-tick.C:
			log("k8stest: still building: %s elapsed, %d packages compiled",
				time.Since(start).Round(time.Second), compiled.Load())
		}
	}
	if err != nil {
		return fmt.Errorf("go build: %w\n%s", err, tail(logPath, 30))
	}

	for _, b := range bins {
		if !cached(filepath.Join(tmp, b.buildName)) {
			return fmt.Errorf("go build did not produce %s in %s", b.buildName, tmp)
		}
	}
	// The first is a Kubernetes component: it says its version.
	out, err := exec.CommandContext(ctx, filepath.Join(tmp, bins[0].buildName), "--version").CombinedOutput()
	if err != nil || !bytes.Contains(out, []byte(KubernetesVersion)) {
		return fmt.Errorf("built %s --version says %q (%v), want %s", bins[0].name, bytes.TrimSpace(out), err, KubernetesVersion)
	}
	for _, b := range bins {
		if err := os.Rename(filepath.Join(tmp, b.buildName), filepath.Join(dir, b.name)); err != nil {
			return err
		}
	}
	log("k8stest: built %s %s in %s (%d packages compiled)",
		names(bins), KubernetesVersion, time.Since(start).Round(time.Second), compiled.Load())
	return nil
}

// findTools returns the tools module directory, after checking that it builds
// KubernetesVersion (otherwise the cache would be keyed by the wrong version).
func findTools(ctx context.Context) (string, error) {
	out, err := exec.CommandContext(ctx, "go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", fmt.Errorf("not inside the rlagent module (go env GOMOD is %q); run from the source tree", gomod)
	}
	tools := filepath.Join(filepath.Dir(gomod), toolsDir)
	mod, err := os.ReadFile(filepath.Join(tools, "go.mod"))
	if err != nil {
		return "", fmt.Errorf("read the tools module: %w", err)
	}
	if !bytes.Contains(mod, []byte("k8s.io/kubernetes "+KubernetesVersion)) {
		return "", fmt.Errorf("%s/go.mod does not require k8s.io/kubernetes %s (KubernetesVersion); update one to match the other",
			toolsDir, KubernetesVersion)
	}
	return tools, nil
}

// major and minor split "v1.34.3" into "1" and "34".
func major(v string) string { return strings.Split(strings.TrimPrefix(v, "v"), ".")[0] }
func minor(v string) string { return strings.Split(strings.TrimPrefix(v, "v"), ".")[1] }

// packageCounter counts the package lines of go build -v, skipping the go
// command's own messages ("go: downloading ...").
type packageCounter struct {
	n       *atomic.Int64
	partial []byte
}

func (c *packageCounter) Write(p []byte) (int, error) {
	c.partial = append(c.partial, p...)
	for {
		i := bytes.IndexByte(c.partial, '\n')
		if i < 0 {
			return len(p), nil
		}
		if line := c.partial[:i]; len(line) > 0 && !bytes.HasPrefix(line, []byte("go: ")) {
			c.n.Add(1)
		}
		c.partial = c.partial[i+1:]
	}
}

// tail returns the last n lines of the file at path, for error messages.
func tail(path string, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Sprintf("(read %s: %v)", path, err)
	}
	defer f.Close()
	var lines []string
	skipped := 0
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > n {
			lines = lines[1:]
			skipped++
		}
	}
	head := ""
	if skipped > 0 {
		head = fmt.Sprintf("[... %d earlier lines of %s]\n", skipped, path)
	}
	return head + strings.Join(lines, "\n")
}
