package vmtests

import (
	"fmt"
	"io"
	"io/fs"
	"strings"

	"golang.org/x/sys/unix"
)

// CPIOWriter writes a cpio archive in the "newc" format (magic 070701), the
// one the kernel unpacks as an initramfs (Documentation/driver-api/early-userspace/buffer-format.rst).
// Each header is 110 ASCII bytes: the magic and 13 fields of 8 hex digits;
// the name (with its NUL) and the data are each padded to a multiple of 4
// bytes from the archive's start. The kernel does not create missing
// parent directories, so write a directory before what it holds.
type CPIOWriter struct {
	w   io.Writer
	off int64
	ino uint32
}

// NewCPIOWriter returns a writer that appends entries to w. Close writes
// the trailer.
func NewCPIOWriter(w io.Writer) *CPIOWriter { return &CPIOWriter{w: w} }

// Dir writes a directory entry.
func (c *CPIOWriter) Dir(name string, perm fs.FileMode) error {
	return c.header(name, unix.S_IFDIR|uint32(perm.Perm()), 0, 0, 0, 2)
}

// File writes a regular file of size bytes read from r.
func (c *CPIOWriter) File(name string, perm fs.FileMode, size int64, r io.Reader) error {
	if err := c.header(name, unix.S_IFREG|uint32(perm.Perm()), size, 0, 0, 1); err != nil {
		return err
	}
	n, err := io.CopyN(c.w, r, size)
	c.off += n
	if err != nil {
		return fmt.Errorf("cpio %s: write %d bytes of data: %w", name, size, err)
	}
	return c.pad()
}

// CharDev writes a character device node.
func (c *CPIOWriter) CharDev(name string, perm fs.FileMode, major, minor uint32) error {
	return c.header(name, unix.S_IFCHR|uint32(perm.Perm()), 0, major, minor, 1)
}

// Close writes the trailer entry. It does not close the underlying writer.
func (c *CPIOWriter) Close() error {
	return c.header("TRAILER!!!", 0, 0, 0, 0, 1)
}

func (c *CPIOWriter) header(name string, mode uint32, size int64, rmajor, rminor, nlink uint32) error {
	name = strings.TrimPrefix(name, "/")
	if name == "" || strings.IndexByte(name, 0) >= 0 {
		return fmt.Errorf("cpio: invalid name %q", name)
	}
	if size < 0 || size > 0xffffffff {
		return fmt.Errorf("cpio %s: size %d does not fit newc's 32 bits", name, size)
	}
	c.ino++
	h := fmt.Sprintf("070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
		c.ino, mode, 0, 0, nlink, 0, size, 0, 0, rmajor, rminor, len(name)+1, 0)
	n, err := io.WriteString(c.w, h+name+"\x00")
	c.off += int64(n)
	if err != nil {
		return fmt.Errorf("cpio %s: write header: %w", name, err)
	}
	return c.pad()
}

// pad writes NULs up to the next multiple of 4.
func (c *CPIOWriter) pad() error {
	k := (4 - c.off%4) % 4
	if k == 0 {
		return nil
	}
	n, err := c.w.Write(make([]byte, k))
	c.off += int64(n)
	if err != nil {
		return fmt.Errorf("cpio: write padding: %w", err)
	}
	return nil
}
