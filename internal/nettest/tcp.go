package nettest

import (
	"errors"
	"fmt"
	"math"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// TCPSinkConfig sizes a TCPSink's bins.
type TCPSinkConfig struct {
	// Bin is the width of the bins of Received (default DefaultBin).
	Bin time.Duration
	// Span is how long from now the bins cover (default 2 minutes); later
	// bytes count only in the totals.
	Span time.Duration
	// ReadSize is the buffer of each read (default 256 KiB): large, so
	// that a fast sender is not held back by the reader.
	ReadSize int
}

// TCPSink accepts TCP connections in a namespace and reads them to the end,
// counting the bytes by arrival time and the connections accepted.
type TCPSink struct {
	ln       *net.TCPListener
	cfg      TCPSinkConfig
	got      *Bins        // bytes, by the time the read returned them
	accepted *Bins        // connections, by the time accept returned them
	last     atomic.Int64 // UnixNano of the last read that returned bytes
	// bufs holds read buffers: a connector's many short connections
	// would otherwise allocate one large buffer each.
	bufs sync.Pool

	mu    sync.Mutex
	conns map[net.Conn]struct{} // open connections, closed by Close
	wg    sync.WaitGroup        // the accept loop and the readers
}

// ListenTCPSink listens on addr (port 0: any) in the namespace and starts
// accepting. The caller closes the sink.
func (ns *NS) ListenTCPSink(addr netip.AddrPort, cfg TCPSinkConfig) (*TCPSink, error) {
	if cfg.Span <= 0 {
		cfg.Span = 2 * time.Minute
	}
	if cfg.ReadSize <= 0 {
		cfg.ReadSize = 256 << 10
	}
	var ln *net.TCPListener
	err := ns.Do(func() error {
		var err error
		ln, err = net.ListenTCP("tcp", net.TCPAddrFromAddrPort(addr))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listen tcp %s in %s: %w", addr, ns.Name, err)
	}
	now := time.Now()
	s := &TCPSink{
		ln: ln, cfg: cfg,
		got:      newBins(now, cfg.Bin, cfg.Span),
		accepted: newBins(now, cfg.Bin, cfg.Span),
		conns:    map[net.Conn]struct{}{},
	}
	s.bufs.New = func() any { b := make([]byte, cfg.ReadSize); return &b }
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// Addr is the address the sink listens on.
func (s *TCPSink) Addr() netip.AddrPort { return s.ln.Addr().(*net.TCPAddr).AddrPort() }

func (s *TCPSink) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// E.g. a connection reset while it waited in the queue, or
			// too many open files: try again, without spinning.
			time.Sleep(time.Millisecond)
			continue
		}
		s.accepted.add(time.Now(), 1)
		s.mu.Lock()
		if s.conns == nil { // closed meanwhile
			s.mu.Unlock()
			c.Close()
			return
		}
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.read(c)
	}
}

func (s *TCPSink) read(c net.Conn) {
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		if s.conns != nil {
			delete(s.conns, c)
		}
		s.mu.Unlock()
		c.Close()
	}()
	bp := s.bufs.Get().(*[]byte)
	defer s.bufs.Put(bp)
	buf := *bp
	for {
		n, err := c.Read(buf)
		if n > 0 {
			now := time.Now()
			s.got.add(now, int64(n))
			s.last.Store(now.UnixNano())
		}
		if err != nil { // EOF, a reset, or Close
			return
		}
	}
}

// Received counts the bytes received, by arrival: Rate over a window is
// the goodput in bytes per second.
func (s *TCPSink) Received() *Bins { return s.got }

// LastArrival is when the last bytes arrived (zero before any).
func (s *TCPSink) LastArrival() time.Time {
	if ns := s.last.Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

// Accepted counts the connections accepted, by accept time.
func (s *TCPSink) Accepted() *Bins { return s.accepted }

// WaitReceived waits until the sink has received at least n bytes in all,
// for up to timeout, and reports whether it has.
func (s *TCPSink) WaitReceived(n int64, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for s.got.Total() < n {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
	return true
}

// Close stops accepting, closes every connection and waits for the
// goroutines. It is idempotent.
func (s *TCPSink) Close() error {
	err := s.ln.Close()
	s.mu.Lock()
	for c := range s.conns {
		c.Close()
	}
	s.conns = nil
	s.mu.Unlock()
	s.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}

// BulkConfig bounds a Bulk transfer. Bytes and Duration are both required:
// the sender stops by itself at whichever comes first.
type BulkConfig struct {
	// Bytes is the most bytes sent.
	Bytes int64
	// Duration is the longest the sender runs, connecting included.
	Duration time.Duration
	// WriteSize is the size of each write (default 256 KiB). A write far
	// above the MSS lets TCP build GSO packets of up to 64 KiB, which a
	// veth (TSO and GSO on by default) passes whole.
	WriteSize int
	// Bin is the width of the bins of Sent (default DefaultBin).
	Bin time.Duration
	// Rate paces the sender, in bytes/s (0: as fast as the path allows).
	// It writes WriteSize bytes whenever it has the credit, checking every
	// millisecond, and does not catch up after a stall of more than 10 ms.
	Rate float64
}

// Bulk sends bytes on one TCP connection as fast as the path allows (or at
// a pace), and stops by itself at its bounds. When all its bytes are
// written it shuts its side down (FIN), so the sink reads to the end and the
// kernel delivers what is queued; stopped or out of time, it resets the
// connection, and nothing is sent after it stopped.
type Bulk struct {
	conn  *net.TCPConn
	start time.Time // before connecting
	sent  *Bins     // bytes, by the time the write returned
	err   error     // a write error other than the time bound; set before done closes

	stop     chan struct{}
	stopOnce sync.Once
	done     chan struct{}
}

// StartBulk connects from the namespace to dst and starts sending.
func (ns *NS) StartBulk(dst netip.AddrPort, cfg BulkConfig) (*Bulk, error) {
	if cfg.Bytes <= 0 || cfg.Duration <= 0 {
		return nil, fmt.Errorf("bulk: Bytes (%d) and Duration (%s) must both be positive", cfg.Bytes, cfg.Duration)
	}
	if cfg.WriteSize <= 0 {
		cfg.WriteSize = 256 << 10
	}
	start := time.Now()
	deadline := start.Add(cfg.Duration)
	var conn *net.TCPConn
	err := ns.Do(func() error {
		d := net.Dialer{Deadline: deadline}
		c, err := d.Dial("tcp", dst.String())
		if err != nil {
			return err
		}
		conn = c.(*net.TCPConn)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("bulk: connect to %s from %s: %w", dst, ns.Name, err)
	}
	b := &Bulk{
		conn:  conn,
		start: start,
		sent:  newBins(start, cfg.Bin, cfg.Duration+time.Second),
		stop:  make(chan struct{}),
		done:  make(chan struct{}),
	}
	// The time bound stops a write that waits for window space too.
	conn.SetWriteDeadline(deadline)
	go b.run(cfg)
	return b, nil
}

func (b *Bulk) run(cfg BulkConfig) {
	defer close(b.done)
	complete := false
	defer func() {
		if !complete {
			// Stopped, or out of time: what the socket still holds is
			// thrown away (a reset), not sent on by the kernel after
			// the sender is gone. Load stops when the sender does: the
			// orphaned socket of a paced transfer went on sending
			// (0-1,266 segments on 6.12 under emulation) through the
			// reload that followed, and the next transfer's connect
			// then timed out in 2 of 12 runs.
			b.conn.SetLinger(0)
		}
		b.conn.Close()
	}()
	buf := make([]byte, cfg.WriteSize)
	for i := range buf {
		buf[i] = byte(i)
	}
	var total int64
	pace := newPacer(cfg.Rate, float64(cfg.WriteSize))
	defer pace.stop()
	for total < cfg.Bytes {
		if !pace.take(b.stop) {
			return
		}
		n, err := b.conn.Write(buf[:min(int64(len(buf)), cfg.Bytes-total)])
		if n > 0 {
			total += int64(n)
			b.sent.add(time.Now(), int64(n))
		}
		if err != nil {
			if !errors.Is(err, os.ErrDeadlineExceeded) && !errors.Is(err, net.ErrClosed) {
				b.err = fmt.Errorf("bulk: write after %d bytes: %w", total, err)
			}
			return
		}
	}
	// Everything is written: a FIN after it, and Close (deferred) leaves
	// the kernel to deliver what is still queued.
	b.conn.CloseWrite()
	complete = true
}

// pacer hands out credit for writes of a fixed size at a rate.
type pacer struct {
	rate, size float64
	credit     float64
	last       time.Time
	tick       *time.Ticker // nil: no pace
}

func newPacer(rate, size float64) *pacer {
	p := &pacer{rate: rate, size: size, last: time.Now()}
	if rate > 0 {
		p.tick = time.NewTicker(time.Millisecond)
	}
	return p
}

// take waits until there is credit for a write and spends it; it returns
// false if stop closed first.
func (p *pacer) take(stop <-chan struct{}) bool {
	for {
		select {
		case <-stop:
			return false
		default:
		}
		if p.tick == nil {
			return true
		}
		now := time.Now()
		p.credit = min(p.credit+p.rate*now.Sub(p.last).Seconds(), p.size+p.rate*0.010)
		p.last = now
		if p.credit >= p.size {
			p.credit -= p.size
			return true
		}
		select {
		case <-stop:
			return false
		case <-p.tick.C:
		}
	}
}

func (p *pacer) stop() {
	if p.tick != nil {
		p.tick.Stop()
	}
}

// Stop stops the sender and waits for it: the connection is reset, and
// what it had not sent yet is dropped. It is idempotent.
func (b *Bulk) Stop() {
	b.stopOnce.Do(func() {
		close(b.stop)
		// Unblock a write waiting for window space.
		b.conn.SetWriteDeadline(time.Now())
	})
	<-b.done
}

// Started is when the sender started connecting: a transfer's goodput is
// its bytes over the time from Started to the sink's LastArrival.
func (b *Bulk) Started() time.Time { return b.start }

// Done is closed when the sender has stopped, by Stop or by its bounds.
func (b *Bulk) Done() <-chan struct{} { return b.done }

// Sent counts the bytes written into the socket, by write time. Bytes
// written are not yet delivered: the sink's Received says what arrived.
func (b *Bulk) Sent() *Bins { return b.sent }

// Err is the write error that ended the transfer early, if any (the time
// bound and Stop are not errors). Read it after Done.
func (b *Bulk) Err() error {
	select {
	case <-b.done:
		return b.err
	default:
		return nil
	}
}

// ConnectConfig bounds and paces a Connector. Count and Duration are both
// required.
type ConnectConfig struct {
	// Rate is the attempts per second.
	Rate float64
	// Count is the most attempts.
	Count int64
	// Duration is the longest the connector starts attempts; those under
	// way then still finish (within Timeout).
	Duration time.Duration
	// Timeout is how long an attempt waits for the handshake (default
	// 500 ms). Below the kernel's 1 s initial SYN retransmission timeout,
	// an attempt sends exactly one SYN: an attempt is one connection for a
	// connection-rate limit.
	Timeout time.Duration
	// Bin is the width of the bins (default DefaultBin).
	Bin time.Duration
	// Tick is how often the connector wakes up to start what is due
	// (default 1 ms).
	Tick time.Duration
}

// Connector opens TCP connections at a paced rate, each a new socket that
// sends one SYN, and closes each as soon as it is established, with a reset
// (SO_LINGER 0: no FIN, no TIME_WAIT left on either side, so ports never run
// out). It counts attempts, completions and failures by attempt time.
type Connector struct {
	ns       *NS
	dst      netip.AddrPort
	cfg      ConnectConfig
	attempts *Bins
	// completed counts attempts whose handshake finished.
	completed *Bins
	// refused (a reset answered the SYN), timedOut (nothing in Timeout)
	// and otherErr (anything else, such as no route) are the failures.
	refused, timedOut, otherErr atomic.Int64
	firstErr                    atomic.Pointer[error]

	wg       sync.WaitGroup // attempts under way
	stop     chan struct{}
	stopOnce sync.Once
	done     chan struct{}
}

// StartConnector starts connecting from the namespace to dst.
func (ns *NS) StartConnector(dst netip.AddrPort, cfg ConnectConfig) (*Connector, error) {
	if cfg.Count <= 0 || cfg.Duration <= 0 {
		return nil, fmt.Errorf("connector: Count (%d) and Duration (%s) must both be positive", cfg.Count, cfg.Duration)
	}
	if cfg.Rate <= 0 || math.IsNaN(cfg.Rate) || math.IsInf(cfg.Rate, 0) {
		return nil, fmt.Errorf("connector: rate %v is not a positive rate", cfg.Rate)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 500 * time.Millisecond
	}
	if cfg.Tick <= 0 {
		cfg.Tick = time.Millisecond
	}
	span := cfg.Duration + cfg.Timeout + time.Second
	now := time.Now()
	c := &Connector{
		ns: ns, dst: dst, cfg: cfg,
		attempts:  newBins(now, cfg.Bin, span),
		completed: newBins(now, cfg.Bin, span),
		stop:      make(chan struct{}),
		done:      make(chan struct{}),
	}
	go c.run()
	return c, nil
}

func (c *Connector) run() {
	defer close(c.done)
	defer c.wg.Wait()
	// The pacing loop runs on a thread of its own inside the namespace and
	// makes every socket and starts every handshake itself: a few system
	// calls an attempt. NS.Do for each (a fresh locked thread, two setns)
	// or a hand-off to another thread (two wake-ups, ~180 us here) would
	// cost more than the pacing interval at high rates. The lock is never
	// undone: when run returns, the runtime ends the thread with it, so no
	// thread goes back to the scheduler in a foreign namespace. The thread
	// still goes back to the process's namespace first: the runtime wedges
	// the main thread rather than ending it, and one left in ns would keep
	// ns, with its interfaces, for the process's life.
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		c.fail(fmt.Errorf("enter %s: %w", c.ns.Name, err))
		return
	}
	defer func() {
		netns.Set(orig)
		orig.Close()
	}()
	if err := netns.Set(c.ns.h); err != nil {
		c.fail(fmt.Errorf("enter %s: %w", c.ns.Name, err))
		return
	}
	start := time.Now()
	deadline := start.Add(c.cfg.Duration)
	tick := time.NewTicker(c.cfg.Tick)
	defer tick.Stop()
	var n int64
	credit, last := 0.0, start
	for n < c.cfg.Count {
		now := time.Now()
		if !now.Before(deadline) {
			return
		}
		credit += c.cfg.Rate * now.Sub(last).Seconds()
		last = now
		credit = min(credit, max(c.cfg.Rate*0.010, 1)) // no catching up after a stall
		for ; credit >= 1 && n < c.cfg.Count; credit-- {
			n++
			c.attempt()
		}
		select {
		case <-c.stop:
			return
		case <-tick.C:
		}
	}
}

// attempt makes a socket and starts connecting (the SYN leaves now), on
// run's thread, inside the namespace; a goroutine waits for the outcome
// through the runtime's poller.
func (c *Connector) attempt() {
	var sa unix.Sockaddr
	family := unix.AF_INET
	if c.dst.Addr().Is4() {
		sa = &unix.SockaddrInet4{Port: int(c.dst.Port()), Addr: c.dst.Addr().As4()}
	} else {
		family = unix.AF_INET6
		sa = &unix.SockaddrInet6{Port: int(c.dst.Port()), Addr: c.dst.Addr().As16()}
	}
	at := time.Now()
	c.attempts.add(at, 1)
	fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		c.fail(fmt.Errorf("socket in %s: %w", c.ns.Name, err))
		return
	}
	// SO_LINGER 0: close sends a reset and leaves no TIME_WAIT.
	cerr := unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
	if cerr == nil {
		cerr = unix.Connect(fd, sa)
	}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		err := waitConnect(fd, cerr, at.Add(c.cfg.Timeout))
		switch {
		case err == nil:
			c.completed.add(at, 1)
		case errors.Is(err, unix.ECONNREFUSED):
			c.refused.Add(1)
		case errors.Is(err, os.ErrDeadlineExceeded):
			c.timedOut.Add(1)
		default:
			c.fail(err)
		}
	}()
}

func (c *Connector) fail(err error) {
	if c.otherErr.Add(1) == 1 {
		c.firstErr.Store(&err)
	}
}

// waitConnect waits by deadline for the handshake that connect, returning
// cerr, started on the non-blocking socket fd, and closes fd (with a reset:
// SO_LINGER 0). It owns fd.
func waitConnect(fd int, cerr error, deadline time.Time) error {
	// os.NewFile registers a non-blocking fd with the poller, so the wait
	// below parks the goroutine, not a thread. Registering after connect
	// loses nothing: epoll reports a socket that is already writable.
	f := os.NewFile(uintptr(fd), "tcp-connect")
	defer f.Close()
	if cerr == nil {
		return nil // connected at once
	}
	if !errors.Is(cerr, unix.EINPROGRESS) {
		return fmt.Errorf("connect: %w", cerr)
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	if err := f.SetWriteDeadline(deadline); err != nil {
		return err
	}
	var soerr error
	err = rc.Write(func(fd uintptr) bool {
		// Called once at once, then each time the poller says writable:
		// a connecting socket turns writable when the handshake ends,
		// either way. Connected when there is no error and a peer.
		v, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR)
		if err != nil {
			soerr = err
			return true
		}
		if v != 0 {
			soerr = syscall.Errno(v)
			return true
		}
		_, err = unix.Getpeername(int(fd))
		return err == nil
	})
	if err != nil {
		return err // os.ErrDeadlineExceeded: no answer in time
	}
	if soerr != nil {
		return fmt.Errorf("connect: %w", soerr)
	}
	return nil
}

// Stop stops starting attempts and waits for those under way. It is
// idempotent.
func (c *Connector) Stop() {
	c.stopOnce.Do(func() { close(c.stop) })
	<-c.done
}

// Done is closed when the connector has stopped and every attempt has its
// outcome.
func (c *Connector) Done() <-chan struct{} { return c.done }

// Attempts counts the attempts (SYNs sent), by attempt time.
func (c *Connector) Attempts() *Bins { return c.attempts }

// Completed counts the attempts whose handshake completed, by attempt
// time.
func (c *Connector) Completed() *Bins { return c.completed }

// ConnectFailures are a Connector's failed attempts by cause.
type ConnectFailures struct {
	Refused  int64 // answered by a reset: nothing listens, or a reject
	TimedOut int64 // no answer within Timeout: the SYN (or SYN-ACK) was dropped
	Other    int64 // anything else; Err is the first
	Err      error
}

// Total is every failure.
func (f ConnectFailures) Total() int64 { return f.Refused + f.TimedOut + f.Other }

// Failures reports the failed attempts so far (all of them after Done).
func (c *Connector) Failures() ConnectFailures {
	f := ConnectFailures{Refused: c.refused.Load(), TimedOut: c.timedOut.Load(), Other: c.otherErr.Load()}
	if p := c.firstErr.Load(); p != nil {
		f.Err = *p
	}
	return f
}

// SetOffload turns a segmentation or receive offload of ifname on or off,
// as `ethtool -K IF tso|gso|gro on|off` does (legacy ethtool ioctls).
// Turning off TSO and GSO on a sender's veth makes it put MTU-sized frames
// on the link, as a real wire carries; turning on GRO on the receiving
// veth makes it aggregate them again (a veth runs NAPI, and so GRO, only
// with GRO on or an XDP program attached).
func (ns *NS) SetOffload(ifname string, offload Offload, on bool) error {
	if len(ifname) >= unix.IFNAMSIZ {
		return fmt.Errorf("offload %s of %s: name too long", offload, ifname)
	}
	cmd, ok := map[Offload]uint32{OffloadTSO: unix.ETHTOOL_STSO, OffloadGSO: unix.ETHTOOL_SGSO, OffloadGRO: unix.ETHTOOL_SGRO}[offload]
	if !ok {
		return fmt.Errorf("offload %q of %s: unknown", offload, ifname)
	}
	return ns.Do(func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("offload %s of %s in %s: %w", offload, ifname, ns.Name, err)
		}
		defer unix.Close(fd)
		ev := ethtoolValue{cmd: cmd}
		if on {
			ev.data = 1
		}
		var ifr ifreqPtr
		copy(ifr.name[:], ifname)
		ifr.data = unsafe.Pointer(&ev)
		if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr))); errno != 0 {
			return fmt.Errorf("offload %s of %s in %s: %w", offload, ifname, ns.Name, errno)
		}
		return nil
	})
}

// Offload names an offload SetOffload sets.
type Offload string

// The offloads SetOffload sets.
const (
	OffloadTSO Offload = "tso"
	OffloadGSO Offload = "gso"
	OffloadGRO Offload = "gro"
)
