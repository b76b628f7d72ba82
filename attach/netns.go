package attach

import (
	"errors"
	"fmt"
	"runtime"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// nsRef is the network namespace of a Point, open for the length of one
// call: a handle (which keeps the namespace from going away meanwhile), its
// identity, and a route netlink socket inside it.
type nsRef struct {
	// path is the Point's Netns; "" is the caller's namespace.
	path string
	h    netns.NsHandle
	// ino identifies the namespace (the nsfs inode, what lsns shows) while
	// it lives; 0 for the caller's.
	ino uint64
	nl  *netlink.Handle
}

// openNS opens the namespace at path ("" for the caller's). An error wraps
// the os error, so errors.Is(err, fs.ErrNotExist) holds for a path that is
// gone.
func openNS(path string) (*nsRef, error) {
	if path == "" {
		// Only NETLINK_ROUTE: a minimal kernel may lack the families
		// netlink.NewHandle opens by default (XFRM).
		nl, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return nil, fmt.Errorf("netlink: %w", err)
		}
		return &nsRef{h: netns.None(), nl: nl}, nil
	}
	ino, err := netnsInode(path)
	if err != nil {
		return nil, err
	}
	h, err := netns.GetFromPath(path)
	if err != nil {
		return nil, fmt.Errorf("open network namespace %s: %w", path, err)
	}
	// The inode again, from the open handle: the path may have been
	// re-pointed between the stat and the open.
	var st unix.Stat_t
	if err := unix.Fstat(int(h), &st); err != nil || st.Ino != ino {
		h.Close()
		return nil, fmt.Errorf("open network namespace %s: it changed while being opened", path)
	}
	nl, err := netlink.NewHandleAt(h, unix.NETLINK_ROUTE)
	if err != nil {
		h.Close()
		return nil, fmt.Errorf("netlink in network namespace %s: %w", path, err)
	}
	return &nsRef{path: path, h: h, ino: ino, nl: nl}, nil
}

// netnsInode is the identity of the network namespace at path. It fails
// for a file that is not a network namespace.
func netnsInode(path string) (uint64, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("open network namespace %s: %w", path, &pathError{path, err})
	}
	defer unix.Close(fd)
	typ, err := unix.IoctlRetInt(fd, unix.NS_GET_NSTYPE)
	if err != nil || typ != unix.CLONE_NEWNET {
		return 0, fmt.Errorf("open network namespace %s: %w", path, errNotNetns)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, fmt.Errorf("open network namespace %s: %w", path, err)
	}
	return st.Ino, nil
}

// errNotNetns: the file is not a network namespace (any more: a
// /proc/PID/ns/net whose PID now runs elsewhere is still one, but a bind
// mount target left after the namespace went is a plain file).
var errNotNetns = errors.New("not a network namespace file")

// pathError keeps errno comparable (errors.Is(err, fs.ErrNotExist) holds
// for ENOENT) while saying which path.
type pathError struct {
	path string
	err  error
}

func (e *pathError) Error() string { return e.err.Error() }
func (e *pathError) Unwrap() error { return e.err }

func (n *nsRef) Close() {
	if n == nil {
		return
	}
	if n.nl != nil {
		n.nl.Close()
	}
	if n.h.IsOpen() {
		n.h.Close()
	}
}

// do runs fn with the calling OS thread inside the namespace. It is needed
// where the kernel resolves an interface index in the calling thread's
// namespace: BPF_LINK_CREATE for XDP and tcx. Netlink requests go through
// n.nl instead, whose socket lives in the namespace already.
//
// fn runs on a fresh goroutine locked to its thread, which is switched into
// the namespace and back, also when fn fails. If switching back fails, the
// thread stays locked, and the Go runtime ends it with the goroutine
// instead of reusing it, in the wrong namespace, for other goroutines.
func (n *nsRef) do(fn func() error) error {
	if n.path == "" {
		return fn()
	}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("enter network namespace %s: %w", n.path, err)
			return
		}
		defer orig.Close()
		if err := netns.Set(n.h); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("enter network namespace %s: %w", n.path, err)
			return
		}
		ferr := fn()
		if err := netns.Set(orig); err != nil {
			errc <- errors.Join(ferr, fmt.Errorf("leave network namespace %s: %w", n.path, err))
			return // the thread stays locked and dies with this goroutine
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// link finds the interface in the namespace; the error is ErrNoInterface
// when there is none of that name.
func (n *nsRef) link(iface string) (netlink.Link, error) {
	l, err := n.nl.LinkByName(iface)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil, ErrNoInterface
		}
		return nil, err
	}
	return l, nil
}
