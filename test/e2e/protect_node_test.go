package e2e

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/internal/nettest"
)

// TestProtectEgressNeedsSocket: at an uplink's TC egress a protect rule
// exempts only what the node itself sends, with a local socket. With an
// egress limit of one packet a second (burst 1) and the rule ssh (tcp,
// local port 22):
//   - the node's own sshd-like server on port 22 answers the remote:
//     every exchange completes (its packets leave from a node address, with
//     a socket);
//   - a pod that opens its connections from source port 22, forwarded by
//     the node out of the same uplink, is limited: no exchange completes.
//     On 54615ce the rule matched any packet from port 22, and every one
//     did.
//
// A pod's exchange sends 4,096 bytes, three segments, so that it needs
// four packets to leave (its SYN and the segments) within its 500 ms,
// where the limit lets two at most: the token in its bucket, and the next,
// which accrues at a whole second of the limit's clock and so may come a
// moment after the first left. With 64 bytes (two packets), one of a CI
// run's ten exchanges once completed that way.
func TestProtectEgressNeedsSocket(t *testing.T) {
	r := newRig(t, nettest.TopologyConfig{Uplink: true, RoutedPods: []string{"p"}})
	pod := r.topo.Pod("p")
	const nodePort, remotePorts = 22, 7100
	echoServer(t, r.topo.Node, nodePort)
	for i := range 5 {
		echoServer(t, r.topo.Remote, remotePorts+i)
	}
	r.start("protect: [{name: ssh, protocol: tcp, localPorts: [22]}]\n", `  - name: egress
    rate: 2
    burst: 2
    match: {direction: egress}
`)
	for _, v6 := range []bool{false, true} {
		node := r.topo.NodeUp4
		remote := r.topo.RemoteUp4
		if v6 {
			node, remote = r.topo.NodeUp6, r.topo.RemoteUp6
		}
		ok, err := exchanges(r.topo.Remote, netip.AddrPortFrom(node, nodePort), 20, 2*time.Second)
		t.Logf("%s: the node's port 22 answering the remote: %d of 20 exchanges completed", family(v6), ok)
		if ok != 20 {
			t.Errorf("%s: %d of 20 exchanges with the node's port 22 completed (last error %v), want all: the node's own answers are protected", family(v6), ok, err)
		}
		fromPod := 0
		var last error
		for i := range 5 {
			err := exchangeFrom(pod.NS, netip.AddrPortFrom(pod.Addr(v6), 22), netip.AddrPortFrom(remote, uint16(remotePorts+i)),
				4096, 500*time.Millisecond)
			if err == nil {
				fromPod++
			} else {
				last = err
			}
		}
		t.Logf("%s: a pod connecting from its port 22, forwarded out of the uplink: %d of 5 exchanges completed (last error %v)", family(v6), fromPod, last)
		if fromPod != 0 {
			t.Errorf("%s: %d of 5 exchanges from a pod's port 22 completed under an egress limit that admits nothing: a forwarded packet passed as the node's", family(v6), fromPod)
		}
	}
}

// exchangeFrom connects from ns to dst, from the local address from (any,
// if from is the zero AddrPort), sends size bytes, reads them back and
// closes, all within timeout.
func exchangeFrom(ns *nettest.NS, from, dst netip.AddrPort, size int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var c net.Conn
	if err := ns.Do(func() (err error) {
		d := net.Dialer{Deadline: deadline}
		if from.IsValid() {
			// SO_REUSEADDR: the previous connection from the same port
			// waits in TIME_WAIT (to another remote port).
			d.LocalAddr = net.TCPAddrFromAddrPort(from)
			d.Control = func(_, _ string, rc syscall.RawConn) error {
				var serr error
				if err := rc.Control(func(fd uintptr) {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
				}); err != nil {
					return err
				}
				return serr
			}
		}
		c, err = d.DialContext(context.Background(), "tcp", dst.String())
		return err
	}); err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(deadline)
	msg := []byte(strings.Repeat("protected", size/9+1)[:size])
	if _, err := c.Write(msg); err != nil {
		return err
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	if string(buf) != string(msg) {
		return errors.New("echo differs")
	}
	return nil
}
