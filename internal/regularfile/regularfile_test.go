package regularfile

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// readWithin runs Read in a goroutine and fails the test if it has not
// returned by the deadline: a FIFO must not block it.
func readWithin(t *testing.T, path string, limit int64) ([]byte, error) {
	t.Helper()
	type result struct {
		b   []byte
		err error
	}
	done := make(chan result, 1)
	go func() {
		b, err := Read(path, limit)
		done <- result{b, err}
	}()
	select {
	case r := <-done:
		return r.b, r.err
	case <-time.After(10 * time.Second):
		t.Fatalf("Read(%s) has not returned after 10s", path)
		return nil, nil
	}
}

// TestRead: a regular file is read; a FIFO without a writer, /dev/zero and
// a directory are refused at once, naming their kind; a file over the
// limit is refused with its first limit+1 bytes, not read to the end.
func TestRead(t *testing.T) {
	dir := t.TempDir()
	regular := filepath.Join(dir, "regular")
	if err := os.WriteFile(regular, []byte("hello"), 0o644); err != nil {
		t.Fatal(err)
	}
	if b, err := readWithin(t, regular, 5); err != nil || string(b) != "hello" {
		t.Errorf("regular file: %q, %v", b, err)
	}
	if b, err := readWithin(t, regular, 4); !errors.Is(err, ErrTooLarge) || string(b) != "hello" {
		t.Errorf("over the limit: %q, %v; want ErrTooLarge and the first 5 bytes", b, err)
	}

	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ path, kind string }{{fifo, "a FIFO"}, {"/dev/zero", "a device"}, {dir, "a directory"}} {
		_, err := readWithin(t, tc.path, 1<<20)
		if !errors.Is(err, ErrNotRegular) || !strings.Contains(err.Error(), tc.kind) {
			t.Errorf("%s: %v; want ErrNotRegular naming %s", tc.path, err, tc.kind)
		}
	}
}
