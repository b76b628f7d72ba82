package node

import (
	"archive/tar"
	"compress/gzip"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestImageReproducible: `make image` on two clones of the same commit, in
// different directories, writes the same digest; the image is the static
// binary as its entrypoint, labelled with the version and commit, and that
// binary runs and says its version. (The clones share the Go build cache:
// the binary is linked in each, and -trimpath keeps the directories out of
// it; with RLAGENT_IMAGE_COLD=1 the second one builds with an empty cache,
// as on a fresh machine, which takes minutes.)
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
			checkImage(t, filepath.Join(dir, "bin/image/rlagent.tar"), head)
		}
	}
	t.Logf("two builds of %s: %s, %s", head[:12], refs[0], refs[1])
	if refs[0] != refs[1] {
		t.Errorf("one commit built two images: %s and %s", refs[0], refs[1])
	}
}

// checkImage reads an image tarball (the docker/ctr import format) and
// checks its config and its one layer.
func checkImage(t *testing.T, path, commit string) {
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
	var cfg struct {
		Architecture, OS string
		Config           struct {
			Entrypoint []string
			Labels     map[string]string
		}
	}
	if err := json.Unmarshal(files[m.Config], &cfg); err != nil {
		t.Fatalf("config %s: %v", m.Config, err)
	}
	version := cfg.Config.Labels["org.opencontainers.image.version"]
	t.Logf("image %s: %s/%s, entrypoint %v, labels %v", m.RepoTags[0], cfg.OS, cfg.Architecture, cfg.Config.Entrypoint, cfg.Config.Labels)
	if want := "ghcr.io/rlagent/rlagent:" + version; m.RepoTags[0] != want || version == "" {
		t.Errorf("the image is tagged %s, want %s (the version label)", m.RepoTags[0], want)
	}
	if cfg.Config.Labels["org.opencontainers.image.revision"] != commit {
		t.Errorf("revision label %q, want %s", cfg.Config.Labels["org.opencontainers.image.revision"], commit)
	}
	if len(cfg.Config.Entrypoint) != 1 || cfg.Config.Entrypoint[0] != "/usr/local/bin/rlagent" {
		t.Fatalf("entrypoint %v, want [/usr/local/bin/rlagent]", cfg.Config.Entrypoint)
	}

	// The layer: directories and the binary, nothing else, owned by root.
	gz, err := gzip.NewReader(strings.NewReader(string(files[m.Layers[0]])))
	if err != nil {
		t.Fatalf("layer %s: %v", m.Layers[0], err)
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
	exe := filepath.Join(t.TempDir(), "rlagent")
	if err := os.WriteFile(exe, bin, 0o755); err != nil {
		t.Fatal(err)
	}
	if out := strings.TrimSpace(run(t, "", nil, exe, "version")); out != "rlagent "+version {
		t.Errorf("the image's binary says %q, want %q", out, "rlagent "+version)
	}
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
