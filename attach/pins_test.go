package attach

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/rlagent/rlagent/internal/bpftest"
	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
)

func TestPinNames(t *testing.T) {
	for _, tc := range []struct {
		kind  Kind
		mode  Mode
		iface string
		want  string
	}{
		{XDP, "", "eth0", "xdp_eth0"}, // the agent's name before this package
		{XDP, "", "eth0.100", "xdp_eth0%2e100"},
		{TCIngress, ModeTCX, "veth_1.2", "tcx_ingress_veth_1%2e2"},
		{TCEgress, ModeTCX, "cali12ab", "tcx_egress_cali12ab"},
		{TCIngress, ModeClsact, "a%b", "clsact_ingress_a%25b"},
		{TCEgress, ModeClsact, "x.y.z", "clsact_egress_x%2ey%2ez"},
	} {
		got := pinName(tc.kind, tc.mode, tc.iface)
		if got != tc.want {
			t.Errorf("pinName(%s, %q, %q) = %q, want %q", tc.kind, tc.mode, tc.iface, got, tc.want)
		}
		if strings.Contains(got, ".") {
			t.Errorf("pin name %q has a dot, which bpffs refuses", got)
		}
		pk, iface, ok := parsePin(got)
		if !ok || pk.kind != tc.kind || pk.mode != tc.mode || iface != tc.iface {
			t.Errorf("parsePin(%q) = %+v %q %v, want %s %q %q", got, pk, iface, ok, tc.kind, tc.mode, tc.iface)
		}
	}
	for _, name := range []string{"netns", "netns-new", "new_clsact_ingress_eth0", "xdp_", "lock"} {
		if _, _, ok := parsePin(name); ok {
			t.Errorf("parsePin(%q) took it for a pin", name)
		}
	}
}

func TestPickPriority(t *testing.T) {
	filters := func(prios ...uint16) []netlink.Filter {
		var out []netlink.Filter
		for _, p := range prios {
			out = append(out, &netlink.BpfFilter{FilterAttrs: netlink.FilterAttrs{Priority: p}})
		}
		return out
	}
	for _, tc := range []struct {
		others    []uint16
		want      uint16
		wantFirst bool
	}{
		{nil, 1, true},
		{[]uint16{5}, 4, true},
		{[]uint16{49152, 7}, 6, true},
		{[]uint16{1}, 2, false},
		{[]uint16{1, 2, 4}, 3, false},
	} {
		got, first := pickPriority(filters(tc.others...))
		if got != tc.want || first != tc.wantFirst {
			t.Errorf("pickPriority(%v) = %d, %v; want %d, %v", tc.others, got, first, tc.want, tc.wantFirst)
		}
	}
}

// Two namespaces' interfaces of the same name get pins of their own, named
// by the namespace's identity; Pinned gives back each Point with its path,
// and detaching one leaves the other.
func TestPinsPerNetns(t *testing.T) {
	testenv.RequireRoot(t)
	nettest.HoldTraffic(t)
	x, err := nettest.NewNS("x")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { x.Close() })
	y, err := nettest.NewNS("y")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { y.Close() })
	nl, err := x.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	// eth0 in x and eth0 in y, one veth pair.
	err = nl.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}, PeerName: "eth0",
		PeerNamespace: netlink.NsFd(int(y.Handle()))})
	if err != nil {
		t.Fatal(err)
	}

	a := newAttacher(t, Options{})
	px := Point{Iface: "eth0", Netns: nsPath(x), Kind: TCIngress}
	py := Point{Iface: "eth0", Netns: nsPath(y), Kind: TCIngress}
	c := bpftest.NewCounter(t, ebpf.SchedCLS, "test_ns", bpftest.TCXNext)
	rx := mustAttach(t, a, px, c.Prog)
	ry := mustAttach(t, a, py, c.Prog)
	if rx.Pin == ry.Pin || rx.Link == ry.Link {
		t.Fatalf("both eth0s share pin %s / link %d", rx.Pin, rx.Link)
	}
	for _, r := range []Attached{rx, ry} {
		if !strings.Contains(r.Pin, "/links/netns_") {
			t.Errorf("pin %s is not under a netns_<inode> directory", r.Pin)
		}
	}
	pinned, err := Pinned(a.pinDir)
	if err != nil {
		t.Fatal(err)
	}
	if len(pinned) != 2 || !slices.Contains(pinned, px) || !slices.Contains(pinned, py) {
		t.Fatalf("Pinned = %v, want %v and %v", pinned, px, py)
	}

	if err := a.Detach(px); err != nil {
		t.Fatal(err)
	}
	notAlive(t, a, px, "nothing pinned")
	mustAlive(t, a, py)
	if _, err := os.Stat(filepath.Dir(rx.Pin)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("x's pin directory is still there after its last pin went: %v", err)
	}
	if pinned, _ := Pinned(a.pinDir); !slices.Equal(pinned, []Point{py}) {
		t.Errorf("after Detach Pinned = %v, want [%v]", pinned, py)
	}

	// The namespace goes (the pod is deleted): its pins are dead, and
	// Cleanup removes them without a namespace to enter.
	y.Close()
	notAlive(t, a, py, "network namespace is gone")
	if err := Cleanup(a.pinDir); err != nil {
		t.Fatal(err)
	}
	if pinned, _ := Pinned(a.pinDir); len(pinned) != 0 {
		t.Errorf("after Cleanup Pinned = %v", pinned)
	}
}

// Alive writes nothing: not on a pin directory that does not exist, not
// on a dead pin.
func TestAliveReadsOnly(t *testing.T) {
	p := pair(t, "10.220.11.0/24")
	a := newAttacher(t, Options{})
	pt := Point{Iface: "veth-b", Netns: nsPath(p.B), Kind: TCEgress}
	notAlive(t, a, pt, "nothing pinned")
	notAlive(t, a, Point{Iface: "veth-b", Kind: XDP}, "nothing pinned")
	if _, err := os.Stat(a.pinDir); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Alive created the pin directory: %v", err)
	}

	c := bpftest.NewCounter(t, ebpf.SchedCLS, "test_ro", bpftest.TCXNext)
	res := mustAttach(t, a, pt, c.Prog)
	nl, err := p.B.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	l, err := nl.LinkByName("veth-b")
	if err == nil {
		err = nl.LinkDel(l)
	}
	if err != nil {
		t.Fatal(err)
	}
	before := listTree(t, a.pinDir)
	notAlive(t, a, pt, "deleted")
	if after := listTree(t, a.pinDir); !slices.Equal(before, after) {
		t.Errorf("Alive changed the pin directory: %v -> %v", before, after)
	}
	if _, err := os.Stat(res.Pin); err != nil {
		t.Errorf("Alive removed the dead pin: %v", err)
	}
}

func listTree(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		out = append(out, path)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}
