package nettest

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// PairConfig describes two namespaces joined by a veth pair. Each end gets
// the first and second host address of each subnet.
type PairConfig struct {
	// NameA, NameB name the namespaces in messages (default "a", "b").
	NameA, NameB string
	// IfA, IfB are the veth ends' names (default "veth-a", "veth-b").
	IfA, IfB string
	// Subnet4 is the IPv4 subnet (default 10.201.0.0/24: A is .1, B is .2).
	Subnet4 netip.Prefix
	// Subnet6 is the IPv6 subnet (default fd00:201::/64: A is ::1, B is ::2).
	Subnet6 netip.Prefix
}

// Pair is two namespaces, A and B, joined by a veth pair that is up, with
// IPv4 and IPv6 addresses on both ends (IPv6 without duplicate address
// detection) and permanent neighbor entries for each other's addresses.
// NewPair returns once both ends are ready to carry the first packet.
type Pair struct {
	A, B     *NS
	IfA, IfB string
	A4, B4   netip.Addr
	A6, B6   netip.Addr
}

// NewPair creates the namespaces and the veth pair. On error nothing is
// left behind. The caller closes the pair.
func NewPair(cfg PairConfig) (_ *Pair, err error) {
	def := func(s *string, d string) {
		if *s == "" {
			*s = d
		}
	}
	def(&cfg.NameA, "a")
	def(&cfg.NameB, "b")
	def(&cfg.IfA, "veth-a")
	def(&cfg.IfB, "veth-b")
	if !cfg.Subnet4.IsValid() {
		cfg.Subnet4 = netip.MustParsePrefix("10.201.0.0/24")
	}
	if !cfg.Subnet6.IsValid() {
		cfg.Subnet6 = netip.MustParsePrefix("fd00:201::/64")
	}
	if !cfg.Subnet4.Addr().Is4() || !cfg.Subnet6.Addr().Is6() || cfg.Subnet4.Bits() > 30 || cfg.Subnet6.Bits() > 126 {
		return nil, fmt.Errorf("veth pair: subnets %s, %s: want an IPv4 prefix up to /30 and an IPv6 prefix up to /126",
			cfg.Subnet4, cfg.Subnet6)
	}
	s4, s6 := cfg.Subnet4.Masked().Addr(), cfg.Subnet6.Masked().Addr()
	p := &Pair{IfA: cfg.IfA, IfB: cfg.IfB, A4: s4.Next(), A6: s6.Next()}
	p.B4, p.B6 = p.A4.Next(), p.A6.Next()
	defer func() {
		if err != nil {
			p.Close()
		}
	}()
	if p.A, err = NewNS(cfg.NameA); err != nil {
		return nil, err
	}
	if p.B, err = NewNS(cfg.NameB); err != nil {
		return nil, err
	}
	nlA, err := p.A.Netlink()
	if err != nil {
		return nil, err
	}
	defer nlA.Close()
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: cfg.IfA},
		PeerName:      cfg.IfB,
		PeerNamespace: netlink.NsFd(int(p.B.Handle())),
	}
	if err := nlA.LinkAdd(veth); err != nil {
		return nil, fmt.Errorf("veth pair %s/%s: %w", cfg.IfA, cfg.IfB, err)
	}
	if err := setUp(p.A, cfg.IfA, netip.PrefixFrom(p.A4, cfg.Subnet4.Bits()), netip.PrefixFrom(p.A6, cfg.Subnet6.Bits())); err != nil {
		return nil, err
	}
	if err := setUp(p.B, cfg.IfB, netip.PrefixFrom(p.B4, cfg.Subnet4.Bits()), netip.PrefixFrom(p.B6, cfg.Subnet6.Bits())); err != nil {
		return nil, err
	}
	if err := p.addNeighbors(); err != nil {
		return nil, err
	}
	// Carrier, queue and the IPv6 local routes come after "set up"
	// returns (see WaitReady): without the wait a test's first datagram
	// can be lost.
	deadline := time.Now().Add(5 * time.Second)
	for _, ns := range []*NS{p.A, p.B} {
		if err := ns.WaitReady(time.Until(deadline)); err != nil {
			return nil, fmt.Errorf("veth pair %s/%s: %w", cfg.IfA, cfg.IfB, err)
		}
	}
	return p, nil
}

// addNeighbors makes each end know the other's MAC address for both
// families (permanent entries): no ARP or neighbor discovery delays or loses
// the first packets.
func (p *Pair) addNeighbors() error {
	type end struct {
		ns     *NS
		ifname string
		addrs  []netip.Addr
	}
	ends := []end{{p.A, p.IfA, []netip.Addr{p.A4, p.A6}}, {p.B, p.IfB, []netip.Addr{p.B4, p.B6}}}
	macs := make([]net.HardwareAddr, 2)
	idx := make([]int, 2)
	for i, e := range ends {
		nl, err := e.ns.Netlink()
		if err != nil {
			return err
		}
		l, err := nl.LinkByName(e.ifname)
		nl.Close()
		if err != nil {
			return fmt.Errorf("%s in %s: %w", e.ifname, e.ns.Name, err)
		}
		macs[i], idx[i] = l.Attrs().HardwareAddr, l.Attrs().Index
	}
	for i, e := range ends {
		peer := ends[1-i]
		nl, err := e.ns.Netlink()
		if err != nil {
			return err
		}
		for _, a := range peer.addrs {
			family := unix.AF_INET6
			if a.Is4() {
				family = unix.AF_INET
			}
			err = nl.NeighSet(&netlink.Neigh{
				LinkIndex:    idx[i],
				Family:       family,
				State:        netlink.NUD_PERMANENT,
				IP:           a.AsSlice(),
				HardwareAddr: macs[1-i],
			})
			if err != nil {
				break
			}
		}
		nl.Close()
		if err != nil {
			return fmt.Errorf("%s in %s: neighbor entries: %w", e.ifname, e.ns.Name, err)
		}
	}
	return nil
}

// MustPair is NewPair for a test: it fails tb on error and closes the pair
// in tb.Cleanup, which runs also when the test fails. The test holds the
// traffic lock (HoldTraffic) until then.
func MustPair(tb testing.TB, cfg PairConfig) *Pair {
	tb.Helper()
	HoldTraffic(tb)
	p, err := NewPair(cfg)
	if err != nil {
		tb.Fatalf("%v", err)
	}
	tb.Cleanup(func() { p.Close() })
	return p
}

// MustNS creates a network namespace (NewNS) closed in tb's Cleanup, and
// fails tb if it cannot. Unlike MustPair it takes no traffic lock: a test
// that sends through the namespace holds it (HoldTraffic).
func MustNS(tb testing.TB, name string) *NS {
	tb.Helper()
	ns, err := NewNS(name)
	if err != nil {
		tb.Fatalf("%v", err)
	}
	tb.Cleanup(func() { ns.Close() })
	return ns
}

// setUp gives the interface its addresses and sets it up.
func setUp(ns *NS, ifname string, addrs ...netip.Prefix) error {
	nl, l, err := ns.link(ifname)
	if err != nil {
		return err
	}
	defer nl.Close()
	for _, a := range addrs {
		addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.Addr().AsSlice(), Mask: net.CIDRMask(a.Bits(), a.Addr().BitLen())}}
		if a.Addr().Is6() {
			addr.Flags = unix.IFA_F_NODAD
		}
		if err := nl.AddrAdd(l, addr); err != nil {
			return fmt.Errorf("%s in %s: add %s: %w", ifname, ns.Name, a, err)
		}
	}
	if err := nl.LinkSetUp(l); err != nil {
		return fmt.Errorf("%s in %s: set up: %w", ifname, ns.Name, err)
	}
	return nil
}

// Close closes both namespaces; the veth pair goes with them. It is
// idempotent.
func (p *Pair) Close() error {
	return errors.Join(p.A.Close(), p.B.Close())
}

// ListenUDP opens a UDP socket in the namespace bound to addr (network
// "udp4" or "udp6"), with a receive buffer of at least rcvbuf bytes (0: the
// system default; as root the system maximum does not apply).
func (ns *NS) ListenUDP(network string, addr netip.AddrPort, rcvbuf int) (*net.UDPConn, error) {
	var c *net.UDPConn
	err := ns.Do(func() error {
		var err error
		c, err = net.ListenUDP(network, net.UDPAddrFromAddrPort(addr))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listen %s %s in %s: %w", network, addr, ns.Name, err)
	}
	if rcvbuf > 0 {
		if err := setRcvbuf(c, rcvbuf); err != nil {
			c.Close()
			return nil, fmt.Errorf("listen %s %s in %s: %w", network, addr, ns.Name, err)
		}
	}
	return c, nil
}

// DialUDP opens a UDP socket in the namespace connected to raddr, of
// raddr's family.
func (ns *NS) DialUDP(raddr netip.AddrPort) (*net.UDPConn, error) {
	network := "udp4"
	if raddr.Addr().Is6() && !raddr.Addr().Is4In6() {
		network = "udp6"
	}
	var c *net.UDPConn
	err := ns.Do(func() error {
		var err error
		c, err = net.DialUDP(network, nil, net.UDPAddrFromAddrPort(raddr))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("dial %s %s in %s: %w", network, raddr, ns.Name, err)
	}
	return c, nil
}

// SendUDP sends n datagrams with payload from the namespace to dst, back
// to back, from one socket.
func (ns *NS) SendUDP(dst netip.AddrPort, n int, payload []byte) error {
	c, err := ns.DialUDP(dst)
	if err != nil {
		return err
	}
	defer c.Close()
	for i := range n {
		if _, err := c.Write(payload); err != nil {
			return fmt.Errorf("send datagram %d of %d to %s from %s: %w", i+1, n, dst, ns.Name, err)
		}
	}
	return nil
}

func setRcvbuf(c *net.UDPConn, n int) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	err = rc.Control(func(fd uintptr) {
		// SO_RCVBUFFORCE (root) ignores net.core.rmem_max.
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, n)
		if serr != nil {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, n)
		}
	})
	return errors.Join(err, serr)
}

// UDPStats are a namespace's UDP counters (/proc/net/snmp, IPv4 and IPv6
// added up).
type UDPStats struct {
	InDatagrams  uint64
	RcvbufErrors uint64 // datagrams dropped because a socket's buffer was full
}

// UDPStats reads the namespace's UDP counters.
func (ns *NS) UDPStats() (UDPStats, error) {
	var s UDPStats
	err := ns.Do(func() error {
		// /proc/thread-self/net is this thread's namespace's view.
		b, err := os.ReadFile("/proc/thread-self/net/snmp")
		if err != nil {
			return err
		}
		var head []string
		for line := range strings.SplitSeq(string(b), "\n") {
			f := strings.Fields(line)
			if len(f) == 0 || f[0] != "Udp:" {
				continue
			}
			if head == nil {
				head = f
				continue
			}
			for i := 1; i < len(f) && i < len(head); i++ {
				v, _ := strconv.ParseUint(f[i], 10, 64)
				switch head[i] {
				case "InDatagrams":
					s.InDatagrams += v
				case "RcvbufErrors":
					s.RcvbufErrors += v
				}
			}
			break
		}
		b, err = os.ReadFile("/proc/thread-self/net/snmp6")
		if err != nil {
			return nil // IPv6 disabled
		}
		for line := range strings.SplitSeq(string(b), "\n") {
			f := strings.Fields(line)
			if len(f) != 2 {
				continue
			}
			v, _ := strconv.ParseUint(f[1], 10, 64)
			switch f[0] {
			case "Udp6InDatagrams":
				s.InDatagrams += v
			case "Udp6RcvbufErrors":
				s.RcvbufErrors += v
			}
		}
		return nil
	})
	if err != nil {
		return UDPStats{}, fmt.Errorf("udp stats of %s: %w", ns.Name, err)
	}
	return s, nil
}
