package vmtests

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// entry is one archive member as a reader sees it.
type entry struct {
	name         string
	mode         uint32
	nlink        uint32
	rmaj, rmin   uint32
	data         string
	headerOffset int
}

// readNewc is a reader written from the format's description
// (Documentation/driver-api/early-userspace/buffer-format.rst), not from
// the writer: it checks the magic, the zero check field, the NUL after each
// name, the padding bytes, and that the archive ends right after the
// trailer's padding.
func readNewc(t *testing.T, b []byte) []entry {
	t.Helper()
	var out []entry
	off := 0
	align := func() {
		for off%4 != 0 {
			if off >= len(b) || b[off] != 0 {
				t.Fatalf("offset %d: padding byte is not NUL", off)
			}
			off++
		}
	}
	for {
		start := off
		if off+110 > len(b) {
			t.Fatalf("offset %d: truncated header (archive is %d bytes)", off, len(b))
		}
		h := string(b[off : off+110])
		if h[:6] != "070701" {
			t.Fatalf("offset %d: magic %q", off, h[:6])
		}
		field := func(i int) uint32 {
			v, err := strconv.ParseUint(h[6+8*i:14+8*i], 16, 32)
			if err != nil {
				t.Fatalf("offset %d: field %d %q: %v", off, i, h[6+8*i:14+8*i], err)
			}
			return uint32(v)
		}
		// ino mode uid gid nlink mtime filesize devmajor devminor rdevmajor rdevminor namesize check
		size, namesize := int(field(6)), int(field(11))
		if field(12) != 0 {
			t.Fatalf("offset %d: check field %d, want 0 for newc", off, field(12))
		}
		off += 110
		name := b[off : off+namesize]
		if name[namesize-1] != 0 {
			t.Fatalf("offset %d: name %q is not NUL-terminated", off, name)
		}
		off += namesize
		align()
		e := entry{name: string(name[:namesize-1]), mode: field(1), nlink: field(4), rmaj: field(9), rmin: field(10), headerOffset: start}
		if e.name == "TRAILER!!!" {
			if off != len(b) {
				t.Fatalf("%d bytes after the trailer", len(b)-off)
			}
			return out
		}
		e.data = string(b[off : off+size])
		off += size
		align()
		out = append(out, e)
	}
}

// sampleArchive holds every kind of entry the initramfs uses, with names
// and sizes that exercise each padding length.
func sampleArchive(t *testing.T) ([]byte, []entry) {
	t.Helper()
	want := []entry{
		{name: "dev", mode: 0o40755, nlink: 2},
		{name: "dev/console", mode: 0o20600, nlink: 1, rmaj: 5, rmin: 1},
		{name: "a", mode: 0o100644, nlink: 1, data: ""},
		{name: "bb", mode: 0o100755, nlink: 1, data: "x"},
		{name: "ccc", mode: 0o100644, nlink: 1, data: "xyz"},
		{name: "dddd", mode: 0o100644, nlink: 1, data: "1234"},
		{name: "suites/bpf.test", mode: 0o100755, nlink: 1, data: strings.Repeat("\x7fELF", 1001) + "!"},
	}
	var buf bytes.Buffer
	w := NewCPIOWriter(&buf)
	for _, e := range want {
		var err error
		switch e.mode &^ 0o7777 {
		case 0o40000:
			err = w.Dir("/"+e.name, os.FileMode(e.mode&0o777))
		case 0o20000:
			err = w.CharDev("/"+e.name, os.FileMode(e.mode&0o777), e.rmaj, e.rmin)
		default:
			err = w.File(e.name, os.FileMode(e.mode&0o777), int64(len(e.data)), strings.NewReader(e.data))
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes(), want
}

func TestCPIORoundTrip(t *testing.T) {
	b, want := sampleArchive(t)
	if len(b)%4 != 0 {
		t.Errorf("archive is %d bytes, not a multiple of 4", len(b))
	}
	got := readNewc(t, b)
	if len(got) != len(want) {
		t.Fatalf("read %d entries, wrote %d", len(got), len(want))
	}
	for i := range want {
		g, w := got[i], want[i]
		if g.name != w.name || g.mode != w.mode || g.nlink != w.nlink || g.rmaj != w.rmaj || g.rmin != w.rmin || g.data != w.data {
			t.Errorf("entry %d: got %s mode %o nlink %d rdev %d:%d %d bytes; want %s mode %o nlink %d rdev %d:%d %d bytes",
				i, g.name, g.mode, g.nlink, g.rmaj, g.rmin, len(g.data), w.name, w.mode, w.nlink, w.rmaj, w.rmin, len(w.data))
		}
		if g.headerOffset%4 != 0 {
			t.Errorf("entry %s: header at offset %d, not 4-aligned", g.name, g.headerOffset)
		}
	}
}

// TestCPIOGNUCpio reads the archive with GNU cpio, when installed (Debian
// package cpio): the listing and every file's contents.
func TestCPIOGNUCpio(t *testing.T) {
	if _, err := exec.LookPath("cpio"); err != nil {
		t.Skip("GNU cpio not installed (Debian package cpio)")
	}
	b, want := sampleArchive(t)
	list := exec.Command("cpio", "-t", "-v", "--quiet")
	list.Stdin = bytes.NewReader(b)
	out, err := list.CombinedOutput()
	if err != nil {
		t.Fatalf("cpio -t: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != len(want) {
		t.Fatalf("cpio -t lists %d entries, want %d:\n%s", len(lines), len(want), out)
	}
	for i, w := range want {
		if !strings.HasSuffix(lines[i], " "+w.name) {
			t.Errorf("cpio -t line %d: %q, want the name %s", i, lines[i], w.name)
		}
		perm := fmt.Sprintf("%v", os.FileMode(w.mode&0o777))[1:]
		if !strings.Contains(lines[i], perm) {
			t.Errorf("cpio -t line %d: %q, want permissions %s", i, lines[i], perm)
		}
	}
	if !strings.HasPrefix(lines[1], "crw-------") || !strings.Contains(lines[1], "5,") {
		t.Errorf("cpio -t: /dev/console is %q, want a character device 5,1", lines[1])
	}

	dir := t.TempDir()
	extract := exec.Command("cpio", "-i", "-d", "--quiet", "--no-absolute-filenames", "a", "bb", "ccc", "dddd", "suites/bpf.test")
	extract.Dir = dir
	extract.Stdin = bytes.NewReader(b)
	if out, err := extract.CombinedOutput(); err != nil {
		t.Fatalf("cpio -i: %v\n%s", err, out)
	}
	for _, w := range want[2:] {
		f, err := os.Open(filepath.Join(dir, w.name))
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(f)
		f.Close()
		if err != nil || string(got) != w.data {
			t.Errorf("%s: cpio extracted %d bytes (%v), want %d", w.name, len(got), err, len(w.data))
		}
	}
}

func TestCPIORejects(t *testing.T) {
	w := NewCPIOWriter(io.Discard)
	if err := w.File("", 0o644, 0, strings.NewReader("")); err == nil {
		t.Error("empty name accepted")
	}
	if err := w.File("x", 0o644, 5, strings.NewReader("abc")); err == nil {
		t.Error("short data accepted")
	}
}

// TestWriteInitramfs checks the layout the kernel and /init rely on: every
// directory before what it holds, /dev/console, /init, the manifest.
func TestWriteInitramfs(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	init, suite, mod := write("vminit", "init!"), write("bpf.test", "suite"), write("veth.ko.xz", "module")
	out := filepath.Join(dir, "initrd.cpio")
	man := Manifest{Modules: []string{"/modules/veth.ko.xz"}, Env: []string{"A=1"}, Suites: []Suite{{Name: "bpf.test", Path: "/suites/bpf.test", Args: []string{"-test.v"}}}}
	files := []File{{Src: suite, Dst: "/suites/bpf.test", Mode: 0o755}, {Src: mod, Dst: "/modules/veth.ko.xz", Mode: 0o644}}
	if err := WriteInitramfs(out, init, files, man); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]entry{}
	for _, e := range readNewc(t, b) {
		if parent := filepath.Dir(e.name); parent != "." {
			if p, ok := seen[parent]; !ok || p.mode&0o170000 != 0o40000 {
				t.Errorf("%s comes before its directory %s", e.name, parent)
			}
		}
		seen[e.name] = e
	}
	for name, want := range map[string]struct {
		mode uint32
		data string
	}{
		"dev/console":        {0o20600, ""},
		"init":               {0o100755, "init!"},
		"suites/bpf.test":    {0o100755, "suite"},
		"modules/veth.ko.xz": {0o100644, "module"},
		"vmtest.json":        {0o100644, ""},
		"proc":               {0o40755, ""},
		"sys":                {0o40755, ""},
		"tmp":                {0o40755, ""},
	} {
		e, ok := seen[name]
		if !ok {
			t.Errorf("no %s", name)
			continue
		}
		if e.mode != want.mode || (want.data != "" && e.data != want.data) {
			t.Errorf("%s: mode %o, %q; want mode %o, %q", name, e.mode, e.data, want.mode, want.data)
		}
	}
	if c := seen["dev/console"]; c.rmaj != 5 || c.rmin != 1 {
		t.Errorf("/dev/console is %d:%d, want 5:1", c.rmaj, c.rmin)
	}
	var got Manifest
	if err := json.Unmarshal([]byte(seen["vmtest.json"].data), &got); err != nil {
		t.Fatal(err)
	}
	if len(got.Suites) != 1 || got.Suites[0].Path != "/suites/bpf.test" || got.Modules[0] != "/modules/veth.ko.xz" || got.Env[0] != "A=1" {
		t.Errorf("manifest %+v, want %+v", got, man)
	}
}
