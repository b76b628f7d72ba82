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
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
)

func TestMain(m *testing.M) {
	nettest.MaybeExec() // the process started in a "pod" namespace (TestFindEndpoints)
	os.Exit(m.Run())
}

// Verdicts of the test programs.
const (
	tcxNext = -1 // TCX_NEXT; TC_ACT_UNSPEC for a clsact filter: the next one runs
	tcxDrop = 2  // TCX_DROP, TC_ACT_SHOT
	xdpPass = 2  // XDP_PASS
)

// counter is a test program that counts the IPv4 packets it sees (XDP: all
// frames) into a one-slot array, and returns a fixed verdict. Counting only
// IPv4 keeps the namespaces' IPv6 chatter (router and multicast listener
// messages) out of the exact counts the tests compare.
type counter struct {
	Prog *ebpf.Program
	// m is the count: array of one u64, added to atomically (programs run
	// on several CPUs at once).
	m *ebpf.Map
}

func newCounter(tb testing.TB, typ ebpf.ProgramType, name string, verdict int32) *counter {
	tb.Helper()
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		tb.Fatalf("counter map: %v", err)
	}
	tb.Cleanup(func() { m.Close() })
	insns := asm.Instructions{asm.Mov.Reg(asm.R6, asm.R1)}
	if typ == ebpf.SchedCLS {
		insns = append(insns,
			// __sk_buff.protocol, network order: ETH_P_IP reads 0x0008.
			asm.LoadMem(asm.R2, asm.R6, 16, asm.Word),
			asm.JNE.Imm(asm.R2, 0x0008, "out"),
		)
	}
	insns = append(insns,
		asm.StoreImm(asm.RFP, -4, 0, asm.Word),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -4),
		asm.LoadMapPtr(asm.R1, m.FD()),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "out"),
		asm.Mov.Imm(asm.R1, 1),
		asm.StoreXAdd(asm.R0, asm.R1, asm.DWord),
		asm.Mov.Imm(asm.R0, verdict).WithSymbol("out"),
		asm.Return(),
	)
	return &counter{Prog: loadProg(tb, typ, name, insns), m: m}
}

func loadProg(tb testing.TB, typ ebpf.ProgramType, name string, insns asm.Instructions) *ebpf.Program {
	tb.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: name, Type: typ, Instructions: insns, License: "GPL"})
	if err != nil {
		tb.Fatalf("load %s: %+v", name, err)
	}
	tb.Cleanup(func() { prog.Close() })
	return prog
}

// redirectPeer is a tc program that hands every packet to the peer of the
// veth ifindex (in another namespace) with bpf_redirect_peer, the way
// Cilium's BPF host routing delivers into a pod.
func redirectPeer(tb testing.TB, ifindex int) *ebpf.Program {
	return loadProg(tb, ebpf.SchedCLS, "test_redir_peer", asm.Instructions{
		asm.Mov.Imm(asm.R1, int32(ifindex)),
		asm.Mov.Imm(asm.R2, 0),
		asm.FnRedirectPeer.Call(),
		asm.Return(),
	})
}

func (c *counter) n(tb testing.TB) uint64 {
	tb.Helper()
	var v uint64
	if err := c.m.Lookup(uint32(0), &v); err != nil {
		tb.Fatalf("read counter: %v", err)
	}
	return v
}

func (c *counter) id(tb testing.TB) ebpf.ProgramID {
	tb.Helper()
	id, err := programID(c.Prog)
	if err != nil {
		tb.Fatal(err)
	}
	return id
}

// waitCount waits up to a second for c to reach want (packets on a veth
// are counted within microseconds, but on another CPU) and returns what it
// counted.
func waitCount(tb testing.TB, c *counter, want uint64) uint64 {
	tb.Helper()
	deadline := time.Now().Add(time.Second)
	for {
		got := c.n(tb)
		if got >= want || time.Now().After(deadline) {
			return got
		}
		time.Sleep(5 * time.Millisecond)
	}
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
	c, err := from.DialUDP("udp4", dst)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i := range n {
		if _, err := c.Write([]byte("rlagent attach test")); err != nil {
			t.Fatalf("send datagram %d: %v", i, err)
		}
	}
}

// ifindex is the index of ifname in ns.
func ifindex(t *testing.T, ns *nettest.NS, ifname string) int {
	t.Helper()
	nl, err := ns.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	l, err := nl.LinkByName(ifname)
	if err != nil {
		t.Fatal(err)
	}
	return l.Attrs().Index
}

// tcxPrograms lists the programs on a tcx hook in the order they run.
func tcxPrograms(t *testing.T, ns *nettest.NS, ifname string, at ebpf.AttachType) []ebpf.ProgramID {
	t.Helper()
	idx := ifindex(t, ns, ifname)
	var ids []ebpf.ProgramID
	err := ns.Do(func() error {
		res, err := link.QueryPrograms(link.QueryOptions{Target: idx, Attach: at})
		if err != nil {
			return err
		}
		for _, p := range res.Programs {
			ids = append(ids, p.ID)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("query tcx programs of %s in %s: %v", ifname, ns.Name, err)
	}
	return ids
}

// attachForeignTCX attaches prog at the tail of a tcx hook, as another
// agent would, and detaches it in Cleanup.
func attachForeignTCX(t *testing.T, ns *nettest.NS, ifname string, at ebpf.AttachType, prog *ebpf.Program) link.Link {
	t.Helper()
	idx := ifindex(t, ns, ifname)
	var l link.Link
	err := ns.Do(func() (err error) {
		l, err = link.AttachTCX(link.TCXOptions{Interface: idx, Program: prog, Attach: at, Anchor: link.Tail()})
		return err
	})
	if err != nil {
		t.Fatalf("attach foreign tcx program: %v", err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// bpfFilters lists the bpf filters of a clsact hook.
func bpfFilters(t *testing.T, ns *nettest.NS, ifname string, parent uint32) []*netlink.BpfFilter {
	t.Helper()
	nl, err := ns.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	l, err := nl.LinkByName(ifname)
	if err != nil {
		t.Fatal(err)
	}
	fs, err := nl.FilterList(l, parent)
	if err != nil {
		t.Fatal(err)
	}
	var out []*netlink.BpfFilter
	for _, f := range fs {
		if b, ok := f.(*netlink.BpfFilter); ok {
			out = append(out, b)
		}
	}
	return out
}

// qdiscTypes lists the qdisc kinds of an interface.
func qdiscTypes(t *testing.T, ns *nettest.NS, ifname string) []string {
	t.Helper()
	nl, err := ns.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	l, err := nl.LinkByName(ifname)
	if err != nil {
		t.Fatal(err)
	}
	qs, err := nl.QdiscList(l)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, q := range qs {
		out = append(out, q.Type())
	}
	return out
}

// xdpProgram is the ID of the program on an interface's XDP hook (0:
// none).
func xdpProgram(t *testing.T, ns *nettest.NS, ifname string) ebpf.ProgramID {
	t.Helper()
	nl, err := ns.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	l, err := nl.LinkByName(ifname)
	if err != nil {
		t.Fatal(err)
	}
	if x := l.Attrs().Xdp; x != nil && x.Attached {
		return ebpf.ProgramID(x.ProgId)
	}
	return 0
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
