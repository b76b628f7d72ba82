package attach

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// The pins, under <pinDir>/links:
//
//	xdp_<iface>                XDP link of an interface of the caller's namespace
//	tcx_ingress_<iface>        tcx link (tcx_egress_ for egress)
//	clsact_ingress_<iface>     the record of a clsact filter: its program, pinned
//	                           (clsact_egress_ for egress)
//	netns_<inode>/netns        symlink to the path of another network namespace
//	netns_<inode>/xdp_<iface>  ... and the same pins for its interfaces
//
// xdp_<iface> is where the agent has always pinned its XDP links, so the
// pins of an agent that ran before this package adopt without a gap.
// Pins in another namespace live in a directory named by that namespace's
// identity (its nsfs inode), so that two pods' eth0 never share a name; the
// symlink records a path to reach it again (for Pinned and Cleanup), which
// is checked against the inode before it is used.
//
// bpffs refuses names with a dot (it keeps them for its own files), and
// interface names may have one (eth0.100): a dot is written %2e, and a %
// (which no interface name keeps: the kernel reads it as a name template)
// %25.
const (
	linkDir       = "links"
	netnsPrefix   = "netns_"
	netnsRecord   = "netns"
	netnsRecordNw = "netns-new"
	// newPrefix marks a record being replaced; listings skip it.
	newPrefix = "new_"
)

// pinKind is one kind of pin.
type pinKind struct {
	prefix string
	kind   Kind
	mode   Mode // ModeTCX or ModeClsact for tc pins; "" for XDP
}

// pinKinds are the pins a hook can have. A tc hook has a tcx pin or a
// clsact record; both for a moment while it moves from one to the other.
var pinKinds = []pinKind{
	{"xdp_", XDP, ""},
	{"tcx_ingress_", TCIngress, ModeTCX},
	{"tcx_egress_", TCEgress, ModeTCX},
	{"clsact_ingress_", TCIngress, ModeClsact},
	{"clsact_egress_", TCEgress, ModeClsact},
}

// pinName is the name of the pin of kind k, tc mode m ("" for XDP), for
// iface.
func pinName(k Kind, m Mode, iface string) string {
	for _, pk := range pinKinds {
		if pk.kind == k && pk.mode == m {
			return pk.prefix + escapeIface(iface)
		}
	}
	panic(fmt.Sprintf("attach: no pin for %s in mode %q", k, m))
}

// parsePin reads a pin's name; ok is false for anything else (a record, a
// pin being replaced).
func parsePin(name string) (pk pinKind, iface string, ok bool) {
	for _, pk := range pinKinds {
		if rest, found := strings.CutPrefix(name, pk.prefix); found && rest != "" {
			return pk, unescapeIface(rest), true
		}
	}
	return pinKind{}, "", false
}

func escapeIface(s string) string {
	return strings.NewReplacer("%", "%25", ".", "%2e").Replace(s)
}

func unescapeIface(s string) string {
	return strings.NewReplacer("%2e", ".", "%25", "%").Replace(s)
}

// linksDir is <pinDir>/links.
func linksDir(pinDir string) string { return filepath.Join(pinDir, linkDir) }

// nsDir is the directory of the pins of the namespace with inode ino; the
// links directory itself for the caller's (ino 0).
func nsDir(pinDir string, ino uint64) string {
	if ino == 0 {
		return linksDir(pinDir)
	}
	return filepath.Join(linksDir(pinDir), netnsPrefix+strconv.FormatUint(ino, 10))
}

// readNetnsRecord is the path recorded in a namespace's pin directory.
func readNetnsRecord(dir string) (string, error) {
	return os.Readlink(filepath.Join(dir, netnsRecord))
}

// makeNsDir creates the pin directory of n and, for another namespace, its
// record.
func makeNsDir(pinDir string, n *nsRef) (string, error) {
	dir := nsDir(pinDir, n.ino)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	if n.ino == 0 {
		return dir, nil
	}
	if old, err := readNetnsRecord(dir); err == nil && old == n.path {
		return dir, nil
	}
	// A new symlink renamed over the old one: a reader sees the old
	// record or the new one, never none.
	tmp := filepath.Join(dir, netnsRecordNw)
	os.Remove(tmp)
	if err := os.Symlink(n.path, tmp); err != nil {
		return "", fmt.Errorf("record network namespace path: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, netnsRecord)); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("record network namespace path: %w", err)
	}
	return dir, nil
}

// pointDir is the pin directory of p's namespace, and that namespace's
// identity (0 for the caller's). For a namespace that cannot be opened
// (gone, or its path gone) it is the directory whose record names p.Netns,
// if any; ok is false when there is none.
func pointDir(pinDir string, p Point) (dir string, ino uint64, ok bool) {
	if p.Netns == "" {
		return linksDir(pinDir), 0, true
	}
	if ino, err := netnsInode(p.Netns); err == nil {
		dir := nsDir(pinDir, ino)
		if _, err := os.Stat(dir); err == nil {
			return dir, ino, true
		}
	}
	dirs, _ := netnsDirs(pinDir)
	for _, d := range dirs {
		if path, err := readNetnsRecord(d.dir); err == nil && path == p.Netns {
			return d.dir, d.ino, true
		}
	}
	return "", 0, false
}

// netnsDir is the pin directory of another namespace.
type netnsDir struct {
	dir string
	ino uint64
}

// netnsDirs lists the pin directories of other namespaces.
func netnsDirs(pinDir string) ([]netnsDir, error) {
	ents, err := os.ReadDir(linksDir(pinDir))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []netnsDir
	for _, e := range ents {
		rest, ok := strings.CutPrefix(e.Name(), netnsPrefix)
		if !ok || !e.IsDir() {
			continue
		}
		ino, err := strconv.ParseUint(rest, 10, 64)
		if err != nil {
			continue
		}
		out = append(out, netnsDir{filepath.Join(linksDir(pinDir), e.Name()), ino})
	}
	return out, nil
}

// pinsIn lists the pins in one directory.
func pinsIn(dir string) ([]pinEntry, error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []pinEntry
	for _, e := range ents {
		if pk, iface, ok := parsePin(e.Name()); ok {
			out = append(out, pinEntry{pk, iface, filepath.Join(dir, e.Name())})
		}
	}
	return out, nil
}

// pinEntry is one pin found in a directory.
type pinEntry struct {
	pinKind
	iface string
	path  string
}

// Pinned lists the Points that have pins in pinDir: the hooks an agent
// attached and did not detach. Points of another namespace carry the path
// recorded when they were attached (which Alive checks against the
// namespace's identity). It reads only; the Points come sorted, each once.
func Pinned(pinDir string) ([]Point, error) {
	var out []Point
	top, err := pinsIn(linksDir(pinDir))
	if err != nil {
		return nil, fmt.Errorf("list pins in %s: %w", pinDir, err)
	}
	for _, e := range top {
		out = append(out, Point{Iface: e.iface, Kind: e.kind})
	}
	dirs, err := netnsDirs(pinDir)
	if err != nil {
		return nil, fmt.Errorf("list pins in %s: %w", pinDir, err)
	}
	for _, d := range dirs {
		path, err := readNetnsRecord(d.dir)
		if err != nil {
			// Written before any pin: a directory without one holds
			// nothing a Point could name. Cleanup still removes it.
			continue
		}
		pins, err := pinsIn(d.dir)
		if err != nil {
			return nil, fmt.Errorf("list pins in %s: %w", pinDir, err)
		}
		for _, e := range pins {
			out = append(out, Point{Iface: e.iface, Netns: path, Kind: e.kind})
		}
	}
	slices.SortFunc(out, func(a, b Point) int {
		return strings.Compare(a.Netns+"\x00"+a.Iface+"\x00"+a.Kind.String(), b.Netns+"\x00"+b.Iface+"\x00"+b.Kind.String())
	})
	return slices.Compact(out), nil
}

// Pinned is Pinned of the Attacher's pin directory: the hooks it holds.
func (a *Attacher) Pinned() ([]Point, error) { return Pinned(a.pinDir) }

// removeNsDirIfEmpty removes another namespace's pin directory once only
// its record is left.
func removeNsDirIfEmpty(dir string) {
	if filepath.Base(filepath.Dir(dir)) != linkDir || !strings.HasPrefix(filepath.Base(dir), netnsPrefix) {
		return
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if e.Name() != netnsRecord && e.Name() != netnsRecordNw {
			return
		}
	}
	os.Remove(filepath.Join(dir, netnsRecord))
	os.Remove(filepath.Join(dir, netnsRecordNw))
	os.Remove(dir)
}
