package vmtests

import (
	"bufio"
	"debug/elf"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// ManifestPath is where /init finds what to do.
const ManifestPath = "/vmtest.json"

// Manifest tells /init what to load and run.
type Manifest struct {
	// Modules are module files in the initramfs, in load order.
	Modules []string `json:"modules"`
	// Env is the suites' environment, KEY=value.
	Env []string `json:"env"`
	// Suites run one after another, each in /tmp.
	Suites []Suite `json:"suites"`
}

// Suite is one test binary and its arguments.
type Suite struct {
	Name string   `json:"name"` // for the report lines: no spaces
	Path string   `json:"path"` // in the VM
	Args []string `json:"args"`
}

// File is a host file copied into the initramfs.
type File struct {
	Src  string // on the host
	Dst  string // absolute path in the VM
	Mode fs.FileMode
}

// WriteInitramfs writes a newc cpio archive to out holding init as /init,
// the files, the manifest, /dev/console (without it the kernel gives /init
// no console) and the mount points /init uses.
func WriteInitramfs(out, init string, files []File, m Manifest) (err error) {
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}()
	bw := bufio.NewWriterSize(f, 1<<20)
	w := NewCPIOWriter(bw)
	dirs := map[string]bool{"/": true}
	var mkdirAll func(dir string) error
	mkdirAll = func(dir string) error {
		if dirs[dir] {
			return nil
		}
		if err := mkdirAll(path.Dir(dir)); err != nil {
			return err
		}
		dirs[dir] = true
		return w.Dir(dir, 0o755)
	}
	for _, d := range []string{"/dev", "/proc", "/sys", "/tmp", "/run"} {
		if err := mkdirAll(d); err != nil {
			return err
		}
	}
	if err := w.CharDev("/dev/console", 0o600, 5, 1); err != nil {
		return err
	}
	manifest, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return err
	}
	if err := w.File(ManifestPath, 0o644, int64(len(manifest)), strings.NewReader(string(manifest))); err != nil {
		return err
	}
	for _, fl := range append([]File{{Src: init, Dst: "/init", Mode: 0o755}}, files...) {
		if err := mkdirAll(path.Dir(fl.Dst)); err != nil {
			return err
		}
		if err := copyInto(w, fl); err != nil {
			return err
		}
	}
	if err := w.Close(); err != nil {
		return err
	}
	return bw.Flush()
}

func copyInto(w *CPIOWriter, fl File) error {
	src, err := os.Open(fl.Src)
	if err != nil {
		return err
	}
	defer src.Close()
	st, err := src.Stat()
	if err != nil {
		return err
	}
	if !st.Mode().IsRegular() {
		return fmt.Errorf("%s: not a regular file", fl.Src)
	}
	return w.File(fl.Dst, fl.Mode, st.Size(), src)
}

// CheckStatic fails unless path is an ELF executable without an
// interpreter: the VM has no dynamic loader and no libc.
func CheckStatic(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	defer f.Close()
	if f.Machine != elf.EM_X86_64 {
		return fmt.Errorf("%s: built for %v, the VM is x86-64", path, f.Machine)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("%s is dynamically linked and the VM has no libc: build it with CGO_ENABLED=0 (go test -c, go build)", path)
		}
	}
	return nil
}

// SuiteName is the report name of a test binary: its base name, which the
// report lines need without spaces.
func SuiteName(bin string) string {
	return strings.ReplaceAll(filepath.Base(bin), " ", "_")
}
