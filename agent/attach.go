package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/rlagent/rlagent/maps"
)

// linkDir is where the XDP links are pinned, under the pin directory.
const linkDir = "links"

func linkPin(pinDir, iface string) string {
	return filepath.Join(pinDir, linkDir, "xdp_"+iface)
}

// attachXDP makes prog the XDP program of iface, pins the link and says in
// which mode the program runs (ModeNative or ModeGeneric).
//
// A link pinned by an earlier agent is adopted: its program is replaced in
// one atomic update, so there is no moment without enforcement. Otherwise
// the program is attached in native mode, falling back to generic mode
// (with a log line that says so) when the driver has no XDP support.
func attachXDP(prog *ebpf.Program, iface, pinDir string, log *slog.Logger) (link.Link, string, error) {
	nl, err := netlink.LinkByName(iface)
	if err != nil {
		return nil, "", fmt.Errorf("attach xdp to %s: %w", iface, err)
	}
	ifindex := nl.Attrs().Index
	path := linkPin(pinDir, iface)

	if l, err := link.LoadPinnedLink(path, nil); err == nil {
		if info, ierr := l.Info(); ierr == nil && info.XDP() != nil && int(info.XDP().Ifindex) == ifindex {
			if err := l.Update(prog); err != nil {
				l.Close()
				return nil, "", fmt.Errorf("attach xdp to %s: update pinned link: %w", iface, err)
			}
			log.Info("adopted pinned XDP link", "interface", iface, "pin", path)
			return l, xdpMode(nl), nil
		}
		// The interface went away and came back (or the pin is not an
		// XDP link of it): the old link is dead.
		log.Warn("pinned XDP link is stale, attaching anew", "interface", iface, "pin", path)
		l.Unpin()
		l.Close()
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, "", fmt.Errorf("attach xdp to %s: load pinned link: %w", iface, err)
	}

	mode := ModeNative
	l, err := link.AttachXDP(link.XDPOptions{Program: prog, Interface: ifindex, Flags: link.XDPDriverMode})
	if err != nil {
		native := err
		mode = ModeGeneric
		l, err = link.AttachXDP(link.XDPOptions{Program: prog, Interface: ifindex, Flags: link.XDPGenericMode})
		if err != nil {
			return nil, "", fmt.Errorf("attach xdp to %s: native: %v; generic: %w", iface, native, err)
		}
		log.Warn("native XDP not available, attached in generic mode (slower, after the stack allocates an skb)",
			"interface", iface, "native_error", native)
	} else {
		log.Info("attached XDP in native mode", "interface", iface)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		l.Close()
		return nil, "", fmt.Errorf("attach xdp to %s: %w", iface, err)
	}
	if err := l.Pin(path); err != nil {
		l.Close()
		return nil, "", fmt.Errorf("attach xdp to %s: pin link: %w", iface, err)
	}
	return l, mode, nil
}

// pinnedLinks lists the interfaces that have a pinned XDP link in pinDir.
func pinnedLinks(pinDir string) ([]string, error) {
	ents, err := os.ReadDir(filepath.Join(pinDir, linkDir))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range ents {
		if name, ok := strings.CutPrefix(e.Name(), "xdp_"); ok {
			out = append(out, name)
		}
	}
	return out, nil
}

// detachXDP removes the pinned XDP link of iface, which detaches it.
func detachXDP(iface, pinDir string) error {
	path := linkPin(pinDir, iface)
	l, err := link.LoadPinnedLink(path, nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("detach xdp from %s: %w", iface, err)
	}
	defer l.Close()
	if err := l.Unpin(); err != nil {
		return fmt.Errorf("detach xdp from %s: %w", iface, err)
	}
	return nil
}

// Cleanup detaches every XDP link pinned in pinDir and removes the pins.
func Cleanup(pinDir string) error {
	ifaces, err := pinnedLinks(pinDir)
	if err != nil {
		return fmt.Errorf("cleanup %s: %w", pinDir, err)
	}
	for _, iface := range ifaces {
		if err := detachXDP(iface, pinDir); err != nil {
			return fmt.Errorf("cleanup %s: %w", pinDir, err)
		}
	}
	os.Remove(filepath.Join(pinDir, linkDir))
	if err := maps.RemovePins(pinDir); err != nil {
		return fmt.Errorf("cleanup %s: %w", pinDir, err)
	}
	removeLockRecord(pinDir) // a killed agent's (see pinlock.go)
	os.Remove(pinDir)
	return nil
}
