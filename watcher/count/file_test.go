package count

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

func quietLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func write(t *testing.T, path, s string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// The last good count stands through every kind of bad file, and only the
// error and the age change.
func TestFileKeepsLastGoodCount(t *testing.T) {
	path := filepath.Join(t.TempDir(), "replicas")
	f := NewFile(path, time.Millisecond, quietLog())
	clock := time.Unix(1000, 0)
	f.now = func() time.Time { return clock }

	steps := []struct {
		name    string
		content *string // nil: remove the file
		changed bool
		want    int
		wantErr string
	}{
		{"missing at start", nil, true, 0, "no such file"},
		{"appears", sptr("3\n"), true, 3, ""},
		{"same count", sptr(" 3 "), false, 3, ""},
		{"changes", sptr("4"), true, 4, ""},
		{"malformed", sptr("four"), true, 4, "not an integer"},
		{"malformed again", sptr("four"), false, 4, "not an integer"},
		{"empty", sptr(""), true, 4, "empty"},
		{"negative", sptr("-2"), true, 4, "negative"},
		{"removed", nil, true, 4, "no such file"},
		{"back", sptr("2"), true, 2, ""},
		{"zero is a count", sptr("0"), true, 0, ""},
	}
	var lastGood time.Time
	for _, s := range steps {
		clock = clock.Add(time.Second)
		if s.content == nil {
			os.Remove(path)
		} else {
			write(t, path, *s.content)
		}
		if got := f.Poll(); got != s.changed {
			t.Errorf("%s: changed = %v, want %v", s.name, got, s.changed)
		}
		o := f.Observe("any")
		if o.Replicas != s.want {
			t.Errorf("%s: replicas = %d, want %d", s.name, o.Replicas, s.want)
		}
		if s.wantErr == "" {
			if o.Err != nil {
				t.Errorf("%s: err = %v, want none", s.name, o.Err)
			}
			lastGood = clock
		} else if o.Err == nil || !strings.Contains(o.Err.Error(), s.wantErr) {
			t.Errorf("%s: err = %v, want one containing %q", s.name, o.Err, s.wantErr)
		}
		if o.At != lastGood {
			t.Errorf("%s: observed at %v, want the last good read %v", s.name, o.At, lastGood)
		}
	}
	if !errors.Is(func() error { write(t, path, ""); f.Poll(); return f.Observe("").Err }(), ErrEmpty) {
		t.Error("empty file error does not wrap ErrEmpty")
	}
}

// A FIFO renamed over the count file, with no writer, is refused at once:
// opening it for reading without O_NONBLOCK would wait for a writer forever
// and stall the poll loop (and with it every count change). The last good
// count stands.
func TestFileFIFODoesNotHang(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "replicas")
	write(t, path, "3")
	f := NewFile(path, time.Millisecond, quietLog())
	f.Poll()
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(fifo, path); err != nil {
		t.Fatal(err)
	}

	done := make(chan bool, 1)
	go func() { done <- f.Poll() }()
	select {
	case changed := <-done:
		if !changed {
			t.Error("Poll did not report the new error state")
		}
	case <-time.After(5 * time.Second):
		// Let the blocked open return, so the goroutine ends with the test.
		if w, err := os.OpenFile(path, os.O_WRONLY|syscall.O_NONBLOCK, 0); err == nil {
			w.Close()
		}
		<-done
		t.Fatal("Poll blocked for 5 s on a FIFO without a writer")
	}
	o := f.Observe("")
	if o.Replicas != 3 || !errors.Is(o.Err, ErrNotRegular) || !strings.Contains(o.Err.Error(), "FIFO") {
		t.Errorf("observation %+v: want the last count 3 and an error wrapping ErrNotRegular that names a FIFO", o)
	}

	// A directory is refused the same way.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(path, 0o700); err != nil {
		t.Fatal(err)
	}
	f.Poll()
	if o := f.Observe(""); o.Replicas != 3 || !errors.Is(o.Err, ErrNotRegular) {
		t.Errorf("directory: observation %+v: want the last count 3 and ErrNotRegular", o)
	}
}

// A huge file at the count path (here 100 MB, sparse, starting with a
// valid count) is refused after reading its first bytes: Poll allocates
// next to nothing, the last good count stands, and the warning it logs is
// one short line, not the file.
func TestFileHugeFileReadsOnlyItsHead(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "replicas")
	write(t, path, "5")
	var logs bytes.Buffer
	f := NewFile(path, time.Millisecond, slog.New(slog.NewTextHandler(&logs, nil)))
	f.Poll()

	huge := filepath.Join(dir, "huge")
	hf, err := os.Create(huge)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := hf.WriteString("7\n"); err != nil {
		t.Fatal(err)
	}
	if err := hf.Truncate(100 << 20); err != nil {
		t.Fatal(err)
	}
	hf.Close()
	if err := os.Rename(huge, path); err != nil {
		t.Fatal(err)
	}

	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	f.Poll()
	runtime.ReadMemStats(&after)
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 1<<20 {
		t.Errorf("Poll of a 100 MB file allocated %d bytes: it reads more than the head", alloc)
	}
	o := f.Observe("")
	if o.Replicas != 5 || o.Err == nil || !strings.Contains(o.Err.Error(), "more than 64 bytes") {
		t.Errorf("observation %+v: want the last count 5 and a \"more than 64 bytes\" error", o)
	}
	checkLogLines(t, &logs, path, 1)
}

// A malformed count is quoted in the error and the log, cut to a bounded
// excerpt.
func TestFileErrorExcerptIsBounded(t *testing.T) {
	path := filepath.Join(t.TempDir(), "replicas")
	var logs bytes.Buffer
	f := NewFile(path, time.Millisecond, slog.New(slog.NewTextHandler(&logs, nil)))
	for _, content := range []string{
		strings.Repeat("x", 60),      // short enough to parse, not a number
		strings.Repeat("\x00", 4096), // NULs quote to four bytes each
	} {
		write(t, path, content)
		f.Poll()
		err := f.Observe("").Err
		if err == nil || !strings.Contains(err.Error(), `"...`) || len(strings.ReplaceAll(err.Error(), path, "")) > 200 {
			t.Errorf("error for %d bytes: %v: want a cut excerpt, under 200 characters besides the path", len(content), err)
		}
	}
	checkLogLines(t, &logs, path, 2)
}

// checkLogLines fails unless logs holds want lines, each short once the
// path (which the line names twice) is left out.
func checkLogLines(t *testing.T, logs *bytes.Buffer, path string, want int) {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	if len(lines) != want {
		t.Errorf("%d log lines, want %d", len(lines), want)
	}
	for _, l := range lines {
		if n := len(strings.ReplaceAll(l, path, "")); n > 512 {
			t.Errorf("a log line of %d bytes besides the path (%.200s...): want a bounded excerpt", n, l)
		}
	}
}

func TestFileRunNotifies(t *testing.T) {
	path := filepath.Join(t.TempDir(), "replicas")
	write(t, path, "1")
	f := NewFile(path, 5*time.Millisecond, quietLog())
	ctx, cancel := context.WithCancel(context.Background())
	var calls atomic.Int32
	done := make(chan struct{})
	go func() { f.Run(ctx, func() { calls.Add(1) }); close(done) }()

	waitFor(t, func() bool { return f.Observe("").Replicas == 1 })
	write(t, path, "5")
	waitFor(t, func() bool { return f.Observe("").Replicas == 5 })
	cancel()
	<-done
	if n := calls.Load(); n != 2 {
		t.Fatalf("notified %d times, want 2 (first read, change)", n)
	}
}

func TestStatic(t *testing.T) {
	s := NewStatic(4)
	if o := s.Observe("x"); o.Replicas != 4 || o.Local != 4 || o.Err != nil || o.Age(time.Now()) != 0 {
		t.Fatalf("static observation %+v", o)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met in 5 s")
		}
		time.Sleep(time.Millisecond)
	}
}

func sptr(s string) *string { return &s }
