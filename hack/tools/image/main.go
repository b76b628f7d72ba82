// Command image builds and pushes the rlagent container image without a
// container daemon (`make image`, `make push`).
//
// The image is an OCI image index with one image per --binary (make image
// gives it linux/amd64 and linux/arm64), each one layer on an empty base: the
// static rlagent binary at /usr/local/bin/rlagent, its entrypoint. A
// binary's platform is read from its ELF header, never from a flag, so that a
// label cannot disagree with the bytes it names. Everything in the index is a
// function of the binaries and the flags (file times and the images'
// creation time are the commit's time), so that the same commit builds the
// same digest.
//
// Beside the index, build writes kustomization.yaml: an overlay on deploy/
// that names the index it just built by digest, so that what runs is what
// was built (a tag can be moved; deploy/ keeps one, since a digest committed
// there would change the commit the binary describes). A node's runtime picks
// its platform's image from the index. push points that overlay at the
// registry it pushed to and prints the line that pins an overlay of one's
// own the same way.
//
//	image build --binary bin/rlagent-amd64 --binary bin/rlagent-arm64 --repo ghcr.io/rlagent/rlagent --version v0.1.0 \
//	    --revision $(git rev-parse HEAD) --created $(git log -1 --format=%ct) --out bin/image --deploy deploy
//	image push --from bin/image/oci --to registry.example.com/rlagent:v0.1.0 --overlay bin/image/kustomization.yaml
package main

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Where the binary lives in the image by default; deploy/daemonset.yaml
// relies on it being the entrypoint.
const defaultPath = "usr/local/bin/rlagent"

// deployImage is the image's name in deploy/ (daemonset.yaml and the
// images: of kustomization.yaml), which an overlay's images: entry matches.
const deployImage = "ghcr.io/rlagent/rlagent"

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "build":
		err = build(os.Args[2:])
	case "push":
		err = push(os.Args[2:])
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "image "+os.Args[1]+":", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, `usage: image build --binary FILE [--binary FILE...] --repo REPO --version V [--revision SHA] [--created UNIX] [--load ARCH] --out DIR [--deploy DIR]
       image push --from DIR/oci --to REGISTRY/REPO:TAG [--overlay DIR/kustomization.yaml]`)
	os.Exit(2)
}

func build(args []string) error {
	fs := flag.NewFlagSet("build", flag.ExitOnError)
	var binaries []string
	fs.Func("binary", "a static linux rlagent binary, one per platform (repeat it); the index lists them in this order", func(s string) error {
		binaries = append(binaries, s)
		return nil
	})
	repo := fs.String("repo", "ghcr.io/rlagent/rlagent", "the image's repository, as deploy/kustomization.yaml names it")
	version := fs.String("version", "", "the version: the image's tag and its org.opencontainers.image.version")
	revision := fs.String("revision", "", "the commit (org.opencontainers.image.revision)")
	created := fs.String("created", "0", "the image's creation time, Unix seconds (the commit's time, for a reproducible digest)")
	load := fs.String("load", runtime.GOARCH, "the architecture whose image DIR/rlagent.tar holds (a tarball holds one image); the default, this machine's, falls back to the first --binary's")
	path := fs.String("path", defaultPath, "where the binary goes in the image, without the leading /: the image's entrypoint")
	out := fs.String("out", "", "the output directory: DIR/rlagent.tar (the --load image, a tarball for `ctr images import`, `docker load`), DIR/oci (an OCI image layout of the index), DIR/ref and DIR/kustomization.yaml")
	deploy := fs.String("deploy", "", "deploy/, the kustomization that DIR/kustomization.yaml overlays with the image's digest (none if empty)")
	fs.Parse(args)
	if len(binaries) == 0 || *version == "" || *out == "" {
		return errors.New("--binary, --version and --out are required")
	}
	secs, err := strconv.ParseInt(*created, 10, 64)
	if err != nil {
		return fmt.Errorf("--created %q: want Unix seconds: %w", *created, err)
	}
	when := time.Unix(secs, 0).UTC()
	tag, err := name.NewTag(*repo + ":" + *version)
	if err != nil {
		return fmt.Errorf("--repo %q --version %q: not an image reference: %w", *repo, *version, err)
	}
	labels := map[string]string{
		"org.opencontainers.image.title":    filepath.Base(*path),
		"org.opencontainers.image.source":   "https://github.com/rlagent/rlagent",
		"org.opencontainers.image.version":  *version,
		"org.opencontainers.image.revision": *revision,
	}
	var idx v1.ImageIndex = empty.Index
	var archs []string
	var loaded v1.Image
	for _, binary := range binaries {
		bin, err := os.ReadFile(binary)
		if err != nil {
			return err
		}
		arch, err := checkStatic(bin)
		if err != nil {
			return fmt.Errorf("%s: %w", binary, err)
		}
		if slices.Contains(archs, arch) {
			return fmt.Errorf("%s: a second linux/%s binary; want one per platform", binary, arch)
		}
		archs = append(archs, arch)
		img, err := image(bin, strings.TrimPrefix(*path, "/"), when, arch, labels)
		if err != nil {
			return err
		}
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{
			Add:        img,
			Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: arch}},
		})
		if arch == *load || loaded == nil {
			loaded = img
		}
	}

	// Written beside and renamed into place: a failed build leaves the
	// previous image whole.
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return err
	}
	tmp, err := os.MkdirTemp(*out, ".build-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	// The tarball format (docker's) holds images, not an index: it gets
	// the one that runs here, which `docker load` and a plain `ctr images
	// import` take without a --platform.
	if err := tarball.WriteToFile(filepath.Join(tmp, "rlagent.tar"), tag, loaded); err != nil {
		return err
	}
	// The layout's index.json names the image index, as an OCI exporter
	// does, so that the ref.name annotation tags the whole index.
	p, err := layout.Write(filepath.Join(tmp, "oci"), empty.Index)
	if err != nil {
		return err
	}
	if err := p.AppendIndex(idx, layout.WithAnnotations(map[string]string{
		"org.opencontainers.image.ref.name": tag.Name(),
	})); err != nil {
		return err
	}
	digest, err := idx.Digest()
	if err != nil {
		return err
	}
	ref := tag.Name() + "@" + digest.String()
	if err := os.WriteFile(filepath.Join(tmp, "ref"), []byte(ref+"\n"), 0o644); err != nil {
		return err
	}
	files := []string{"rlagent.tar", "oci", "ref"}
	if *deploy != "" {
		if err := writeOverlay(filepath.Join(tmp, "kustomization.yaml"), *out, *deploy, tag.Context().Name(), digest.String()); err != nil {
			return err
		}
		files = append(files, "kustomization.yaml")
	}
	for _, f := range files {
		if err := os.RemoveAll(filepath.Join(*out, f)); err != nil {
			return err
		}
		if err := os.Rename(filepath.Join(tmp, f), filepath.Join(*out, f)); err != nil {
			return err
		}
	}
	fmt.Println(ref)
	return nil
}

// writeOverlay writes to path the kustomization of the directory dir: deploy
// (its path relative to dir, as kustomize wants it) with the image named by
// digest.
func writeOverlay(path, dir, deploy, repo, digest string) error {
	absDir, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	absDeploy, err := filepath.Abs(deploy)
	if err != nil {
		return err
	}
	if _, err := os.Stat(filepath.Join(absDeploy, "kustomization.yaml")); err != nil {
		return fmt.Errorf("--deploy %s: not a kustomization: %w", deploy, err)
	}
	rel, err := filepath.Rel(absDir, absDeploy)
	if err != nil {
		return fmt.Errorf("--deploy %s: no path to it from --out %s: %w", deploy, dir, err)
	}
	return os.WriteFile(path, []byte(overlay(filepath.ToSlash(rel), repo, digest)), 0o644)
}

// overlay is the text of an overlay on the kustomization at base that
// names the image repo@digest.
func overlay(base, repo, digest string) string {
	return fmt.Sprintf(`# Written by make image (make push names the registry it pushed to): %[1]s
# with the image it built, by digest. A tag can be moved; a digest names
# these bytes only. Deploy with: kubectl apply -k <this directory>
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - %[1]s
images:
  - name: %[2]s
    newName: %[3]s
    digest: %[4]s
`, base, deployImage, repo, digest)
}

// repoint rewrites the overlay that build wrote so that it names repo (where
// push put the image), with the same base and digest.
func repoint(path, repo, digest string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	base := ""
	lines := strings.Split(string(b), "\n")
	for i, l := range lines {
		if l == "resources:" && i+1 < len(lines) {
			base = strings.TrimPrefix(strings.TrimSpace(lines[i+1]), "- ")
		}
	}
	if base == "" {
		return fmt.Errorf("%s: no resources: entry; not the overlay make image writes", path)
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(overlay(base, repo, digest)), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// image is the one-layer image of bin at binaryPath.
func image(bin []byte, binaryPath string, when time.Time, arch string, labels map[string]string) (v1.Image, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	var dirs []string
	for d := filepath.Dir(binaryPath); d != "."; d = filepath.Dir(d) {
		dirs = append([]string{d + "/"}, dirs...)
	}
	for _, dir := range dirs {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: dir, Mode: 0o755, ModTime: when, Format: tar.FormatPAX}); err != nil {
			return nil, err
		}
	}
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: binaryPath, Mode: 0o755, Size: int64(len(bin)), ModTime: when, Format: tar.FormatPAX}); err != nil {
		return nil, err
	}
	if _, err := tw.Write(bin); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(buf.Bytes())), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, err
	}

	base := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	base = mutate.ConfigMediaType(base, types.OCIConfigJSON)
	cf, err := base.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.Architecture, cf.OS = arch, "linux"
	cf.Created = v1.Time{Time: when}
	cf.Config.Entrypoint = []string{"/" + binaryPath}
	cf.Config.WorkingDir = "/"
	cf.Config.Labels = labels
	base, err = mutate.ConfigFile(base, cf)
	if err != nil {
		return nil, err
	}
	return mutate.Append(base, mutate.Addendum{
		Layer:     layer,
		MediaType: types.OCILayer,
		History:   v1.History{Created: v1.Time{Time: when}, CreatedBy: "make image: " + binaryPath},
	})
}

// goArch is the GOARCH of each ELF machine an image is built for.
var goArch = map[elf.Machine]string{
	elf.EM_X86_64:  "amd64",
	elf.EM_AARCH64: "arm64",
}

// checkStatic returns the GOARCH of a static linux binary. It refuses one
// that needs a dynamic loader (the image has no libc) and a machine the
// index has no platform for.
func checkStatic(bin []byte) (string, error) {
	f, err := elf.NewFile(bytes.NewReader(bin))
	if err != nil {
		return "", fmt.Errorf("not an ELF binary: %w", err)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return "", errors.New("dynamically linked (it names an ELF interpreter): build it with CGO_ENABLED=0, the image has no libc")
		}
	}
	libs, err := f.ImportedLibraries()
	if err != nil {
		return "", fmt.Errorf("read its dynamic section: %w", err)
	}
	if len(libs) > 0 {
		return "", fmt.Errorf("dynamically linked (it needs %v): build it with CGO_ENABLED=0, the image has no libc", libs)
	}
	arch, ok := goArch[f.Machine]
	if !ok || f.Class != elf.ELFCLASS64 || f.Data != elf.ELFDATA2LSB {
		return "", fmt.Errorf("a %s %s %s binary: want a little-endian amd64 or arm64 one", f.Machine, f.Class, f.Data)
	}
	return arch, nil
}

func push(args []string) error {
	fs := flag.NewFlagSet("push", flag.ExitOnError)
	from := fs.String("from", "", "the OCI image layout `make image` wrote (bin/image/oci): one image index")
	to := fs.String("to", "", "where to push: REGISTRY/REPO:TAG (credentials from ~/.docker/config.json, as docker login writes them)")
	insecure := fs.Bool("insecure", false, "allow a registry over plain HTTP")
	ov := fs.String("overlay", "", "the overlay `image build` wrote (bin/image/kustomization.yaml), to point at the pushed image (left alone if empty)")
	fs.Parse(args)
	if *from == "" || *to == "" {
		return errors.New("--from and --to are required")
	}
	var opts []name.Option
	if *insecure {
		opts = append(opts, name.Insecure)
	}
	ref, err := name.ParseReference(*to, opts...)
	if err != nil {
		return fmt.Errorf("--to %q: not an image reference: %w", *to, err)
	}
	p, err := layout.FromPath(*from)
	if err != nil {
		return fmt.Errorf("--from %s: %w (run make image first)", *from, err)
	}
	idx, err := p.ImageIndex()
	if err != nil {
		return err
	}
	m, err := idx.IndexManifest()
	if err != nil {
		return err
	}
	if len(m.Manifests) != 1 || !m.Manifests[0].MediaType.IsIndex() {
		return fmt.Errorf("--from %s: want one image index in the layout, found %d descriptors (run make image again)", *from, len(m.Manifests))
	}
	images, err := idx.ImageIndex(m.Manifests[0].Digest)
	if err != nil {
		return err
	}
	// The index with every image in it: a node pulls its platform's.
	if err := remote.WriteIndex(ref, images, remote.WithAuthFromKeychain(authn.DefaultKeychain)); err != nil {
		return err
	}
	repo, digest := ref.Context().Name(), m.Manifests[0].Digest.String()
	if *ov != "" {
		if err := repoint(*ov, repo, digest); err != nil {
			return fmt.Errorf("--overlay: %w", err)
		}
		fmt.Fprintf(os.Stderr, "%s names %s@%s: kubectl apply -k %s\n", *ov, repo, digest, filepath.Dir(*ov))
	}
	// Deploy by digest: the line for deploy/ or an overlay of one's own.
	fmt.Printf("kustomize edit set image %s=%s@%s\n", deployImage, repo, digest)
	return nil
}
