package node

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// TestImageReproducible: `make image` on two clones of the same commit, in
// different directories, writes the same index digest; the index (oci/) has
// exactly a linux/amd64 and a linux/arm64 image, each the static binary of
// its machine (a little-endian ELF of EM_X86_64 resp. EM_AARCH64 with no
// interpreter and no DT_NEEDED) as its entrypoint, labelled with the version
// and commit; rlagent.tar is this machine's image of the index, and its
// binary runs and says its version. (The clones share the Go build cache:
// the binaries are linked in each, and -trimpath keeps the directories out
// of them; with RLAGENT_IMAGE_COLD=1 the second one builds with an empty
// cache, as on a fresh machine, which takes minutes.)
func TestImageReproducible(t *testing.T) {
	repo := repoRoot(t)
	head := strings.TrimSpace(run(t, repo, nil, "git", "rev-parse", "HEAD"))
	second := []string(nil)
	if os.Getenv("RLAGENT_IMAGE_COLD") == "1" {
		second = []string{"GOCACHE=" + t.TempDir()}
	}
	var refs []string
	for i, env := range [][]string{nil, second} {
		dir := filepath.Join(t.TempDir(), "clone"+string(rune('a'+i)))
		run(t, "", nil, "git", "clone", "--quiet", "--no-hardlinks", repo, dir)
		run(t, dir, nil, "git", "checkout", "--quiet", head)
		run(t, dir, env, "make", "image")
		ref, err := os.ReadFile(filepath.Join(dir, "bin/image/ref"))
		if err != nil {
			t.Fatal(err)
		}
		refs = append(refs, strings.TrimSpace(string(ref)))
		if i == 0 {
			configs := checkIndex(t, filepath.Join(dir, "bin/image/oci"), refs[0], head)
			if got, want := checkImage(t, filepath.Join(dir, "bin/image/rlagent.tar"), head), configs[runtime.GOARCH]; got != want {
				t.Errorf("rlagent.tar holds the image of config %s, want the index's linux/%s image (config %s)", got, runtime.GOARCH, want)
			}
		}
	}
	t.Logf("two builds of %s: %s, %s", head[:12], refs[0], refs[1])
	if refs[0] != refs[1] {
		t.Errorf("one commit built two images: %s and %s", refs[0], refs[1])
	}
}

// TestImageByDigest: `make image` writes IMAGE_DIR/kustomization.yaml, an
// overlay on deploy/ that names the image it just built by digest, and
// `make push` points it at the registry it pushed to and prints the
// `kustomize edit set image` line that pins an overlay of one's own. The
// overlay, rendered by kubectl kustomize (the kubectl that applies deploy/
// in TestDaemonSetOnRealNode), sets the DaemonSet's image to REPO@ the digest
// of the image index in oci/ and ref, with no tag: before the push with
// IMAGE_REPO, after it with the registry's repository (go-containerregistry's
// registry on loopback, which then serves that index and both of its
// images). deploy/ itself keeps a tag.
func TestImageByDigest(t *testing.T) {
	repo := repoRoot(t)
	dir := t.TempDir()
	const imageRepo = "registry.example.com/team/rlagent"
	vars := []string{"VERSION=digest-test", "IMAGE_DIR=" + dir, "IMAGE_REPO=" + imageRepo}
	run(t, repo, nil, "make", append([]string{"--no-print-directory", "-s", "image"}, vars...)...)
	ref, err := os.ReadFile(filepath.Join(dir, "ref"))
	if err != nil {
		t.Fatal(err)
	}
	_, digest, _ := strings.Cut(strings.TrimSpace(string(ref)), "@")
	var index struct {
		Manifests []struct{ MediaType, Digest string }
	}
	b, err := os.ReadFile(filepath.Join(dir, "oci", "index.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &index); err != nil {
		t.Fatal(err)
	}
	if len(index.Manifests) != 1 || index.Manifests[0].MediaType != ociIndex || index.Manifests[0].Digest != digest || !strings.HasPrefix(digest, "sha256:") {
		t.Fatalf("ref %q and the OCI layout's manifests %+v: want one image index, the ref's digest", ref, index.Manifests)
	}
	t.Logf("built %s", strings.TrimSpace(string(ref)))

	bins, err := k8stest.EnsureNodeBinaries(t.Context(), t.Logf)
	if err != nil {
		testenv.SkipOrFail(t, "no kubectl to render the overlay with: %v", err)
		return
	}
	kustomize := func(dir string) []string {
		t.Helper()
		return daemonSetImages(t, run(t, "", nil, bins["kubectl"], "kustomize", dir))
	}
	overlay, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s/kustomization.yaml:\n%s", dir, overlay)
	if got, want := kustomize(dir), imageRepo+"@"+digest; !slices.Equal(got, []string{want}) {
		t.Errorf("make image's overlay runs the images %v, want [%s]", got, want)
	}
	// deploy/ keeps a tag: a digest committed there would name the image of
	// another commit (the binary embeds git describe).
	if got := kustomize(filepath.Join(repo, "deploy")); len(got) != 1 || strings.Contains(got[0], "@") || !strings.HasPrefix(got[0], "ghcr.io/rlagent/rlagent:") {
		t.Errorf("deploy/ runs the images %v, want one ghcr.io/rlagent/rlagent:TAG", got)
	}

	// make push to a registry on loopback.
	reg := startRegistry(t, repo)
	out := run(t, repo, nil, "make", append([]string{"--no-print-directory", "-s", "push", "PUSH_TO=" + reg + "/team/rlagent:digest-test"}, vars...)...)
	t.Logf("make push:\n%s", out)
	pushed := reg + "/team/rlagent@" + digest
	if line := "kustomize edit set image ghcr.io/rlagent/rlagent=" + pushed; !slices.Contains(strings.Split(out, "\n"), line) {
		t.Errorf("make push did not print %q", line)
	}
	if got := kustomize(dir); !slices.Equal(got, []string{pushed}) {
		t.Errorf("after make push the overlay runs the images %v, want [%s]", got, pushed)
	}
	var pushedIndex struct {
		Manifests []struct{ MediaType, Digest string }
	}
	if err := json.Unmarshal(getManifest(t, reg, "team/rlagent", digest, ociIndex), &pushedIndex); err != nil {
		t.Fatalf("the pushed index: %v", err)
	}
	if len(pushedIndex.Manifests) != 2 {
		t.Errorf("the pushed index lists %+v, want two images", pushedIndex.Manifests)
	}
	for _, m := range pushedIndex.Manifests {
		getManifest(t, reg, "team/rlagent", m.Digest, m.MediaType)
	}
}

// The media types of an OCI image index and image manifest.
const (
	ociIndex    = "application/vnd.oci.image.index.v1+json"
	ociManifest = "application/vnd.oci.image.manifest.v1+json"
)

// getManifest fetches the manifest repo@digest of the registry at host,
// checks that its bytes are that digest and returns them.
func getManifest(t *testing.T, host, repo, digest, mediaType string) []byte {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://"+host+"/v2/"+repo+"/manifests/"+digest, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Accept", mediaType)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(body)
	if resp.StatusCode != http.StatusOK || "sha256:"+hex.EncodeToString(sum[:]) != digest {
		t.Errorf("the registry serves %s/%s@%s with status %d and digest sha256:%x, want 200 and that digest", host, repo, digest, resp.StatusCode, sum)
	}
	return body
}

// daemonSetImages returns the images of the DaemonSets' containers in a
// rendered kustomization.
func daemonSetImages(t *testing.T, rendered string) []string {
	t.Helper()
	var images []string
	for _, doc := range strings.Split(rendered, "\n---\n") {
		var obj struct {
			Kind string `json:"kind"`
			Spec struct {
				Template struct {
					Spec struct {
						InitContainers []struct{ Image string } `json:"initContainers"`
						Containers     []struct{ Image string } `json:"containers"`
					} `json:"spec"`
				} `json:"template"`
			} `json:"spec"`
		}
		if err := yaml.Unmarshal([]byte(doc), &obj); err != nil {
			t.Fatalf("rendered manifest: %v\n%s", err, doc)
		}
		if obj.Kind != "DaemonSet" {
			continue
		}
		for _, c := range append(obj.Spec.Template.Spec.InitContainers, obj.Spec.Template.Spec.Containers...) {
			images = append(images, c.Image)
		}
	}
	return images
}

// startRegistry runs go-containerregistry's in-memory registry (the module
// hack/tools/image builds with) on loopback and returns its host:port; it
// stops when t ends.
func startRegistry(t *testing.T, repo string) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "registry")
	run(t, filepath.Join(repo, "hack/tools/image"), nil, "go", "build", "-o", bin, "github.com/google/go-containerregistry/cmd/registry")
	cmd := exec.Command(bin, "-port", "0")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	port := make(chan int, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			var n int
			if _, after, ok := strings.Cut(sc.Text(), "serving on port "); ok {
				if _, err := fmt.Sscan(after, &n); err == nil {
					port <- n
				}
			}
		}
	}()
	select {
	case n := <-port:
		return fmt.Sprintf("localhost:%d", n)
	case <-time.After(30 * time.Second):
		t.Fatal("the registry did not say its port within 30 s")
		return ""
	}
}

// checkIndex reads the OCI layout of make image and checks that it names
// one image index, ref's digest, of exactly a linux/amd64 and a linux/arm64
// image, each the static binary of its machine labelled with commit. It
// returns the digests of the images' configs by architecture.
func checkIndex(t *testing.T, layoutDir, ref, commit string) map[string]string {
	t.Helper()
	// blob reads the blob digest and checks that its bytes are that digest.
	blob := func(digest string) []byte {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(layoutDir, "blobs", "sha256", strings.TrimPrefix(digest, "sha256:")))
		if err != nil {
			t.Fatal(err)
		}
		if sum := sha256.Sum256(b); "sha256:"+hex.EncodeToString(sum[:]) != digest {
			t.Fatalf("blob %s holds sha256:%x", digest, sum)
		}
		return b
	}
	type descriptor struct {
		MediaType, Digest string
		Platform          struct{ OS, Architecture, Variant string }
		Annotations       map[string]string
	}
	var top struct{ Manifests []descriptor }
	b, err := os.ReadFile(filepath.Join(layoutDir, "index.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &top); err != nil {
		t.Fatalf("index.json: %v", err)
	}
	tag, digest, _ := strings.Cut(ref, "@")
	if len(top.Manifests) != 1 || top.Manifests[0].MediaType != ociIndex || top.Manifests[0].Digest != digest || top.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != tag {
		t.Fatalf("index.json lists %+v, want one image index: %s named %s", top.Manifests, digest, tag)
	}
	var index struct {
		MediaType string
		Manifests []descriptor
	}
	if err := json.Unmarshal(blob(digest), &index); err != nil {
		t.Fatalf("index %s: %v", digest, err)
	}
	var platforms []string
	for _, m := range index.Manifests {
		platforms = append(platforms, m.Platform.OS+"/"+m.Platform.Architecture+m.Platform.Variant)
	}
	if want := []string{"linux/amd64", "linux/arm64"}; index.MediaType != ociIndex || !slices.Equal(platforms, want) {
		t.Fatalf("the index (%s) lists the platforms %v, want %v", index.MediaType, platforms, want)
	}

	machines := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}
	configs := make(map[string]string)
	for _, m := range index.Manifests {
		arch := m.Platform.Architecture
		var manifest struct {
			Config struct{ Digest string }
			Layers []struct{ MediaType, Digest string }
		}
		if err := json.Unmarshal(blob(m.Digest), &manifest); err != nil {
			t.Fatalf("manifest %s: %v", m.Digest, err)
		}
		if m.MediaType != ociManifest || len(manifest.Layers) != 1 {
			t.Fatalf("linux/%s: a %s of layers %+v, want an OCI image of one layer", arch, m.MediaType, manifest.Layers)
		}
		configs[arch] = manifest.Config.Digest
		cfg := imageConfig(t, blob(manifest.Config.Digest), commit)
		if cfg.OS != "linux" || cfg.Architecture != arch {
			t.Errorf("the index's linux/%s image has the config of %s/%s", arch, cfg.OS, cfg.Architecture)
		}
		bin := layerBinary(t, blob(manifest.Layers[0].Digest))
		f, err := elf.NewFile(bytes.NewReader(bin))
		if err != nil {
			t.Fatalf("linux/%s: the binary: %v", arch, err)
		}
		libs, err := f.ImportedLibraries()
		if err != nil {
			t.Fatalf("linux/%s: the binary's dynamic section: %v", arch, err)
		}
		var interp bool
		for _, p := range f.Progs {
			interp = interp || p.Type == elf.PT_INTERP
		}
		t.Logf("linux/%s: %s, %d bytes, a %s %s %s ELF, interpreter %t, needs %v", arch, m.Digest, len(bin), f.Machine, f.Class, f.Data, interp, libs)
		if f.Machine != machines[arch] || f.Class != elf.ELFCLASS64 || f.Data != elf.ELFDATA2LSB {
			t.Errorf("linux/%s: the binary is a %s %s %s ELF, want %s ELFCLASS64 ELFDATA2LSB", arch, f.Machine, f.Class, f.Data, machines[arch])
		}
		if interp || len(libs) > 0 {
			t.Errorf("linux/%s: the binary is dynamically linked (interpreter %t, DT_NEEDED %v), want a static one: the image has no libc", arch, interp, libs)
		}
	}
	return configs
}

// config is the part of an image's config that make image sets.
type config struct {
	Architecture, OS string
	Config           struct {
		Entrypoint []string
		Labels     map[string]string
	}
}

// imageConfig parses an image's config and checks its entrypoint and its
// revision label.
func imageConfig(t *testing.T, b []byte, commit string) config {
	t.Helper()
	var cfg config
	if err := json.Unmarshal(b, &cfg); err != nil {
		t.Fatalf("config: %v", err)
	}
	if cfg.Config.Labels["org.opencontainers.image.revision"] != commit {
		t.Errorf("%s/%s: revision label %q, want %s", cfg.OS, cfg.Architecture, cfg.Config.Labels["org.opencontainers.image.revision"], commit)
	}
	if len(cfg.Config.Entrypoint) != 1 || cfg.Config.Entrypoint[0] != "/usr/local/bin/rlagent" {
		t.Fatalf("%s/%s: entrypoint %v, want [/usr/local/bin/rlagent]", cfg.OS, cfg.Architecture, cfg.Config.Entrypoint)
	}
	return cfg
}

// checkImage reads an image tarball (the docker/ctr import format) and
// checks its config and its one layer. It returns the config's digest.
func checkImage(t *testing.T, path, commit string) string {
	t.Helper()
	files := tarFiles(t, path)
	var manifest []struct {
		Config   string
		RepoTags []string
		Layers   []string
	}
	if err := json.Unmarshal(files["manifest.json"], &manifest); err != nil {
		t.Fatalf("manifest.json: %v", err)
	}
	if len(manifest) != 1 || len(manifest[0].Layers) != 1 || len(manifest[0].RepoTags) != 1 {
		t.Fatalf("manifest.json: want one image of one layer with one tag, got %+v", manifest)
	}
	m := manifest[0]
	cfg := imageConfig(t, files[m.Config], commit)
	version := cfg.Config.Labels["org.opencontainers.image.version"]
	t.Logf("image %s: %s/%s, entrypoint %v, labels %v", m.RepoTags[0], cfg.OS, cfg.Architecture, cfg.Config.Entrypoint, cfg.Config.Labels)
	if want := "ghcr.io/rlagent/rlagent:" + version; m.RepoTags[0] != want || version == "" {
		t.Errorf("the image is tagged %s, want %s (the version label)", m.RepoTags[0], want)
	}
	if cfg.OS != "linux" || cfg.Architecture != runtime.GOARCH {
		t.Errorf("the image is for %s/%s, want linux/%s: the one that runs here", cfg.OS, cfg.Architecture, runtime.GOARCH)
	}

	bin := layerBinary(t, files[m.Layers[0]])
	exe := filepath.Join(t.TempDir(), "rlagent")
	if err := os.WriteFile(exe, bin, 0o755); err != nil {
		t.Fatal(err)
	}
	if out := strings.TrimSpace(run(t, "", nil, exe, "version")); out != "rlagent "+version {
		t.Errorf("the image's binary says %q, want %q", out, "rlagent "+version)
	}
	sum := sha256.Sum256(files[m.Config])
	return "sha256:" + hex.EncodeToString(sum[:])
}

// layerBinary reads an image's layer (a gzipped tar) and returns the binary
// in it. The layer holds the directories and the binary, nothing else, all
// owned by root.
func layerBinary(t *testing.T, layer []byte) []byte {
	t.Helper()
	gz, err := gzip.NewReader(bytes.NewReader(layer))
	if err != nil {
		t.Fatalf("layer: %v", err)
	}
	tr := tar.NewReader(gz)
	var bin []byte
	var names []string
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, h.Name)
		if h.Uid != 0 || h.Gid != 0 {
			t.Errorf("%s is owned by %d:%d, want root", h.Name, h.Uid, h.Gid)
		}
		if h.Name == "usr/local/bin/rlagent" {
			if bin, err = io.ReadAll(tr); err != nil {
				t.Fatal(err)
			}
		}
	}
	if bin == nil || len(names) != 4 {
		t.Fatalf("the layer holds %v, want usr/, usr/local/, usr/local/bin/ and usr/local/bin/rlagent", names)
	}
	return bin
}

// tarFiles reads the regular files of a tar archive.
func tarFiles(t *testing.T, path string) map[string][]byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	files := make(map[string][]byte)
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return files
		}
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if h.Typeflag != tar.TypeReg {
			continue
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		files[h.Name] = b
	}
}

// repoRoot is the checkout the test runs in.
func repoRoot(t *testing.T) string {
	t.Helper()
	return strings.TrimSpace(run(t, "", nil, "git", "rev-parse", "--show-toplevel"))
}

// run runs a command in dir with extra environment and returns its stdout;
// a failure fails the test with the command's output.
func run(t *testing.T, dir string, env []string, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s%s", name, strings.Join(args, " "), err, out, stderr.String())
	}
	return string(out)
}
