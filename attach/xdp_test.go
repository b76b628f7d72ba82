package attach

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/rlagent/rlagent/internal/bpftest"
)

// XDP in the caller's namespace is pinned where the agent has always pinned
// it (links/xdp_<iface>), so an agent of before this package is adopted;
// attaching is idempotent, and a new program replaces the old one in the
// same link.
func TestXDPAttachKeepAdopt(t *testing.T) {
	p := pair(t, "10.220.7.0/24")
	a := newAttacher(t, Options{})
	pt := Point{Iface: "veth-a", Kind: XDP} // Netns "": the calling thread's, A below
	c1 := bpftest.NewCounter(t, ebpf.XDP, "test_xdp1", bpftest.XDPPass)
	c2 := bpftest.NewCounter(t, ebpf.XDP, "test_xdp2", bpftest.XDPPass)

	var first, again, replaced, adopted Attached
	var alive Attached
	err := p.A.Do(func() (err error) {
		if first, err = a.Attach(pt, c1.Prog); err != nil {
			return err
		}
		if again, err = a.Attach(pt, c1.Prog); err != nil {
			return err
		}
		if replaced, err = a.Attach(pt, c2.Prog); err != nil {
			return err
		}
		// A restarted agent, with the first program again.
		b := New(Options{PinDir: a.pinDir, Log: testLogger(t)})
		if adopted, err = b.Attach(pt, c1.Prog); err != nil {
			return err
		}
		alive, err = b.Alive(pt)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(a.pinDir, "links", "xdp_veth-a"); first.Pin != want {
		t.Errorf("pinned at %s, want %s (the agent's path)", first.Pin, want)
	}
	if _, err := os.Stat(filepath.Join(a.pinDir, "links", "xdp_veth-a")); err != nil {
		t.Errorf("no pin: %v", err)
	}
	if first.Change != Created || first.Mode != ModeNative {
		t.Errorf("first Attach = %+v, want created in native mode (veth has native XDP)", first)
	}
	if again.Change != Kept || again.Link != first.Link || again.Mode != ModeNative {
		t.Errorf("second Attach = %+v, want link %d kept, native", again, first.Link)
	}
	if replaced.Change != Replaced || replaced.Link != first.Link || replaced.Program != c2.ID(t) {
		t.Errorf("Attach of a new program = %+v, want link %d replaced, running %d", replaced, first.Link, c2.ID(t))
	}
	if adopted.Change != Replaced || adopted.Link != first.Link || adopted.Program != c1.ID(t) {
		t.Errorf("a new Attacher = %+v, want link %d adopted, running %d", adopted, first.Link, c1.ID(t))
	}
	if alive.Link != first.Link || alive.Program != c1.ID(t) || alive.Mode != ModeNative {
		t.Errorf("Alive = %+v", alive)
	}
	if got := bpftest.XDPProgram(t, p.A, "veth-a"); got != c1.ID(t) {
		t.Errorf("veth-a's XDP hook runs %d, want %d", got, c1.ID(t))
	}
}

// Another program on the XDP hook is never replaced: Attach fails with
// ErrXDPBusy naming it, and it stays.
func TestXDPBusy(t *testing.T) {
	for _, tc := range []struct {
		name   string
		viaNL  bool
		subnet string
	}{
		{"netlink", true, "10.220.8.0/24"},
		{"bpf_link", false, "10.220.9.0/24"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := pair(t, tc.subnet)
			a := newAttacher(t, Options{})
			foreign := bpftest.NewCounter(t, ebpf.XDP, "foreign_xdp", bpftest.XDPPass)
			idx := bpftest.IfIndex(t, p.B, "veth-b")
			var fl link.Link
			if tc.viaNL {
				// As ip link set dev veth-b xdp ... does (netlink, no link).
				err := p.B.Do(func() error {
					l, err := netlink.LinkByIndex(idx)
					if err != nil {
						return err
					}
					return netlink.LinkSetXdpFd(l, foreign.Prog.FD())
				})
				if err != nil {
					t.Fatalf("attach foreign XDP through netlink: %v", err)
				}
			} else {
				err := p.B.Do(func() (err error) {
					fl, err = link.AttachXDP(link.XDPOptions{Program: foreign.Prog, Interface: idx})
					return err
				})
				if err != nil {
					t.Fatalf("attach foreign XDP link: %v", err)
				}
				t.Cleanup(func() { fl.Close() })
			}

			pt := Point{Iface: "veth-b", Netns: nsPath(p.B), Kind: XDP}
			ours := bpftest.NewCounter(t, ebpf.XDP, "test_ours", bpftest.XDPPass)
			_, err := a.Attach(pt, ours.Prog)
			if !errors.Is(err, ErrXDPBusy) {
				t.Fatalf("Attach = %v, want ErrXDPBusy", err)
			}
			t.Logf("refused: %v", err)
			var be *XDPBusyError
			if !errors.As(err, &be) {
				t.Fatalf("%v is not an *XDPBusyError", err)
			}
			if be.Program != foreign.ID(t) || be.Name != "foreign_xdp" {
				t.Errorf("the error names program %d %q, want %d %q", be.Program, be.Name, foreign.ID(t), "foreign_xdp")
			}
			if !tc.viaNL {
				info, ierr := fl.Info()
				if ierr != nil {
					t.Fatal(ierr)
				}
				if be.Link != info.ID {
					t.Errorf("the error names link %d, want %d", be.Link, info.ID)
				}
			}
			for _, want := range []string{"foreign_xdp", "xdpFallback: tc", "never replaces"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("the message %q does not say %q", err, want)
				}
			}
			if got := bpftest.XDPProgram(t, p.B, "veth-b"); got != foreign.ID(t) {
				t.Errorf("the XDP hook runs %d after the refusal, want the foreign %d", got, foreign.ID(t))
			}
			if pinned, _ := Pinned(a.pinDir); len(pinned) != 0 {
				t.Errorf("a refused attach left pins %v", pinned)
			}
			if ents, _ := os.ReadDir(filepath.Join(a.pinDir, "links")); len(ents) != 0 {
				t.Errorf("a refused attach left %d entries in links/", len(ents))
			}
		})
	}
}
