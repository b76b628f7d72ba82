package watcher

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
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
