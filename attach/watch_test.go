package attach

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// Watch pokes once when it has subscribed, and within a second of a new
// veth, of a new route, and of a new neighbour entry.
func TestWatchPokes(t *testing.T) {
	testenv.RequireRoot(t)
	ns := nettest.MustNS(t, "watched")
	a := newAttacher(t, Options{})
	pokes := make(chan time.Time, 1024)
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		// On a thread in the namespace: Watch subscribes there.
		ns.Do(func() error {
			a.Watch(ctx, func() { pokes <- time.Now() })
			return nil
		})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-stopped:
		case <-time.After(5 * time.Second):
			t.Error("Watch did not return after its context ended")
		}
	})
	select {
	case <-pokes:
	case <-time.After(time.Second):
		t.Fatal("no poke after subscribing")
	}

	nl, err := ns.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	// quiet drains the pokes of earlier changes, then waits for the one
	// change makes.
	pokedAfter := func(what string, change func() error) {
		t.Helper()
		for {
			select {
			case <-pokes:
				continue
			case <-time.After(100 * time.Millisecond):
			}
			break
		}
		at := time.Now()
		if err := change(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		select {
		case p := <-pokes:
			t.Logf("%s: poked after %v", what, p.Sub(at))
		case <-time.After(time.Second):
			t.Fatalf("%s: no poke within 1 s", what)
		}
	}
	pokedAfter("veth added", func() error {
		return nl.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "w0"}, PeerName: "w1"})
	})
	w0, err := nl.LinkByName("w0")
	if err != nil {
		t.Fatal(err)
	}
	w1, err := nl.LinkByName("w1")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range []netlink.Link{w0, w1} {
		if err := nl.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
	}
	pokedAfter("route added", func() error {
		return nl.RouteAdd(&netlink.Route{LinkIndex: w0.Attrs().Index, Scope: netlink.SCOPE_LINK,
			Dst: &net.IPNet{IP: net.IPv4(10, 231, 0, 7), Mask: net.CIDRMask(32, 32)}})
	})
	pokedAfter("neighbour added", func() error {
		return nl.NeighAdd(&netlink.Neigh{LinkIndex: w0.Attrs().Index, Family: netlink.FAMILY_V4,
			State: netlink.NUD_PERMANENT, IP: net.IPv4(10, 231, 0, 7), HardwareAddr: w1.Attrs().HardwareAddr})
	})
}
