package watcher

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"time"
)

// DefaultPollInterval is how often File reads its file.
const DefaultPollInterval = 200 * time.Millisecond

// File reads a replica count from a file holding one integer, for every
// limit. The file is polled, not watched with inotify: polling sees a file
// replaced by rename, a file that appears after start, and a bind-mounted
// file alike, and one stat every 200 ms costs nothing.
//
// A missing, empty or malformed file keeps the last good count; the change
// of state is logged once, and the error is reported in the observation
// until a read works again.
type File struct {
	path     string
	interval time.Duration
	log      *slog.Logger
	now      func() time.Time

	mu  sync.Mutex
	obs Observation
}

// NewFile returns a source that reads path every interval (0: the default).
func NewFile(path string, interval time.Duration, log *slog.Logger) *File {
	if interval <= 0 {
		interval = DefaultPollInterval
	}
	if log == nil {
		log = slog.Default()
	}
	return &File{path: path, interval: interval, log: log, now: time.Now}
}

// Run polls the file until ctx ends.
func (f *File) Run(ctx context.Context, notify func()) {
	t := time.NewTicker(f.interval)
	defer t.Stop()
	for {
		if f.Poll() {
			notify()
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Observe returns the latest observation; the same for every limit.
func (f *File) Observe(string) Observation {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.obs
}

// Poll reads the file once and reports whether the count or the error
// state changed.
func (f *File) Poll() bool {
	n, err := readCount(f.path)
	now := f.now()

	f.mu.Lock()
	defer f.mu.Unlock()
	prev := f.obs
	if err != nil {
		// The last good count stands; only the error is new.
		f.obs.Err = err
		if prev.Err == nil || prev.Err.Error() != err.Error() {
			f.log.Warn("replica count file unreadable, keeping the last count",
				"path", f.path, "count", prev.Replicas, "error", err)
			return true
		}
		return false
	}
	f.obs = Observation{Replicas: n, Local: n, At: now}
	if prev.Err != nil {
		f.log.Info("replica count file readable again", "path", f.path, "count", n)
	}
	return prev.Err != nil || prev.Replicas != n || prev.At.IsZero()
}

// ErrEmpty is reported for an empty count file.
var ErrEmpty = errors.New("empty")

func readCount(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("read replica count: %w", err)
	}
	b = bytes.TrimSpace(b)
	if len(b) == 0 {
		return 0, fmt.Errorf("read replica count from %s: %w", path, ErrEmpty)
	}
	n, err := strconv.Atoi(string(b))
	if err != nil {
		return 0, fmt.Errorf("read replica count from %s: %q is not an integer", path, b)
	}
	if n < 0 {
		return 0, fmt.Errorf("read replica count from %s: %d is negative", path, n)
	}
	return n, nil
}
