// Package regularfile reads small files that an operator names (the config
// file, the replica count file) without letting the path stall or flood the
// reader: a FIFO without a writer would block a plain read forever, and
// /dev/zero would never end.
package regularfile

import (
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
)

// ErrNotRegular is returned for a path that is not a regular file (a FIFO,
// a socket, a device or a directory).
var ErrNotRegular = errors.New("not a regular file")

// ErrTooLarge is returned for a regular file longer than the reader's cap.
var ErrTooLarge = errors.New("file too large")

// Read reads the regular file at path, at most limit bytes. It never
// blocks on the file's kind and never reads more than limit+1 bytes: the
// file is opened with O_NONBLOCK (so a FIFO without a writer does not hold
// the open) and O_NOCTTY, checked with fstat on the open descriptor (not a
// stat of the path, which a FIFO renamed over the path right after could get
// past), and read through a limit. A longer file returns its first limit+1
// bytes, for a caller to quote, with an error that wraps ErrTooLarge; a file
// of another kind an error that wraps ErrNotRegular and names the kind. An
// error opening or reading the file is returned as the os package's, which
// names the path.
func Read(path string, limit int64) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOCTTY, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%w (%s)", ErrNotRegular, Kind(fi.Mode()))
	}
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return b, fmt.Errorf("more than %d bytes: %w", limit, ErrTooLarge)
	}
	return b, nil
}

// Kind names a file type for an error message.
func Kind(m os.FileMode) string {
	switch {
	case m&os.ModeNamedPipe != 0:
		return "a FIFO"
	case m&os.ModeSocket != 0:
		return "a socket"
	case m&os.ModeDevice != 0:
		return "a device"
	case m.IsDir():
		return "a directory"
	}
	return m.Type().String()
}
