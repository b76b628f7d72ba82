package count

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/rlagent/rlagent/internal/regularfile"
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
// until a read works again. So does anything that is not a small regular
// file: a FIFO, a device or a directory is refused without blocking, and a
// file longer than a count is refused after reading its first bytes only,
// so that neither can stall the poll loop or flood the log.
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

// ErrNotRegular is reported for a count file that is not a regular file (a
// FIFO, a socket, a device or a directory): reading one can block the poll
// loop forever or never end.
var ErrNotRegular = regularfile.ErrNotRegular

// maxCountBytes is the most readCount reads: a replica count and some white
// space. A longer file is not a count file, and is refused without reading
// the rest of it.
const maxCountBytes = 64

// maxExcerpt bounds the part of a bad file quoted in an error (and so in the
// log line), in bytes of the file.
const maxExcerpt = 24

// readCount reads the replica count at path. It never blocks and never reads
// more than maxCountBytes+1 bytes (regularfile.Read: O_NONBLOCK, fstat on the
// open descriptor, a limited read).
func readCount(path string) (int, error) {
	b, err := regularfile.Read(path, maxCountBytes)
	switch {
	case errors.Is(err, regularfile.ErrTooLarge):
		return 0, fmt.Errorf("read replica count from %s: more than %d bytes, not one integer (starts %s)", path, maxCountBytes, excerpt(b))
	case errors.Is(err, regularfile.ErrNotRegular):
		return 0, fmt.Errorf("read replica count from %s: %w", path, err)
	case err != nil:
		return 0, fmt.Errorf("read replica count: %w", err)
	}
	b = bytes.TrimSpace(b)
	if len(b) == 0 {
		return 0, fmt.Errorf("read replica count from %s: %w", path, ErrEmpty)
	}
	n, err := strconv.Atoi(string(b))
	if err != nil {
		return 0, fmt.Errorf("read replica count from %s: %s is not an integer", path, excerpt(b))
	}
	if n < 0 {
		return 0, fmt.Errorf("read replica count from %s: %d is negative", path, n)
	}
	return n, nil
}

// excerpt quotes at most maxExcerpt bytes of b, marking a cut with "...".
func excerpt(b []byte) string {
	if len(b) <= maxExcerpt {
		return strconv.Quote(string(b))
	}
	return strconv.Quote(string(b[:maxExcerpt])) + "..."
}
