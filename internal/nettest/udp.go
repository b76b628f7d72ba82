package nettest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// A datagram from Sender carries a magic, a sequence number and its send
// time, so that Receiver counts it in the bin of when it was sent (and
// rate-limited: the data path decides on the send path, microseconds
// later), not of when the receiving goroutine got to it.
const (
	payloadMagic = 0x524c4e54 // "RLNT"
	payloadLen   = 4 + 8 + 8
)

func putPayload(b []byte, seq uint64, at time.Time) {
	binary.BigEndian.PutUint32(b[0:], payloadMagic)
	binary.BigEndian.PutUint64(b[4:], seq)
	binary.BigEndian.PutUint64(b[12:], uint64(at.UnixNano()))
}

func parsePayload(b []byte) (time.Time, bool) {
	if len(b) < payloadLen || binary.BigEndian.Uint32(b) != payloadMagic {
		return time.Time{}, false
	}
	return time.Unix(0, int64(binary.BigEndian.Uint64(b[12:]))), true
}

// SenderConfig bounds and paces a Sender. Count and Duration are both
// required: a sender stops by itself at whichever comes first.
type SenderConfig struct {
	// Rate is the offered rate in packets per second (SetRate changes it).
	Rate float64
	// Count is the most packets sent.
	Count int64
	// Duration is the longest the sender runs.
	Duration time.Duration
	// Bin is the width of the bins of Sent (default DefaultBin).
	Bin time.Duration
	// Tick is how often the sender wakes up to send what is due (default
	// 1 ms). Packets due in one tick leave back to back.
	Tick time.Duration
	// Size is the UDP payload of each datagram, in bytes: at least the 20
	// bytes a Receiver reads (the default), at most 65507. Above the path
	// MTU the kernel fragments each datagram.
	Size int
	// CatchUp is the most lag the sender makes up at once, back to back,
	// after a stall (default 10 ms): what is due beyond it is never sent.
	// A longer one keeps the offered rate on a busy machine, at the cost
	// of bursts of up to CatchUp x Rate packets.
	CatchUp time.Duration
}

// Sender sends datagrams on a connected UDP socket at a paced rate. It
// never makes up more than CatchUp of lag at once: after a longer stall it
// resumes at the paced rate, and Sent shows what was really offered.
type Sender struct {
	conn *net.UDPConn
	cfg  SenderConfig
	rate atomic.Uint64 // math.Float64bits of packets/s
	sent *Bins
	errs atomic.Int64
	err  atomic.Pointer[error] // the first write error

	stop     chan struct{}
	stopOnce sync.Once
	done     chan struct{}
}

// StartSender starts sending on conn, which must be connected (DialUDP).
// The caller still owns conn and closes it after Stop.
func StartSender(conn *net.UDPConn, cfg SenderConfig) (*Sender, error) {
	if cfg.Count <= 0 || cfg.Duration <= 0 {
		return nil, fmt.Errorf("sender: Count (%d) and Duration (%s) must both be positive", cfg.Count, cfg.Duration)
	}
	if cfg.Rate < 0 || math.IsNaN(cfg.Rate) || math.IsInf(cfg.Rate, 0) {
		return nil, fmt.Errorf("sender: rate %v is not a rate", cfg.Rate)
	}
	if cfg.Tick <= 0 {
		cfg.Tick = time.Millisecond
	}
	if cfg.Size == 0 {
		cfg.Size = payloadLen
	}
	if cfg.CatchUp <= 0 {
		cfg.CatchUp = 10 * time.Millisecond
	}
	if cfg.Size < payloadLen || cfg.Size > 65507 {
		return nil, fmt.Errorf("sender: Size %d is not in %d..65507", cfg.Size, payloadLen)
	}
	s := &Sender{
		conn: conn,
		cfg:  cfg,
		sent: newBins(time.Now(), cfg.Bin, cfg.Duration+time.Second),
		stop: make(chan struct{}),
		done: make(chan struct{}),
	}
	s.SetRate(cfg.Rate)
	go s.run()
	return s, nil
}

// SetRate changes the offered rate, in packets per second.
func (s *Sender) SetRate(pps float64) {
	if pps < 0 || math.IsNaN(pps) || math.IsInf(pps, 0) {
		pps = 0
	}
	s.rate.Store(math.Float64bits(pps))
}

// Rate is the offered rate as set.
func (s *Sender) Rate() float64 { return math.Float64frombits(s.rate.Load()) }

func (s *Sender) run() {
	defer close(s.done)
	buf := make([]byte, s.cfg.Size)
	start := time.Now()
	deadline := start.Add(s.cfg.Duration)
	tick := time.NewTicker(s.cfg.Tick)
	defer tick.Stop()
	var seq uint64
	credit, last := 0.0, start
	for int64(seq) < s.cfg.Count {
		now := time.Now()
		if !now.Before(deadline) {
			return
		}
		rate := s.Rate()
		credit += rate * now.Sub(last).Seconds()
		last = now
		credit = min(credit, max(rate*s.cfg.CatchUp.Seconds(), 1))
		for ; credit >= 1 && int64(seq) < s.cfg.Count; credit-- {
			at := time.Now()
			putPayload(buf, seq, at)
			seq++
			if _, err := s.conn.Write(buf); err != nil {
				if s.errs.Add(1) == 1 {
					s.err.Store(&err)
				}
				if errors.Is(err, net.ErrClosed) {
					return
				}
				continue
			}
			s.sent.add(at, 1)
		}
		select {
		case <-s.stop:
			return
		case <-tick.C:
		}
	}
}

// Stop stops the sender and waits for it. It is idempotent.
func (s *Sender) Stop() {
	s.stopOnce.Do(func() { close(s.stop) })
	<-s.done
}

// Done is closed when the sender has stopped, by Stop or by its bounds.
func (s *Sender) Done() <-chan struct{} { return s.done }

// Sent counts the packets written, by send time.
func (s *Sender) Sent() *Bins { return s.sent }

// Errors is the number of failed writes and the first error.
func (s *Sender) Errors() (int64, error) {
	n := s.errs.Load()
	if p := s.err.Load(); p != nil {
		return n, *p
	}
	return n, nil
}

// Receiver counts the datagrams arriving on a UDP socket. A datagram from a
// Sender is counted in the bin of its send time; any other in the bin of its
// arrival.
type Receiver struct {
	conn    *net.UDPConn
	got     *Bins
	foreign atomic.Int64
	done    chan struct{}
}

// ReceiverConfig sizes a Receiver's bins.
type ReceiverConfig struct {
	// Bin is the bin width (default DefaultBin).
	Bin time.Duration
	// Span is how long from now the bins cover (default 2 minutes); later
	// datagrams count only in the totals.
	Span time.Duration
}

// StartReceiver reads conn until it is closed (Close does that).
func StartReceiver(conn *net.UDPConn, cfg ReceiverConfig) *Receiver {
	if cfg.Span <= 0 {
		cfg.Span = 2 * time.Minute
	}
	r := &Receiver{conn: conn, got: newBins(time.Now(), cfg.Bin, cfg.Span), done: make(chan struct{})}
	go r.run()
	return r
}

func (r *Receiver) run() {
	defer close(r.done)
	buf := make([]byte, 2048)
	for {
		n, err := r.conn.Read(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue // e.g. ICMP errors reported on the socket
		}
		at, ok := parsePayload(buf[:n])
		if !ok {
			at = time.Now()
			r.foreign.Add(1)
		}
		r.got.add(at, 1)
	}
}

// Got counts the datagrams received, by send time.
func (r *Receiver) Got() *Bins { return r.got }

// Foreign is the number of datagrams that did not come from a Sender.
func (r *Receiver) Foreign() int64 { return r.foreign.Load() }

// Close closes the socket and waits for the reading goroutine.
func (r *Receiver) Close() error {
	err := r.conn.Close()
	<-r.done
	return err
}
