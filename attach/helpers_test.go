package attach

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
)

func TestMain(m *testing.M) {
	nettest.MaybeExec() // the process started in a "pod" namespace (TestFindEndpoints)
	os.Exit(m.Run())
}

// nsPath is a path to ns's namespace that this process can open.
func nsPath(ns *nettest.NS) string {
	return fmt.Sprintf("/proc/self/fd/%d", int(ns.Handle()))
}

// newAttacher returns an Attacher on a fresh pin directory.
func newAttacher(t *testing.T, o Options) *Attacher {
	t.Helper()
	if o.PinDir == "" {
		o.PinDir = testenv.BPFFS(t)
	}
	o.Log = testLogger(t)
	return New(o)
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(b), "\n"))
	return len(b), nil
}

// pair builds two namespaces joined by a veth pair (veth-a in A, veth-b in
// B) and holds the traffic lock.
func pair(t *testing.T, subnet string) *nettest.Pair {
	t.Helper()
	testenv.RequireRoot(t)
	return nettest.MustPair(t, nettest.PairConfig{Subnet4: netip.MustParsePrefix(subnet)})
}

// listen opens a UDP socket at dst in ns until the test ends, so that the
// datagrams a test sends there are delivered (and no ICMP error comes
// back).
func listen(t *testing.T, ns *nettest.NS, dst netip.AddrPort) *net.UDPConn {
	t.Helper()
	rc, err := ns.ListenUDP("udp4", dst, 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rc.Close() })
	return rc
}

// receive reads datagrams from c until want came or nothing more comes for
// 200 ms, and returns how many it read.
func receive(t *testing.T, c *net.UDPConn, want int) int {
	t.Helper()
	buf := make([]byte, 2048)
	n := 0
	for n < want {
		c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		if _, err := c.Read(buf); err != nil {
			break
		}
		n++
	}
	return n
}

// sendUDP sends n datagrams from one namespace to dst.
func sendUDP(t *testing.T, from *nettest.NS, dst netip.AddrPort, n int) {
	t.Helper()
	if err := from.SendUDP(dst, n, []byte("rlagent attach test")); err != nil {
		t.Fatal(err)
	}
}

// mustAttach attaches and fails the test on error.
func mustAttach(t *testing.T, a *Attacher, p Point, prog *ebpf.Program) Attached {
	t.Helper()
	res, err := a.Attach(p, prog)
	if err != nil {
		t.Fatalf("Attach(%s): %+v", p, err)
	}
	return res
}

// mustAlive checks Alive and fails the test unless p is attached.
func mustAlive(t *testing.T, a *Attacher, p Point) Attached {
	t.Helper()
	res, err := a.Alive(p)
	if err != nil {
		t.Fatalf("Alive(%s): %v", p, err)
	}
	return res
}

// notAlive checks that Alive says p is not attached, for a reason that
// contains why.
func notAlive(t *testing.T, a *Attacher, p Point, why string) {
	t.Helper()
	_, err := a.Alive(p)
	if !errors.Is(err, ErrNotAttached) || !strings.Contains(err.Error(), why) {
		t.Fatalf("Alive(%s) = %v, want ErrNotAttached saying %q", p, err, why)
	}
}
