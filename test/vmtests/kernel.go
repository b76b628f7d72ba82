package vmtests

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// debianSuites are the Debian releases kernels come from, with the apt
// sources of each ("archive suite component"). Every release gets a private
// apt state under the cache, so the host's apt configuration is neither
// read nor changed and a host of any release can fetch any of them.
var debianSuites = map[string][]string{
	// Without bullseye-security: its kernel packages answered 404 on the
	// mirror (the lists name them, the pool does not have them); bullseye's
	// last point release has a 5.10 kernel, which is all 5.10 is here for.
	"bullseye": {"debian bullseye main", "debian bullseye-updates main"},
	"bookworm": {"debian bookworm main", "debian bookworm-updates main", "debian-security bookworm-security main"},
}

// seriesSuite maps a kernel series to the Debian release that ships it.
// 5.10 is below the minimum the data path needs; it is here to show that
// (the data path fails to load on it).
var seriesSuite = map[string]string{
	"5.10": "bullseye",
	"6.1":  "bookworm",
	"6.12": "bookworm", // linux-image-6.12.*+deb12, through bookworm-security
}

// Series lists the kernel series the runner can fetch, oldest first.
func Series() []string {
	s := make([]string, 0, len(seriesSuite))
	for k := range seriesSuite {
		s = append(s, k)
	}
	slices.SortFunc(s, func(a, b string) int { return slices.Compare(versionParts(a), versionParts(b)) })
	return s
}

// DebianKeyring verifies the Debian archives of every suite above.
const DebianKeyring = "/usr/share/keyrings/debian-archive-keyring.gpg"

// Kernel is a kernel image and its modules, extracted from a Debian package.
type Kernel struct {
	Series  string // as requested: "6.1"
	Release string // uname -r: "6.1.0-40-cloud-amd64"
	Package string // linux-image-6.1.0-40-cloud-amd64-unsigned
	Vmlinuz string
	Modules string // the /lib/modules/<release> directory
}

// Fetcher resolves a kernel series to the newest Debian image package of
// a flavor and downloads and extracts it into a cache.
type Fetcher struct {
	Cache  string // root of the cache: apt/<suite>/ and kernels/<release>/
	Flavor string // "cloud-amd64" (fewer drivers to probe: faster to boot) or "amd64"
	Mirror string // "http://deb.debian.org"
	// MaxListAge is how old a suite's package lists may get before they are
	// downloaded again.
	MaxListAge time.Duration
	Log        io.Writer // progress messages (apt's output too)
}

// Kernel returns the kernel for series (such as "6.1"), fetching it if the
// cache does not have the newest package of the series.
func (f *Fetcher) Kernel(ctx context.Context, series string) (*Kernel, error) {
	suite, ok := seriesSuite[series]
	if !ok {
		return nil, fmt.Errorf("kernel %s: not a series the runner knows how to fetch (known: %s)", series, strings.Join(Series(), ", "))
	}
	cached := f.cachedReleases(series)
	pkgs, err := f.candidates(ctx, suite, series)
	if err != nil {
		if len(cached) > 0 {
			fmt.Fprintf(f.Log, "vmtest: kernel %s: %v; using the cached %s\n", series, err, cached[0])
			return f.kernel(series, cached[0], "linux-image-"+cached[0]+"-unsigned")
		}
		return nil, fmt.Errorf("kernel %s: %w", series, err)
	}
	// The newest first; a package the lists name may still be missing on
	// the mirror (a 404 between two list updates): then the next one.
	var tried []string
	for _, p := range pkgs[:min(len(pkgs), 3)] {
		if slices.Contains(cached, p.Release) {
			return f.kernel(series, p.Release, p.Name)
		}
		if err := f.download(ctx, suite, p); err != nil {
			fmt.Fprintf(f.Log, "vmtest: kernel %s: %v\n", series, err)
			tried = append(tried, p.Name)
			continue
		}
		// The older kernels of the series are not booted again: free their
		// ~100 MB each.
		for _, old := range cached {
			os.RemoveAll(filepath.Join(f.Cache, "kernels", old))
		}
		return f.kernel(series, p.Release, p.Name)
	}
	return nil, fmt.Errorf("kernel %s: could not download %s from Debian %s (apt-get's errors above)", series, strings.Join(tried, ", "), suite)
}

func (f *Fetcher) kernel(series, release, pkg string) (*Kernel, error) {
	root := filepath.Join(f.Cache, "kernels", release)
	k := &Kernel{Series: series, Release: release, Package: pkg, Vmlinuz: filepath.Join(root, "boot", "vmlinuz-"+release)}
	if _, err := os.Stat(k.Vmlinuz); err != nil {
		return nil, fmt.Errorf("kernel %s: package %s has no /boot/vmlinuz-%s: %w", series, pkg, release, err)
	}
	for _, dir := range []string{"lib/modules", "usr/lib/modules"} {
		if _, err := os.Stat(filepath.Join(root, dir, release, "modules.order")); err == nil {
			k.Modules = filepath.Join(root, dir, release)
			return k, nil
		}
	}
	return nil, fmt.Errorf("kernel %s: package %s has no modules.order under /lib/modules/%s", series, pkg, release)
}

// cachedReleases lists the extracted kernels of series and the fetcher's
// flavor, newest first.
func (f *Fetcher) cachedReleases(series string) []string {
	ents, _ := os.ReadDir(filepath.Join(f.Cache, "kernels"))
	var names []string
	for _, e := range ents {
		names = append(names, "linux-image-"+e.Name()+"-unsigned")
	}
	var rel []string
	for _, p := range ImagePackages(names, series, f.Flavor) {
		rel = append(rel, p.Release)
	}
	return rel
}

// ImagePackage is a Debian kernel image package: linux-image-<release>-unsigned.
type ImagePackage struct {
	Name    string
	Release string // uname -r of the kernel
	version []int  // upstream version, then the Debian ABI number if any
}

// imageRE matches linux-image-<upstream>[-<abi>][+<debian suffix>]-<flavor>-unsigned;
// the flavor is appended at use.
const imageRE = `^linux-image-((\d+(?:\.\d+)*)(?:-(\d+))?(?:\+[0-9a-z.~]+)?-%s)-unsigned$`

// ImagePackages picks the image packages of series and flavor among names
// (one per line of `apt-cache search`, "name - description" or a bare
// name), newest first. Series "6.1" matches 6.1.0-40 but not 6.12.117.
// The unsigned packages hold the same kernel as the signed ones without a
// dependency on the signing machinery.
func ImagePackages(names []string, series, flavor string) []ImagePackage {
	re := regexp.MustCompile(fmt.Sprintf(imageRE, regexp.QuoteMeta(flavor)))
	var out []ImagePackage
	for _, line := range names {
		name, _, _ := strings.Cut(strings.TrimSpace(line), " ")
		m := re.FindStringSubmatch(name)
		if m == nil {
			continue
		}
		upstream := m[2]
		if upstream != series && !strings.HasPrefix(upstream, series+".") {
			continue
		}
		v := versionParts(upstream)
		if m[3] != "" {
			abi, _ := strconv.Atoi(m[3])
			v = append(v, abi)
		}
		out = append(out, ImagePackage{Name: name, Release: m[1], version: v})
	}
	slices.SortStableFunc(out, func(a, b ImagePackage) int { return slices.Compare(b.version, a.version) })
	return slices.CompactFunc(out, func(a, b ImagePackage) bool { return a.Name == b.Name })
}

func versionParts(s string) []int {
	var v []int
	for _, f := range strings.Split(s, ".") {
		n, _ := strconv.Atoi(f)
		v = append(v, n)
	}
	return v
}

// aptDir is the private apt state of one Debian suite.
func (f *Fetcher) aptDir(suite string) string { return filepath.Join(f.Cache, "apt", suite) }

// aptOptions make apt-get and apt-cache use only the suite's private
// sources and lists.
func (f *Fetcher) aptOptions(suite string) []string {
	dir := f.aptDir(suite)
	opts := []string{
		"-o", "Dir::Etc::SourceList=" + filepath.Join(dir, "sources.list"),
		"-o", "Dir::Etc::SourceParts=" + filepath.Join(dir, "sources.list.d"),
		"-o", "Dir::State::Lists=" + filepath.Join(dir, "lists"),
		"-o", "Dir::Cache::pkgcache=", "-o", "Dir::Cache::srcpkgcache=",
	}
	if os.Geteuid() == 0 {
		// apt would download as the _apt user, who cannot write to a private
		// directory under root's cache.
		opts = append(opts, "-o", "APT::Sandbox::User=root")
	}
	return opts
}

// candidates lists the image packages of series in suite, newest first,
// updating the suite's private package lists when they are stale.
func (f *Fetcher) candidates(ctx context.Context, suite, series string) ([]ImagePackage, error) {
	for _, tool := range []string{"apt-get", "apt-cache", "dpkg-deb"} {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, fmt.Errorf("%s not found: kernels are fetched from Debian packages with apt-get and dpkg-deb (a Debian or Ubuntu host)", tool)
		}
	}
	if err := f.updateLists(ctx, suite); err != nil {
		return nil, err
	}
	pattern := fmt.Sprintf("^linux-image-%s.*-%s-unsigned$", regexp.QuoteMeta(series), regexp.QuoteMeta(f.Flavor))
	args := append(f.aptOptions(suite), "search", "--names-only", pattern)
	out, err := exec.CommandContext(ctx, "apt-cache", args...).Output()
	if err != nil {
		return nil, fmt.Errorf("apt-cache search %s in Debian %s: %w%s", pattern, suite, err, stderrOf(err))
	}
	pkgs := ImagePackages(strings.Split(string(out), "\n"), series, f.Flavor)
	if len(pkgs) == 0 {
		return nil, fmt.Errorf("no package linux-image-%s*-%s-unsigned in Debian %s (apt-cache search %s found none)", series, f.Flavor, suite, pattern)
	}
	return pkgs, nil
}

// updateLists writes the suite's sources.list and runs apt-get update on
// it unless its lists are younger than MaxListAge.
func (f *Fetcher) updateLists(ctx context.Context, suite string) error {
	dir := f.aptDir(suite)
	for _, d := range []string{"lists/partial", "sources.list.d"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return err
		}
	}
	if _, err := os.Stat(DebianKeyring); err != nil {
		return fmt.Errorf("%s is missing: install the package debian-archive-keyring", DebianKeyring)
	}
	var src strings.Builder
	for _, line := range debianSuites[suite] {
		archive, rest, _ := strings.Cut(line, " ")
		fmt.Fprintf(&src, "deb [signed-by=%s] %s/%s %s\n", DebianKeyring, f.Mirror, archive, rest)
	}
	list := filepath.Join(dir, "sources.list")
	old, _ := os.ReadFile(list)
	changed := string(old) != src.String()
	if changed {
		if err := os.WriteFile(list, []byte(src.String()), 0o644); err != nil {
			return err
		}
	}
	stamp := filepath.Join(dir, "updated")
	if st, err := os.Stat(stamp); err == nil && !changed && time.Since(st.ModTime()) < f.MaxListAge {
		return nil
	}
	fmt.Fprintf(f.Log, "vmtest: apt-get update of Debian %s (private lists in %s)\n", suite, dir)
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "apt-get", append(f.aptOptions(suite), "-q", "update")...)
	cmd.Stdout, cmd.Stderr = io.Discard, &stderr
	if err := cmd.Run(); err != nil {
		err = fmt.Errorf("apt-get update of Debian %s from %s: %w\n%s", suite, f.Mirror, err, stderr.String())
		if _, serr := os.Stat(stamp); serr == nil && !changed {
			fmt.Fprintf(f.Log, "vmtest: %v\nvmtest: using the package lists of the last update\n", err)
			return nil
		}
		return err
	}
	// apt-get update exits 0 when a source failed ("W: Failed to fetch").
	if bytes.Contains(stderr.Bytes(), []byte("Failed to fetch")) || bytes.Contains(stderr.Bytes(), []byte("E: ")) {
		fmt.Fprintf(f.Log, "vmtest: apt-get update of Debian %s:\n%s", suite, stderr.String())
	}
	return os.WriteFile(stamp, nil, 0o644)
}

// download fetches p with apt-get download and extracts it with dpkg-deb
// into kernels/<release>, renamed into place only when complete.
func (f *Fetcher) download(ctx context.Context, suite string, p ImagePackage) error {
	tmp, err := os.MkdirTemp(f.Cache, "download-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	fmt.Fprintf(f.Log, "vmtest: downloading %s from Debian %s\n", p.Name, suite)
	cmd := exec.CommandContext(ctx, "apt-get", append(f.aptOptions(suite), "-q", "download", p.Name)...)
	cmd.Dir = tmp
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("apt-get download %s (Debian %s): %w\n%s", p.Name, suite, err, out)
	}
	debs, _ := filepath.Glob(filepath.Join(tmp, "*.deb"))
	if len(debs) != 1 {
		return fmt.Errorf("apt-get download %s: want one .deb, got %d", p.Name, len(debs))
	}
	root := filepath.Join(tmp, "root")
	if out, err := exec.CommandContext(ctx, "dpkg-deb", "-x", debs[0], root).CombinedOutput(); err != nil {
		return fmt.Errorf("dpkg-deb -x %s: %w\n%s", filepath.Base(debs[0]), err, out)
	}
	kernels := filepath.Join(f.Cache, "kernels")
	if err := os.MkdirAll(kernels, 0o755); err != nil {
		return err
	}
	return os.Rename(root, filepath.Join(kernels, p.Release))
}

// stderrOf returns the stderr an *exec.ExitError captured, on its own line.
func stderrOf(err error) string {
	var ee *exec.ExitError
	if errors.As(err, &ee) && len(ee.Stderr) > 0 {
		return "\n" + strings.TrimSpace(string(ee.Stderr))
	}
	return ""
}
