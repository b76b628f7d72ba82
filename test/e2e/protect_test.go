package e2e

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlagent/rlagent/agent"
	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// The ports of TestProtectedTrafficPassesMatchAllLimit.
const (
	protectedLocal    = 2222 // on B: a protect rule's localPorts (as SSH)
	unprotectedLocal  = 2223 // on B: no rule
	protectedRemote   = 6443 // on A: a protect rule's remotePorts with A as peer (as the API server)
	unprotectedRemote = 6444 // on A: no rule
)

// TestProtectedTrafficPassesMatchAllLimit runs the real agent with a limit
// that matches every packet at rate 1, burst 1, and two protect rules: TCP
// to B's local port 2222 from anyone (the SSH and kubelet kind), and TCP
// from A's remote port 6443 (the API server kind: B is the client). Every
// protected exchange completes, over IPv4 and IPv6, and none of it is
// charged to the limit; UDP and the other TCP ports are cut to about one
// packet a second.
func TestProtectedTrafficPassesMatchAllLimit(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t)
	e.writeConfig(fmt.Sprintf(`interfaces: [%s]
pinDir: %s
metricsAddress: "off"
limits:
  - name: all
    rate: 1
    burst: 1
    match: {}
protect:
  - name: local
    protocol: tcp
    localPorts: [%d]
  - name: remote
    protocol: tcp
    peers: [%s, "%s"]
    remotePorts: [%d]
`, e.pair.IfB, e.pinDir, protectedLocal, e.pair.A4, e.pair.A6, protectedRemote))

	// Echo servers: B's two local ports, A's two remote ones.
	for _, s := range []struct {
		ns   *nettest.NS
		port int
	}{{e.pair.B, protectedLocal}, {e.pair.B, unprotectedLocal}, {e.pair.A, protectedRemote}, {e.pair.A, unprotectedRemote}} {
		echoServer(t, s.ns, s.port)
	}
	e.startAgent()

	// Protected: 200 of 200 exchanges (connect, 64 bytes each way, close)
	// complete, each family, each kind.
	const n = 200
	began := time.Now()
	for _, c := range []struct {
		what string
		from *nettest.NS
		to   netip.AddrPort
	}{
		{"tcp to B's protected local port, IPv4", e.pair.A, netip.AddrPortFrom(e.pair.B4, protectedLocal)},
		{"tcp to B's protected local port, IPv6", e.pair.A, netip.AddrPortFrom(e.pair.B6, protectedLocal)},
		{"tcp from B to A's protected remote port, IPv4", e.pair.B, netip.AddrPortFrom(e.pair.A4, protectedRemote)},
		{"tcp from B to A's protected remote port, IPv6", e.pair.B, netip.AddrPortFrom(e.pair.A6, protectedRemote)},
	} {
		ok, err := exchanges(c.from, c.to, n, 2*time.Second)
		t.Logf("%s: %d of %d exchanges completed", c.what, ok, n)
		if ok != n {
			t.Errorf("%s: %d of %d exchanges completed, want all (last error: %v)", c.what, ok, n, err)
		}
	}
	t.Logf("%d protected exchanges in %s", 4*n, time.Since(began).Round(time.Millisecond))
	l, _ := e.limitNamed("all")
	charged := l.Totals.AdmittedPackets + l.Totals.DroppedPackets
	t.Logf("limit all after the protected traffic: admitted %d, dropped %d", l.Totals.AdmittedPackets, l.Totals.DroppedPackets)
	// Each exchange is at least 5 packets into B; what the limit saw is the
	// odd ICMPv6 packet of the kernel, never the protected traffic.
	if charged > 20 {
		t.Errorf("the limit was charged %d packets during %d protected exchanges: protected traffic is charged", charged, 4*n)
	}

	// Unprotected: the limit admits 1 packet a second (and the burst of 1).
	began = time.Now()
	for _, ipv6 := range []bool{false, true} {
		network, dst := "udp4", e.pair.B4
		if ipv6 {
			network, dst = "udp6", e.pair.B6
		}
		conn, err := e.pair.A.DialUDP(netip.AddrPortFrom(dst, port))
		if err != nil {
			t.Fatal(err)
		}
		before := e.recv.Got().Total()
		s, err := nettest.StartSender(conn, nettest.SenderConfig{Rate: 1000, Count: n, Duration: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		<-s.Done()
		conn.Close()
		time.Sleep(100 * time.Millisecond)
		got := e.recv.Got().Total() - before
		t.Logf("udp to B, %s: %d of %d arrived", network, got, s.Sent().Total())
		if s.Sent().Total() != n || got > 3 {
			t.Errorf("udp to B, %s: %d of %d sent arrived, want at most 3 (rate 1, burst 1)", network, got, s.Sent().Total())
		}
	}
	for _, c := range []struct {
		what string
		from *nettest.NS
		to   netip.AddrPort
	}{
		{"tcp to B's unprotected local port", e.pair.A, netip.AddrPortFrom(e.pair.B4, unprotectedLocal)},
		{"tcp from B to A's unprotected remote port", e.pair.B, netip.AddrPortFrom(e.pair.A6, unprotectedRemote)},
	} {
		// In parallel, each given 1 s: a completed exchange needs at least
		// two packets into B (SYN-ACK and echo, or SYN, ACK and data), and
		// the limit admits about two in that second, for all 20.
		ok := parallelExchanges(c.from, c.to, 20, time.Second)
		t.Logf("%s: %d of 20 exchanges completed", c.what, ok)
		if ok > 1 {
			t.Errorf("%s: %d of 20 exchanges completed, want at most 1 (rate 1, burst 1)", c.what, ok)
		}
	}
	t.Logf("unprotected traffic checked in %s", time.Since(began).Round(time.Millisecond))
}

// limitNamed is the status of the named limit.
func (e *env) limitNamed(name string) (l agent.LimitStatus, at time.Time) {
	e.t.Helper()
	st, at := e.status()
	for _, s := range st {
		if s.Name == name {
			return s, at
		}
	}
	e.t.Fatalf("rlagent status has no limit %q: %+v", name, st)
	return l, at
}

// echoServer accepts TCP connections on port (IPv4 and IPv6) in ns and
// echoes what each sends, until the test ends.
func echoServer(t *testing.T, ns *nettest.NS, port int) {
	t.Helper()
	var ln net.Listener
	if err := ns.Do(func() (err error) {
		ln, err = net.Listen("tcp", fmt.Sprintf(":%d", port))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				c.SetDeadline(time.Now().Add(5 * time.Second))
				io.Copy(c, c)
			}()
		}
	}()
}

// exchange connects from ns to dst, sends 64 bytes, reads them back and
// closes, all within timeout.
func exchange(ns *nettest.NS, dst netip.AddrPort, timeout time.Duration) error {
	return exchangeFrom(ns, netip.AddrPort{}, dst, 64, timeout)
}

// exchanges runs n exchanges one after the other and returns how many
// completed, and the last error.
func exchanges(ns *nettest.NS, dst netip.AddrPort, n int, timeout time.Duration) (int, error) {
	ok := 0
	var last error
	for range n {
		if err := exchange(ns, dst, timeout); err != nil {
			last = err
			continue
		}
		ok++
	}
	return ok, last
}

// parallelExchanges runs n exchanges at once and returns how many
// completed.
func parallelExchanges(ns *nettest.NS, dst netip.AddrPort, n int, timeout time.Duration) int {
	var ok atomic.Int32
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if exchange(ns, dst, timeout) == nil {
				ok.Add(1)
			}
		}()
	}
	wg.Wait()
	return int(ok.Load())
}
