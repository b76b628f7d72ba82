package nettest

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"
	"unsafe"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// PacketConn is an AF_PACKET socket bound to one interface of a namespace.
// It sends whole Ethernet frames exactly as given (nothing is filled in or
// checked: a test crafts what no socket API would send) and receives every
// frame the interface receives, not the ones it sends.
type PacketConn struct {
	fd      int
	ifindex int
	name    string
}

// OpenPacket opens an AF_PACKET socket on ifname in the namespace.
func (ns *NS) OpenPacket(ifname string) (*PacketConn, error) {
	c := &PacketConn{fd: -1, name: ifname + " in " + ns.Name}
	err := ns.Do(func() error {
		l, err := net.InterfaceByName(ifname)
		if err != nil {
			return err
		}
		c.ifindex = l.Index
		proto := int(htons(unix.ETH_P_ALL))
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, proto)
		if err != nil {
			return err
		}
		c.fd = fd
		// The kernel's own packets leaving the interface are not what a
		// test reads here.
		if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_IGNORE_OUTGOING, 1); err != nil {
			return fmt.Errorf("PACKET_IGNORE_OUTGOING: %w", err)
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: l.Index})
	})
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("packet socket on %s: %w", c.name, err)
	}
	return c, nil
}

// Send sends one frame.
func (c *PacketConn) Send(frame []byte) error {
	for {
		_, err := unix.Write(c.fd, frame)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return fmt.Errorf("send %d bytes on %s: %w", len(frame), c.name, err)
		}
		return nil
	}
}

// Recv reads one frame into buf, waiting up to timeout (0: do not wait).
// It returns 0 and no error when no frame came in time.
func (c *PacketConn) Recv(buf []byte, timeout time.Duration) (int, error) {
	deadline := time.Now().Add(timeout)
	for {
		n, _, err := unix.Recvfrom(c.fd, buf, 0)
		if err == nil {
			return n, nil
		}
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if !errors.Is(err, unix.EAGAIN) {
			return 0, fmt.Errorf("receive on %s: %w", c.name, err)
		}
		left := time.Until(deadline)
		if left <= 0 {
			return 0, nil
		}
		fds := []unix.PollFd{{Fd: int32(c.fd), Events: unix.POLLIN}}
		if _, err := unix.Poll(fds, int(max(left/time.Millisecond, 1))); err != nil && !errors.Is(err, unix.EINTR) {
			return 0, fmt.Errorf("poll %s: %w", c.name, err)
		}
	}
}

// Close closes the socket. It is idempotent.
func (c *PacketConn) Close() error {
	if c == nil || c.fd < 0 {
		return nil
	}
	err := unix.Close(c.fd)
	c.fd = -1
	return err
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// MAC is the hardware address of ifname in the namespace.
func (ns *NS) MAC(ifname string) (net.HardwareAddr, error) {
	nl, l, err := ns.link(ifname)
	if err != nil {
		return nil, err
	}
	defer nl.Close()
	return l.Attrs().HardwareAddr, nil
}

// AddNeighbor adds a permanent neighbor entry on ifname: addr is at mac.
// It lets the namespace answer an address no interface holds (a spoofed
// source) without neighbor discovery.
func (ns *NS) AddNeighbor(ifname string, addr netip.Addr, mac net.HardwareAddr) error {
	nl, l, err := ns.link(ifname)
	if err != nil {
		return err
	}
	defer nl.Close()
	family := unix.AF_INET6
	if addr.Is4() {
		family = unix.AF_INET
	}
	err = nl.NeighSet(&netlink.Neigh{
		LinkIndex:    l.Attrs().Index,
		Family:       family,
		State:        netlink.NUD_PERMANENT,
		IP:           addr.AsSlice(),
		HardwareAddr: mac,
	})
	if err != nil {
		return fmt.Errorf("%s in %s: neighbor %s: %w", ifname, ns.Name, addr, err)
	}
	return nil
}

// SetChecksumOffload turns the receive and transmit checksum offloads of
// ifname on or off (what `ethtool -K IF rx off tx off` does, through the
// legacy ethtool ioctl). Off, a veth no longer marks what it forwards as
// verified, so the receiving stack checks every checksum itself.
func (ns *NS) SetChecksumOffload(ifname string, on bool) error {
	if len(ifname) >= unix.IFNAMSIZ {
		return fmt.Errorf("checksum offload of %s: name too long", ifname)
	}
	return ns.Do(func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("checksum offload of %s in %s: %w", ifname, ns.Name, err)
		}
		defer unix.Close(fd)
		val := uint32(0)
		if on {
			val = 1
		}
		for _, cmd := range []uint32{unix.ETHTOOL_SRXCSUM, unix.ETHTOOL_STXCSUM} {
			ev := ethtoolValue{cmd: cmd, data: val}
			var ifr ifreqPtr
			copy(ifr.name[:], ifname)
			ifr.data = unsafe.Pointer(&ev)
			if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr))); errno != 0 {
				return fmt.Errorf("checksum offload of %s in %s: ethtool command %#x: %w", ifname, ns.Name, cmd, errno)
			}
		}
		return nil
	})
}

// ethtoolValue is struct ethtool_value.
type ethtoolValue struct {
	cmd  uint32
	data uint32
}

// ifreqPtr is struct ifreq with a pointer in its union (ifr_data), padded
// to the kernel's size of the union.
type ifreqPtr struct {
	name [unix.IFNAMSIZ]byte
	data unsafe.Pointer
	_    [24 - unsafe.Sizeof(uintptr(0))]byte
}
